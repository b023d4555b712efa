"""The house's layering: the modules of sicl_fast (kernels/ included, as sicl_fast.kernels) import one another
without a cycle, counting every import statement (those inside functions too: a lazy import is still an edge),
and no kernel or op imports the static step."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTENSIONS = {"sicl_fast._C"}  # compiled (setup.py): a leaf, with no .py file to walk


def modules() -> dict:
    """module name -> (path, is a package)."""
    out = {}
    for base, pkg in ((ROOT / "sicl_fast", "sicl_fast"), (ROOT / "kernels", "sicl_fast.kernels")):
        for f in base.rglob("*.py"):
            parts = [pkg, *f.relative_to(base).with_suffix("").parts]
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def import_graph() -> dict:
    """module -> the sicl_fast modules its import statements name (a `from package import name` names the
    submodule when there is one, else the package)."""
    mods = modules()
    graph = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        pkg = name if is_pkg else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for b in node.body for n in ast.walk(b)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
                mod = ".".join(base + [node.module] if node.module else base) if node.level else node.module
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods or f"{mod}.{a.name}" in EXTENSIONS else mod
                           for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each a sorted list."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_what_it_must():
    g = import_graph()
    assert "sicl_fast.step_state" in g["sicl_fast.kernels.advance"]  # an absolute import of a module
    assert "sicl_fast.kernels" in g["sicl_fast.ops.triton_ops"]  # `from .. import kernels`, inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_kernels_and_ops_do_not_import_the_static_step():
    g = import_graph()
    for name, deps in g.items():
        if name.startswith(("sicl_fast.kernels", "sicl_fast.ops")):
            assert "sicl_fast.static" not in deps, name


def test_static_step_does_not_call_back_into_calibrator():
    """The pieces both loops need (the step spec, the scale, the initial embeddings) live below both: the static
    and packed steps neither import the eager loop's Calibrator nor name it (a call, an attribute, a lazy import)."""
    for f in ("static.py", "packed.py"):
        tree = ast.parse((ROOT / "sicl_fast" / f).read_text())
        named = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        named |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        named |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not {"Calibrator", "step_spec", "initial_embeddings"} & named, f

"""The house's layering, over every import statement of sicl_fast (kernels/ included, as sicl_fast.kernels; those
inside functions and under `if TYPE_CHECKING:` too: a lazy or a type-only import is still an edge):

  * no cycle among the modules;
  * the tree reads by role: the top level holds only the package, engine.py and errors.py, and every folder says
    in its docstring what lives there;
  * no import runs back up a floor (FLOORS, bottom first): errors.py, the role folders (the package's subpackages; a
    nested package is its parent's role) in the order docs/development.md shows (ROLE_ORDER), engine.py above the
    core and below the front ends (commands/, serve/, diagnostics/, evaluation/), and the package itself on top: it
    only hands names on, so nothing imports it (`from .. import X` of a name the package defines, or of a compiled
    extension at its root, is an import of the package); a compiled extension sits on its folder's floor;
  * no kernel or op imports a calibration loop, and the static and packed steps do not call back into the
    eager loop's Calibrator."""
import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTENSIONS = {"sicl_fast.ops._C"}  # compiled (setup.py): a leaf of its folder's floor, with no .py file to walk


def modules() -> dict:
    """module name -> (path, is a package)."""
    out = {}
    for base, pkg in ((ROOT / "sicl_fast", "sicl_fast"), (ROOT / "kernels", "sicl_fast.kernels")):
        for f in base.rglob("*.py"):
            parts = [pkg, *f.relative_to(base).with_suffix("").parts]
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


@functools.cache
def import_graph() -> dict:
    """module -> the sicl_fast modules its import statements name (a `from package import name` names the
    submodule or the compiled extension when there is one, else the package). The extensions are nodes without
    edges."""
    mods = modules()
    graph = {ext: set() for ext in EXTENSIONS}
    for name, (path, is_pkg) in mods.items():
        graph[name] = imports(tree_of(path), name if is_pkg else name.rsplit(".", 1)[0], mods) - {name}
    return graph


@functools.cache
def tree_of(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once for all the tests of this module."""
    return ast.parse(path.read_text())


def imports(tree: ast.Module, pkg: str, mods) -> set:
    """The modules of `mods` that the import statements of `tree` (a module of package `pkg`) name: every one, at
    any depth (a function's, an `if TYPE_CHECKING:` block's)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + [node.module] if node.module else base) if node.level else node.module
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods or f"{mod}.{a.name}" in EXTENSIONS else mod
                       for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in mods or t in EXTENSIONS}
    return out


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


# The role folders, bottom first: each imports only folders before it (and errors.py). A nested package is its
# parent's role (serve.routes is the server's): every folder is one floor. step/ (one step's torch math, which the
# ops and kernels implement) sits below them, the loops of calibration/ above the backends that run the steps.
ROLE_ORDER = ["formats", "models", "step", "kernels", "ops", "run", "backends", "calibration", "store",
              "answering", "scheduler", "icleval", "evaluation", "diagnostics", "serve", "commands"]
FRONT_ENDS = ("commands", "serve", "diagnostics", "evaluation")
TOP = {"sicl_fast", "sicl_fast.engine", "sicl_fast.errors"}
# Every floor, bottom first: errors.py, the core's folders, the engine (it runs the core; the front ends run it), the
# front ends, and the package itself, which only hands on names from below (its __init__ imports the engine)
_CORE = ROLE_ORDER[:len(ROLE_ORDER) - len(FRONT_ENDS)]
FLOORS = ["sicl_fast.errors", *_CORE, "sicl_fast.engine", *ROLE_ORDER[len(_CORE):], "sicl_fast"]


def role(module: str) -> str:
    """The role folder of a module ("serve" for sicl_fast.serve.routes.chat), or the module itself at the top
    level."""
    return module if module in TOP else module.split(".")[1]


def floor(module: str) -> int:
    """A module's floor: its role's place in FLOORS (0: errors.py, the bottom)."""
    return FLOORS.index(role(module))


def runs_back_up(graph: dict) -> list:
    """The imports (module, what it imports) that run back up a floor, sorted."""
    return sorted((a, b) for a, deps in graph.items() for b in deps if floor(b) > floor(a))


def role_graph(graph: dict) -> dict:
    """role -> the other roles its modules import."""
    out = {}
    for name, deps in graph.items():
        out.setdefault(role(name), set()).update(role(d) for d in deps if role(d) != role(name))
    return out


def test_the_walk_sees_what_it_must():
    g = import_graph()
    assert "sicl_fast.step.step_state" in g["sicl_fast.kernels.bookkeep"]  # an absolute import
    assert "sicl_fast.kernels" in g["sicl_fast.ops.triton_ops"]  # `from .. import kernels`, inside a function
    # a type-only import is an edge too (calibration/reads.py once imported static.py so, a circle: issue #48)
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .static import StaticStep\n"
    assert imports(ast.parse(typed), "sicl_fast.calibration", modules()) == {"sicl_fast.calibration.static"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # `from .. import X` of a name the package itself defines is an import of the package (its __init__, which
    # imports the engine): the serve app once took __version__ so, and the C++ ops their extension where it sat at the
    # package's root (issue #54); an extension of the tree is an import of that extension, on its folder's floor
    mods = modules()
    assert imports(ast.parse("from .. import __version__"), "sicl_fast.serve", mods) == {"sicl_fast"}
    assert imports(ast.parse("from .. import _C"), "sicl_fast.ops", mods) == {"sicl_fast"}
    assert imports(ast.parse("from . import _C"), "sicl_fast.ops", mods) == {"sicl_fast.ops._C"}
    assert imports(ast.parse("import sicl_fast"), "sicl_fast.ops", mods) == {"sicl_fast"}
    assert runs_back_up({"sicl_fast.ops.cpp_ops": {"sicl_fast"}, "sicl_fast.commands.cli": {"sicl_fast.engine"},
                         "sicl_fast.store.disk": {"sicl_fast.engine"}, "sicl_fast.run.plan": {"sicl_fast.errors"}}) == [
        ("sicl_fast.ops.cpp_ops", "sicl_fast"), ("sicl_fast.store.disk", "sicl_fast.engine")]
    assert floor("sicl_fast.ops._C") == floor("sicl_fast.ops.cpp_ops")
    assert role("sicl_fast.serve.routes.chat") == "serve"
    assert role("sicl_fast.step.zo") == "step"
    assert role("sicl_fast.calibration.static") == "calibration" and role("sicl_fast.engine") == "sicl_fast.engine"


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_top_level_holds_only_the_api():
    assert {f.name for f in (ROOT / "sicl_fast").glob("*.py")} == {"__init__.py", "engine.py", "errors.py"}


def test_every_folder_is_a_package_that_says_what_lives_there():
    """Every folder of modules has an __init__.py with a docstring, and pyproject.toml installs it (a folder missing
    from its package list would be left out of a wheel, though an editable install finds it)."""
    listed = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M).group(1)
    listed = set(re.findall(r'"([\w.]+)"', listed))
    folders = {f.parent for f in (ROOT / "sicl_fast").rglob("*.py")} | {ROOT / "kernels"}
    for folder in folders:
        init = folder / "__init__.py"
        assert init.exists(), folder
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and doc.strip(), init
        rel = folder.relative_to(ROOT).parts
        assert ".".join(("sicl_fast", *rel[1:]) if rel[0] == "sicl_fast" else ("sicl_fast", *rel)) in listed, folder


def test_no_import_runs_back_up():
    """Every import goes down FLOORS or stays on its floor: between role folders down ROLE_ORDER; errors.py imports
    none of them; engine.py and the package's __init__ (which imports the engine) sit above the core, so a core module
    that imported them would import what imports it; and nothing imports the package itself, which only hands names
    on (a `from .. import X` of a name it defines included)."""
    graph = import_graph()
    roles = role_graph(graph)
    assert set(roles) == set(ROLE_ORDER) | TOP, set(roles) ^ (set(ROLE_ORDER) | TOP)
    assert set(FLOORS) == set(ROLE_ORDER) | TOP and set(FLOORS[-len(FRONT_ENDS) - 1:-1]) == set(FRONT_ENDS)
    assert runs_back_up(graph) == []
    assert roles["sicl_fast.errors"] == set()


def test_role_order_is_the_layout_development_md_shows():
    """ROLE_ORDER is the order of docs/development.md's layout (its folders of sicl_fast, bottom first, kernels/ in
    its place as `(kernels/)`), which tells a reader what each folder may import: the page and the test agree."""
    block = (ROOT / "docs" / "development.md").read_text().split("```")[1]
    shown = [m.group(1) for m in re.finditer(r"^  \(?([a-z_]+)/\)?", block, re.M)]
    assert shown == ROLE_ORDER, shown


def test_the_extensions_are_the_ones_setup_builds():
    """EXTENSIONS (the compiled modules the walk counts) are setup.py's extension modules, at their built path."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    built = {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "Pybind11Extension"}
    assert built == EXTENSIONS


def test_kernels_and_ops_do_not_import_the_loops():
    loops = {"sicl_fast.calibration.ascent", "sicl_fast.calibration.static", "sicl_fast.calibration.packed"}
    for name, deps in import_graph().items():
        if name.startswith(("sicl_fast.kernels", "sicl_fast.ops")):
            assert not loops & deps, name


def test_static_step_does_not_call_back_into_calibrator():
    """The pieces both loops need (the step spec, the scale, the initial embeddings) live below both: the static
    and packed steps neither import the eager loop's Calibrator nor name it (a call, an attribute, a lazy import)."""
    for f in ("calibration/static.py", "calibration/packed.py"):
        tree = ast.parse((ROOT / "sicl_fast" / f).read_text())
        named = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        named |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        named |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not {"Calibrator", "step_spec", "initial_embeddings"} & named, f


def test_every_relative_import_names_a_module_of_the_tree():
    """A relative import resolves to a module of the tree, by its new path: one that climbed past the package (the
    lazy `from ...models.rows` left behind when step/ moved up a floor, issue #48) or named an old path (MOVED)
    would fail, or work only through the finder, when it runs."""
    mods = modules()
    bad = []
    for name, (path, is_pkg) in mods.items():
        pkg = (name if is_pkg else name.rsplit(".", 1)[0]).split(".")
        for node in ast.walk(tree_of(path)):
            if isinstance(node, ast.ImportFrom) and node.level:
                mod = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                if mod not in mods:
                    bad.append((name, node.lineno, "." * node.level + (node.module or "")))
    assert bad == [], bad

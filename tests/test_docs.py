"""The README and docs/ show only commands that exist. In their shell code blocks, every sicl-fast invocation
(`sicl-fast ...` with any path prefix, `python -m sicl_fast.cli ...`, one inside `$(...)`, any part of `a && b`,
`a || b`, `a; b` or `a | b`, behind `timeout` / `taskset` / `env` / `nice` or VAR=value settings, with variables set
earlier on the page expanded) parses with the real parser: the command and each flag exist, the values are
accepted. Every repository script run with `python` exists and, when it builds an argparse parser, accepts the
arguments shown. Every `make` target is in the Makefile, every relative link points at a file, and no two README
commands write the same --out (a newcomer runs them in order; a second run on a finished file resumes, finds
nothing to do and writes nothing else)."""
from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from sicl_fast.commands.cli import build_parser
from sicl_fast.errors import SiclError
from sicl_fast.evaluation.report import check_summary_target

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "sicl_fast" / "evaluation" / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)  # (language, body)
SHELL = ("bash", "sh", "console", "")
SUBSTITUTED = "SUBSTITUTED"  # the word a `$(...)` leaves in the command around it
PYTHON = re.compile(r"python(3(\.\d+)?)?")
ASSIGNMENT = re.compile(r"(\w+)=(.*)", re.S)


def command_lines(block: str) -> list[str]:
    """The shell command lines of one code block: continuations and quotes across lines joined, here-documents'
    bodies and comments left out."""
    out, heredoc, pending = [], None, ""
    for line in block.replace("\\\n", " ").splitlines():
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if m := re.search(r"<<'?(\w+)'?", line):
            heredoc = m.group(1)
        line = pending + re.sub(r"\s+#\s.*$", "", line)
        try:
            shlex.split(line)
        except ValueError:  # a quote goes on to the next line
            pending = line + " "
            continue
        pending = ""
        if line.strip() and not line.strip().startswith("#"):
            out.append(line.strip())
    return out


def substitutions(line: str) -> tuple[str, list[str]]:
    """(the line with each outermost `$(...)` replaced by SUBSTITUTED, the commands those held)."""
    inner, out, i = [], [], 0
    while (start := line.find("$(", i)) >= 0:
        depth, j = 0, start + 1
        while j < len(line):
            depth += {"(": 1, ")": -1}.get(line[j], 0)
            if depth == 0:
                break
            j += 1
        out.append(line[i:start] + SUBSTITUTED)
        inner.append(line[start + 2:j])
        i = j + 1
    return "".join(out) + line[i:], inner


def _strip_wrappers(words: list[str]) -> list[str]:
    """`words` without leading VAR=value settings and the commands that run another (timeout, taskset, env, nice,
    time, exec, nohup) with their options."""
    while words:
        if ASSIGNMENT.fullmatch(words[0]) or words[0] in ("time", "exec", "nohup", "!", "{"):
            words = words[1:]
        elif words[0] in ("timeout", "taskset", "nice", "env"):
            head, words = words[0], words[1:]
            while words and words[0].startswith("-"):
                takes_value = words[0] in ("-s", "-k", "--signal", "--kill-after", "-n", "-u")
                words = words[2:] if takes_value else words[1:]
            if head in ("timeout", "taskset"):
                words = words[1:]  # the duration, the CPU list or mask
        else:
            break
    return words


def simple_commands(line: str, variables: dict[str, str]) -> list[list[str]]:
    """The words of each simple command of a shell line: those inside `$(...)` first, then each part between
    `&&`, `||`, `;`, `|` and `&`, with redirections, settings and wrapper commands left out and the `variables` set
    earlier on the page expanded ($NAME alone splits into words, as the shell does). A part that only sets
    variables (`F="..."`, `export A=1`) records them in `variables`."""
    line, inner = substitutions(line)
    out = [cmd for text in inner for cmd in simple_commands(text, variables)]
    line = re.sub(r"(?<=\s)\d+(?=[<>])", "", line)  # `2>&1`: the descriptor goes with the redirection
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    parts, words, skip = [], [], False
    for tok in lex:
        if skip:
            skip = False
        elif tok and set(tok) <= set("();<>|&"):
            if "<" in tok or ">" in tok:
                skip = True  # a redirection: its target is no argument
            else:
                parts.append(words)
                words = []
        else:
            words.append(tok)
    parts.append(words)
    for words in parts:
        expanded = []
        for w in words:
            name = re.fullmatch(r"\$\{?(\w+)\}?", w)
            if name and name.group(1) in variables:
                expanded += variables[name.group(1)].split()
            else:
                expanded.append(re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), w))
        words = expanded[1:] if expanded[:1] == ["export"] else expanded
        if words and all(ASSIGNMENT.fullmatch(w) for w in words):
            variables.update(ASSIGNMENT.fullmatch(w).groups() for w in words)
            continue
        if words := _strip_wrappers(words):
            out.append(words)
    return out


def page_commands(page: Path) -> list[list[str]]:
    """Every simple command of a page's shell code blocks, in order. Variables hold across the page's blocks: a
    runbook's block may stand for one line of an earlier block, using its settings."""
    out, variables = [], {}
    for lang, block in FENCE.findall(page.read_text()):
        if lang in SHELL:
            out += [cmd for line in command_lines(block) for cmd in simple_commands(line, variables)]
    return out


def invocation(words: list[str]) -> tuple[str, list[str]] | None:
    """("sicl-fast", its arguments) for `sicl-fast ...` (any path prefix) and `python -m sicl_fast.cli ...`;
    (the script's path, its arguments) for `python SCRIPT.py ...`; None for anything else."""
    prog = os.path.basename(words[0])
    if prog == "sicl-fast":
        return "sicl-fast", words[1:]
    if not PYTHON.fullmatch(prog):
        return None
    i = 1
    while i < len(words) and words[i].startswith("-") and words[i] not in ("-m", "-c"):
        i += 2 if words[i] in ("-X", "-W") else 1
    if words[i:i + 2] == ["-m", "sicl_fast.cli"]:
        return "sicl-fast", words[i + 2:]
    if i < len(words) and words[i].endswith(".py"):
        return words[i], words[i + 1:]
    return None


def cases(kind: str) -> list[tuple[str, str, list[str]]]:
    """(page, program, arguments) of every sicl-fast invocation (kind "sicl-fast") or script run (kind "script")."""
    out = []
    for page in PAGES:
        for words in page_commands(page):
            if (inv := invocation(words)) is not None and (inv[0] == "sicl-fast") == (kind == "sicl-fast"):
                out.append((page.relative_to(ROOT).as_posix(), *inv))
    return out


SICL = cases("sicl-fast")
SCRIPTS = cases("script")


def _ids(rows) -> list[str]:
    return [f"{page}:{i}" for i, (page, *_) in enumerate(rows)]


def test_the_docs_show_commands():
    pages = {p for p, _, _ in SICL}
    assert len(SICL) >= 20 and pages >= {"README.md", "docs/usage.md", "docs/gpu_runbook.md"}
    assert any(prog.startswith("bench/") for _, prog, _ in SCRIPTS)


@pytest.mark.parametrize("page,prog,argv", SICL, ids=_ids(SICL))
def test_every_sicl_fast_invocation_parses(page, prog, argv, capsys):
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{page}: `sicl-fast {shlex.join(argv)}` does not parse (exit {exc.code}): "
                    f"{capsys.readouterr().err.strip()}")


class _Parsed(Exception):
    """Raised by the stand-in parse_args once a script's parser has accepted the arguments."""


def parse_script_args(script: Path, argv: list[str], monkeypatch) -> argparse.Namespace:
    """`argv` parsed by the argparse parser the script's main() builds: the script imported (not run) with its own
    folder first on sys.path, as when it runs, and ArgumentParser.parse_args replaced by one that parses `argv` and
    stops main() there. A parse error is SystemExit, as on the command line."""
    spec = importlib.util.spec_from_file_location(f"_docs_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", [str(script.parent), *sys.path])  # restored after the test
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, argv, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    try:
        module.main()
    except _Parsed as done:
        return done.args[0]
    raise AssertionError(f"{script.relative_to(ROOT)}: main() returned without parsing its arguments")


ARGPARSE_SCRIPTS = [row for row in SCRIPTS if (ROOT / row[1]).is_file() and "argparse" in (ROOT / row[1]).read_text()]


@pytest.mark.parametrize("page,script,argv", ARGPARSE_SCRIPTS, ids=_ids(ARGPARSE_SCRIPTS))
def test_every_script_accepts_its_arguments(page, script, argv, monkeypatch, capsys):
    try:
        parse_script_args(ROOT / script, argv, monkeypatch)
    except SystemExit as exc:
        pytest.fail(f"{page}: `python {script} {shlex.join(argv)}` does not parse (exit {exc.code}): "
                    f"{capsys.readouterr().err.strip()}")


def test_every_script_and_make_target_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for page in PAGES:
        name = page.relative_to(ROOT).as_posix()
        for words in page_commands(page):
            line = shlex.join(words)
            if words[0] == "make":
                assert words[1:2] and words[1] in targets, f"{name}: `{line}`: no make target {words[1:2]}"
            for w in (piece for word in words for piece in re.split(r"[\s=]", word)):
                if w.endswith(".py") and "/" in w and not w.startswith(("-", "/", "$")):
                    assert (ROOT / w).is_file(), f"{name}: `{line}`: {w} is not in the repository"


def test_readme_commands_write_distinct_outputs():
    """Each README command that writes --out writes its own file: run top to bottom, each does what it says."""
    seen: dict[str, str] = {}
    for page, _, argv in SICL:
        out = getattr(build_parser().parse_args(argv), "out", None) if page == "README.md" and "--out" in argv else None
        if out in (None, "-"):
            continue
        assert out not in seen, f"README.md: `sicl-fast {shlex.join(argv)}` writes {out}, as `{seen[out]}` does"
        seen[out] = f"sicl-fast {shlex.join(argv)}"
    assert len(seen) >= 2


def test_the_readme_is_a_newcomers_page():
    """At most 150 lines (issue 48: it had grown to 154); the rest belongs to docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_every_summary_target_holds_its_markers():
    """A `report --summary-into FILE --summary-name NAME` shown in the docs writes into a file that has the markers
    (a table moved to another page takes its command along)."""
    targets = [(page, build_parser().parse_args(argv)) for page, _, argv in SICL if argv[:1] == ["report"]]
    targets = [(page, args) for page, args in targets if args.summary_into]
    for page, args in targets:
        try:
            check_summary_target(ROOT / args.summary_into, args.summary_name)
        except SiclError as exc:
            pytest.fail(f"{page}: {exc}")
    assert targets


def test_every_relative_link_points_at_a_file():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: link {target} points at nothing"


def python_blocks() -> list[tuple[str, str]]:
    return [(str(page.relative_to(ROOT)), body) for page in PAGES for lang, body in FENCE.findall(page.read_text())
            if lang == "python"]


@pytest.mark.parametrize("page, block", python_blocks(), ids=lambda v: v if v.endswith(".md") else "")
def test_python_examples_compile_and_name_what_exists(page, block):
    """Every Python example compiles, and what it names of sicl_fast exists: `sicl_fast.NAME`, names imported from
    sicl_fast, and the methods it calls on an object made by `Engine(...)` (a renamed method fails here, not in a
    reader's hands)."""
    import importlib

    import sicl_fast

    tree = ast.parse(block, filename=page)
    compile(tree, page, "exec")
    engines = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
               and ast.unparse(n.value.func).split(".")[-1] == "Engine" for t in n.targets if isinstance(t, ast.Name)}
    engine_src = ast.parse((ROOT / "sicl_fast" / "engine.py").read_text())
    engine_attrs = set(dir(sicl_fast.Engine)) | {  # and what its methods set on self (plan, lm, backend, ...)
        t.attr for n in ast.walk(engine_src) if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) for t in ast.walk(t)
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("sicl_fast"):
            mod = importlib.import_module(n.module)
            assert all(hasattr(mod, a.name) for a in n.names), (page, ast.unparse(n))
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            if n.value.id == "sicl_fast":
                assert hasattr(sicl_fast, n.attr), (page, ast.unparse(n))
            elif n.value.id in engines:
                assert n.attr in engine_attrs, (page, ast.unparse(n))

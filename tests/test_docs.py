"""The README and docs/ show only commands that exist: every `sicl-fast` line of their code blocks parses (the
command and each flag exist, the values are accepted), every script they run is in the repository, every `make`
target is in the Makefile, and every relative link points at a file."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from sicl_fast.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "sicl_fast" / "evaluation" / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)  # (language, body)
SHELL = ("bash", "sh", "console", "")


def command_lines(page: Path) -> list[str]:
    """The shell commands of a page's code blocks: continuations and quotes across lines joined, here-documents'
    bodies, comments and what follows a pipe left out."""
    out = []
    for lang, block in FENCE.findall(page.read_text()):
        if lang not in SHELL:
            continue
        lines, heredoc, pending = block.replace("\\\n", " ").splitlines(), None, ""
        for line in lines:
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
            line = line.split(" | ")[0].split(" && ")[-1].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def cases() -> list[tuple[str, str]]:
    return [(p.relative_to(ROOT).as_posix(), line) for p in PAGES for line in command_lines(p)]


def argv_of(line: str) -> list[str] | None:
    """The arguments after `sicl-fast` (a path prefix and VAR=value settings allowed), or None."""
    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    if not words or not words[0].endswith("sicl-fast"):
        return None
    return words[1:]


SICL_LINES = [(page, line) for page, line in cases() if argv_of(line) is not None]


def test_the_docs_show_commands():
    assert len(SICL_LINES) >= 20 and {p for p, _ in SICL_LINES} >= {"README.md", "docs/usage.md"}


@pytest.mark.parametrize("page,line", SICL_LINES, ids=[f"{p}:{i}" for i, (p, _) in enumerate(SICL_LINES)])
def test_every_sicl_fast_line_parses(page, line):
    try:
        build_parser().parse_args(argv_of(line))
    except SystemExit as exc:
        pytest.fail(f"{page}: `{line}` does not parse (exit {exc.code})")


def test_every_script_and_make_target_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for page, line in cases():
        words = shlex.split(line)
        if words and words[0] == "make":
            assert words[1] in targets, f"{page}: `{line}`: no make target {words[1]!r}"
        for w in (piece for word in words for piece in re.split(r"[\s=]", word)):
            if w.endswith(".py") and "/" in w and not w.startswith(("-", "/", "$")):
                assert (ROOT / w).is_file(), f"{page}: `{line}`: {w} is not in the repository"


def test_every_relative_link_points_at_a_file():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: link {target} points at nothing"

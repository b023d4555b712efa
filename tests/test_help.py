"""Every --help of sicl-fast tells a user the truth in a user's words: no Python words in the prose (None, True,
False, kwargs, "pass model=", dict, list[...]), and the knobs the presets set say that their default is the
model's preset, with the numbers the presets give (N: 8 for models under 1B parameters, as the embedded SmolLM2,
else 16). The parser is built once and each command's help formatted in-process."""
from __future__ import annotations

import argparse
import re

import pytest

from sicl_fast.calibration.ascent import PRESETS, CalibrationConfig
from sicl_fast.commands.cli import COMMANDS, build_parser

PYTHON_WORDS = re.compile(r"\b(None|True|False|NoneType|kwargs|dict|Optional)\b|list\[|pass model=|<class |<function ")
SMOLLM2_PARAMS = 134_515_008  # the embedded SmolLM2-135M; the preset only asks whether it is under 1B
LARGE_PARAMS = 8_000_000_000


def parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of the top level and every command and sub-command under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


PARSERS = dict(parsers(build_parser()))
KNOB_COMMANDS = [path for path, p in PARSERS.items() if any("--N" in a.option_strings for a in p._actions)]


def test_every_command_has_its_help():
    assert {path[0] for path in PARSERS if path} == set(COMMANDS)
    assert ("cache", "path") in PARSERS
    assert {"calibrate", "icleval", "demo"} <= {path[0] for path in KNOB_COMMANDS}


@pytest.mark.parametrize("path", list(PARSERS), ids=[" ".join(p) or "sicl-fast" for p in PARSERS])
def test_help_has_no_python_words(path):
    text = " ".join(PARSERS[path].format_help().split())  # line breaks undone: "pass model=" may be wrapped
    bad = [text[max(m.start() - 40, 0):m.end() + 20] for m in PYTHON_WORDS.finditer(text)]
    assert not bad, f"sicl-fast {' '.join(path)} --help: Python words in {bad}"


def knob_help(path: tuple[str, ...], flag: str) -> str:
    """The help text of `flag` of the command at `path`, with its line breaks undone."""
    (action,) = [a for a in PARSERS[path]._actions if flag in a.option_strings]
    return " ".join(action.help.split())


PRESET_KNOBS = sorted(set.intersection(*(set(preset) for preset in PRESETS.values())))


@pytest.mark.parametrize("path", KNOB_COMMANDS, ids=[" ".join(p) for p in KNOB_COMMANDS])
def test_knob_help_shows_the_models_preset(path):
    small, large = CalibrationConfig.preset("llama", SMOLLM2_PARAMS), CalibrationConfig.preset("llama", LARGE_PARAMS)
    assert small.N != large.N  # else the help's two numbers would say nothing
    n_help = knob_help(path, "--N")
    assert "preset" in n_help and f"{small.N} for models under 1B parameters" in n_help and "SmolLM2" in n_help
    assert f"else {large.N}" in n_help
    for name in PRESET_KNOBS:
        if name == "N" or not any(f"--{name.replace('_', '-')}" in a.option_strings for a in PARSERS[path]._actions):
            continue
        text = knob_help(path, f"--{name.replace('_', '-')}")
        values = {preset[name] for preset in PRESETS.values()}
        assert "the model's preset" in text, f"--{name}: {text}"
        assert len(values) > 1 or f"{values.pop()} for every family" in text, f"--{name}: {text}"


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for a in parser._actions for opt in a.option_strings}


def minimal_args(parser: argparse.ArgumentParser) -> list[str]:
    """Arguments a command parses without error: a value for each positional and each required option (the first
    sub-command where it has them)."""
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            name = next(iter(a.choices))
            out += [name, *minimal_args(a.choices[name])]
        elif not a.option_strings and a.nargs not in ("?", "*"):
            out.append(next(iter(a.choices)) if a.choices else "x")
        elif a.option_strings and a.required:
            out += [a.option_strings[0], "x"]
    return out


def test_each_command_refuses_the_flags_it_does_not_use(capsys):
    """A command takes only its flag groups (cli.COMMAND_GROUPS, #26): every engine flag another command has is
    refused while parsing, with the error naming it (before: every command took every flag, and `bench` ignored
    --loop, --pack and --sync-every)."""
    top = {path[0]: p for path, p in PARSERS.items() if len(path) == 1}
    every = set().union(*(flags_of(p) for p in top.values()))
    checked = 0
    for cmd, parser in top.items():
        own = set().union(*(flags_of(p) for path, p in PARSERS.items() if path[:1] == (cmd,)))  # sub-commands' too
        base = minimal_args(parser)
        build_parser().parse_args([cmd, *base])  # parses as it is
        for flag in sorted(every - own):
            if any(f.startswith(flag) for f in own):
                continue  # an abbreviation of one of its own flags (--max-n of another command: --max-new-tokens)
            with pytest.raises(SystemExit) as exc:
                build_parser().parse_args([cmd, *base, flag, "1"])
            err = capsys.readouterr().err
            assert exc.value.code == 2 and f"unrecognized arguments: {flag}" in err, (cmd, flag, err)
            checked += 1
    assert {"--loop", "--pack", "--diff-matmul", "--N", "--store"} <= every - flags_of(top["proxy"])
    assert checked > 100


def test_the_attention_kernel_has_a_flag_wherever_its_precision_has():
    """--attn chooses the attention kernel (the plan's `attn`) on every command with --attn-precision: the plan's
    refusals say "use attn 'triton' or 'math'", and a fallback to the torch ops records attention 'math', which a
    resume of its file must be able to ask for. Before there was none, and argparse read `--attn math` as an
    abbreviation of --attn-precision ("invalid choice: 'math'") and `--attn ieee` as the precision."""
    from sicl_fast.commands.cli import _plan_choices

    with_precision = [path for path, p in PARSERS.items() if "--attn-precision" in flags_of(p)]
    assert len(with_precision) >= 8
    for path in with_precision:
        args = build_parser().parse_args([*path, *minimal_args(PARSERS[path]), "--attn", "math"])
        assert (_plan_choices(args)["attn"], args.attn_precision) == ("math", "auto"), path
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--attn", "ieee"])

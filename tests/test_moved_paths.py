"""The module paths before the modules were grouped by role (issues #41, #48, #54: `sicl_fast.MOVED`) work as
CHANGELOG.md says, every entry (the C++ extension's where it is built), in a fresh interpreter (a first import through
the old path): the old path is the new module itself, an attribute of its parent package after `import OLD`
(`sicl_fast.proxy` stays the function), a string monkeypatch through it patches the new module, `python -m` runs the
one main (`sicl_fast.cli`) and says in one line that the others have no command line, and a module under an old
package path that is not imported yet loads once. Before #48 the attribute failed for 35 of the 47 entries, and
`python -m sicl_fast.jobs` was an ImportError."""
import json
import subprocess
import sys

CHECK = r"""
import contextlib, importlib, importlib.util, io, json, runpy, sys, types
import pytest
import sicl_fast

out = {"not_the_module": [], "not_an_attribute": [], "patch_missed": [], "run": {}}
# `python -m OLD` (before any import of the old paths, as in a fresh interpreter)
for name, argv in (("sicl_fast.cli", ["x", "plan", "--help"]), ("sicl_fast.jobs", ["x", "--help"]),
                   ("sicl_fast.calibration.step", ["x"])):
    sys.argv, err, stdout = argv, io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(stdout):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            out["run"][name] = [exc.code, err.getvalue(), stdout.getvalue()[:40]]
# a module under an old package path whose new module is not imported yet (the path finder would load its file
# under the old name, as a second module object)
rng = sys.modules["sicl_fast.step.rng"]
for name in [k for k, m in sys.modules.items() if m is rng]:
    del sys.modules[name]
old_rng = importlib.import_module("sicl_fast.calibration.step.rng")
out["once"] = old_rng is importlib.import_module("sicl_fast.step.rng") and old_rng is not rng
for old, new in sicl_fast.MOVED.items():
    if importlib.util.find_spec(f"sicl_fast.{new}") is None:  # the C++ extension, where it is not built
        continue
    module = importlib.import_module(f"sicl_fast.{old}")
    if module is not importlib.import_module(f"sicl_fast.{new}"):
        out["not_the_module"].append(old)
    obj = sicl_fast
    for part in old.split("."):
        obj = getattr(obj, part, None)
    if obj is not (sicl_fast.proxy if old == "proxy" else module):
        out["not_an_attribute"].append(old)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(f"sicl_fast.{old}.PROBE", 1, raising=False)
        target = sicl_fast.proxy if old == "proxy" else module  # the string reaches the function there
        if getattr(target, "PROBE", None) != 1:
            out["patch_missed"].append(old)
files = {}
for name, m in list(sys.modules.items()):
    if name.startswith("sicl_fast") and getattr(m, "__file__", None):
        files.setdefault(m.__file__, set()).add(id(m))
out["loaded_twice"] = sorted(f for f, ids in files.items() if len(ids) > 1)
print(json.dumps(out))
"""


def test_every_old_path_works_as_the_changelog_says():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["once"] and out["loaded_twice"] == [], out
    assert out["not_the_module"] == out["not_an_attribute"] == out["patch_missed"] == [], out
    code, err, help_ = out["run"]["sicl_fast.cli"]
    assert code == 0 and help_.startswith("usage: sicl-fast plan"), out["run"]
    for name, new in (("sicl_fast.jobs", "sicl_fast.commands.work"), ("sicl_fast.calibration.step", "sicl_fast.step")):
        code, err, _ = out["run"][name]
        assert code == 2 and err == (f"python -m {name}: {name} (now {new}) has no command line; the command line is "
                                     "`sicl-fast` (or python -m sicl_fast.cli)\n"), out["run"]

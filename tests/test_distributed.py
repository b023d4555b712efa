"""--ray on a real local Ray (2 CPUs, one cluster for the module): records equal to the single-process run
(calibrate and icleval, a tiny random-weight model and the real SmolLM2), resume after the driver is SIGKILLed,
a worker killed mid-request, bounded retries, and the errors (missing extra, too many workers)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sicl_fast.commands.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "icleval" / "data"
TIMING = {"seconds", "calibration_seconds"}  # the only fields allowed to differ between runs
WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# tau 0: a random-weight model's proxy is far under the gate; patience 0: every request runs all its steps
TINY_KNOBS = ["--tau", "0", "--patience", "0", "--N", "2"]

# one Ray cluster: the module runs on one pytest-xdist worker (`make test` runs --dist loadscope)
pytestmark = [pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def requests_file(path: Path, n: int) -> str:
    reqs = [{"id": f"r{i}", "demos": [{"input": WORDS[(i + k) % 9], "output": str((i + k) % 9 + 1)} for k in range(3)],
             "query": WORDS[(i + 5) % 9]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return str(path)


def records(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def by_key(recs: list[dict], key=lambda r: r["id"]) -> dict:
    """Records by key without the timing fields; fails when a key appears twice."""
    out = {}
    for r in recs:
        k = key(r)
        assert k not in out, f"record {k} written twice"
        out[k] = {f: v for f, v in r.items() if f not in TIMING}
    return out


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory):
    """The single-process calibrate run of 8 requests, 30 steps each, with answers."""
    d = tmp_path_factory.mktemp("ref")
    reqs = requests_file(d / "reqs.jsonl", 8)
    out = d / "single.jsonl"
    args = ["calibrate", reqs, "--model", tiny_dir, "--max-steps", "30", "--generate", "--max-new-tokens", "3",
            *TINY_KNOBS]
    assert main([*args, "--out", str(out)]) == 0
    return {"reqs": reqs, "args": args, "records": by_key(records(out))}


def test_ray_calibrate_equals_single_process(ray_cluster, reference, tmp_path):
    out = tmp_path / "ray.jsonl"
    assert main([*reference["args"], "--out", str(out), "--ray", "--workers", "2"]) == 0
    got = by_key(records(out))
    assert got == reference["records"]
    assert len(got) == 8 and all(r["steps"] == 30 and "error" not in r for r in got.values())


def test_ray_icleval_equals_single_process(ray_cluster, tiny_dir, tmp_path):
    args = ["icleval", str(FIXTURES), "--tasks", "classifier_format", "generate_output_format", "--limit", "2",
            "--model", tiny_dir, "--method", "base", "sicl", "cc", "--max-steps", "3", *TINY_KNOBS, "--quiet"]
    single, dist = tmp_path / "single.jsonl", tmp_path / "ray.jsonl"
    assert main([*args, "--out", str(single)]) == 0
    assert main([*args, "--out", str(dist), "--ray", "--workers", "2"]) == 0
    key = lambda r: (r["variant"], r["task"], r["uid"])  # noqa: E731
    want = by_key(records(single), key)
    assert by_key(records(dist), key) == want
    assert len(want) == 2 * 2 + 2 * 2 + 2  # base and sicl on 4 samples, cc on the 2 classification samples
    assert all(len(r["history"]) == 3 for k, r in want.items() if k[0] != "base" and k[0] != "cc")


def test_ray_stopping_rules_equal_single_process(ray_cluster, tiny_dir, tmp_path):
    """The time budget, min_delta and --answer-at reach the Ray workers (issue 31): the same records as one process
    (a budget of 0 s: one step each; min_delta 1: patience 2 stops after 3 steps)."""
    reqs = requests_file(tmp_path / "r.jsonl", 3)
    runs = [["calibrate", reqs, "--model", tiny_dir, "--max-steps", "6", "--time-budget", "0", *TINY_KNOBS],
            ["icleval", str(FIXTURES), "--tasks", "generate_output_format", "--limit", "2", "--model", tiny_dir,
             "--max-steps", "6", *TINY_KNOBS, "--patience", "2", "--min-delta", "1", "--answer-at", "1", "2",
             "--quiet"]]
    for args, steps, reason in zip(runs, (1, 3), ("time_budget", "patience")):
        single, dist = tmp_path / f"single-{steps}.jsonl", tmp_path / f"ray-{steps}.jsonl"
        assert main([*args, "--out", str(single)]) == 0
        assert main([*args, "--out", str(dist), "--ray", "--workers", "2"]) == 0
        key = lambda r: (r.get("variant"), r.get("task"), r.get("uid"), r.get("id"))  # noqa: E731
        want = by_key(records(single), key)
        assert by_key(records(dist), key) == want
        assert all(r["steps"] == steps and r["stop_reason"] == reason for r in want.values())
    assert all(sorted(r["answers_at"]) == ["1", "2"] for r in want.values())


def test_driver_killed_mid_run_resumes(ray_cluster, tiny_dir, reference, tmp_path, capsys):
    """A driver SIGKILLed mid-run (in a subprocess that joins this cluster) leaves whole lines; the rerun finishes
    the rest, and the file holds every request once, equal to the single-process run."""
    out = tmp_path / "killed.jsonl"
    address = ray_cluster.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "sicl_fast.cli", *reference["args"], "--out", str(out), "--ray", address,
           "--workers", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_text().count("\n") >= 2:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the driver ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    partial = records(out)  # whole lines only: every line parses
    assert 2 <= len(partial) < 8
    assert main([*reference["args"], "--out", str(out), "--ray", "--workers", "2"]) == 0
    assert "resuming: " in capsys.readouterr().err
    assert by_key(records(out)) == reference["records"]


def test_errors_are_one_line(ray_cluster, tiny_dir, reference, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    assert main([*reference["args"], "--out", str(out), "--ray", "--workers", "3"]) == 2
    assert "3 workers x 1 CPU each need 3 CPUs; the Ray cluster has 2" in capsys.readouterr().err
    assert main([*reference["args"], "--out", str(out), "--workers", "2"]) == 2
    assert "--workers 2 needs --ray" in capsys.readouterr().err
    # found by the worker's tokenizer (the driver holds no model): the same one-line error, nothing written
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "long", "demos": [{"input": "a", "output": "b"}], "query": "word " * 3000}) + "\n")
    assert main(["calibrate", str(bad), "--model", tiny_dir, "--out", str(out), "--ray", "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'long'" in err[0] and "context" in err[0] and not out.exists()


def test_missing_extra_is_one_clear_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as it does without the extra
    reqs = requests_file(tmp_path / "r.jsonl", 1)
    assert main(["calibrate", reqs, "--out", str(tmp_path / "o.jsonl"), "--ray"]) == 2
    assert main(["icleval", str(FIXTURES), "--out", str(tmp_path / "e.jsonl"), "--ray", "auto"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all('--ray (a Ray cluster)' in x and 'pip install "sicl-fast[ray]"' in x for x in lines)
    assert not (tmp_path / "o.jsonl").exists()


def test_lost_sample_records_stay_out_of_the_report(tmp_path, capsys):
    """A sample whose worker died too often gets one error record per variant; the report leaves them out."""
    from sicl_fast.evaluation.ablations import Variant
    from sicl_fast.evaluation.methods import lost_records, record_key
    from sicl_fast.evaluation.report import load_runs
    from sicl_fast.icleval import load_dir

    s0, s1 = load_dir(FIXTURES, ["classifier_format"], check_sha256=False)["classifier_format"][:2]
    lost = lost_records([(s0, [Variant("base", "base")])], "worker failed 3 times on this item; last: killed", "m")
    assert len(lost) == 1 and record_key(lost[0]) == ("base", s0.task_file, s0.uid) and "killed" in lost[0]["error"]
    good = {"task": s1.task_file, "uid": s1.uid, "method": "base", "variant": "base", "model": "m",
            "correct_base": True, "correct_calibrated": True}
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*lost, good]))
    (run,) = load_runs([path])
    assert run.records == [good] and "1 error record(s) left out" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_ray_run_equals_single_process(ray_cluster, tmp_path):
    reqs = requests_file(tmp_path / "r.jsonl", 2)
    args = ["calibrate", reqs, "--max-steps", "2", "--N", "2", "--generate", "--max-new-tokens", "3"]
    assert main([*args, "--out", str(tmp_path / "single.jsonl")]) == 0
    assert main([*args, "--out", str(tmp_path / "ray.jsonl"), "--ray", "--workers", "2"]) == 0
    want = by_key(records(tmp_path / "single.jsonl"))
    assert by_key(records(tmp_path / "ray.jsonl")) == want
    assert all(r["steps"] == 2 and r["answer_base"] for r in want.values())


@pytest.fixture(scope="module")
def pool(ray_cluster, tiny_dir):
    """Two actors of the tiny model, shared by the tests that drive a pool directly. They hold both CPUs of the
    cluster until the module ends, so these tests come last in the file (others' actors could not be placed)."""
    from sicl_fast.commands.distributed import RayPool

    with RayPool({"model": tiny_dir, "reuse": "auto"}, workers=2, max_retries=2) as p:  # as `calibrate` builds them
        yield p


def test_worker_killed_mid_request_is_retried(ray_cluster, pool, reference):
    """ray.kill of a busy actor: its request is retried on a fresh actor; every record comes back exactly once."""
    import functools

    from sicl_fast.commands.work import calibrate_requests
    from sicl_fast.formats.requests import read_requests
    from sicl_fast.run.workers import Done

    reqs = list(read_requests(reference["reqs"]))
    restarts = pool.restarts
    cfg = pool.config(tau=0.0, patience=0, N=2, max_steps=30)
    work = functools.partial(calibrate_requests, config=cfg, max_new_tokens=3, generate=True)
    got, killed = [], None
    for res in pool.imap(work, [[r] for r in reqs]):
        assert isinstance(res, Done)
        got += res.value
        if killed is None:
            busy = pool.busy()
            assert busy, "no request in flight to kill"
            killed = busy[0]
            ray_cluster.kill(killed[0], no_restart=True)
    assert pool.restarts == restarts + 1 and killed[0] not in pool.actors
    # the work function's records: the driver's writer adds the run's settings (issue 48)
    assert by_key(got) == {k: {f: v for f, v in r.items() if f != "settings"} for k, r in reference["records"].items()}


def _kill_self_on(engine, item):
    """A work function whose worker process dies on item 'boom' (as an out-of-memory kill would end it)."""
    if item == "boom":
        os._exit(1)
    return [{"id": item, "model": engine.lm.name}]


def test_retries_are_bounded_then_lost(ray_cluster, pool):
    import ray.cloudpickle

    from sicl_fast.run.workers import Done, Lost

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    restarts = pool.restarts
    out = list(pool.imap(_kill_self_on, ["a", "boom", "b", "c"]))
    assert pool.restarts == restarts + 3  # the first try and two retries (max_retries=2), each actor replaced
    lost = [o for o in out if isinstance(o, Lost)]
    assert len(lost) == 1 and lost[0].index == 1 and "worker failed 3 times" in lost[0].message
    done = sorted(o.value[0]["id"] for o in out if isinstance(o, Done))
    assert done == ["a", "b", "c"] and len(out) == 4


def test_each_actor_runs_on_its_cpus(ray_cluster, pool):
    """An actor's threads are its CPUs (the pool sets the engine's `threads`; the engine applies them)."""
    from sicl_fast.run.workers import engine_facts

    assert pool.engine_kwargs["threads"] == pool.cpus_per_worker == 1
    facts = pool.call(engine_facts)
    assert (facts["threads"], facts["torch_threads"]) == (1, 1)

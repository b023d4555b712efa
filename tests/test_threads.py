"""One thread count per process (sicl_fast.run.threads): torch and the C++ ops take the same number, from any thread."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest
import torch

from sicl_fast.errors import SiclError
from sicl_fast.ops import cpp_ops
from sicl_fast.run.threads import WAIT_ENV, apply_threads, available_cores, decide_wait_policy, resolve_threads

needs_cpp = pytest.mark.skipif(not cpp_ops.available(), reason="the C++ extension sicl_fast.ops._C is not built")


@pytest.fixture
def restore_threads():
    n_torch = torch.get_num_threads()
    n_cpp = cpp_ops.num_threads() if cpp_ops.available() else None
    yield
    torch.set_num_threads(n_torch)
    if n_cpp is not None:
        cpp_ops.set_num_threads(n_cpp)


def test_resolve_defaults_to_omp_num_threads_then_the_cores_this_process_may_use(monkeypatch):
    assert available_cores() >= 1
    monkeypatch.setattr("sicl_fast.run.threads.available_cores", lambda: 64)  # the counts below are within the cores
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    n, why = resolve_threads(None)
    assert n == 64 and "affinity" in why
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert resolve_threads(None) == (3, "default: OMP_NUM_THREADS=3 in the environment")
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # a nested list: not one count, so the cores
    assert resolve_threads(None)[0] == 64
    assert resolve_threads(5) == (5, "asked for")


@pytest.mark.parametrize("bad, message", [(0, "must be >= 1, got 0"), (-1, "must be >= 1, got -1"),
                                          (1.5, "must be an integer, got 1.5"), (True, "must be an integer"),
                                          ("2", "must be an integer"), (5000, "must be <= 4096")])
def test_resolve_refuses_bad_counts_through_the_knob_table(bad, message):
    with pytest.raises(SiclError, match=f"Engine: threads {message}"):
        resolve_threads(bad)


def test_omp_num_threads_is_checked_and_said_when_not_used(monkeypatch):
    """99999 was taken as is (and refused after the model loaded, as "Engine: threads"); "²" (a digit to
    str.isdigit) was an internal ValueError; an unusable value was dropped without a word in the plan."""
    monkeypatch.setenv("OMP_NUM_THREADS", "99999")
    with pytest.raises(SiclError, match=r"^OMP_NUM_THREADS=99999: the thread count must be <= 4096"):
        resolve_threads(None)
    for bad in ("\u00b2", "abc", "0", "-1", "2,1"):
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        n, why = resolve_threads(None)
        assert n == available_cores() and f"OMP_NUM_THREADS={bad!r} is not one thread count, so not used" in why
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert "OMP_NUM_THREADS" not in resolve_threads(None)[1]


def test_more_threads_than_cores_is_said_once_and_in_the_plan(monkeypatch):
    """#40: --threads 999 on a 2-core machine ran 77.7 s against 5.4 s at 2, with no word (`plan` showed only
    "999 asked for")."""
    import warnings

    from sicl_fast.errors import SiclWarning
    from sicl_fast.run.plan import Choices

    monkeypatch.setattr("sicl_fast.run.threads.available_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert "more than the 2 core(s) this process may use" in resolve_threads(3)[1]
    assert resolve_threads(2) == (2, "asked for")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        Choices(threads=999)
        Choices(threads=2)
        monkeypatch.setenv("OMP_NUM_THREADS", "8")
        Choices()
    msgs = [str(w.message) for w in got if issubclass(w.category, SiclWarning)]
    assert msgs == ["threads 999: more than the 2 core(s) this process may use: the threads beyond 2 wait for a "
                    "core at every step, which makes it slower, not faster (use 2 or fewer)",
                    "OMP_NUM_THREADS=8: more than the 2 core(s) this process may use: the threads beyond 2 wait for "
                    "a core at every step, which makes it slower, not faster (use 2 or fewer)"]


@pytest.mark.parametrize("value", ["abc", " ", "activ"])
def test_a_wait_policy_libgomp_cannot_read_is_not_reported_as_chosen(value):
    """OMP_WAIT_POLICY=abc was shown by the plan as policy 'abc'; libgomp ignores it and keeps its default."""
    env = {"OMP_WAIT_POLICY": value}
    policy, why = decide_wait_policy(env, openmp_started=False)
    assert policy == "libgomp default" and "neither ACTIVE nor PASSIVE" in why and env == {"OMP_WAIT_POLICY": value}
    assert decide_wait_policy({"OMP_WAIT_POLICY": " Passive "}, openmp_started=False)[0] == "passive"


def test_wait_policy_passive_unless_the_user_chose_or_openmp_started():
    env = {}
    assert decide_wait_policy(env, openmp_started=False)[0] == "passive" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    policy, why = decide_wait_policy(env, openmp_started=False)
    assert (policy, env) == ("active", {"OMP_WAIT_POLICY": "ACTIVE"}) and "OMP_WAIT_POLICY=ACTIVE" in why
    env = {"GOMP_SPINCOUNT": "1000"}
    assert decide_wait_policy(env, openmp_started=False)[0] == "spin count 1000" and "OMP_WAIT_POLICY" not in env
    env = {}
    policy, why = decide_wait_policy(env, openmp_started=True)  # too late to change this process: say so
    assert policy == "libgomp default" and env == {} and "OMP_WAIT_POLICY=PASSIVE" in why


def test_the_cli_sets_the_wait_policy_before_openmp_starts():
    """libgomp reads the policy when torch loads it: `import sicl_fast` first gives PASSIVE (spin count 0, as
    libgomp itself reports it), unless the environment says otherwise."""
    code = "import sicl_fast, torch; torch.ones(4).sum()"
    env = {k: v for k, v in os.environ.items() if k not in WAIT_ENV}
    for extra, spin in (({}, "'0'"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "'30000000000'")):
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra, "OMP_DISPLAY_ENV": "verbose"},
                             capture_output=True, text=True, check=True)
        if "GOMP_SPINCOUNT" not in out.stderr:
            pytest.skip("torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT in OMP_DISPLAY_ENV's report)")
        assert f"GOMP_SPINCOUNT = {spin}" in out.stderr


@needs_cpp
def test_apply_sets_torch_and_the_cpp_ops(restore_threads):
    for n in (1, 3):
        assert apply_threads(n) == n
        assert torch.get_num_threads() == n and cpp_ops.num_threads() == n


@needs_cpp
def test_cpp_thread_count_holds_in_other_threads(restore_threads):
    """A server runs the engine on a worker thread: the count set on the main thread is the one its ops use
    (OpenMP's own setting is per thread, and a new thread would start from the default)."""
    apply_threads(1)
    seen = []
    t = threading.Thread(target=lambda: seen.append(cpp_ops.num_threads()))
    t.start()
    t.join()
    assert seen == [1]


@needs_cpp
def test_set_num_threads_refuses_zero(restore_threads):
    with pytest.raises(ValueError, match="n must be >= 1"):
        cpp_ops.set_num_threads(0)


@needs_cpp
def test_threads_flag_reaches_torch_and_the_cpp_ops(restore_threads, tiny_dir, tmp_path):
    """`--threads N` on a command that runs the model: the plan's count, applied to both pools (build_backend)."""
    from sicl_fast.commands.cli import main

    req = tmp_path / "r.jsonl"
    req.write_text('{"id": "a", "demos": [{"input": "one", "output": "1"}], "query": "two"}\n')
    for n in (3, 1):
        assert main(["proxy", str(req), "--model", str(tiny_dir), "--threads", str(n)]) == 0
        assert torch.get_num_threads() == n and cpp_ops.num_threads() == n


@needs_cpp
def test_engine_takes_threads(restore_threads, tiny_llama):
    from sicl_fast import Engine

    eng = Engine(tiny_llama, threads=3)
    assert eng.plan.threads == 3 and torch.get_num_threads() == 3 and cpp_ops.num_threads() == 3
    assert re.search(r"^  threads +3 +asked for", eng.plan.explain(), re.M)

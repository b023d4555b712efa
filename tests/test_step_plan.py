"""A prompt's static step is planned in one place (sicl_fast.calibration.step_plan, issue #54): over one
Engine.calibrate the config's scale, the length bucket, the StepSpec, the forward's prefix policy and shape, the step's
bytes and the proxy plan are each worked out once, for the prompt that builds the step and for one that re-arms it from
the step cache; the plan counts the bytes the cache and the memory check use, and what the run plan's backend runs.
(Before, a calibration worked out the scale three times, the spec, the bucket and the bytes twice each, the policy
three times, in turns between calibration/static.py, step/spec.py and run/memory.py.) That the static step computes
what it did is tests/test_static.py's, test_buckets.py's and test_packed.py's: the same histories bit for bit."""
import collections
import importlib.util
import inspect
import sys
from pathlib import Path

from conftest import synthetic_prompt
from sicl_fast.backends.step_forward import StepForward
from sicl_fast.calibration.ascent import CalibrationConfig
from sicl_fast.engine import Engine
from sicl_fast.run import memory
from sicl_fast.run.buckets import Bucket
from sicl_fast.step import spec
from sicl_fast.step.proxy import ProxyPlan
from test_fast_backend import V

ROOT = Path(__file__).resolve().parents[1]
# each piece of a step's plan, by the function that works it out
PIECES = {"scale": CalibrationConfig.resolve_scale, "bucket": Bucket.of, "spec": spec.StepSpec.__post_init__,
          "prefix policy": spec.prefix_policy, "forward shape": StepForward.shape, "bytes": memory.step_bytes,
          "proxy plan": ProxyPlan.build}


def worked_out(run) -> collections.Counter:
    """How many times each of PIECES is called while run() runs."""
    codes = {inspect.unwrap(getattr(f, "__func__", f)).__code__: name for name, f in PIECES.items()}
    counts = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return counts


def test_a_prompt_s_step_is_planned_once(models):
    eng = Engine(models["llama"], backend="fast-fp32", impl="torch", length_buckets=4, sync_every=2)
    cfg = CalibrationConfig(N=3, mu=0.05, eta=0.5, kappa=0.2, tau=0.0, patience=0, max_steps=2, seed=3, scale=1.0)
    # two lengths in one bucket: the first builds the step, the second re-arms it (StaticStep.load)
    prompts = [synthetic_prompt(41, [(10, 14), (20, 26)], 6, V, seed=1),
               synthetic_prompt(43, [(9, 12), (21, 27)], 6, V, seed=2)]
    for p in prompts:
        assert worked_out(lambda: eng.calibrate(p, cfg, best_at=[1])) == {name: 1 for name in PIECES}, p.length
    assert eng.steps.cache.stats == {"builds": 1, "hits": 1}


def test_the_cache_and_the_memory_check_count_the_plan_s_bytes(models):
    """The step cache holds what the plan counts the step holds (StepBytes.kept); the run's copies of X (best_at)
    are the memory check's, not the cached step's."""
    from sicl_fast.calibration.step_plan import plan_step

    eng = Engine(models["llama"], backend="fast-fp32", impl="torch", length_buckets=4, sync_every=2)
    cfg = CalibrationConfig(N=3, mu=0.05, eta=0.5, kappa=0.2, tau=0.0, patience=0, max_steps=2, seed=3, scale=1.0)
    p = synthetic_prompt(41, [(10, 14), (20, 26)], 6, V, seed=1)
    eng.calibrate(p, cfg, best_at=[1, 2])
    size = plan_step(eng.backend, cfg, p, buckets=eng.steps.buckets, kept=2)[0].bytes
    assert size.copies == 2 * 4 * p.length * eng.lm.hidden_size
    assert eng.steps.held == size.kept + size.activations
    assert size.total == size.kept + size.copies + size.activations


def file_entries():
    """bench/file_entries.py: the tracer of a calibration's entries into each file (its docstring defines an entry
    and the phases) and the scenarios it counts."""
    spec = importlib.util.spec_from_file_location("file_entries", ROOT / "bench" / "file_entries.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the most entries a prompt's planning (Engine.calibrate's entry to the first call of its static step) makes into each
# file its step is planned in: two, but three into run/memory.py (the run plan's form of the forward, form_of; the
# step's bytes, step_bytes; the memory free, available_memory, from the memory check) and, under a length bucket,
# into step/spec.py (the knob checks of the config with its scale resolved, check_choices, as that config is made; the
# padded step's StepSpec; the prompt's own block end, block_end, which the spec, shared by the bucket's prompts and
# part of the step cache's key, cannot carry). At 481e2be: 15-27 into spec.py, 4-7 into memory.py and buckets.py, 3
# into step_forward.py (bench/RESULTS.md 35).
MOST = {"sicl_fast/run/memory.py": 3}
MOST_BUCKETED = {**MOST, "sicl_fast/step/spec.py": 3}


def test_a_prompt_s_planning_enters_each_planning_file_once_or_twice(models):
    """Following one prompt through Engine.calibrate (the fast backend's static step, tau 0, two steps), with length
    buckets off and on (the step built, and re-armed for another prompt of the bucket): each file the step is planned
    in is entered at most twice while the prompt is planned (MOST's exceptions), and the plan is made once, in
    calibration/step_plan.py. Before (481e2be), the spec's, the bucket's, the bytes' and the policy's pieces were
    worked out in turns between static.py, spec.py, memory.py and step_forward.py, and the config was checked twice."""
    fe = file_entries()
    got = fe.scenarios(Engine, CalibrationConfig, models["llama"],
                       lambda L, spans, seed: synthetic_prompt(L, list(spans), 6, V, seed=seed))
    assert list(got) == ["static", "buckets", "buckets, re-armed"]
    for scenario, (planning, *steps) in got.items():
        most = MOST_BUCKETED if scenario.startswith("buckets") else MOST
        over = {f: planning.get(f, 0) for f in fe.PLANNING_FILES if planning.get(f, 0) > most.get(f, 2)}
        assert not over, (scenario, over)
        assert planning.get("sicl_fast/calibration/step_plan.py") == 1, scenario  # one plan (plan_step)
        assert len(steps) == 2 and all(s.get("sicl_fast/calibration/static.py") for s in steps), scenario

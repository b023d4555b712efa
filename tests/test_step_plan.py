"""A prompt's static step is planned in one place (sicl_fast.calibration.step_plan, issue #54): over one
Engine.calibrate the config's scale, the length bucket, the StepSpec, the forward's prefix policy and shape, the step's
bytes and the proxy plan are each worked out once, for the prompt that builds the step and for one that re-arms it from
the step cache; the plan counts the bytes the cache and the memory check use, and what the run plan's backend runs.
(Before, a calibration worked out the scale three times, the spec, the bucket and the bytes twice each, the policy
three times, in turns between calibration/static.py, step/spec.py and run/memory.py.) That the static step computes
what it did is tests/test_static.py's, test_buckets.py's and test_packed.py's: the same histories bit for bit."""
import collections
import inspect
import sys

from conftest import synthetic_prompt
from sicl_fast.backends.step_forward import StepForward
from sicl_fast.calibration.ascent import CalibrationConfig
from sicl_fast.engine import Engine
from sicl_fast.run import memory
from sicl_fast.run.buckets import Bucket
from sicl_fast.step import spec
from sicl_fast.step.proxy import ProxyPlan
from test_fast_backend import V

# each piece of a step's plan, by the function that works it out
PIECES = {"scale": spec.resolve_scale, "bucket": Bucket.of, "spec": spec.StepSpec.__post_init__,
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

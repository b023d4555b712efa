"""Where the decoder's part of one ascent step goes, op by op: the forward over the step's batch (the static step's
own buffers, as `sicl-fast profile` times it as "decoder layers") under cProfile, so that the C++ extension's calls
(attention, the row epilogues), which torch's profiler does not see, are listed beside torch's.

    python bench/decoder_ops.py --length 512 [--repeats 2]

Prints the calls that took the most time in the last of `repeats` forwards (after one warm-up), by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import torch

from sicl_fast import Engine
from sicl_fast.diagnostics.benchmark import synthetic_prompt
from sicl_fast.run.checks import calibration_inputs
from sicl_fast.diagnostics.profile import layers_call
from sicl_fast.calibration.static import StaticStep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=512, help="prompt length in tokens")
    ap.add_argument("--repeats", type=int, default=1, help="profiled forwards; the last one is printed")
    ap.add_argument("--top", type=int, default=14, help="calls listed")
    args = ap.parse_args(argv)
    eng = Engine()
    be = eng.backend
    prompt = synthetic_prompt(eng.lm, args.length, seed=0)
    config = eng.config().resolve_scale(be.lm)
    st = StaticStep(be, config, prompt, calibration_inputs(be, prompt, config))
    forward = layers_call(st)
    with torch.no_grad():
        forward()
        for _ in range(max(1, args.repeats)):
            prof = cProfile.Profile()
            prof.enable()
            forward()
            prof.disable()
    print(f"# decoder forward over the batch: {eng.lm.name}, impl {be.ops.name}, L {args.length}, "
          f"B {st.spec.B}, {torch.get_num_threads()} threads")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())

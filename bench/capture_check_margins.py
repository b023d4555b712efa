"""How close a step comes to the tolerances of the check every new CUDA graph's first replay passes (issue #53, item
5: sicl_fast.run.graphs.first_replay): the plan's ops, uncaptured, against the same step through the torch ops and
the math attention (FastBackend.torch_twin), as the checks compare them, for the static step, its reference refresh
and a decode step; each figure is the largest error over its tolerance (below 1 passes; a graph that is right gives
what its ops give uncaptured, so these are the margins a correct capture has on this machine).

    python bench/capture_check_margins.py --impl cpp triton --length 64

The embedded SmolLM2-135M in float32 with the difference form (bf16 products), a synthetic prompt of --length tokens
(an 8-token prefix), the model's preset (N 8): one step from the prompt's embeddings, then the refresh at the
stepped X, then one decode step after a prefill of the prompt. Triton runs under its interpreter off CUDA
(TRITON_INTERPRET=1 is set here when there is no GPU). Prints a table and the machine's load (`uptime`).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads: its interpreter on the CPU

from sicl_fast.backends import make_backend  # noqa: E402
from sicl_fast.backends.fast import DecodeCheck  # noqa: E402
from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator  # noqa: E402
from sicl_fast.calibration.static import (F0_TOL, MOVE_TOL, REF_TOL, RefreshCheck, StaticStep,  # noqa: E402
                                          StepCheck, step_outputs)
from sicl_fast.diagnostics.benchmark import synthetic_prompt  # noqa: E402
from sicl_fast.models import load  # noqa: E402
from sicl_fast.run.graphs import DecodeGraph  # noqa: E402


def ratio(got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """The largest |got - want| over tol (NaN where the two are NaN left out)."""
    both = ~(torch.isnan(got) | torch.isnan(want))
    return float((got[both].double() - want[both].double()).abs().max()) / tol


def margins(lm, impl: str, length: int) -> dict:
    be = make_backend("fast", lm, impl=impl, diff_matmul="bf16")
    cfg = Calibrator(be, CalibrationConfig.for_model(lm)).config
    p = synthetic_prompt(lm, length, prefix=8)
    st = StaticStep(be, cfg, p, be.embed(p))
    check = StepCheck(st)
    want = check.reference()
    X = st.state.X.clone()
    st()
    hist, X_next, X_new = step_outputs(st)[:3]
    w_hist, w_next, w_new = want[:3]
    move = float((w_next - X).abs().max()) * MOVE_TOL + 1e-6 * float(X.abs().max())
    out = {"f0 (history)": ratio(hist, w_hist, F0_TOL * (1 + float(w_hist.nan_to_num().abs().max()))),
           "update X_next": ratio(X_next, w_next, move), "X": ratio(X_new, w_new, move),
           "counters equal": all(torch.equal(a, b) for a, b in zip(step_outputs(st)[3:], want[3:]))}
    refresh = RefreshCheck(st)
    want = refresh.reference()
    st.forward.refresh(st.state.X)
    out["refresh (worst tensor)"] = max(ratio(g, w, REF_TOL * float(w.abs().max()) + 1e-30)
                                        for g, w in zip(refresh.outputs(), want))
    m = be.model
    dec = DecodeGraph(m, 256, be.ops)
    with torch.no_grad():
        m.fit_rope(p.length)
        x = be.embed(p).to(m.dtype).unsqueeze(0)
        token = m.logits(m.forward(x, 0, cache=dec.cache)[:, -1])[0].argmax().view(1)
        dec.cache.pos.fill_(p.length)
        dec.token.copy_(token)
        decode = DecodeCheck(dec, be)
        want = decode.reference()
        dec._decode()
    out["decode logits"] = ratio(dec.logits, want[0], DecodeCheck.tolerance(want[0]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", nargs="+", default=["cpp", "triton"], help="the plan's ops to measure")
    ap.add_argument("--length", type=int, default=64, help="the prompt's tokens")
    args = ap.parse_args(argv)
    load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    lm = load()
    rows = {impl: margins(lm, impl, args.length) for impl in args.impl}
    names = list(next(iter(rows.values())))
    print("| impl | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for impl, r in rows.items():
        print(f"| {impl} | " + " | ".join(str(r[n]) if isinstance(r[n], bool) else f"{r[n]:.3g}" for n in names)
              + " |")
    print(f"\nSmolLM2-135M float32, diff bf16, L {args.length}, torch {torch.__version__}, device {lm.device}; load: "
          f"{load_before} / {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

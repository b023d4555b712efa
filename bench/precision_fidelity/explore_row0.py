"""The exploration that chose the difference form's design (bench/RESULTS.md section 17). On the tree before it
(1269398: a float32 model multiplied row 0 in float32 and the other rows' differences in bf16), which treatment of
row 0's product keeps the calibration gain. Each variant replaces sicl_fast.models.diff.product (row 0's product and
the differences'):

    row0-f32     1269398's own: row 0 in float32
    x-rounded    row 0's input rounded to bf16; float32 weights and output
    w-rounded    float32 input, the bf16 weights, float32 output
    shared       input, weights and output bf16: one bf16 product of every row (the values rounded as they are)
    hi-lo        row 0's input as two bf16 parts (hi + lo), each part's product rounded to bf16
    reference    row 0 as its change from a float32 reference of its own input, taken on the run's first forward
                 (at X0) and never again: what the value rows' references do now

Seeded runs (--steps, tau 0, patience 0, one thread) on ICLEval samples of up to 330 tokens; each run's gain read
off the float32 proxy of the X it returns (f32), beside its own proxy's gain (own) and its error in f(X0) (init).

    git worktree add /tmp/old 1269398 && cp sicl_fast/ops/_C*.so /tmp/old/sicl_fast/
    cd /tmp/old && OMP_NUM_THREADS=1 PYTHONPATH=/tmp/old python /work/main/bench/precision_fidelity/explore_row0.py \\
        ../shared/icleval/data --variants fp32 row0-f32 x-rounded w-rounded shared hi-lo reference

It imports 1269398's modules (sicl_fast.models.diff): it does not run on later trees.
"""
import argparse
import time

import torch
import torch.nn.functional as F

import sicl_fast
from sicl_fast.evaluation.methods import sample_prompt
from sicl_fast.icleval import load_task
from sicl_fast.models import diff

SAMPLES = [("generate_order", 1), ("generate_format_conversion", 0), ("classifier_order", 3),
           ("copy_natural_language_string", 20), ("generate_order", 3), ("generate_format_conversion", 3),
           ("classifier_order", 1), ("copy_natural_language_string", 40)]
ROW0 = diff.product
BF16 = torch.bfloat16


def variant(name: str, state: dict):
    """diff.product for a variant: (x0 [1, T, k] f32, dx, ws, bs, low) -> (y0 f32, yd bf16)."""
    def product(x0, dx, ws, bs, low):
        W = torch.cat(list(ws))
        if name == "x-rounded":
            y0 = F.linear(x0.to(BF16).float(), W)
        elif name == "w-rounded":
            y0 = F.linear(x0, low.w.float())
        elif name == "shared":
            y0 = low.linear(x0.to(BF16)).float()
        elif name == "hi-lo":
            hi = x0.to(BF16)
            y0 = low.linear(hi).float() + low.linear((x0 - hi.float()).to(BF16)).float()
        else:  # reference: the first forward's row-0 inputs, in order of the products it calls
            i = state["i"]
            state["i"] += 1
            if state["capture"]:
                y0 = F.linear(x0, W)
                state["refs"].append((x0.clone(), y0.clone()))
            else:
                xr, yr = state["refs"][i]
                y0 = yr + low.linear((x0 - xr).to(BF16)).float()
        if bs[0] is not None:
            y0 = y0 + torch.cat(list(bs))
        return y0, low.linear(dx)
    return product


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("icleval", help="the ICLEval task files' folder")
    ap.add_argument("--variants", nargs="+", default=["fp32", "row0-f32", "shared", "reference"])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ref = sicl_fast.Engine(dtype="float32", backend="fast-fp32", threads=1)
    eng = sicl_fast.Engine(lm=ref.lm, diff_matmul="bf16", threads=1)
    state = {"i": 0, "refs": [], "capture": True}
    forward = eng.backend.model.forward

    def counted(*a, **k):  # the reference variant's product counter restarts with each forward
        state["i"] = 0
        out = forward(*a, **k)
        if k.get("near_row0"):
            state["capture"] = False
        return out

    eng.backend.model.forward = counted
    for task, index in SAMPLES:
        s = load_task(f"{args.icleval}/{task}.json")[index]
        p = sample_prompt(ref, s)
        f00 = float(ref.proxy(p).f)
        print(f"{task}#{index} L {p.length} f0 {f00:.5f}", flush=True)
        for name in args.variants:
            t = time.time()
            state.update(refs=[], capture=True)
            diff.product = ROW0 if name in ("fp32", "row0-f32") else variant(name, state)
            try:
                res = (ref if name == "fp32" else eng).calibrate(p, max_steps=args.steps, tau=0.0, patience=0)
            finally:
                diff.product = ROW0
            f32 = float(ref.proxy(p, embeds=res.embeddings.float()).f)
            print(f"  {name:10s} own {res.best_proxy - res.initial_proxy:+.3e} f32 {f32 - f00:+.3e} "
                  f"init {res.initial_proxy - f00:+.2e} ({time.time() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

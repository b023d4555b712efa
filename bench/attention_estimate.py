"""The float32 attention's expected time in one ascent step on an H200, tf32x3 on the tensor cores against IEEE FMA on
the CUDA cores (issue 53, item 6): an estimate from the sm_90 compile and the rates RESULTS measured, not a
measurement (no GPU here).

    python bench/attention_estimate.py                 # Llama-3.1-8B and Gemma-2-2B, L 256 / 600, N 8

The work, per kernel at its launch configuration for the model's head (kernels/attention.py, as the launcher chooses
it on a GPU) compiled for sm_90 (kernels/_configs, through its cache): the compile's static counts a thread of
tensor-core instructions (their FLOPs from their shapes: m16n8k8 a warp's, m64nNk8 a warp group's) and of CUDA-core
float32 instructions (FMA, add, mul, ex2, the tf32 split's cvt.rna and sub), half of each one block of keys (each
kernel has two key loops, the prefix's and the row's own, each one block's code), times the blocks the step walks:
attention_rows over the pass's rows (the prefix as lead rows; the batch rows in the launcher's program groups for 132
SMs, an anchor computed again a group), and prefix_attention over the value rows of the reference pass every 16 steps
(a sixteenth a step). The prompt: bench/step_memory.prompt_of(L) in its length bucket.

The rates: the tensor cores' tf32 dense peak (494.7 TFLOP/s, H100 SXM / H200) and the CUDA cores' 128 float32
instructions a clock an SM (132 SMs at 1.98 GHz), each at the share of its peak that the measured bf16 step reached
(RESULTS 4: 594 of 989 TFLOP/s at Llama-3.1-8B L 600, 60 %). The attention's time is a range: the two units' work
one after the other (no overlap, the upper end) or the larger of the two (full overlap, the lower end). The step:
RESULTS 4's plain bf16 step (graphs; 123.4 ms Llama-3.1-8B L 600, 44.6 ms Gemma-2-2B L 600, 52.9 ms Llama L 256),
its own attention (bf16 on the tensor cores, the same FLOPs at 60 % of 989) taken out and the float32 one put in.
"""
from __future__ import annotations

import argparse
import re
import sys

from step_memory import prompt_of  # bench/, first on sys.path as a script

FAMILY = {"llama-3.1-8b": "Llama-3.1-8B", "gemma-2-2b": "Gemma-2-2B"}
# the plain bf16 step (fast graphs) measured on an H200, RESULTS 4
PLAIN_STEP_MS = {("llama-3.1-8b", 600): 123.439, ("llama-3.1-8b", 256): 52.909, ("gemma-2-2b", 600): 44.640}
LAYERS = {"llama-3.1-8b": 32, "gemma-2-2b": 26}
REFRESH_EVERY = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks(n_rows: int, a: int, BM: int, BN: int) -> int:
    """Key blocks one head's query tiles of n_rows rows walk: the prefix's a keys, then their own causally (the
    blocks up to each tile's end)."""
    return sum(cdiv(a, BN) + cdiv(min(n_rows, m0 + BM), BN) for m0 in range(0, n_rows, BM))


def per_block(case, result) -> tuple[float, float]:
    """(tensor FLOPs, CUDA-core float32 instructions) of one block of keys of a compiled case (module docstring)."""
    opts, warps = dict(case.options), dict(case.options)["num_warps"]
    flops = 0.0
    for op, n in result["tensor_ops"].items():
        m, nn, k = map(int, re.fullmatch(r"\S+ m(\d+)n(\d+)k(\d+) \S+", op).groups())
        issuers = warps if op.startswith("mma.sync") else warps // 4
        flops += n * issuers * 2 * m * nn * k
    cuda = sum(result["float_ops"].values()) * 32 * opts["num_warps"]
    return flops / 2, cuda / 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=sorted(FAMILY), default=sorted(FAMILY, reverse=True))
    ap.add_argument("--lengths", nargs="+", type=int, default=[256, 600])
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--clock-ghz", type=float, default=1.98)
    ap.add_argument("--tf32-tflops", type=float, default=494.7)
    ap.add_argument("--bf16-tflops", type=float, default=989.0)
    ap.add_argument("--share", type=float, default=0.6, help="share of a unit's peak reached (RESULTS 4's bf16 step)")
    args = ap.parse_args(argv)

    from sicl_fast.kernels import _configs, attention
    from sicl_fast.run.buckets import Bucket

    cuda_rate = args.sms * 128 * args.clock_ghz * 1e9 * args.share  # instructions a second
    tensor_rate = args.tf32_tflops * 1e12 * args.share
    print("| model | L | precision | kernel tiles (rows; prefix) | tensor-core TFLOP | CUDA-core G instr | "
          "attention ms (overlap .. none) | bf16 attention ms | step ms (plain bf16 measured) | x plain bf16 step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        fam = _configs.FAMILIES[FAMILY[name]]
        H, hd = fam["H"], fam["hd"]
        cases = [c for c in _configs.family_cases(FAMILY[name], ("float32",), (600,))
                 if c.spec in ("attention", "attention_rows")]
        compiled = _configs.compile_cases(cases, 90)
        for L in args.lengths:
            p = prompt_of(L)
            a = p.demo_start
            T = Bucket.of(p, 4, 1 << 20).rows - a
            B = args.N + 1
            for precision in attention.PRECISIONS:
                work, tiles, att_flops = [0.0, 0.0], [], 0.0
                for spec, per_step in (("attention_rows", 1.0), ("attention", 1.0 / REFRESH_EVERY)):
                    case = next(c for c in cases if c.spec == spec and dict(c.constexprs)["PRECISION"] == precision)
                    consts = dict(case.constexprs)
                    BM, BN = consts["BLOCK_M"], consts["BLOCK_N"]
                    tiles.append(f"{BM} x {BN} x {dict(case.options)['num_warps']}w")
                    flops, cuda = per_block(case, compiled[case])
                    if spec == "attention_rows":  # the step's pass: lead rows, then B rows in the launcher's groups
                        n_tiles = cdiv(T, BM)
                        groups = min(B, max(1, cdiv(2 * args.sms, n_tiles * H)))
                        n = blocks(a, 0, BM, BN) + (B + groups - 1) * blocks(T, a, BM, BN)
                    else:  # the reference pass: the value rows (lead rows and one batch row) causally from 0
                        n = blocks(a + T, 0, BM, BN)
                    n *= H * LAYERS[name] * per_step
                    work[0] += n * flops
                    work[1] += n * cuda
                keys = T * a + T * (T + 1) / 2  # a batch row's attention, as sicl-fast profile counts it
                att_flops = LAYERS[name] * B * 4 * H * hd * keys
                t_tensor, t_cuda = work[0] / tensor_rate, work[1] / cuda_rate
                lo, hi = 1e3 * max(t_tensor, t_cuda), 1e3 * (t_tensor + t_cuda)
                bf16 = 1e3 * att_flops / (args.bf16_tflops * 1e12 * args.share)
                plain = PLAIN_STEP_MS.get((name, L))
                step = "-" if plain is None else f"{plain - bf16 + lo:.1f} .. {plain - bf16 + hi:.1f} ({plain:.1f})"
                ratio = "-" if plain is None else \
                    f"{(plain - bf16 + lo) / plain:.2f} .. {(plain - bf16 + hi) / plain:.2f}"
                print(f"| {name} | {L} | {precision} | {'; '.join(tiles)} | {work[0] / 1e12:.2f} | "
                      f"{work[1] / 1e9:.1f} | {lo:.1f} .. {hi:.1f} | {bf16:.1f} | {step} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What FP8 differences can save, computed from the shapes (no GPU here to time them): the decoder products' floor of
one step at the tensor cores' dense peak rates, bf16 differences (one bf16 product of every row a projection) against
FP8 differences (one bf16 product of the value rows, one FP8 product of the difference rows, and the quantisation's
pass over the difference rows: 2 bytes read, 1 written an element of each product's input), and the launches FP8
adds (two a projection: the quantisation and torch._scaled_mm).

    python bench/fp8_floor.py            # SmolLM2, Gemma 3 270M, Gemma-2-2B, Llama-3.1-8B at L 256 / 600
    python bench/fp8_floor.py --bf16-tflops 989 --fp8-tflops 1979 --gbps 3350    # an H100 SXM (the defaults)

The step as bench/step_memory.py's (the same prompts, buckets, presets and difference form; projection scope
'prompt': the prefix as lead rows of every pass, value rows). Floors, not times: the products run below their peak
(RESULTS 4 measured the plain bf16 step of Llama-3.1-8B at 60 % of it), and every launch costs a few microseconds of
the GPU's time even inside a graph, which the last column prices at --launch-us.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

from step_memory import GGUF, config_of, n_params, prompt_of, step_parser  # bench/, first on sys.path as a script


def main(argv=None) -> int:
    ap = step_parser(__doc__.splitlines()[0])
    ap.add_argument("--bf16-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM / H200)")
    ap.add_argument("--fp8-tflops", type=float, default=1979.0, help="dense FP8 peak (H100 SXM / H200)")
    ap.add_argument("--gbps", type=float, default=3350.0, help="memory bandwidth (H100 SXM)")
    ap.add_argument("--launch-us", type=float, default=2.0, help="GPU time a launch costs at least, in a graph")
    args = ap.parse_args(argv)

    from sicl_fast.calibration.ascent import CalibrationConfig
    from sicl_fast.run.buckets import Bucket
    from sicl_fast.run.memory import ModelShape

    print("| model | L | B | value rows | difference rows | bf16 floor ms | FP8 floor ms (bf16 + FP8 + quantisation) | "
          "FP8 / bf16 | launches added | at --launch-us, ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        cfg = config_of(name)
        s = ModelShape.of(SimpleNamespace(text_config=cfg, dtype=torch.float32 if name in GGUF else torch.bfloat16))
        config = CalibrationConfig.preset(cfg.model_type, n_params(cfg), N=args.N)
        per_token = 2 * s.layers * s.d * ((s.H + 2 * s.Hk) * s.hd + s.H * s.hd + 3 * s.inter)  # q|k|v, o, gate|up, down
        inputs = s.layers * (s.d + s.H * s.hd + s.d + s.inter)  # the four products' input widths, every layer
        for L in args.lengths:
            p = prompt_of(L)
            bucket = Bucket.of(p, 4, cfg.max_position_embeddings)
            a, T = p.demo_start, bucket.rows - p.demo_start  # the prefix as lead rows; each batch row's T rows
            value, diff = a + T, (config.batch - 1) * T
            bf16 = (value + diff) * per_token / (args.bf16_tflops * 1e12)
            fp8 = (value * per_token / (args.bf16_tflops * 1e12) + diff * per_token / (args.fp8_tflops * 1e12)
                   + 3 * diff * inputs / (args.gbps * 1e9))
            launches = 2 * 4 * s.layers
            print(f"| {name} | {L} | {config.batch} | {value} | {diff} | {1e3 * bf16:.2f} | {1e3 * fp8:.2f} | "
                  f"{fp8 / bf16:.2f} | {launches} | {launches * args.launch_us / 1e3:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

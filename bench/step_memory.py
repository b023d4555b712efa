"""What one cached static step holds, per model family and prompt length, counted from the shapes alone
(sicl_fast.run.memory.step_bytes, the count the step cache's byte budget and the memory check use; tests/test_memory.py
holds it equal to a built step's tensors on the tiny models). No weights are loaded: the configs of
bench/models/*.json and of the registry's Gemma 3 270M (GEMMA3_270M, as sicl_fast loads its GGUF), models made on
torch's meta device for their parameter count.

    python bench/step_memory.py             # SmolLM2, Gemma 3 270M, Gemma-2-2B, Llama-3.1-8B at L 256 / 600
    python bench/step_memory.py --lengths 512 --N 8 --card-gib 141

The prompt of length L: an 8-token prefix, a 16-token query, output spans over 15 % of the demonstration rows (P 35
at L 256, 86 at L 600); the step as a GPU runs it by default: the difference form (--diff-matmul bf16), projection
scope 'prompt' (the prefix as lead rows of every pass), padded to its length bucket (4 a doubling), the model's
preset N (8 below 1B parameters, else 16) unless --N. The weights as `--dtype auto` holds them on CUDA: bf16 for the
bf16 checkpoints, float32 and one bf16 copy for the two GGUF models. Prints a markdown table: each piece of a kept
step, its activations, and how many such steps a card of --card-gib keeps in the step cache's budget
(CACHE_SHARE of what the weights leave, less one step's activations).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
GiB, MiB = 1 << 30, 1 << 20
MODELS = ("smollm2-135m", "gemma-3-270m", "gemma-2-2b", "llama-3.1-8b")
# google/gemma-3-270m's text config as sicl_fast loads the registry's gemma3-270m GGUF (lm.text_config)
GEMMA3_270M = dict(model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512,
                   query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                   max_position_embeddings=32768)
GGUF = {"smollm2-135m", "gemma-3-270m"}  # float32 weights on CUDA (dtype auto), with a bf16 copy for the products


def config_of(name: str):
    from transformers import AutoConfig

    if name == "gemma-3-270m":
        fields = dict(GEMMA3_270M)
    else:
        fields = {k: v for k, v in json.loads((HERE / "models" / f"{name}.json").read_text()).items()
                  if k != "_source"}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def n_params(cfg) -> int:
    """The model's parameter count, from the model made on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def prompt_of(L: int, prefix: int = 8, query: int = 16, share: float = 0.15):
    """A Prompt of L tokens (module docstring): six output spans, about `share` of the demonstration rows."""
    from sicl_fast.formats.requests import Request
    from sicl_fast.formats.spans import Prompt

    end = L - query
    width = max(1, round(share * (end - prefix) / 6))
    block = (end - prefix) // 6
    ends = [prefix + (t + 1) * block for t in range(5)] + [end]
    spans = tuple((e - width, e) for e in ends)
    return Prompt(request=Request(id=f"L{L}", prompt="x" * (L + 1), output_spans=((1, 2),)),
                  input_ids=torch.zeros(L, dtype=torch.int64), token_spans=spans, demo_start=prefix, demo_end=end)


def step_parser(description: str) -> argparse.ArgumentParser:
    """The flags that say which steps to count (--models, --lengths, --N): this script's and bench/fp8_floor.py's."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[256, 600])
    ap.add_argument("--N", type=int, default=None, help="directions a step (default: the model's preset)")
    return ap


def main(argv=None) -> int:
    ap = step_parser(__doc__.splitlines()[0])
    ap.add_argument("--card-gib", type=float, default=80.0, help="the card whose step cache is counted")
    args = ap.parse_args(argv)

    from sicl_fast.calibration.ascent import CalibrationConfig
    from sicl_fast.run.buckets import Bucket
    from sicl_fast.run.memory import CACHE_SHARE, step_bytes

    print(f"| model | weights GiB | L (bucket rows, positions) | B | reference MiB | logits MiB | pass K/V MiB | "
          f"state, batch MiB | kept GiB | activations GiB | steps kept in {args.card_gib:g} GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        cfg = config_of(name)
        n = n_params(cfg)
        dtype = torch.float32 if name in GGUF else torch.bfloat16
        weights = n * (4 + 2 if name in GGUF else 2)
        lm = SimpleNamespace(text_config=cfg, dtype=dtype)
        config = CalibrationConfig.preset(cfg.model_type, n, N=args.N)
        for L in args.lengths:
            p = prompt_of(L)
            bucket = Bucket.of(p, 4, cfg.max_position_embeddings)
            s = step_bytes(lm, p, config, bucket=bucket, form="rows")
            budget = CACHE_SHARE * (args.card_gib * GiB - weights) - s.activations
            print(f"| {name} ({str(dtype)[6:]}) | {weights / GiB:.2f} | {L} ({bucket.rows}, {bucket.positions}) | "
                  f"{config.batch} | {s.reference / MiB:.0f} | {s.logits / MiB:.0f} | {s.kv / MiB:.0f} | "
                  f"{(s.state + s.batch + s.prefix) / MiB:.1f} | {s.kept / GiB:.2f} | {s.activations / GiB:.2f} | "
                  f"{int(budget // s.kept)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

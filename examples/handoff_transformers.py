"""Generate with plain transformers from calibrated embeddings that sicl_fast exported (tested: tests/test_export.py).

    # 1. calibrate on the server and save the rows (or use sicl_fast.export.CalibratedEmbeddings.from_result offline)
    from sicl_fast.client import Client
    r = Client("http://127.0.0.1:8000").calibrate(request, max_steps=20, return_embeddings=True, embeddings_rows="all")
    r["embeddings"].save("q1.safetensors")
    # 2. hand them to transformers' model.generate(inputs_embeds=...)
    python examples/handoff_transformers.py q1.safetensors --max-new-tokens 16

The greedy tokens equal what sicl_fast's own generator decodes from the same embeddings (the test checks it).
"""
from __future__ import annotations

import argparse
import sys

import torch

from sicl_fast import load
from sicl_fast.export import CalibratedEmbeddings


def generate_from_export(model, emb: CalibratedEmbeddings, max_new_tokens: int, eos_token_ids=None) -> list[int]:
    """Greedy new token ids from transformers' generate on the calibrated prompt matrix.

    model: a transformers causal LM (the one the embeddings were calibrated on); rows outside the exported range
    are filled in with the model's own input embeddings of the prompt's token ids."""
    X = emb.full(model.get_input_embeddings()).to(model.dtype).unsqueeze(0)  # [1, L, d]
    mask = torch.ones(X.shape[:2], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(inputs_embeds=X, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_token_ids, pad_token_id=(eos_token_ids or [0])[0])
    return out[0].tolist()  # with inputs_embeds only, generate returns the new tokens only


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("embeddings", help="a .safetensors file written by sicl_fast.export")
    p.add_argument("--model", default=None, help="as `sicl-fast --model` (default: the embedded SmolLM2-135M)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    emb = CalibratedEmbeddings.load(args.embeddings)
    lm = load(args.model)
    if emb.model != lm.name:
        print(f"warning: the embeddings were calibrated on {emb.model!r}, this is {lm.name!r}", file=sys.stderr)
    ids = generate_from_export(lm.model, emb, args.max_new_tokens, sorted(lm.eos_token_ids))
    print(lm.tokenizer.decode(ids, skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Answer from calibrated embeddings with plain transformers + safetensors (no sicl_fast import; tested:
tests/test_export.py).

    # 1. calibrate and save every request's embeddings (or take them from the server: return_embeddings=true)
    sicl-fast calibrate requests.jsonl --out results.jsonl --generate --export emb/
    # 2. the model sicl_fast calibrated on, as a transformers folder: a model directory you gave to --model, or
    #    for a GGUF model (the embedded SmolLM2, gemma3-270m) its converted copy under
    #    ~/.cache/sicl_fast/converted/<name>-<hash>/ (`sicl-fast cache path [MODEL]` prints it)
    python examples/handoff_transformers.py MODEL_FOLDER emb/q1.safetensors

It prints the answer sicl_fast gives (`answer_calibrated` in results.jsonl): greedy decoding with the same stop rule
(an end-of-sequence token, --max-new-tokens, or a stop string in the text so far, leading whitespace removed; the
answer is the text up to the first stop string, stripped).
"""
from __future__ import annotations

import argparse
import sys

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers.utils import logging as hf_logging


def prompt_matrix(model, path: str) -> torch.Tensor:
    """The whole calibrated prompt matrix [L, d] from a sicl_fast embeddings file: tensors "embeddings" (rows
    [row_start, row_end)) and "input_ids" [L]; rows outside the range are the model's own input embeddings."""
    with safe_open(path, framework="pt") as fh:
        meta = fh.metadata()
        rows, ids = fh.get_tensor("embeddings"), fh.get_tensor("input_ids")
    a, b = int(meta["row_start"]), int(meta["row_end"])
    with torch.no_grad():
        X = model.get_input_embeddings()(ids).float()
    X[a:b] = rows.float()
    return X


def cut_at_stops(text: str, stops: list[str]) -> str:
    body = text.lstrip()
    cut = min([body.find(s) for s in stops if s and s in body] or [len(body)])
    return body[:cut].strip()


class StopStrings(StoppingCriteria):
    """Stop once the new text, leading whitespace removed, holds a stop string (transformers' own stop_strings
    looks only at the end of the text and does not skip leading whitespace)."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        body = self.tokenizer.decode(input_ids[0], skip_special_tokens=True).lstrip()
        done = any(s and s in body for s in self.stops)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def answer(model, tokenizer, path: str, max_new_tokens: int = 32, stops: list[str] | None = None) -> str:
    """Greedy answer from the embeddings file at `path` (model: the transformers model they were calibrated on)."""
    stops = ["\n"] if stops is None else stops
    gen_eos = model.generation_config.eos_token_id  # the tokenizer's end-of-sequence and the model's
    eos = {tokenizer.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])}
    eos = sorted(int(e) for e in eos if e is not None)
    X = prompt_matrix(model, path).to(model.dtype).unsqueeze(0)  # [1, L, d]
    with torch.no_grad():
        out = model.generate(inputs_embeds=X, attention_mask=torch.ones(X.shape[:2], dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos or None,
                             pad_token_id=eos[0] if eos else 0,
                             stopping_criteria=StoppingCriteriaList([StopStrings(tokenizer, stops)]))
    new = [t for t in out[0].tolist() if t not in eos]  # with inputs_embeds only, generate returns the new tokens
    return cut_at_stops(tokenizer.decode(new, skip_special_tokens=True), stops)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="the transformers model folder the embeddings were calibrated on")
    p.add_argument("embeddings", help="a .safetensors file written by `sicl-fast calibrate --export` or the server")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: a newline)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    # the answer is the output: transformers' advisory warnings (a converted tokenizer's clean_up_tokenization_spaces,
    # which it ignores for BPE) and its loading bar say nothing a reader of the answer can act on
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    print(answer(model, tokenizer, args.embeddings, args.max_new_tokens, args.stop))
    return 0


if __name__ == "__main__":
    sys.exit(main())

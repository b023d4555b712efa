"""Greedy decoding from prompt embeddings (calibrated demonstrations + original query), with a KV cache.

Stops on an EOS id (the tokenizer's and the generation config's), after max_new_tokens, or as soon as the text
decoded so far (leading whitespace removed) contains a stop string, or `stop_fn(text)` says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable, Sequence

import torch

from ..errors import NumericalError, SiclError
from ..run.knobs import check_range
from ..formats.requests import check_text


@dataclass
class Generation:
    """token_ids: the new tokens; text: them decoded (special tokens skipped); answer: text cut at the first
    stop string and stripped; stop_reason: 'eos', 'stop_string', 'max_new_tokens'."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = "max_new_tokens"
    answer: str = ""


def check_stops(stop_strings, where: str = "stop_strings") -> tuple[str, ...]:
    """Stop strings: a list of non-empty, valid text (an empty one would end every answer before its first
    character, or, as it did before, silently turn stopping off). The one check, run by generation and before any
    model is loaded by the CLI (--stop) and the server (field 'stop'). Returns them as a tuple."""
    if isinstance(stop_strings, str) or not isinstance(stop_strings, Sequence):
        raise SiclError(f"{where}: must be a list of strings, got {type(stop_strings).__name__}")
    for i, s in enumerate(stop_strings):
        if not isinstance(s, str):
            raise SiclError(f"{where}[{i}]: must be a string, got {type(s).__name__}")
        if not s:
            raise SiclError(f"{where}[{i}]: an empty stop string would end every answer before it begins; give at "
                            "least one character (the default is a newline)")
        check_text(s, f"{where}[{i}]")
    return tuple(stop_strings)


def cut_at_stops(text: str, stop_strings: Sequence[str]) -> str:
    """text up to the earliest stop string (searched after leading whitespace), stripped."""
    body = text.lstrip()
    cut = len(body)
    for s in stop_strings:
        i = body.find(s)
        if i != -1:
            cut = min(cut, i)
    return body[:cut].strip()


def stop_reached(text: str, stop_strings: Sequence[str], stop_fn) -> bool:
    """True when the decoded text (leading whitespace removed) holds a stop string, or stop_fn(text) says so."""
    body = text.lstrip()
    if any(s in body for s in stop_strings):
        return True
    return bool(stop_fn is not None and stop_fn(text))


def check_inputs(lm, embeds: torch.Tensor, max_new_tokens: int) -> None:
    """Shape, value and context checks shared by every backend's generation."""
    check_range("max_new_tokens", max_new_tokens, "generate")
    if embeds.dim() != 2 or embeds.shape[1] != lm.hidden_size:
        raise SiclError(f"embeddings must be [L, {lm.hidden_size}], got shape {tuple(embeds.shape)}")
    if not bool(torch.isfinite(embeds).all()):
        raise NumericalError("embeddings for generation contain NaN or inf")
    ctx = lm.max_context
    if ctx is not None and embeds.shape[0] + max_new_tokens > ctx:
        raise SiclError(
            f"prompt of {embeds.shape[0]} tokens plus {max_new_tokens} new tokens exceeds the context of {ctx}"
        )


def greedy_decode(
    lm,
    prefill: Callable[[], torch.Tensor],
    step: Callable[[torch.Tensor], torch.Tensor],
    max_new_tokens: int,
    stop_strings: Sequence[str] = (),
    stop_fn: Callable[[str], bool] | None = None,
    read_every: int = 1,
) -> Generation:
    """The greedy loop and its stop rules, for any forward: prefill() -> next-token logits [V] after the prompt;
    step(token) -> next-token logits [V] after feeding that token (an int64 [1] tensor on the logits' device).

    The argmax stays on the device; the host reads the new tokens every `read_every` tokens and applies the stop
    rules to them in order, so the answer is the same for any read_every (tokens computed past a stop are
    dropped)."""
    stop_strings = check_stops(stop_strings)
    out = Generation()
    if max_new_tokens > 0:
        eos = lm.eos_token_ids
        with torch.no_grad():
            logits = prefill()
            tokens = torch.empty(max_new_tokens, dtype=torch.int64, device=logits.device)
            done = read = 0
            for i in range(max_new_tokens):
                tokens[i:i + 1] = logits.float().argmax().view(1)
                if (i + 1) % read_every == 0 or i + 1 == max_new_tokens:
                    for nxt in tokens[read:i + 1].tolist():
                        done = _take(lm, out, nxt, eos, stop_strings, stop_fn, max_new_tokens)
                        if done:
                            break
                    read = i + 1
                    if done:
                        break
                logits = step(tokens[i:i + 1])
    out.answer = cut_at_stops(out.text, stop_strings)
    return out


def _take(lm, out: Generation, nxt: int, eos, stop_strings, stop_fn, max_new_tokens: int) -> bool:
    """One greedy token through the stop rules; True when generation ends (out.stop_reason set)."""
    if nxt in eos:
        out.stop_reason = "eos"
        return True
    out.token_ids.append(nxt)
    out.text = lm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    if stop_reached(out.text, stop_strings, stop_fn):
        out.stop_reason = "stop_string"
        return True
    return len(out.token_ids) == max_new_tokens


def greedy_generate(
    lm,
    embeds: torch.Tensor,
    max_new_tokens: int,
    stop_strings: Sequence[str] = (),
    stop_fn: Callable[[str], bool] | None = None,
) -> Generation:
    """Greedy answer through the transformers model with its KV cache. embeds: [L, d] (cast to the model's dtype)."""
    check_inputs(lm, embeds, max_new_tokens)
    model = lm.model
    state = {}

    def prefill():
        x = embeds.to(device=lm.device, dtype=lm.dtype).unsqueeze(0)  # [1, L, d]
        out = model(inputs_embeds=x, use_cache=True, logits_to_keep=1)
        state["past"] = out.past_key_values
        return out.logits[0, -1]

    def step(token: torch.Tensor):
        out = model(input_ids=token.view(1, 1), past_key_values=state["past"], use_cache=True)
        state["past"] = out.past_key_values
        return out.logits[0, -1]

    return greedy_decode(lm, prefill, step, max_new_tokens, stop_strings, stop_fn)

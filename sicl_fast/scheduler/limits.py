"""What the scheduler lets into the batch at once, and what each piece of work costs, in rows, tokens and bytes.

    Limits(max_queue, max_rows, max_tokens, max_bytes)
    Cost.of_answer(lm, prompt, max_new_tokens, prefix_rows, every, transient)   an answer's row, K/V slots, bytes
    Cost.of_calibration(lm, plan, prompt, config, packed)       a calibration's step bytes (run.memory.step_bytes)

The bytes are counted as the step cache counts a step's (sicl_fast.run.memory): an answer holds the K/V of its own
slots (its query rows after the prefix, its new tokens and a read interval past them, every layer, in the model
dtype) and its next token's logits, and the prefix K/V when that is its own (an answer from embeddings: the stored
ones are the store's to count); a calibration holds its step (state, batch, prefix K/V, reference, logits and one
layer's activations).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import SiclError
from ..run.memory import ModelShape, form_of, step_bytes


@dataclass(frozen=True)
class Limits:
    """max_queue: requests waiting to be admitted (beyond: QueueFull, the server's 429); max_rows: answers decoding
    at once (over every prefix's batch); max_tokens: the K/V slots those answers hold; max_bytes: the bytes all work
    in flight holds (None: sicl_fast.run.memory.cache_budget of the engine's device when the scheduler starts).
    Calibrations in flight: one at a time with pack 1, `pack` slots of the packed step beside one more with pack >
    1 (the run plan's; not a limit here)."""

    max_queue: int = 16
    max_rows: int = 32  # answering.answer.ANSWER_BATCH: the gain of batching flattened out well before it
    max_tokens: int = 16384
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_queue",):
            if getattr(self, name) < 0:
                raise SiclError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name, flag in (("max_rows", "--max-batch-rows"), ("max_tokens", "--max-batch-tokens")):
            if getattr(self, name) < 1:
                raise SiclError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise SiclError(f"--max-batch-bytes must be >= 1, got {self.max_bytes}")


@dataclass(frozen=True)
class Cost:
    """What one piece of work holds while it is in flight."""

    rows: int = 0  # answer rows
    tokens: int = 0  # answer K/V slots
    bytes: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.rows + other.rows, self.tokens + other.tokens, self.bytes + other.bytes)

    def __sub__(self, other: Cost) -> Cost:
        return Cost(self.rows - other.rows, self.tokens - other.tokens, self.bytes - other.bytes)

    def fits(self, used: Cost, limits: Limits, max_bytes: int) -> str | None:
        """Which limit `used + self` exceeds ('rows', 'tokens', 'bytes'), or None."""
        total = used + self
        for name, cap in (("rows", limits.max_rows), ("tokens", limits.max_tokens), ("bytes", max_bytes)):
            if getattr(total, name) > cap:
                return name
        return None

    @staticmethod
    def of_answer(lm, prompt, max_new_tokens: int, prefix_rows: int, every: int, transient: bool) -> Cost:
        """An answer of `prompt` after `prefix_rows` rows of prefix (decode_batch.AnswerRow.need's slots)."""
        s = ModelShape.of(lm)
        kv_row = 2 * s.layers * s.Hk * s.hd * s.itemsize
        slots = prompt.length - prefix_rows + max(max_new_tokens, 1) + every
        own = prefix_rows * kv_row + 4 * s.d if transient else 0  # its own prefix K/V and last hidden row
        return Cost(rows=1, tokens=slots, bytes=slots * kv_row + 4 * s.vocab + own)

    @staticmethod
    def of_calibration(lm, plan, prompt, config, packed: bool) -> Cost:
        """A calibration's step (a packed slot runs without its prefix K/V)."""
        prefix = not packed and getattr(plan.kind, "cls", None) == "fast"
        return Cost(bytes=step_bytes(lm, prompt, config, form=form_of(plan), prefix=prefix).total)


def over_limit(what: str, cost: Cost, limits: Limits, max_bytes: int) -> str:
    """The one-line refusal of work that exceeds a limit by itself (it could never be admitted)."""
    flag, cap, got = {"rows": ("--max-batch-rows", limits.max_rows, cost.rows),
                      "tokens": ("--max-batch-tokens", limits.max_tokens, cost.tokens),
                      "bytes": ("--max-batch-bytes", max_bytes, cost.bytes)}[what]
    return f"{got} {what} in flight exceed this server's limit of {cap} ({flag})"


__all__ = ["Limits", "Cost", "over_limit"]

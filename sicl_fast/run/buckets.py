"""Length buckets for the static step: prompts of nearby lengths padded to one shape, so that they share one
StaticStep and one captured CUDA graph (a new shape costs a capture: 1.6 s at SmolLM2 on an H200, RESULTS 4).

    ladder(n, per_octave)              n rounded up to the bucket ladder: per_octave sizes in each (2^k, 2^(k+1)]
    Bucket.of(prompt, per_octave, limit)   a prompt's padded sizes: rows, length, positions

A bucket pads three sizes of a prompt with demonstrations ending at row b (demo_end), L rows and P span positions:
    rows       the step forward's rows, b up the ladder: rows [b, rows) are the prompt's next rows (its query) and
               zeros, after every row the proxy reads, so under causal attention no real row sees them; the
               perturbed block is [a, rows) (or [a, length) with perturb_query). The step's cost is here.
    length     X's rows: rows plus the query's L - b rounded up to a power of two (>= 16): X [length, d] is the
               prompt's X, then zero rows, which add nothing to the cosine projection's sums and never move (only the
               update and the bookkeeping read these rows: a coarse size costs little and keeps buckets few)
    positions  the span positions the forward reads, P rounded up to a power of two (>= 32): the padding repeats
               the last position and the proxy reads only the first P (sicl_fast.step.proxy.ProxyPlan's
               count); a position costs one row of the span head, under 1 % of a step
The perturbed block keeps its own end b, an int64 [1] device tensor the noise kernels and the update read
(`rows_end`, sicl_fast.step.zo): the directions, the gradient and the projection are the unpadded
prompt's, and a padded step computes the unpadded step's proxy and history up to the products' summation order
(tests/test_buckets.py states the tolerance). a, the number of spans and the prefix stay exact (a bucket key).

The ladder's spacing bounds the padding of the rows: with 4 sizes an octave a prompt runs at most 25 % more rows
(12 % on average over uniform lengths), and a mix of 24 prompts of 200-600 tokens (bench/length_mix.py) runs in 7
buckets instead of 24 shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import SiclError

PER_OCTAVE = 4  # bucket sizes in each doubling of the length: the default of --length-buckets auto
MIN_ROWS = 16  # the smallest row bucket (short prompts: one bucket)
MIN_QUERY = 16  # the smallest room for the query's rows in X
MIN_POSITIONS = 32  # the smallest position bucket


def check_per_octave(per_octave: int) -> int:
    """per_octave, the sizes a doubling: a power of two (the ladder's steps divide the octave evenly)."""
    if per_octave < 1 or per_octave & (per_octave - 1):
        raise SiclError(f"length buckets: {per_octave} lengths a doubling; the count must be a power of two (1, 2, 4, "
                        "..., 64)")
    return per_octave


def ladder(n: int, per_octave: int = PER_OCTAVE, floor: int = MIN_ROWS) -> int:
    """The smallest size >= n on the ladder: `floor`, then in each octave (2^k, 2^(k+1)] the multiples of
    2^k / per_octave (per_octave a power of two; 4: 160, 192, 224, 256, 320, ...)."""
    check_per_octave(per_octave)
    if n <= floor:
        return floor
    base = 1 << ((n - 1).bit_length() - 1)  # base < n <= 2 base
    step = max(base // per_octave, 1)
    return -(-n // step) * step


@dataclass(frozen=True)
class Bucket:
    """A prompt's padded sizes (module docstring): rows (the forward's, >= b), length (X's, >= rows and >= L) and
    positions (>= P)."""

    rows: int
    length: int
    positions: int

    @classmethod
    def of(cls, prompt, per_octave: int = PER_OCTAVE, limit: int | None = None) -> Bucket:
        """The bucket of `prompt`. limit: the model's context; a padded size never goes past it (nor below the
        prompt's own)."""
        L, b, P = prompt.length, prompt.demo_end, int(prompt.positions.numel())

        def cap(size: int, own: int) -> int:
            return size if limit is None else max(own, min(size, limit))
        rows = cap(ladder(b, per_octave), b)
        length = cap(rows + ladder(L - b, 1, MIN_QUERY), L)
        return cls(rows=min(rows, length), length=length, positions=ladder(P, 1, MIN_POSITIONS))


__all__ = ["Bucket", "check_per_octave", "ladder", "PER_OCTAVE"]

"""Answers decoding together on one stored prefix: a row joins the running batch at its next read and leaves at its
own stop (continuous batching, as vLLM's, on the query-only path of answer_kv).

    batch = DecodeBatch(backend, cal, store)      the K/V of a calibration's rows [0, b) (answer_kv.stored_kv)
    batch.join(AnswerRow(prompt, rows, max_new_tokens, stops, stop_fn))     waits for the next advance()
    stopped = batch.advance()                     one read interval: the joiners' prefill, every row's next tokens
                                                  (backend.read_every of them), the host read, the stop rules
    decode_queries(backend, cal, prompts, query_rows, ...)   the answers of a fixed list (Engine.answer_many)

Layout (answer_kv's, the rows in place of one fixed batch): each row's own K/V slots [0, S) in a per-layer buffer
[cap, S, Hk, hd]; the rows decoding are places [0, B). Joiners are prefilled together at places [B, B + J) against
the shared prefix K/V, right-padded to their longest query (a row's padding follows its real rows, and decoding
writes over it); a row that stops leaves at once and the last row moves into its place (its K/V, slot and logits:
one row copied per row that leaves); the buffers grow (a doubling of places, 64 slots at a time) when a joiner needs
more. A row attends to the stored prefix and to its own slots up to the one it writes (a mask per row), so what it
computes does not depend on the other rows: its tokens are the ones it gets alone, whatever joined or left around
it (tests/test_scheduler.py; the answers equal the full calibrated matrix's, tests/test_answer.py). Free slots hold
zeros or another row's finite K/V, both of weight 0 behind the mask.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable

import torch

from ..backends.generate import Generation, _take, check_inputs, cut_at_stops
from ..errors import SiclError
from ..models.transformer import Positions
from .answer_kv import QueryKV, decoding_positions, stored_kv

SLOT_STEP = 64  # the own-K/V slots of a batch grow in steps of this many


@dataclass(eq=False)
class AnswerRow:
    """One answer in a DecodeBatch. prompt: the query (a Prompt fitting the batch's calibration); rows: its own
    embeddings [T, d] (rows [b, L)); stop_fn(text): the caller's extra stop (streaming, cancellation). out: the
    Generation so far (its answer cut at the stops once done)."""

    prompt: object
    rows: torch.Tensor
    max_new_tokens: int
    stop_strings: tuple = ()
    stop_fn: Callable[[str], bool] | None = None
    out: Generation = field(default_factory=Generation)
    done: bool = False

    @property
    def T(self) -> int:
        return int(self.rows.shape[0])

    def need(self, every: int) -> int:
        """Own K/V slots this row may write: its query rows and a token a step, up to a read interval past its
        last token (the tokens past a stop within one interval are computed and dropped)."""
        return self.T + max(self.max_new_tokens, 1) + every

    def finish(self) -> None:
        self.done = True
        self.out.answer = cut_at_stops(self.out.text, self.stop_strings)


class DecodeBatch:
    """The answers in flight on one calibration's prefix (module docstring). store: the CalibrationStore that counts
    the prefix K/V (or None)."""

    def __init__(self, backend, cal, store=None) -> None:
        self.backend, self.cal, self.lm, self.m = backend, cal, backend.lm, backend.model
        self.store = store
        self.every = backend.read_every  # the plan's tokens between two host reads
        self.b = cal.length
        self.rows: list[AnswerRow] = []  # decoding, in their places [0, B)
        self.joining: list[AnswerRow] = []
        self.stored = None  # the prefix K/V (held while the batch runs, whatever the store drops)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.slot = torch.zeros(0, dtype=torch.int64, device=self.m.device)
        self.logits: torch.Tensor | None = None  # [B, V]: each row's next token's
        self.tokens = 0  # tokens decoded (every row's), for the scheduler's count

    @property
    def size(self) -> int:
        """Rows decoding and joining."""
        return len(self.rows) + len(self.joining)

    def join(self, row: AnswerRow) -> AnswerRow:
        """Add a row: it is prefilled at the next advance() and decodes from there (checks: answer_kv's)."""
        check_inputs(self.lm, row.rows, row.max_new_tokens)  # width, values, max_new_tokens >= 0
        ctx = self.lm.max_context
        p = row.prompt
        if ctx is not None and p.length + row.max_new_tokens > ctx:
            raise SiclError(f"request {p.id!r}: {p.length} tokens plus {row.max_new_tokens} new tokens exceed the "
                            f"context of {ctx}")
        if row.max_new_tokens == 0:
            row.finish()
            return row
        self.joining.append(row)
        return row

    def drop(self, row: AnswerRow) -> None:
        """Take a row out before its stop (its request was cancelled): it leaves at once."""
        if row in self.joining:
            self.joining.remove(row)
        elif row in self.rows:
            self._leave([self.rows.index(row)])

    # ------------------------------------------------------------------------------------------ buffers

    def _reserve(self, places: int, slots: int) -> None:
        """Buffers of at least `places` rows and `slots` own slots, the rows [0, B) kept."""
        m = self.m
        cap, S = (self.k[0].shape[:2] if self.k else (0, 0))
        if places <= cap and slots <= S:
            return
        cap2 = max(cap, 1 << max(0, (places - 1).bit_length()))
        S2 = max(S, -(-slots // SLOT_STEP) * SLOT_STEP)
        B = len(self.rows)
        # zeros, not empty: a masked key has weight 0, and 0 times a NaN left in unused memory would still be NaN
        new = lambda: torch.zeros(cap2, S2, m.Hk, m.hd, dtype=m.dtype, device=m.device)  # noqa: E731
        k, v = [new() for _ in m.layers], [new() for _ in m.layers]
        for old, mine in zip(self.k + self.v, k + v):
            mine[:B, :S].copy_(old[:B])
        slot = torch.zeros(cap2, dtype=torch.int64, device=m.device)
        slot[:B] = self.slot[:B]
        self.k, self.v, self.slot = k, v, slot
        for r in m.rotary.values():
            r.reserve(self.b + S2)

    def _kvs(self, lo: int, hi: int) -> list[QueryKV]:
        return [QueryKV(pre, k[lo:hi], v[lo:hi], self.slot[lo:hi]) for pre, k, v in zip(self.stored.kv, self.k,
                                                                                          self.v)]

    def _leave(self, places: list[int]) -> list[int]:
        """Rows at `places` leave; the last rows move into their places. -> the old place of each row now at
        places 0, 1, ... (to reorder what the caller holds per row)."""
        order = list(range(len(self.rows)))
        for j in sorted(places, reverse=True):
            last = len(self.rows) - 1
            if j != last:
                for t in self.k + self.v:
                    t[j].copy_(t[last])
                self.slot[j] = self.slot[last]
                self.logits[j] = self.logits[last]
                self.rows[j], order[j] = self.rows[last], order[last]
            self.rows.pop()
            order.pop()
        self.logits = self.logits[:len(self.rows)] if self.rows else None
        return order

    # ------------------------------------------------------------------------------------------ a read interval

    @torch.no_grad()
    def _prefill(self) -> None:
        """The joiners' query rows against the prefix, at places [B, B + J): their first tokens' logits."""
        m, rows, B = self.m, self.joining, len(self.rows)
        self.joining = []
        J, T = len(rows), [r.T for r in rows]
        self._reserve(B + J, max(r.need(self.every) for r in self.rows + rows))
        for t in self.k + self.v:  # a place taken again starts from zeros, as a new batch's
            t[B:B + J].zero_()
        self.slot[B:B + J] = torch.tensor(T, dtype=torch.int64)
        last = self.stored.last.expand(J, -1).clone()  # a query without rows of its own answers after row b - 1
        Tmax = max(T)
        if Tmax > 0:
            x = torch.zeros(J, Tmax, m.d, dtype=m.dtype, device=m.device)
            for j, r in enumerate(rows):
                x[j, :r.T] = r.rows.to(device=m.device, dtype=m.dtype)
            h = m.run(x, Positions.rows(m.rotary, self.b, Tmax), self._kvs(B, B + J))
            own = [j for j in range(J) if T[j] > 0]
            last[own] = h[own, [T[j] - 1 for j in own]]
        logits = m.logits(last)  # [J, V]
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self.rows += rows

    @torch.no_grad()
    def _step(self, tokens: torch.Tensor) -> None:
        """Feed each row its token (int64 [B]): the next tokens' logits."""
        m, B = self.m, len(self.rows)
        h = m.run(m.embed(tokens.view(B, 1)), decoding_positions(m, self.b + self.slot[:B]), self._kvs(0, B))
        self.slot[:B].add_(1)
        self.logits = m.logits(h[:, 0])

    def advance(self) -> list[AnswerRow]:
        """One read interval (module docstring) -> the rows that stopped in it (their `out` complete)."""
        m = self.m
        if self.joining or self.rows:  # the rotary tables of these rows (other work may have fitted others)
            m.fit_rope(*(r.prompt.length for r in self.rows + self.joining))
        if self.joining:
            if self.stored is None:
                self.stored = stored_kv(m, self.cal, self.store)
            self._prefill()
        if not self.rows:
            return []
        eos = self.lm.eos_token_ids
        B, every = len(self.rows), self.every
        tokens = torch.empty(every, B, dtype=torch.int64, device=m.device)
        for i in range(every):
            tokens[i] = self.logits.float().argmax(dim=-1)
            if i + 1 < every:
                self._step(tokens[i])
        stopped = []
        for j, (r, got) in enumerate(zip(self.rows, tokens.t().tolist())):  # the one host read
            for t in got:
                self.tokens += 1
                if _take(self.lm, r.out, t, eos, r.stop_strings, r.stop_fn, r.max_new_tokens):
                    r.finish()
                    stopped.append(j)
                    break
        done = [self.rows[j] for j in stopped]
        last = tokens[-1]
        if stopped:
            last = last[self._leave(stopped)]
        if self.rows:
            self._step(last)
        return done


def decode_queries(backend, cal, prompts, query_rows: list[torch.Tensor], max_new_tokens: int, stop_strings=(),
                   stop_fn=None, store=None) -> list[Generation]:
    """Greedy answers of prompts (each fitting `cal`, answering.reuse.fits) from the stored K/V, as one batch:
    query_rows[j] is prompt j's own embeddings [T_j, d] (rows [b, L_j)). Stop rules per row as
    generate.greedy_decode's."""
    m = backend.model
    m.fit_rope(*(p.length for p in prompts))  # one batch: one rotary table (Transformer.fit_rope), checked first
    batch = DecodeBatch(backend, cal, store)
    rows = [batch.join(AnswerRow(p, x, max_new_tokens, tuple(stop_strings), stop_fn))
            for p, x in zip(prompts, query_rows)]
    while batch.size:
        batch.advance()
    for r in rows:
        if not r.done:  # max_new_tokens 0
            r.finish()
    return [r.out for r in rows]


__all__ = ["AnswerRow", "DecodeBatch", "decode_queries", "SLOT_STEP"]

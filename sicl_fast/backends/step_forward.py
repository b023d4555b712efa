"""One step's forward on the fast decoder: a perturbation batch of embeddings -> the span log-probabilities, with the
prefix policy, the span plan and the weight layout in one object. The eager loop (Calibrator), the static step, the
packed step and FastBackend.span_logprobs all call this, and nothing else reaches into the model for a step.

    fwd = backend.step_forward(prompt, prefix)      (FastBackend.step_forward)
    lp = fwd(batch [B, b', d] float32)  -> [B, P] float32      no checks and no host reads: capturable
    fwd.load(prompt, X0)                              re-arm for another prompt of the same shape
    backend.step_forward(prompt, prefix, B, X0, bucket=Bucket(...))   a length bucket's padded forward
                                                      (sicl_fast.run.buckets): b' = bucket.rows, P = its positions

The prefix policy (rows [0, a), the demonstration-free prefix, are never perturbed):

    'kept'  the rows never change during a run (projection scope 'demos', or no projection): their K/V are computed
            once, at construction and at load, from X0, and every pass runs the batch rows [a, b) only
    'pass'  the rows may change between steps (the whole-matrix projection may rescale them): with the difference
            form they run in every pass as its lead rows, once (batch 1), beside the batch rows (one decoder pass a
            step); with plain products, as a batch-1 prefix forward before the batch's
    'none'  no prefix K/V: every batch row runs the full rows [0, b) (a = 0, the packed step, prefix_cache=False)

The weight layout: with difference products on (model.rows_on) the batch goes through the difference form
(Transformer.forward_rows: float32 activations, every product one bf16 product of the rows' changes, the span head
on the same form), its value rows taken against a float32 reference of them (sicl_fast.models.rows.RowsReference):
made from X0 when the forward is made or loaded, and again by `refresh(X)` every REFRESH_EVERY steps, which the
loops call at the same step counts (the eager loop, the static step between two calls of its graph, the packed
step); with them off through the plain forward in the model dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.rows import LOW_DTYPE, RowLayout, is_value
from ..formats.spans import Prompt
from ..run.graphs import weakly

PREFIX_POLICIES = ("kept", "pass", "none")
# steps between two references of the value rows: the values' changes from their reference (the rounding applies
# to those) stay within a few steps' moves; a reference costs a float32 forward of the value rows (1 / B of a step's
# rows) and the step's error from it was below the measured noise after 20 steps without one (RESULTS 17)
REFRESH_EVERY = 16


@dataclass(frozen=True)
class SpanPlan:
    """Where one prompt's span predictions are read, on the device: idx [P] int64, the rows t - 1 of the span
    tokens t among rows [0, b); idx_suffix = idx - a, the same rows among [a, b) (the prefix path's hidden
    states, unless from_prefix: a span starts right at row a); targets [P] the span tokens. With a length bucket
    (sicl_fast.run.buckets) b is the bucket's rows and the three tensors its positions, the last real one repeated
    (the proxy reads the first P)."""

    a: int
    b: int
    idx: torch.Tensor
    idx_suffix: torch.Tensor
    from_prefix: bool
    targets: torch.Tensor

    @classmethod
    def of(cls, prompt: Prompt, device, bucket=None) -> SpanPlan:
        a, idx, targets = prompt.demo_start, prompt.positions - 1, prompt.targets  # the state at t-1 predicts t
        from_prefix = a > 0 and int(idx.min()) < a
        if bucket is not None:
            pad = bucket.positions - idx.numel()
            idx, targets = (torch.cat([t, t[-1:].expand(pad)]) for t in (idx, targets))
        return cls(a=a, b=prompt.demo_end if bucket is None else bucket.rows, idx=idx.to(device),
                   idx_suffix=(idx - a).to(device), from_prefix=from_prefix, targets=targets.to(device))

    def copy_(self, other: SpanPlan) -> None:
        """Take another prompt's plan of the same shape, in place (a captured graph reads these tensors)."""
        for mine, new in ((self.idx, other.idx), (self.idx_suffix, other.idx_suffix), (self.targets, other.targets)):
            mine.copy_(new)


def fixed_rows_kv(model, rows: torch.Tensor, rows_form: bool = False):
    """The K/V of rows that no step changes, [n, d] (batch 1, once): a kept prefix, and a stored calibration's rows
    [0, b) that queries are answered against (answering.answer_kv). rows_form: through the difference form's forward
    (float32 K/V, what its batch rows attend to), else the plain forward in the model dtype. -> PrefixKV."""
    if rows_form:
        return model.prefix_rows(rows.float())
    return model.prefix_kv(rows.to(device=model.device, dtype=model.dtype))


def resolve_policy(prompt: Prompt, prefix: str) -> str:
    """The policy a prompt runs: 'none' where it has no prefix rows."""
    if prefix not in PREFIX_POLICIES:
        raise ValueError(f"prefix policy {prefix!r}; one of {PREFIX_POLICIES}")
    return "none" if prompt.demo_start == 0 else prefix


class StepForward:
    """One prompt's step forward (module docstring). backend: a FastBackend; B: the batch rows of the passes (the
    rows layout is made for it); X0 [L, d] float32: the rows a 'kept' prefix and the first reference are made from
    (None: the prompt's own embeddings); rows: the difference form (None: when the model has difference products
    on); bucket: a length bucket's sizes (sicl_fast.run.buckets.Bucket; X0 then has its `length` rows), or None."""

    # the value rows against a float32 reference (the design); False: their values rounded as they are, which the
    # precision study (bench/precision_fidelity.py, path 'fp32-rows-rounded') sets to measure what the reference buys
    references = True

    def __init__(self, backend, prompt: Prompt, prefix: str, B: int, X0: torch.Tensor | None = None,
                 rows: bool | None = None, bucket=None) -> None:
        m = self.model = backend.model
        m.fit_rope(prompt.length)  # the rotary tables of this prompt's length (rope types that depend on it)
        self.backend, self.ops = backend, backend.ops
        self.policy = resolve_policy(prompt, prefix)
        self.B = B
        self.rows_on = m.rows_on if rows is None else rows
        self.refresh_every = REFRESH_EVERY if self.rows_on and self.references else 0
        self.prompt, self.bucket = prompt, bucket
        self.span = SpanPlan.of(prompt, m.device, bucket)
        a, b = prompt.demo_start, self.span.b
        self.start = 0 if self.policy == "none" else a  # the first row each batch row runs
        X0 = X0 if X0 is not None else backend.embed(prompt)
        self.prefix = self._kept_prefix(prompt, X0) if self.policy == "kept" else None
        self._refresh_graph = None  # (the X it reads, its CUDA graph): capture_refresh
        if self.rows_on:
            self.rows = RowLayout.build(a if self.policy == "pass" else 0, B, b - self.start, self.start,
                                        device=m.device)
            # where a span's first prediction is the prefix's last row: its change in the value rows, none elsewhere
            self._value_mask = is_value(self.rows.anchor).to(LOW_DTYPE).view(B, 1, 1)
            self.value_rows = self.rows.value_layout()  # made once: a refresh makes no tensor from host data
            self.ref, self.z_ref = self._reference(X0) if self.references else (None, None)

    @staticmethod
    def shape(prompt: Prompt, prefix: str, B: int, bucket=None) -> tuple:
        """What a forward's buffers and launches depend on: prompts of one shape can share one StepForward (load)."""
        span = SpanPlan.of(prompt, "cpu", bucket)
        return resolve_policy(prompt, prefix), B, prompt.demo_start, span.b, int(span.idx.numel()), span.from_prefix

    def _kept_prefix(self, prompt: Prompt, X0: torch.Tensor):
        return fixed_rows_kv(self.model, X0[:prompt.demo_start].to(self.model.device), self.rows_on)

    def _reference(self, X: torch.Tensor, out: tuple | None = None):
        """(the value rows' RowsReference, their reference logits at the span rows [1, P, V] float32) at X [L, d]
        float32 on the model's device: the value rows are batch row 0's, X itself (the lead rows, where they run,
        are X's first rows, and the batch rows follow them: X[:b]). out: (RowsReference, logits) to write in place
        (refresh), or None: new ones."""
        m, rows, span = self.model, self.rows, self.span
        x = X.to(m.device, torch.float32)[0 if rows.lead else self.start:span.b]  # X itself where it is already so
        ref = m.reference_rows(x, self.value_rows, self.prefix, out=None if out is None else out[0])
        hb = ref.hidden[rows.lead:].view(1, rows.T, -1)

        def last():  # the prefix's last row: the lead row's reference, or the kept prefix's float32 hidden row
            return (ref.hidden[span.a - 1] if rows.lead else self.prefix.hidden[0, span.a - 1]).view(1, 1, -1)
        return ref, m.reference_logits(self._at_spans(hb, last), None if out is None else out[1])

    def refresh(self, X: torch.Tensor) -> None:
        """Take the value rows' reference again at X [L, d] float32 on the model's device (the X the next call's
        row 0 is), in place: one float32 pass of the value rows writing the tensors a step reads, with no host read
        and no tensor made from host data (a refresh's launches: at most three steps', tests/test_refresh.py). Where
        capture_refresh captured it for this X tensor, its graph replays instead."""
        if not (self.rows_on and self.ref is not None):
            return
        if self._refresh_graph is not None and X is self._refresh_graph[0]:
            self._refresh_graph[1]()
        else:
            self._reference(X, (self.ref, self.z_ref))

    def capture_refresh(self, X: torch.Tensor, captures, keep=None, check=None) -> None:
        """Capture refresh(X) as a graph of its own with `captures` (sicl_fast.run.graphs.Captures: warm-up refreshes
        on its stream, then the capture, on its pool), which later refresh(X) calls with this same tensor X replay:
        the static step's refresh between two replays of its step (StepCache). Where captures capture nothing (off
        CUDA) nothing changes (the refresh runs eagerly, the same operations). The graph's callable holds this
        forward weakly: the forward and its graph free each other by reference counting. check: the ReplayCheck of
        its first replay (run.graphs.first_replay)."""
        if self.rows_on and self.ref is not None and captures.on:
            self._refresh_graph = None
            self._refresh_graph = (X, captures.capture(weakly(self._reference, X, (self.ref, self.z_ref)),
                                                       keep=keep, check=check))

    @property
    def refresh_graph(self):
        """The captured refresh (capture_refresh), or None."""
        return None if self._refresh_graph is None else self._refresh_graph[1]

    def load(self, prompt: Prompt, X0: torch.Tensor) -> None:
        """Re-arm for `prompt` (of this forward's `shape`) from X0 [L, d]: every tensor a pass reads is overwritten
        in place, so a graph captured on this forward replays the new prompt."""
        self.model.fit_rope(prompt.length)
        self.span.copy_(SpanPlan.of(prompt, self.model.device, self.bucket))
        self.prompt = prompt
        if self.prefix is not None:
            new = self._kept_prefix(prompt, X0)
            self.prefix.rows.copy_(new.rows)
            self.prefix.hidden.copy_(new.hidden)
            for (k, v), (k_new, v_new) in zip(self.prefix.kv, new.kv):
                k.copy_(k_new)
                v.copy_(v_new)
        self.refresh(X0)

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        """batch [B, b', d] float32 (b' >= b; rows 1.. near row 0) -> [B, P] float32 span log-probs."""
        return self.head(self.decoder(batch))

    @torch.no_grad()
    def decoder(self, batch: torch.Tensor) -> torch.Tensor:
        """The decoder's part of a call: batch [B, b', d] float32 -> the final-normed hidden states at the span
        rows [B, P, d] (difference form in the low dtype, or the model dtype's plain rows)."""
        return self._rows(batch) if self.rows_on else self._plain(batch)

    @torch.no_grad()
    def head(self, hs: torch.Tensor) -> torch.Tensor:
        """The span head's part: hidden states at the span rows [B, P, d] -> [B, P] float32 log-probs."""
        m, span = self.model, self.span
        if self.rows_on:
            return self.ops.span_head_rows(hs, m.head_low.w, span.targets, self.rows.anchor, softcap=m.final_softcap,
                                           z_ref=self.z_ref, value_slot=self.rows.value_slot)
        return self.ops.span_head(hs, m.head, span.targets, softcap=m.final_softcap)

    # ------------------------------------------------------------------------------------------------ forms

    def rows_input(self, batch: torch.Tensor) -> torch.Tensor:
        """The difference form's input rows x [R, d] float32 of a batch: the prefix rows once (lead rows, policy
        'pass'), then each batch row's rows from its first run row on."""
        rows, a = self.rows, self.span.a
        own = batch[:, self.start:self.span.b].reshape(self.B * rows.T, -1)  # a copy when start > 0
        return torch.cat([batch[0, :a], own]) if rows.lead else own

    def layers(self, x: torch.Tensor) -> torch.Tensor:
        """The decoder's layers on the input rows x [R, d] -> the final-normed hidden states [R, d] (difference
        form). What the launch budget counts per layer (sicl_fast.diagnostics.profile.kernels_per_step)."""
        return self.model.forward_rows(x, self.rows, self.prefix, self.ref)

    def _rows(self, batch: torch.Tensor) -> torch.Tensor:
        rows, span = self.rows, self.span
        h = self.layers(self.rows_input(batch))  # [R, d]
        hb = rows.batch(h)  # [B, T, d]

        def last():
            # the prefix's last row, in difference form: its change from the reference, the lead row's (in the
            # value rows) or none (a kept prefix: exact); without references, the kept prefix's last hidden row
            # itself in the value rows
            if rows.lead:
                return h[span.a - 1] * self._value_mask
            if self.ref is None:
                return self.prefix.hidden[0, span.a - 1].to(LOW_DTYPE) * self._value_mask
            return torch.zeros_like(hb[:, :1])
        return self._at_spans(hb, last)

    def _at_spans(self, hb: torch.Tensor, last) -> torch.Tensor:
        """The rows of hb [n, T, d] (a pass's batch rows from row `start`) where the spans are predicted -> [n, P, d].
        last(): the prefix's last row [n, 1, d], asked for only where a span starts right at row a (its first
        prediction is that row's)."""
        span = self.span
        if self.start == 0:
            return hb.index_select(1, span.idx)
        if span.from_prefix:
            return torch.cat([last(), hb], dim=1).index_select(1, span.idx_suffix + 1)
        return hb.index_select(1, span.idx_suffix)

    def _plain(self, batch: torch.Tensor) -> torch.Tensor:
        m, span = self.model, self.span
        x = batch[:, :span.b].to(m.dtype)
        if self.policy == "none":
            return m.forward(x).index_select(1, span.idx)  # [B, P, d]
        prefix = self.prefix if self.policy == "kept" else m.prefix_kv(x[0, :span.a])
        hidden = m.forward(x[:, span.a:], span.a, prefix)  # [B, b-a, d]
        if span.from_prefix:
            return torch.cat([prefix.hidden.expand(x.shape[0], -1, -1), hidden], dim=1).index_select(1, span.idx)
        return hidden.index_select(1, span.idx_suffix)


class PackedForward:
    """Several prompts' perturbation batches through one pass (the packed step, sicl_fast.calibration.packed): slot
    j's B_j rows stacked after the earlier slots', each right-padded with zeros to T, the longest b_j (causal attention
    never lets a real row see the padding after it), no prefix K/V (every row runs its rows [0, b_j)). In difference
    form each slot's rows are differences from its own first row (the layout's anchors), whose values are taken
    against a float32 reference of that slot's rows alone: its part of one RowsReference (value rows [j T, j T + b_j),
    the rest zeros), made when the slot takes its prompt and again by refresh(j, X). A slot that changes makes its
    own reference, never the others': a kept slot keeps its own (copied, where the layout moves it: another T, other
    slots before it), and a slot that takes a prompt of its shape (load) is re-armed in place, so a graph captured on
    this forward replays it. Plain products otherwise.

        fwd = backend.packed_forward()
        fwd.arrange(prompts, Bs, Xs, kept, buckets)   the slots: B_j rows from X_j [L_j, d]; kept[j] the slot's place in
                                                       the last arrangement (None: a new prompt); buckets[j] a length
                                                       bucket its rows and positions are padded to (or None)
        fwd.load(j, prompt, X)                         slot j takes another prompt of its shape, in place
        fwd.refresh(j, X)                              slot j's reference again at X, in place
        lps = fwd([batch_j [B_j, b_j', d] float32 ...])  -> [lp_j [B_j, P_j] float32 ...]     no host read"""

    def __init__(self, backend) -> None:
        m = self.model = backend.model
        self.ops = backend.ops
        self.rows_on = m.rows_on
        self.refresh_every = REFRESH_EVERY if self.rows_on else 0
        self.key = None  # (Bs, T): the layout's
        self.T = 0
        self.spans: list[SpanPlan] = []
        self.buckets: list = []
        self.blocks: list[tuple[int, int]] = []  # (first batch row, last + 1) of each slot
        self.lengths: list[int] = []  # each slot's prompt length (the rotary tables of one pass: Transformer.fit_rope)
        self.z_refs: list = []
        self.x = self.rows = self.ref = None
        self._one: dict = {}  # b -> the layout of one slot's b value rows (its reference pass)

    def arrange(self, prompts, Bs, Xs, kept=None, buckets=None) -> None:
        """Lay out the slots (class docstring). A slot kept in its place keeps everything; one kept elsewhere keeps
        its span plan and reference logits and has its reference copied (the layout moved); a new one gets its
        own."""
        m, S = self.model, len(prompts)
        m.fit_rope(*(p.length for p in prompts))  # one pass: one rotary table for all (Transformer.fit_rope)
        self.lengths = [p.length for p in prompts]
        kept = list(kept) if kept is not None else [None] * S
        buckets = list(buckets) if buckets is not None else [None] * S
        spans = [self.spans[k] if k is not None else SpanPlan.of(p, m.device, bk)
                 for p, k, bk in zip(prompts, kept, buckets)]
        T = max(span.b for span in spans)
        old_z, old_ref, old_T = self.z_refs, self.ref, self.T
        if (tuple(Bs), T) != self.key or any(k not in (None, j) for j, k in enumerate(kept)):
            self._layout(Bs, T)
            moved = [(j, k) for j, k in enumerate(kept) if k is not None]
            if self.rows_on and moved:  # the kept slots' reference rows where the new layout has them: two launches
                dst, src = (torch.tensor(v, device=m.device) for v in zip(*moved))  # a tensor, for every slot
                n = min(old_T, T)  # a slot's rows past its b_j are zeros in both
                for new, old in zip(self.ref.tensors(), old_ref.tensors()):
                    w = new.shape[-1]
                    new.view(S, T, w)[:, :n].index_copy_(0, dst, old.view(-1, old_T, w)[:, :n].index_select(0, src))
        self.spans, self.buckets = spans, buckets
        self.z_refs = [old_z[k] if k is not None and self.rows_on else None for k in kept]
        for j, k in enumerate(kept):
            if k is None:
                self._take(j, Xs[j])

    def _layout(self, Bs, T: int) -> None:
        m = self.model
        self.blocks, r = [], 0
        for B in Bs:
            self.blocks.append((r, r + B))
            r += B
        self.key, self.T = (tuple(Bs), T), T
        self.x = None  # the old buffer freed before the new one is made
        self.x = torch.zeros(r, T, m.d, dtype=torch.float32 if self.rows_on else m.dtype, device=m.device)
        if self.rows_on:
            self.rows = RowLayout.build(0, r, T, 0, [r0 for r0, r1 in self.blocks for _ in range(r1 - r0)],
                                        device=m.device)
            self.anchors = [torch.zeros(B, dtype=torch.int64, device=m.device) for B in Bs]
            self.ref = m.new_reference(len(Bs) * T)

    def _take(self, j: int, X: torch.Tensor) -> None:
        """Slot j's buffers for its new prompt (its span plan in place): its rows of the pass zeroed, its reference
        made (the padding rows' zeroed)."""
        r0, r1 = self.blocks[j]
        self.x[r0:r1].zero_()
        if self.rows_on:
            span, T = self.spans[j], self.T
            self.ref.rows(j * T + span.b, (j + 1) * T).zero_()
            if self.z_refs[j] is None:
                self.z_refs[j] = torch.empty(1, span.idx.numel(), self.model.head.shape[0], device=self.model.device)
            self.refresh(j, X)

    def load(self, j: int, prompt: Prompt, X: torch.Tensor) -> None:
        """Slot j takes `prompt` from X [L, d] (its shape: the same rows and positions), every tensor in place."""
        self.model.fit_rope(*self.lengths[:j], prompt.length, *self.lengths[j + 1:])  # refused before any change
        self.lengths[j] = prompt.length
        self.spans[j].copy_(SpanPlan.of(prompt, self.model.device, self.buckets[j]))
        self._take(j, X)

    def refresh(self, j: int, X: torch.Tensor) -> None:
        """Slot j's reference at its X [L, d] (rows [0, b_j): its value rows), written in place; the others'
        untouched."""
        if not self.rows_on:
            return
        m, span, T = self.model, self.spans[j], self.T
        one = self._one.get(span.b)
        if one is None:
            one = self._one[span.b] = RowLayout.build(0, 1, span.b, 0, device=m.device)
        ref = m.reference_rows(X[:span.b].to(m.device, torch.float32), one, out=self.ref.rows(j * T, j * T + span.b))
        m.reference_logits(ref.hidden.index_select(0, span.idx)[None], out=self.z_refs[j])

    @torch.no_grad()
    def __call__(self, batches) -> list:
        m = self.model
        for (r0, r1), span, batch in zip(self.blocks, self.spans, batches):
            self.x[r0:r1, :span.b].copy_(batch[:, :span.b])
        if self.rows_on:
            h = self.rows.batch(m.forward_rows(self.x.view(-1, m.d), self.rows, ref=self.ref))  # [sum B_j, T, d]
        else:
            h = m.forward(self.x)
        out = []
        for i, ((r0, r1), span) in enumerate(zip(self.blocks, self.spans)):
            hs = h[r0:r1].index_select(1, span.idx)  # [B_j, P_j, d]
            if self.rows_on:
                out.append(self.ops.span_head_rows(hs, m.head_low.w, span.targets, self.anchors[i],
                                                   softcap=m.final_softcap, z_ref=self.z_refs[i],
                                                   value_slot=self.anchors[i]))
            else:
                out.append(self.ops.span_head(hs, m.head, span.targets, softcap=m.final_softcap))
        return out


__all__ = ["StepForward", "PackedForward", "SpanPlan", "PREFIX_POLICIES", "REFRESH_EVERY", "fixed_rows_kv",
           "resolve_policy"]

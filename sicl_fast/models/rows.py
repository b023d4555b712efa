"""Difference rows: how the fast decoder carries a perturbation batch through its low-precision products.

In the ascent's batch, row 0 is X and rows 1.. are X + mu U_i: every activation of row i is row 0's plus a change
of about one bf16 ulp. Rounded to bf16 as they are, the rows lose that change (a plain bf16 ascent kept 5 % of the
float32 gain on SmolLM2 and none on Gemma 3 270M: bench/RESULTS.md section 17, the precision study). So the
forward keeps its activations in float32 and hands each product its rows in *difference form*, in the low dtype
(bf16):

    difference row  bf16(x_i - x_a)           batch rows 1..: their change from their anchor row a (row 0)
    value row       bf16(x_0 - r_0)           the prefix rows of the pass and batch row 0: their change from a
                                              float32 reference r of the same rows (RowsReference)

One product of the stacked weights then gives every row at once, y = form @ W^T, and the float32 rows are

    y_0 = y_ref + y[value row]        y_i = y_0 + y[difference row i]

where y_ref = r_0 W^T is the reference's own float32 product. The rounding (of a product's input and of its
output) applies to the differences only: 2^-8 relative of a change, never of a value. Without the reference (the
values rounded as they are, r = 0) the differences would keep the perturbation just as well, but row 0 itself, and
so f(X) and the best X the ascent keeps, would carry bf16's rounding: on SmolLM2 the proxy of X moved by 1e-3 to
2e-3 (a step gains 3e-4 to 6e-4), and the X kept lost up to 9 % of the float32 gain (RESULTS 17). The reference is
one float32 forward of the value rows (Transformer.reference_rows: sicl_fast.models.reference), made from X0 when a
run starts and again every few steps (StepForward.refresh, in place), so that the values' changes from it stay
small. The nonlinearities (norms, rotary,
attention, the gated activation, the span head's log-sum-exp) run in float32 on the reconstructed rows.

The rows of one pass, R = lead + B * T in all, in this order:

    lead rows      value rows at positions 0 .. lead-1: the demonstration-free prefix when it runs in the same pass
                   (its K/V are then this pass's, read by every batch row); 0 when the prefix K/V are kept from an
                   earlier pass, or there is no prefix
    batch rows     B rows of T tokens each, at positions pos0 .. pos0+T-1; anchor[j] is the batch row that row j is
                   a difference from (anchor[j] == j: a value row). One prompt: anchor 0 for all; packed prompts:
                   the first row of each prompt's block

A reference tensor holds the value rows alone, [V, k] with V = lead + (value batch rows) * T: the lead rows, then
each value batch row's T rows in order (value_slot[j]: value batch row j's place among them).

The references here are the oracle of the fused ops (sicl_fast.ops: TorchDecoderOps binds them; the C++ and Triton
forms are tested against them). Float32 and bf16 tensors, contiguous rows; `ref` None: no reference (r = 0).

    to_rows(x [R, k] f32, rows, ref [V, k] or None) -> [R, k] low          the difference form
    from_rows(y [R, k] low, rows, ref [V, o] or None) -> [R, o] f32         the float32 rows

and the references of the decoder's three row epilogues (DecoderOps.norm_rows, rope_rows, gated_rows), each one
launch in the fused forms: it reads a product's difference form (with that product's output reference), works on
float32 rows and writes the form the next product takes (against that product's input reference):

    norm_rows(x [R, d] f32, y [R, d] low or None, bias [d] or None, post_w, w, eps, gemma, rows, y_ref, h_ref)
            -> (x' [R, d] f32, h [R, d] low)
        x' = x + (rms_norm(y', post_w) or y') with y' the float32 rows of y plus the product's bias; h = the
        difference form of rms_norm(x', w)
    rope_rows(qkv [R, (H + 2 Hk) hd] low, bias [(H + 2 Hk) hd] or None, rows, cos, sin [n, hd] f32, q_norm,
              k_norm, eps, gemma, H, Hk, k_out, v_out [R, Hk, hd] f32, qkv_ref) -> q [R, H, hd] f32
        the float32 rows of q, k, v (plus the bias); q / k per-head norms (Qwen3, Gemma 3) and rotary at each
        row's position (the tables from position 0); k and v written into k_out / v_out
    gated_rows(y [R, 2I] low, bias [2I] or None, act_name, rows, y_ref, a_ref) -> [R, I] low
        act(gate) * up on the float32 rows of y (plus the bias), in difference form

A product's bias belongs to every row's value, so it is added to the float32 rows here (a difference carries none;
the reference's products carry none either).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .elementwise import ACTIVATIONS, rms_norm, rope

LOW_DTYPE = torch.bfloat16  # the dtype of the difference form and of the products that take it


@dataclass(frozen=True, eq=False)
class RowLayout:
    """The rows of one difference-form pass (module docstring). anchor: int64 [B] on the device; value_slot: int64
    [B] on the device, value batch row j's place among the value batch rows (0 for a difference row: unread);
    differences: the batch rows that hold differences (int64 on the device); anchors: the anchors as host ints (the
    C++ ops and the shapes read them). The rows split by kind, for products that take the two kinds apart (FP8
    differences, sicl_fast.models.projections): value_rows / difference_rows, int64 [V] / [R - V] on the device,
    the pass's rows of each kind in order; value_end: lead + T where the value rows are the pass's first rows (one
    anchor, row 0: one prompt), else None."""

    lead: int
    B: int
    T: int
    pos0: int
    anchor: torch.Tensor
    value_slot: torch.Tensor
    differences: torch.Tensor
    anchors: tuple = field(repr=False)
    value_rows: torch.Tensor = field(repr=False, default=None)
    difference_rows: torch.Tensor = field(repr=False, default=None)

    @classmethod
    def build(cls, lead: int, B: int, T: int, pos0: int, anchors=None, device="cpu") -> RowLayout:
        """anchors: the anchor of each batch row (None: every row a difference from row 0, one prompt)."""
        anchors = tuple(int(a) for a in (anchors if anchors is not None else [0] * B))
        if len(anchors) != B or any(not 0 <= a <= j or anchors[a] != a for j, a in enumerate(anchors)):
            raise ValueError(f"anchors {anchors} must name, for each of the {B} batch rows, an earlier or the same "
                             "row that is its own anchor")
        slots, n = [], 0
        for j, a in enumerate(anchors):
            slots.append(n if a == j else 0)
            n += a == j
        ints = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        kinds = [True] * lead + [a == j for j, a in enumerate(anchors) for _ in range(T)]  # is each row a value row
        return cls(lead=lead, B=B, T=T, pos0=pos0, anchor=ints(anchors), value_slot=ints(slots),
                   differences=ints([j for j in range(B) if anchors[j] != j]), anchors=anchors,
                   value_rows=ints([r for r, v in enumerate(kinds) if v]),
                   difference_rows=ints([r for r, v in enumerate(kinds) if not v]))

    @property
    def value_end(self) -> int | None:
        """lead + T where the value rows are the pass's first lead + T rows (every anchor row 0), else None."""
        return self.lead + self.T if all(a == 0 for a in self.anchors) else None

    @property
    def R(self) -> int:
        return self.lead + self.B * self.T

    @property
    def values(self) -> int:
        """V: the value rows (a reference tensor's rows): the lead rows and the value batch rows' T each."""
        return self.lead + sum(a == j for j, a in enumerate(self.anchors)) * self.T

    @property
    def key(self) -> tuple:
        """What the shapes and kernels of a pass depend on (for caches of buffers and graphs)."""
        return (self.lead, self.B, self.T, self.pos0, self.anchors)

    def value_layout(self) -> RowLayout:
        """The layout of the value rows alone (the reference pass): the lead rows and one batch row per value
        batch row, each its own anchor."""
        vb = sum(a == j for j, a in enumerate(self.anchors))
        return RowLayout.build(self.lead, vb, self.T, self.pos0, list(range(vb)), device=self.anchor.device)

    def batch(self, t: torch.Tensor) -> torch.Tensor:
        """The batch part of t [R, ...] as [B, T, ...] (a view)."""
        return t[self.lead:].view(self.B, self.T, *t.shape[1:])

    def positions(self) -> torch.Tensor:
        """The position of each of the R rows (int64 [R], on the anchor's device)."""
        dev = self.anchor.device
        return torch.cat([torch.arange(self.lead, device=dev),
                          (self.pos0 + torch.arange(self.T, device=dev)).repeat(self.B)])


def is_value(anchor: torch.Tensor) -> torch.Tensor:
    """bool [B]: which batch rows are their own anchor."""
    return anchor == torch.arange(anchor.numel(), device=anchor.device)


def batch_ref(ref: torch.Tensor | None, rows: RowLayout) -> torch.Tensor | float:
    """A reference [V, k] spread over the batch rows: [B, T, k], each value batch row's own rows (a difference
    row gets some value row's, unread); 0.0 without a reference or without batch rows."""
    if ref is None or rows.B == 0:
        return 0.0
    vb = ref[rows.lead:].view(-1, rows.T, ref.shape[-1])
    return vb.index_select(0, rows.value_slot)


def to_form(x: torch.Tensor, anchor: torch.Tensor, dtype=LOW_DTYPE, ref=0.0) -> torch.Tensor:
    """x [B, ...] float32 -> [B, ...] dtype in difference form over its first dimension (anchor [B]; ref: the value
    rows' reference, spread over the batch as batch_ref gives it, or 0.0)."""
    keep = is_value(anchor).view(-1, *([1] * (x.dim() - 1)))
    return torch.where(keep, x - ref, x - x.index_select(0, anchor)).to(dtype)


def from_form(y: torch.Tensor, anchor: torch.Tensor, ref=0.0) -> torch.Tensor:
    """y [B, ...] in difference form over its first dimension -> the float32 rows [B, ...] (ref: as to_form's)."""
    yf = y.float()
    keep = is_value(anchor).view(-1, *([1] * (y.dim() - 1)))
    values = yf + ref
    return torch.where(keep, values, yf + values.index_select(0, anchor))


def to_rows(x: torch.Tensor, rows: RowLayout, dtype=LOW_DTYPE, ref: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, k] float32 -> [R, k] in difference form: lead and value rows against the reference ref [V, k] (None:
    none), the other rows against their anchors."""
    lead = x[:rows.lead] if ref is None else x[:rows.lead] - ref[:rows.lead]
    form = to_form(rows.batch(x), rows.anchor, dtype, batch_ref(ref, rows))
    return torch.cat([lead.to(dtype), form.view(-1, x.shape[-1])])


def from_rows(y: torch.Tensor, rows: RowLayout, ref: torch.Tensor | None = None) -> torch.Tensor:
    """y [R, k] in difference form (ref [V, k]: the value rows' reference, None: none) -> the float32 rows [R, k]."""
    lead = y[:rows.lead].float() if ref is None else ref[:rows.lead] + y[:rows.lead].float()
    return torch.cat([lead, from_form(rows.batch(y), rows.anchor, batch_ref(ref, rows)).view(-1, y.shape[-1])])


def _rows_with_bias(y: torch.Tensor, bias, rows: RowLayout, ref=None) -> torch.Tensor:
    yf = from_rows(y, rows, ref)
    return yf if bias is None else yf + bias.float()


def norm_rows_reference(x: torch.Tensor, y: torch.Tensor | None, bias, post_w, w, eps: float, gemma: bool,
                        rows: RowLayout, y_ref=None, h_ref=None, dtype=LOW_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', h): see the module docstring. The norms in float32 with the weights as float32 (Gemma's 1 + w is).
    dtype: the form's (float32: the values themselves, for the tests' float32 references)."""
    if y is not None:
        yf = _rows_with_bias(y, bias, rows, y_ref)
        x = x + (rms_norm(yf, post_w.float(), eps, gemma) if post_w is not None else yf)
    return x, to_rows(rms_norm(x, w.float(), eps, gemma), rows, dtype, h_ref)


def rope_rows_reference(qkv: torch.Tensor, bias, rows: RowLayout, cos: torch.Tensor, sin: torch.Tensor, q_norm,
                        k_norm, eps: float, gemma: bool, H: int, Hk: int, k_out: torch.Tensor, v_out: torch.Tensor,
                        qkv_ref=None) -> torch.Tensor:
    """q [R, H, hd] float32, k and v written into k_out / v_out [R, Hk, hd] (module docstring)."""
    R = qkv.shape[0]
    hd = k_out.shape[-1]
    f = _rows_with_bias(qkv, bias, rows, qkv_ref)
    q, k, v = f.split([H * hd, Hk * hd, Hk * hd], dim=-1)
    q, k = q.reshape(R, H, hd), k.reshape(R, Hk, hd)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm.float(), eps, gemma), rms_norm(k, k_norm.float(), eps, gemma)
    pos = rows.positions()
    c, s = cos.index_select(0, pos)[:, None], sin.index_select(0, pos)[:, None]  # [R, 1, hd]
    k_out.copy_(rope(k, c, s))
    v_out.copy_(v.view(R, Hk, hd))
    return rope(q, c, s)


def gated_rows_reference(y: torch.Tensor, bias, act_name: str, rows: RowLayout, y_ref=None, a_ref=None,
                         dtype=LOW_DTYPE) -> torch.Tensor:
    """act(gate) * up of the float32 rows of y [R, 2I] (gate | up) plus the bias, in difference form [R, I]."""
    g, u = _rows_with_bias(y, bias, rows, y_ref).chunk(2, dim=-1)
    return to_rows(ACTIVATIONS[act_name](g) * u, rows, dtype, a_ref)


@dataclass
class RowsReference:
    """The float32 reference of a pass's value rows (module docstring): per layer, each product's input and output
    rows [V, k] / [V, o] (`layers[i]` maps 'qkv', 'o', 'gate_up', 'down' to (input, output)); `hidden`: the
    final-normed hidden states [V, d] (the span head's input reference). Made by Transformer.reference_rows;
    refreshed in place (a captured graph reads these tensors)."""

    layers: list
    hidden: torch.Tensor

    def copy_(self, other: RowsReference) -> None:
        for mine, new in zip(self.layers, other.layers):
            for name in mine:
                for a, b in zip(mine[name], new[name]):
                    a.copy_(b)
        self.hidden.copy_(other.hidden)

    def tensors(self) -> list:
        return [t for layer in self.layers for pair in layer.values() for t in pair] + [self.hidden]

    def rows(self, lo: int, hi: int) -> RowsReference:
        """Rows [lo, hi) of every tensor, as views: a part of the value rows (a packed pass's slot), which
        reference_rows(out=) writes and copy_ / zero_ change in place."""
        return RowsReference([{name: tuple(t[lo:hi] for t in pair) for name, pair in layer.items()}
                              for layer in self.layers], self.hidden[lo:hi])

    def zero_(self) -> None:
        for t in self.tensors():
            t.zero_()


__all__ = ["LOW_DTYPE", "RowLayout", "RowsReference", "batch_ref", "is_value", "to_form", "from_form", "to_rows",
           "from_rows", "norm_rows_reference", "rope_rows_reference", "gated_rows_reference"]

"""The float32 reference of a difference-form pass's value rows (sicl_fast.models.rows.RowsReference): one float32
forward of the value rows alone, every product's input and output kept. The step forward makes it when it starts
and again every REFRESH_EVERY steps (sicl_fast.backends.step_forward: StepForward.refresh), in place into the
tensors the step reads, so that the refresh is a fixed sequence of launches with no host read: a CUDA graph of its
own replays it between the step's replays (sicl_fast.calibration.static.StepCache).

    reference_pass(model, x [V, d] f32, rows, prefix=None, keep=False, out=None) -> RowsReference (and the K/V)
    reference_product(ops, x [n, k] f32, w [o, k], out=None) -> [n, o] f32      a float32 product of a weight
    reference_head(ops, h [n, d] f32, head [V', d], out=None) -> [n, V'] f32     the LM head's, before soft-caps

A layer is the plain forward's work on float32 rows with the fused ops of the run's implementation: the input norm
and the residual norms (`residual_norm`), rotary with the q / k norms (the difference form's `rope_rows`, reading
the q | k | v product's float32 output as its value rows' reference with a zero change: one launch that leaves the
product's output as it is), the attention kernel, the gated activation (`gated`), and the four products; each
product's input is copied into the reference (out given) and its output written there: 13 launches a layer with the
Triton ops and float32 weights (14 with the C++ ops, whose gated activation is torch's two; 2 more where lead rows
run: their own attention call and the join), where the torch references took about 105; a bf16 weight's product
takes 2 more on CUDA (the split and the sum). tests/test_refresh.py holds a refresh to three steps' launches.

Products (reference_product). A float32 weight (a float32 model's own) is one float32 product. A bf16 weight (a
bf16 model's own) has no float32 copy: on CUDA the float32 rows are split into PIECES bf16 pieces, x = x_1 + x_2 +
x_3 to float32's 24 bits (x_1 = bf16(x), x_2 = bf16(x - x_1), x_3 = bf16(x - x_1 - x_2): DecoderOps.split_bf16),
the pieces go through one bf16 product with float32 accumulation and a float32 output (torch.mm's out_dtype,
cuBLAS), and the pieces' products are summed: a product of two bf16 values is exact in float32, so this is the
float32 product up to the order of its sums, from the weight's own bytes, at the bf16 rate (3 products of the value
rows, about a third of one step's products at B 9, every 16 steps). Elsewhere (torch has no bf16 product with a
float32 output on the CPU) the weight is made float32 one product at a time, as the reference always did there:
a transient copy, and no graph to keep it out of. SPLIT chooses ('auto': split where the device has that product;
'on': always, emulated with float32 operands off CUDA, for the precision study; 'off': never). ACCUMULATION: how the
emulation sums ('float32': to nearest, as torch on the CPU; 'tensor-cores': as sicl_fast.models.tensor_cores models a
tensor core's float32 accumulation, truncating: the precision study's path, slow).

The products run with cuBLAS's reduced-precision reductions off (sicl_fast.models.reductions): the pass and the head
are one full_reductions scope each.
"""
from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import SiclError
from .reductions import full_reductions
from .rows import LOW_DTYPE, RowLayout, RowsReference
from .tensor_cores import tc_accumulate

# bf16 pieces of a float32 row in a bf16 weight's float32 product: 3, all of float32's 24 bits (2 left SmolLM2's
# reference ten times further from float32 products than another float32 summation order: RESULTS 22)
PIECES = 3
SPLIT = "auto"  # 'auto', 'on', 'off': the module docstring
ACCUMULATION = "float32"  # off CUDA, how the split products' emulation sums: 'float32' or 'tensor-cores'
TC_GROUP = 16  # products a tensor core sums before its accumulator rounds (a bf16 MMA's k: tensor_cores.tc_accumulate)
HEAD_CHUNK = 32768  # vocabulary rows a split head product takes at a time (its float32 output: PIECES x n x chunk)


def split_bf16_reference(x: torch.Tensor, pieces: int = PIECES) -> torch.Tensor:
    """x [n, k] float32 -> [pieces, n, k] bf16 whose sum is x (to float32's bits with 3 pieces): piece j rounds to
    nearest even what the pieces before it leave of x (the remainders are exact in float32). The reference of
    DecoderOps.split_bf16 (kernels/split_bf16.py)."""
    out = torch.empty(pieces, *x.shape, dtype=LOW_DTYPE, device=x.device)
    rest = x.float()
    for j in range(pieces):
        out[j] = rest.to(LOW_DTYPE)
        rest = rest - out[j].float()
    return out


def splits(device: torch.device) -> bool:
    """Do a bf16 weight's float32 products take the split form on `device` (module docstring, SPLIT)?"""
    if SPLIT not in ("auto", "on", "off"):
        raise SiclError(f"reference products: SPLIT must be 'auto', 'on' or 'off', got {SPLIT!r}")
    return SPLIT == "on" or (SPLIT == "auto" and torch.device(device).type == "cuda")


def bf16_mm_f32(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [n, k] bf16 @ w^T (w [o, k] bf16) -> [n, o] float32, accumulated in float32: one cuBLAS product on CUDA;
    elsewhere the same products on float32 operands (exact: bf16 values and their products are float32 values),
    summed as ACCUMULATION says."""
    if a.device.type == "cuda":
        return torch.mm(a, w.t(), out_dtype=torch.float32)
    if ACCUMULATION == "tensor-cores":
        return tc_accumulate(a.float(), w.t().float(), TC_GROUP)
    return torch.mm(a.float(), w.t().float())


def reference_product(ops, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, k] float32 @ w^T, w [o, k] a model's weight in its own dtype -> [n, o] float32, into `out` when given
    (module docstring: one float32 product of a float32 weight; a bf16 weight's by split pieces or, off CUDA, made
    float32 for the product)."""
    if w.dtype == torch.float32:
        return torch.mm(x, w.t(), out=out)
    if w.dtype != LOW_DTYPE or not splits(x.device):  # (an fp16 weight too: made float32 for the product)
        return torch.mm(x, w.t().float(), out=out)
    n, k = x.shape
    y = bf16_mm_f32(ops.split_bf16(x, PIECES).view(PIECES * n, k), w)
    return torch.sum(y.view(PIECES, n, -1), 0, out=out)


@full_reductions()
def reference_head(ops, h: torch.Tensor, head: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The LM head's float32 product of reference hidden rows h [n, d] float32 (head [V', d], the model's own) ->
    [n, V'] float32 before any soft-cap, into `out` when given: one product of a float32 head; a bf16 head's a
    vocabulary chunk at a time (HEAD_CHUNK rows split, 8192 made float32), so that its float32 temporaries stay
    small."""
    if head.dtype == torch.float32:
        return torch.mm(h, head.t(), out=out)
    V = head.shape[0]
    out = torch.empty(h.shape[0], V, dtype=torch.float32, device=h.device) if out is None else out
    split = head.dtype == LOW_DTYPE and splits(h.device)
    chunk = HEAD_CHUNK if split else 8192
    pieces = ops.split_bf16(h, PIECES).view(PIECES * h.shape[0], -1) if split else None
    for v0 in range(0, V, chunk):
        w = head[v0:v0 + chunk]
        if split:
            torch.sum(bf16_mm_f32(pieces, w).view(PIECES, h.shape[0], -1), 0, out=out[:, v0:v0 + chunk])
        else:
            torch.mm(h, w.t().float(), out=out[:, v0:v0 + chunk])
    return out


_F32 = WeakIdKeyDictionary()  # a model's norm weight -> its float32 copy (made once: see _f32)


def _f32(w: torch.Tensor | None) -> torch.Tensor | None:
    """A norm weight as float32 (what the fused norms take with float32 rows): itself, or a copy made once per
    tensor (a bf16 model's: d values a norm; kept as long as the model, so a graph may read it)."""
    if w is None or w.dtype == torch.float32:
        return w
    got = _F32.get(w)
    if got is None:
        got = _F32[w] = w.detach().float()
    return got


class _Kept:
    """Where the pass keeps each product's input and output: the tensors of `out` (a RowsReference, written in place:
    a refresh) or the pass's own results (a new reference)."""

    def __init__(self, out: RowsReference | None) -> None:
        self.out = out
        self.layers: list = []

    def slot(self, i: int, name: str, j: int) -> torch.Tensor | None:
        return None if self.out is None else self.out.layers[i][name][j]

    def input(self, i: int, name: str, t: torch.Tensor) -> torch.Tensor:
        """Keep t as product `name`'s input of layer i (a copy into out's tensor when given) -> the kept tensor."""
        if i == len(self.layers):
            self.layers.append({})
        mine = self.slot(i, name, 0)
        kept = t if mine is None else mine.copy_(t)
        self.layers[i][name] = (kept,)
        return kept

    def product(self, ops, i: int, name: str, w: torch.Tensor) -> torch.Tensor:
        """Product `name` of layer i from its kept input, written where its output is kept -> that output."""
        x = self.layers[i][name][0]
        y = reference_product(ops, x, w, self.slot(i, name, 1))
        self.layers[i][name] = (x, y)
        return y


def _check_layout(rows: RowLayout) -> None:
    """Value rows only; batch rows after lead rows start right after them (the lead rows are their prefix)."""
    if any(a != j for j, a in enumerate(rows.anchors)):
        raise SiclError("the reference pass takes value rows only (RowLayout.value_layout())")
    if rows.lead and rows.B and rows.pos0 != rows.lead:
        raise SiclError(f"the reference pass's batch rows start after the {rows.lead} lead rows, not at {rows.pos0}")


def _attention(m, q, k, v, rows: RowLayout, window, prefix) -> torch.Tensor:
    """o [V, H hd] float32 of the value rows' q [V, H, hd], k, v [V, Hk, hd]: the lead rows among themselves from
    position 0, then the batch rows over the prefix (the lead rows' K/V, or the kept prefix's (k, v) [1, a, Hk, hd],
    or none) and causally over their own rows, as the fused attention_rows and its reference compose it (one call
    each: the same sums whatever the batch rows' count, so a length bucket's padded rows change no real row's bits)."""
    a, B, T, H, hd, Hk = rows.lead, rows.B, rows.T, q.shape[1], q.shape[2], k.shape[1]
    parts = []
    if a:
        parts.append(m.attention(q[None, :a], k[None, :a], v[None, :a], 0, window))
        prefix = (k[None, :a], v[None, :a])
    if B:
        parts.append(m.attention(q[a:].view(B, T, H, hd), k[a:].view(B, T, Hk, hd), v[a:].view(B, T, Hk, hd),
                                 rows.pos0, window, prefix))
    return torch.cat([o.reshape(-1, H * hd) for o in parts]) if len(parts) > 1 else parts[0].reshape(-1, H * hd)


@torch.no_grad()
@full_reductions()  # a bf16 weight's products from bf16 pieces reduce in float32 (sicl_fast.models.reductions)
def reference_pass(m, x: torch.Tensor, rows: RowLayout, prefix=None, keep: bool = False,
                   out: RowsReference | None = None):
    """The float32 reference of a pass's value rows (module docstring) on the Transformer m: x [V, d] float32, the
    value rows alone (rows: their layout, RowLayout.value_layout()); prefix: the kept prefix K/V (PrefixKV) the
    batch rows attend to, or None. out: a RowsReference of these rows' shapes to write in place (a refresh: no
    allocation kept, no copy of a whole reference); None: a new one. keep: also return the pass's K/V per layer
    (k, v) [V, Hk, hd] float32 (a kept prefix's: Transformer.prefix_rows)."""
    _check_layout(rows)
    m._check_prefix(rows, prefix)
    ops, eps, gemma, ys, f32 = m.ops, m.eps, m.gemma, m.residual_mult, torch.float32
    V, H, Hk, hd = rows.R, m.H, m.Hk, m.hd
    if m.embed_scale is not None:
        x = x * m.embed_scale
    x, h = ops.residual_norm(x, None, None, _f32(m.layers[0].attn_norm), eps, gemma)
    kept, kvs = _Kept(out), []
    for i, L in enumerate(m.layers):
        w, rot = L.w, m.rotary[L.rope]
        kept.input(i, "qkv", h)
        qkv = kept.product(ops, i, "qkv", w.qkv)
        k = torch.empty(V, Hk, hd, dtype=f32, device=x.device)
        v = torch.empty(V, Hk, hd, dtype=f32, device=x.device)
        q = ops.rope_rows(m.zero_form(V, qkv.shape[1]), w.qkv_bias, rows, rot.cos32, rot.sin32, L.q_norm, L.k_norm,
                          eps, gemma, H, Hk, k, v, qkv)
        kept.input(i, "o", _attention(m, q, k, v, rows, L.window, None if prefix is None else prefix.kv[i]))
        y = kept.product(ops, i, "o", w.o)
        x, h2 = ops.residual_norm(x, y if w.o_bias is None else y + w.o_bias, _f32(L.post_attn_norm),
                                  _f32(L.mlp_norm), eps, gemma, y_scale=ys)
        kept.input(i, "gate_up", h2)
        gu = kept.product(ops, i, "gate_up", w.gate_up)
        if w.gate_up_bias is not None:
            gu = gu + w.gate_up_bias
        kept.input(i, "down", ops.gated(gu[:, :w.inter], gu[:, w.inter:], m.config.act_name))
        y = kept.product(ops, i, "down", w.down)
        x, h = ops.residual_norm(x, y if w.down_bias is None else y + w.down_bias, _f32(L.post_mlp_norm),
                                 _f32(L.next_norm), eps, gemma, y_scale=ys)
        if keep:  # else each layer's K/V go as the next layer comes
            kvs.append((k, v))
    hidden = h if out is None else out.hidden.copy_(h)
    ref = out if out is not None else RowsReference(layers=kept.layers, hidden=hidden)
    return (ref, kvs) if keep else ref


__all__ = ["reference_pass", "reference_product", "reference_head", "split_bf16_reference", "bf16_mm_f32",
           "splits", "PIECES", "SPLIT", "ACCUMULATION", "TC_GROUP", "HEAD_CHUNK"]

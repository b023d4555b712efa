"""What one calibration step holds in memory, counted in bytes from the shapes alone (before anything is built), and
the memory a cache of steps may take. The one count behind the memory check (sicl_fast.run.checks.check_step_memory)
and the step cache's budget (sicl_fast.calibration.static.StepCache); tests/test_memory.py holds it equal to the
tensors a built step holds, piece by piece.

    available_memory(device) -> bytes free for a step (CUDA: the driver's free memory plus what torch's allocator
                                holds unused; the CPU: MemAvailable, or the cgroup's headroom when smaller)
    step_bytes(lm, prompt, config, kept, bucket, form, prefix, policy, spec) -> StepBytes
    cache_budget(device) -> bytes the kept steps may take (CACHE_SHARE of the memory available)

A static step of the fast backend keeps, for as long as it is cached (its CUDA graph reads them by address):

    state       X, X0, X_next, the best X [L, d] float32; the history [max_steps]
    copies      the copies of X [L, d] the run keeps along the way (best_at): the run's, not the step's, so not in
                what a cached step holds (kept)
    batch       the perturbation batch [B, b, d] float32 (b: the perturbed block's end)
    prefix      the kept prefix's K/V and hidden rows (prefix policy 'kept'): float32 in the difference form, the
                model dtype in the plain one
    reference   the value rows' float32 RowsReference (the difference form): per layer each product's input and
                output over the value rows (the lead rows and batch row 0's T), and the final hidden rows
    logits      their reference logits at the span positions, z_ref [1, P, V] float32
    kv          the pass's K/V buffers, per layer two [R, Hk, hd] (float32 in the difference form, R the pass's rows;
                the plain form's [B, T, Hk, hd] in the model dtype): the model keeps one set a shape, and a captured
                graph holds on to the set it was captured with
    activations the temporaries of one layer of the pass at its peak (what the graphs' shared memory pool holds
                for the largest step), freed between two steps

The activations are the old estimate's (issue 4): 4 bytes an element of the batch's rows times a layer's widths; the
rest is exact, the tensors' own sizes. The naive backend's forward also makes the batch's full logits [B, n, V] and
their log-softmax, counted with its activations (naive_head_bytes; issue 54), and the hf backend's with the model's
own head its logits at the span rows (own_head_bytes).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from ..models.output_head import own_rows
from ..step.spec import block_end, prefix_policy

# the share of the memory available when a step cache is made that its kept steps may take: the rest is left to
# what runs beside them (the decode graphs and their KV caches, the span head's vocabulary chunks, answers from the
# store, the allocator's fragmentation); the same rule on a CPU, where kept steps take RAM as on a GPU
CACHE_SHARE = 0.8
# the step forward: the fast backend's difference form or plain products, the naive backend's (its full logits), or
# the hf backend's with the model's own head (form_of)
FORMS = ("rows", "plain", "naive", "own", "own-all")


def available_memory(device) -> int:
    """Bytes free for a step: on CUDA the driver's free memory plus what torch's caching allocator holds unused
    (reserved, not allocated: a dropped step's memory goes there, not back to the driver); on the CPU the smaller
    of MemAvailable and the cgroup's headroom."""
    device = torch.device(device)
    if device.type == "cuda":
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + int(unused)
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    if free is None:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        cg = Path("/sys/fs/cgroup")
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int((cg / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free


def cache_budget(device) -> int:
    """The bytes a step cache's kept steps may take: CACHE_SHARE of available_memory(device) now."""
    return int(CACHE_SHARE * available_memory(device))


@dataclass(frozen=True)
class ModelShape:
    """The sizes the counts read, from a transformers text config (LoadedModel.text_config) and the model dtype."""

    layers: int
    d: int
    H: int
    Hk: int
    hd: int
    inter: int
    vocab: int
    itemsize: int  # bytes an element of the model dtype

    @classmethod
    def of(cls, lm) -> ModelShape:
        cfg = lm.text_config
        d, H = int(cfg.hidden_size), int(getattr(cfg, "num_attention_heads", 1) or 1)
        return cls(layers=int(getattr(cfg, "num_hidden_layers", 1) or 1), d=d, H=H,
                   Hk=int(getattr(cfg, "num_key_value_heads", None) or H),
                   hd=int(getattr(cfg, "head_dim", None) or d // H),
                   inter=int(getattr(cfg, "intermediate_size", 4 * d) or 4 * d),
                   vocab=int(getattr(cfg, "vocab_size", 0) or 0), itemsize=torch.empty(0, dtype=lm.dtype).itemsize)


@dataclass(frozen=True)
class StepBytes:
    """One step's bytes, by what holds them (module docstring); and, summed once when it is made: kept, what the step
    holds between two steps (a cached step's cost: not the run's copies of X), and total, what running it needs (what
    it keeps, the run's copies of X and one layer's temporaries)."""

    state: int = 0
    copies: int = 0
    batch: int = 0
    prefix: int = 0
    reference: int = 0
    logits: int = 0
    kv: int = 0
    activations: int = 0
    kept: int = field(init=False, repr=False, compare=False)
    total: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        total = sum(getattr(self, f.name) for f in fields(self) if f.init)
        object.__setattr__(self, "kept", total - self.activations - self.copies)
        object.__setattr__(self, "total", total)


def step_bytes(lm, prompt, config, kept: int = 0, bucket=None, form: str | None = None,
               prefix: bool = True, policy: str | None = None, spec=None) -> StepBytes:
    """The bytes of one ascent step of `prompt` under the CalibrationConfig config (module docstring), padded to
    `bucket` (a length bucket) where given; kept: copies of X [L, d] kept along the way (BestAt). form: the fast
    backend's step forward, 'rows' (the difference form) or 'plain'; 'naive' (the naive backend: the layers'
    temporaries and its full logits, naive_head_bytes); 'own' / 'own-all' (the hf backend with the model's own head:
    own_head_bytes) or None (the hf backend with its head's table: the layers' temporaries); prefix: False where the
    step runs without the prefix K/V (the packed step, a backend without the prefix cache); policy: the forward's
    prefix policy ('kept', 'pass', 'none') where the caller worked it out (a StepPlan,
    sicl_fast.calibration.step_plan), else worked out here from prefix; spec: the step's StepSpec where the caller made
    one (a StepPlan's: its batch rows B and its block's end b, the batch's rows), else worked out here from config,
    prompt and bucket. The exact gradient (estimator 'grad') runs one row, but autograd keeps every layer's
    activations for the backward (one layer's with checkpoint), about twice over."""
    s = ModelShape.of(lm)
    f32 = 4
    # B, and the perturbed block's end n: the batch's rows
    B, n = (spec.B, spec.b) if spec is not None else (config.batch, block_end(config, prompt, bucket))
    L = bucket.length if bucket is not None else prompt.length
    b = bucket.rows if bucket is not None else prompt.demo_end  # the forward's rows
    P = bucket.positions if bucket is not None else int(prompt.positions.numel())
    a = prompt.demo_start
    state = f32 * (4 * L * s.d + config.max_steps)
    copies = f32 * kept * prompt.length * s.d
    per_row = 2 * s.d + 6 * s.d + 3 * s.inter + s.H * n  # one layer's widths, the attention scores' among them
    if config.estimator == "grad":
        layers = 1 if config.checkpoint else s.layers
        return StepBytes(state=state, copies=copies, activations=f32 * 2 * (layers + 1) * n * per_row)
    out = dict(state=state, copies=copies, batch=f32 * B * n * s.d, activations=f32 * B * n * per_row)
    if form is None:
        return StepBytes(**out)
    if form not in FORMS:
        raise ValueError(f"form {form!r}; one of {FORMS} or None")
    if form == "naive":
        return StepBytes(**{**out, "activations": out["activations"] + naive_head_bytes(s, B, n)})
    if form in ("own", "own-all"):
        return StepBytes(**{**out, "activations": out["activations"] + own_head_bytes(s, B, b, P, form == "own")})
    if policy is None:
        policy = "none" if not prefix or a == 0 else prefix_policy(config.kappa, config.projection_scope)
    start = 0 if policy == "none" else a  # the first row each batch row runs
    T, lead = b - start, a if policy == "pass" else 0
    kv_row = 2 * s.layers * s.Hk * s.hd  # K and V of one row, every layer
    if form == "plain":
        size = s.itemsize
        return StepBytes(**out, prefix=size * a * (2 * s.d + kv_row) if policy == "kept" else 0,
                         kv=size * B * T * kv_row)
    widths = 4 * s.d + 2 * (s.H + s.Hk) * s.hd + 3 * s.inter  # a layer's product inputs and outputs
    return StepBytes(**out, prefix=f32 * a * (2 * s.d + kv_row) if policy == "kept" else 0,
                     reference=f32 * (lead + T) * (s.layers * widths + s.d), logits=f32 * P * s.vocab,
                     kv=f32 * (lead + B * T) * kv_row)


def naive_head_bytes(s: ModelShape, B: int, n: int) -> int:
    """What the naive backend's forward of a batch [B, n, d] makes beyond the layers' temporaries (backends.naive):
    its input in the model dtype, the full logits [B, n, V] and their log-softmax in float32, held at once (the
    model-dtype logits beside their float32 copy weigh no more). Added to the layers' temporaries, not the larger of
    the two: the CPU's allocator keeps the layers' freed blocks resident while the logits are made (measured:
    bench/forward_peak.py, bench/RESULTS.md 32)."""
    return s.itemsize * B * n * s.d + (4 + max(4, s.itemsize)) * B * n * s.vocab


def own_head_bytes(s: ModelShape, B: int, b: int, P: int, keep: bool) -> int:
    """What the hf backend's head 'own' (the model's own forward at the span rows: models.output_head.own_logits,
    own_rows batch rows a call) makes beyond the layers' temporaries for a batch of B rows of b, P span rows: per
    call, the model's logits [r, P or b, V] in the model dtype (P with logits_to_keep: keep), their span rows (a
    copy where not keep), their float32 copy (where the model dtype is not float32) and the log-sum-exp's temporary
    [r, P, V], added together as naive_head_bytes adds its parts."""
    per_row = P if keep else b
    r = min(B, own_rows(per_row, s.vocab))
    at_spans = r * P * s.vocab * ((0 if keep else s.itemsize) + (4 if s.itemsize != 4 else 0) + 4)
    return r * per_row * s.vocab * s.itemsize + at_spans


def form_of(plan) -> str | None:
    """The step forward's form a run plan gives its steps (step_bytes' form): the fast backend's static and packed
    steps' ('rows' or 'plain'), 'naive' for the naive backend's (the model's full logits), for the hf backend's 'own'
    or 'own-all' where its head is the model's own forward (with logits_to_keep, or its every row), else None (its
    head at the span rows, a vocabulary chunk at a time)."""
    if plan is None:
        return None
    if plan.kind.cls == "hf":
        head = plan.head
        return None if head is None or head.mode != "own" else "own" if head.keep else "own-all"
    if plan.kind.cls == "naive":
        return "naive"
    return "rows" if plan.diff_matmul != "off" else "plain"


__all__ = ["CACHE_SHARE", "ModelShape", "StepBytes", "available_memory", "cache_budget", "form_of", "naive_head_bytes",
           "own_head_bytes", "step_bytes"]

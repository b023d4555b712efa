"""Before / after: seeded calibrations of this checkout against another checkout of sicl_fast, compared bit for bit.

    mkdir /tmp/base && git archive 89e93f6 | tar -x -C /tmp/base && cp sicl_fast/ops/_C*.so /tmp/base/sicl_fast/
    python bench/same_histories.py --other /tmp/base [--smollm2]

A grid of 36 seeded runs on tiny random-weight models (Llama with llama3 rope scaling and biases; Gemma 2 with
soft-caps and a sliding window), over the estimators (forward, central, grad), grad modes (clip, normalize),
projection scopes (prompt, demos; kappa high enough that the projection fires), SNR skips, the gate, the loops
(eager, static, packed), the backends (fast, fast-fp32, hf) and the implementations (torch, cpp, triton under
Triton's interpreter); with --smollm2 also a few short runs on the embedded SmolLM2-135M. Each side runs in its own
interpreter (bench/other_checkout.py's PRELUDE, TRITON_INTERPRET=1, one thread) through the public Engine API and
records, per run, the proxy history (exact floats), steps, best step, stop reason, projections and the sha256 of
the calibrated embeddings' bytes. Prints the runs that differ (none: exit 0).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from other_checkout import PRELUDE, run_worker  # bench/, first on sys.path when run as a script

WORKER = PRELUDE + r"""
# the module paths before #41: both checkouts have them (sicl_fast.MOVED in a newer one)
import hashlib, json
import torch
torch.set_num_threads(1)
from sicl_fast import CalibrationConfig, Engine
from sicl_fast.models import from_transformers, load
from sicl_fast.requests import Request
from sicl_fast.spans import Prompt


class Tok:
    eos_token_id = None
    all_special_ids = []

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def tiny(family):
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1)
    torch.manual_seed({"llama": 1, "gemma2": 3}[family])
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    else:
        model = Gemma2ForCausalLM(Gemma2Config(**common, sliding_window=8, query_pre_attn_scalar=24,
                                               final_logit_softcapping=5.0, attn_logit_softcapping=2.0))
        model.config._attn_implementation = "eager"
    with torch.no_grad():  # norm weights away from 1 (so (1 + w) vs w matters), biases away from 0
        for p in (p for name, p in model.named_parameters() if "norm" in name or name.endswith("bias")):
            p.uniform_(-0.3, 0.3) if p.abs().max() == 0 else p.mul_(torch.empty_like(p).uniform_(0.7, 1.3))
    return from_transformers(model, Tok(), name="tiny-" + family)


def prompt(a, seed=0, L=40, spans=((14, 20), (26, 31))):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (L,), generator=g)
    req = Request(id=f"p{a}-{seed}", prompt="x" * (L + 1), output_spans=((1, 2),))
    return Prompt(request=req, input_ids=ids, token_spans=tuple(spans), demo_start=a, demo_end=spans[-1][1])


def record(res):
    X = res.embeddings.detach().float().contiguous().cpu()
    return {"history": [repr(v) for v in res.history], "steps": res.steps, "best_step": res.best_step,
            "stop": res.stop_reason, "projections": res.projections, "gated": res.gated,
            "best": repr(res.best_proxy), "X": hashlib.sha256(X.numpy().tobytes()).hexdigest()[:16]}


BASE = dict(N=4, mu=0.05, eta=0.5, kappa=0.0, tau=0.0, patience=3, max_steps=4, seed=7, scale=1.0)
RUNS = []  # (name, model, engine kwargs, config overrides, prompts (demo_start, seed), many)
for impl in ("torch", "cpp", "triton"):
    for backend, loop in (("fast-fp32", "eager"), ("fast-fp32", "static"), ("fast", "static"), ("hf", "eager")):
        RUNS.append((f"llama {backend} {loop} {impl}", "llama",
                     dict(backend=backend, loop=loop, impl=impl, diff_matmul="bf16" if backend == "fast" else "auto"),
                     dict(kappa=0.999, eta=50.0), [(6, 0)], False))
    RUNS.append((f"gemma2 fast central demos {impl}", "gemma2", dict(backend="fast", diff_matmul="bf16", impl=impl),
                 dict(estimator="central", kappa=0.999, eta=50.0, projection_scope="demos"), [(6, 1)], False))
    RUNS.append((f"gemma2 fast-fp32 normalize snr {impl}", "gemma2", dict(backend="fast-fp32", impl=impl),
                 dict(grad_mode="normalize", snr_threshold=0.5, max_steps=5), [(0, 2)], False))
    RUNS.append((f"llama fast gate {impl}", "llama", dict(backend="fast", impl=impl), dict(tau=0.99), [(6, 3)],
                 False))
    RUNS.append((f"llama packed 2 {impl}", "llama", dict(backend="fast-fp32", pack=2, impl=impl),
                 dict(kappa=0.999, eta=50.0, estimator="central"), [(6, 4), (0, 5)], True))
for backend in ("hf", "fast", "fast-fp32"):
    for mode in ("clip", "normalize"):
        RUNS.append((f"llama grad {backend} {mode}", "llama", dict(backend=backend, grad=True),
                     dict(estimator="grad", grad_mode=mode, kappa=0.999, N=1), [(6, 6)], False))
RUNS.append(("gemma2 grad fast-fp32 demos", "gemma2", dict(backend="fast-fp32", grad=True),
             dict(estimator="grad", projection_scope="demos", kappa=0.999), [(6, 7)], False))
for impl in ("torch", "cpp"):
    RUNS.append((f"llama eager forward demos {impl}", "llama", dict(backend="fast", loop="eager", impl=impl,
                 diff_matmul="bf16"), dict(kappa=0.999, eta=50.0, projection_scope="demos"), [(0, 8)], False))
    RUNS.append((f"gemma2 static patience {impl}", "gemma2", dict(backend="fast-fp32", loop="static", impl=impl,
                 sync_every=3), dict(patience=1, max_steps=6), [(6, 9)], False))
RUNS.append(("llama naive eager", "llama", dict(backend="naive", impl="torch"), dict(), [(6, 10)], False))
SMOL = [("smollm2 fast auto", dict(backend="fast"), dict()),
        ("smollm2 fast-fp32 eager torch", dict(backend="fast-fp32", loop="eager", impl="torch"), dict(kappa=0.99)),
        ("smollm2 hf central", dict(backend="hf", impl="cpp"), dict(estimator="central"))]

out = {}
models = {}
for name, model, kw, over, specs, many in RUNS:
    lm = models.get(model) or models.setdefault(model, tiny(model))
    eng = Engine(lm, **kw)
    cfg = CalibrationConfig(**{**BASE, **over})
    ps = [prompt(a, s) for a, s in specs]
    res = eng.calibrate_many(ps, cfg) if many else [eng.calibrate(ps[0], cfg)]
    out[name] = [record(r) for r in res]
if sys.argv[2] == "1":
    lm = load()
    req = {"id": "s", "instruction": "Write each number word as a digit.", "query": "five",
           "demos": [{"input": w, "output": d} for w, d in (("one", "1"), ("seven", "7"), ("two", "2"))]}
    for name, kw, over in SMOL:
        eng = Engine(lm, **kw)
        res = eng.calibrate(eng.prepare(req), CalibrationConfig(**{**BASE, "scale": None, "mu": 0.004, "eta": 0.05,
                                                                     **over}))
        out[name] = [record(res)]
print(json.dumps(out))
"""


def run(root: Path, smollm2: bool) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    return run_worker(WORKER, root, int(smollm2), timeout=3600, env=env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="the other checkout (B); A is this one")
    ap.add_argument("--smollm2", action="store_true", help="also a few short runs on the embedded SmolLM2-135M")
    ap.add_argument("--save", default=None, metavar="DIR", help="write A.json and B.json there")
    args = ap.parse_args()
    here, other = Path(__file__).resolve().parent.parent, Path(args.other).resolve()
    a, b = run(here, args.smollm2), run(other, args.smollm2)
    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        for name, side in (("A", a), ("B", b)):
            (Path(args.save) / f"{name}.json").write_text(json.dumps(side, indent=1))
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    for k in differ:
        print(f"DIFFERS: {k}\n  A: {a.get(k)}\n  B: {b.get(k)}")
    steps = sum(r["steps"] for runs in a.values() for r in runs)
    print(f"{len(a)} runs ({steps} steps): {len(a) - len(differ)} identical, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

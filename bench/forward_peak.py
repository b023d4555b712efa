"""The memory one perturbation batch's forward takes, measured, against what the memory check counts for it
(sicl_fast.run.memory.step_bytes, through sicl_fast.run.checks.step_memory), for the backends whose forward is the
model's own (naive: the whole batch's [B, n, V] logits and their log-softmax; hf: the decoder, then the LM head at the
span rows only), on the embedded SmolLM2-135M in float32 on the CPU; with --other, another checkout's count beside
this one's (the forward measured again there: the same code runs it).

    git worktree add /tmp/base 481e2be && cp sicl_fast/ops/_C*.so /tmp/base/sicl_fast/
    python bench/forward_peak.py --lengths 406 --N 8 --other /tmp/base

Each (checkout, backend, length) in its own interpreter (bench/other_checkout.py), one torch thread: the model
loaded, the prompt's batch [B, n, d] made (bench/step_memory.prompt_of's prompt of L tokens, n = L - 16 rows), the
process's peak resident memory reset (/proc/self/clear_refs), one Backend.span_logprobs of the batch, then the
peak (VmHWM) less the resident memory before the call: what the forward raised the peak by (--repeats interpreters
a row: it varies by some tens of MiB from one to the next). Beside it the step's
estimate (step_memory: what a step keeps and its forward's temporaries) and the forward's part of it (the
activations). MiB.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from other_checkout import run_worker  # bench/, first on sys.path when run as a script
from weights_memory import MEMORY_PRELUDE

ROOT = Path(__file__).resolve().parents[1]

WORKER = MEMORY_PRELUDE + r"""
import json
sys.path.insert(0, os.path.join(root, "bench"))
from step_memory import prompt_of
from sicl_fast.backends import make_backend
from sicl_fast.calibration.ascent import CalibrationConfig
from sicl_fast.models import load
from sicl_fast.run.checks import step_memory
from sicl_fast.run.memory import form_of, step_bytes

lm = load(dtype="float32", device="cpu")
be = make_backend(sys.argv[2], lm)
p = prompt_of(int(sys.argv[3]))
cfg = CalibrationConfig.for_model(lm, N=int(sys.argv[4])).replace(scale=lm.embedding_scale)
X = be.embed(p)
n = p.demo_end
batch = X[:n].expand(cfg.batch, n, X.shape[1]).clone()
batch[1:] += 0.01 * torch.randn_like(batch[1:])
form = form_of(be.plan)
counted = step_bytes(lm, p, cfg, form=form)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) reset to the resident memory now
before = status("VmRSS")
with torch.no_grad():
    be.span_logprobs(batch, p, near_row0=True)
print(json.dumps({"measured": status("VmHWM") - before, "estimate": step_memory(lm, p, cfg, form=form) / 2**20,
                  "forward": counted.activations / 2**20, "B": cfg.batch, "n": n, "form": form}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="+", default=["naive", "hf"], choices=["naive", "hf"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[406])
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--other", help="another checkout: its estimate beside this one's")
    ap.add_argument("--repeats", type=int, default=3, help="interpreters a row (the measured range: RSS varies)")
    args = ap.parse_args()
    sides = [("this", ROOT)] + ([("other", Path(args.other).resolve())] if args.other else [])
    print("| checkout | backend | L | B, n | forward raised the peak by (min - max) | estimate: the step | its "
          "forward's part | estimate / largest measured |")
    print("|---|---|---|---|---|---|---|---|")
    for backend in args.backends:
        for L in args.lengths:
            for side, root in sides:
                runs = [run_worker(WORKER, root, backend, L, args.N) for _ in range(args.repeats)]
                r, low, high = runs[0], min(x["measured"] for x in runs), max(x["measured"] for x in runs)
                print(f"| {side} | {backend} | {L} | {r['B']}, {r['n']} | {low:.0f} - {high:.0f} MiB | "
                      f"{r['estimate']:.0f} MiB | {r['forward']:.0f} MiB | {r['estimate'] / high:.2f} |", flush=True)


if __name__ == "__main__":
    main()

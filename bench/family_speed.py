"""The fast backend's step on each later family (issue #47, item 5) beside Llama's at the same sizes: random-weight
models at SmolLM2-135M's shapes (d 576, 30 layers, 9 / 3 heads of 64, MLP 1536, its vocabulary and tokenizer), each
with its family's quirks as a real checkpoint of it has them, timed by `sicl-fast bench --backends fast hf`.

    python bench/family_speed.py [--dir DIR] [--families qwen2 ...] [--length 256] [--N 8] [--repeats 3]
                                 [--rounds 1] [--interleaved STEPS]

The models are written once into DIR (float32 safetensors, about 540 MB each; default /tmp/sicl_family_models).
Each family's bench runs beside a run of the Llama model (one `sicl-fast bench` process each, the same flags), so
that the load of a shared machine changes little between the two: `--rounds R` pairs, the order alternating (Llama
first, then the family first), each model's min over its rounds; `uptime` is printed before each family. The table:
each family's fast ms a step (min) against Llama's in the same rounds (Llama's fast backend alone), and against its
own hf backend (timed in the family's first round).

`--interleaved STEPS` times the fast step a second way, in this one process: Llama's step and each family's in
turn, one step each, STEPS of each after one warm-up step each, min ms (diagnostics.profile's best_in_turn). Every
model steps the same prompt (the same token ids, spans and demonstration rows: `synthetic_prompt` of Llama's
tokenizer, given as it is to every family, all of which have SmolLM2's vocabulary), so that a family's own tokenizer
class cannot change the work (Qwen2's folder loads transformers' Qwen2Tokenizer, which splits the same text into
other tokens).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

SIZES = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
             tie_word_embeddings=True, initializer_range=0.041666666666666664, bos_token_id=0, eos_token_id=0,
             pad_token_id=0)
# each family's quirks at the settings of a real checkpoint of it (the transformers config fields)
QUIRKS = {
    "llama": ("LlamaConfig", {"rope_theta": 100000}),
    "qwen2": ("Qwen2Config", {}),  # q / k / v biases (Qwen2.5: no window without use_sliding_window)
    "mistral": ("MistralConfig", {"sliding_window": 4096}),  # Mistral 7B v0.1: a window on every layer
    "ministral": ("MinistralConfig", {"sliding_window": 4096}),  # windows per layer type
    "phi3": ("Phi3Config", {"original_max_position_embeddings": 4096, "rope_parameters": {  # Phi-4-mini's rotary
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0] * 24, "long_factor": [1.5] * 24}}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                  "attention_multiplier": 0.015625, "logits_scaling": 8.0}),  # Granite 3.x's
    "olmo2": ("Olmo2Config", {}),  # post-norms, q / k norms over the whole projection
    "smollm3": ("SmolLM3Config", {}),  # no rope on every 4th layer
}
ROW = re.compile(r"^\| (\S+) \| (\w+) \| (\w+) \| (\d+) \| \d+ \| \d+ \| ([\d.]+) \| ([\d.]+) \|")


def write_models(root: Path, families) -> dict:
    """{family: its folder}: a random-weight model of each at SmolLM2's sizes, with SmolLM2's tokenizer."""
    import torch
    import transformers

    from sicl_fast.models import load

    out, tok = {}, None
    for family in families:
        folder = root / family
        out[family] = folder
        if (folder / "config.json").is_file():
            continue
        if tok is None:
            tok = load(dtype="float32", device="cpu").tokenizer
        name, quirks = QUIRKS[family]
        torch.manual_seed(0)
        cfg = getattr(transformers, name)(**SIZES, **quirks)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        print(f"# wrote {folder}", flush=True)
    return out


def bench(folder: Path, args, backends=("fast", "hf")) -> dict:
    """{backend: (ms mean, ms min, impl, loop)} of one `sicl-fast bench` run (its main, in a process of its own)."""
    cmd = [sys.executable, "-c", "import sys; from sicl_fast.commands.cli import main; sys.exit(main())", "bench",
           "--model", str(folder), "--backends", *backends, "--length", str(args.length),
           "--N", str(args.N), "--repeats", str(args.repeats)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd[3:])} failed: {r.stderr.strip()[-2000:]}")
    rows = {}
    for line in r.stdout.splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = (float(m.group(5)), float(m.group(6)), m.group(2), m.group(3))
    return rows


def processes(folders: dict, args) -> list:
    """[{family, runs, load}]: each family's `sicl-fast bench` processes beside Llama's (module docstring)."""
    print("| family | fast ms (min) | Llama's fast ms (min), same rounds | family / Llama | hf ms (min) | "
          "hf / fast | load (uptime, before the family's rounds) |")
    print("|---|---|---|---|---|---|---|")
    records = []
    for family in args.families:
        load = _uptime()
        runs = {"llama": [], family: []}
        for r in range(args.rounds):
            for name in (("llama", family) if r % 2 == 0 else (family, "llama")):
                hf = name != "llama" and r == 0  # the family's hf backend in its first round
                runs[name].append(bench(folders[name], args, ("fast", "hf") if hf else ("fast",)))
        best = lambda m, b: min(run[b][1] for run in runs[m] if b in run)  # noqa: E731
        f, ll, hf = best(family, "fast"), best("llama", "fast"), best(family, "hf")
        print(f"| {family} | {f:.1f} | {ll:.1f} | {f / ll:.2f} | {hf:.1f} | {hf / f:.2f} | {load} |", flush=True)
        records.append({"family": family, "runs": runs, "load": load})
    return records


def interleaved(folders: dict, args) -> list:
    """[{family, rounds, load}]: each family's fast step and Llama's in turn in this process, one step each,
    args.interleaved of each, on one prompt (module docstring)."""
    from sicl_fast.backends import build_backend
    from sicl_fast.calibration.ascent import CalibrationConfig
    from sicl_fast.diagnostics.benchmark import step_runner, synthetic_prompt
    from sicl_fast.diagnostics.profile import best_in_turn
    from sicl_fast.models import load
    from sicl_fast.run.plan import make_plan

    def runner(lm):
        """One fast step of the prompt, as `sicl-fast bench` builds it (its plan, config and step_runner)."""
        cfg = CalibrationConfig.for_model(lm, N=args.N)
        return step_runner(build_backend(make_plan(lm, backend="fast"), lm), prompt, cfg)[0]

    lm = load(folders["llama"], dtype="float32", device="cpu")
    prompt = synthetic_prompt(lm, args.length)  # Llama's tokenizer: the same token ids for every family
    llama = runner(lm)
    print(f"# one prompt for all: L {prompt.length}, demonstration rows [{prompt.demo_start}, {prompt.demo_end}), "
          f"{sum(b - a for a, b in prompt.token_spans)} span positions, N {args.N}")
    print("| family | fast ms (min) | Llama's (min), interleaved | family / Llama | load (uptime, before) |")
    print("|---|---|---|---|---|")
    records = []
    for family in args.families:
        load_avg = _uptime()
        step = runner(load(folders[family], dtype="float32", device="cpu"))
        rounds = []
        best = best_in_turn({"llama": llama, family: step}, "cpu", args.interleaved,
                            on_round=lambda r, n, times: rounds.append(times))
        f, ll = best[family], best["llama"]
        print(f"| {family} | {f:.0f} | {ll:.0f} | {f / ll:.2f} | {load_avg} |", flush=True)
        records.append({"family": family, "rounds": rounds, "load": load_avg})
        del step
    return records


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.split("load average:")[-1].strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/sicl_family_models"))
    ap.add_argument("--families", nargs="+", default=[f for f in QUIRKS if f != "llama"])
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="Llama / family pairs a family, each model's min taken")
    ap.add_argument("--interleaved", type=int, default=0, metavar="STEPS",
                    help="time in this process instead, one prompt for all, STEPS of each (module docstring)")
    ap.add_argument("--json", type=Path, help="also write the measurements here")
    args = ap.parse_args(argv)
    folders = write_models(args.dir, ["llama", *args.families])
    records = interleaved(folders, args) if args.interleaved else processes(folders, args)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

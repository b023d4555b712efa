"""How far a bf16 model's value-row reference moves when its float32 products come from bf16 pieces of the rows (the
CUDA form, sicl_fast.models.reference: no float32 copy of the weights; emulated here with float32 operands, the same
products) instead of the weights made float32: for 3, 2 and 1 pieces, against the float32 noise of the reference
itself (the same pass with the torch ops instead of the C++ ones: another summation order of the same float32 math).

    python bench/reference_products.py --length 256 --steps 2

Loads the embedded SmolLM2-135M in bf16 on the CPU, runs `--steps` static steps (so that X has moved from the
embeddings) and makes the reference at that X each way. Prints, per form, the largest |difference| over every kept
tensor relative to that tensor's largest |value|, the reference logits' largest |difference|, and the seconds.
"""
from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    from sicl_fast.backends import make_backend
    from sicl_fast.calibration.ascent import CalibrationConfig, Calibrator
    from sicl_fast.calibration.static import StaticStep
    from sicl_fast.diagnostics.benchmark import synthetic_prompt
    from sicl_fast.models import load, reference

    lm = load(dtype="bfloat16", device="cpu")
    p = synthetic_prompt(lm, args.length, prefix=8)
    refs = {}
    for impl in ("cpp", "torch"):
        be = make_backend("fast", lm, diff_matmul="bf16", impl=impl)
        cal = Calibrator(be, CalibrationConfig(N=8, tau=0.0))
        st = StaticStep(be, cal.config, p, cal.initial_embeddings(p))
        for _ in range(args.steps):
            st()
        forms = (("copy", "off", 3), ("3 pieces", "on", 3), ("2 pieces", "on", 2), ("1 piece", "on", 1))
        for name, split, pieces in forms if impl == "cpp" else forms[:1]:
            reference.SPLIT, reference.PIECES = split, pieces
            t = time.perf_counter()
            refs[impl, name] = st.forward._reference(st.state.X), time.perf_counter() - t
        reference.SPLIT, reference.PIECES = "auto", 3
    (base, _) = refs["cpp", "copy"]
    print(f"SmolLM2-135M bf16, L {p.length}, the reference after {args.steps} steps; against float32 products of the "
          "weights made float32 (C++ ops):")
    print("| form | largest difference / largest value | reference logits: largest difference | seconds |")
    print("|---|---|---|---|")
    for (impl, name), ((ref, z), sec) in refs.items():
        if (impl, name) == ("cpp", "copy"):
            continue
        rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ref.tensors(), base[0].tensors()))
        label = f"{name} (C++ ops)" if impl == "cpp" else "copy, torch ops (float32 noise)"
        dz, zmax = float((z - base[1]).abs().max()), float(base[1].abs().max())
        print(f"| {label} | {rel:.2e} | {dz:.2e} (largest {zmax:.1f}) | {sec:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""float32 vs bf16 matrix-product rates on this machine at SmolLM2's projection shapes (why the fast backend's
difference products pay on CPUs with AVX512-BF16 / AMX), and the bf16 weight in oneDNN's packed layout (what
sicl_fast.models.weights.LowWeight keeps) against plain F.linear.

    OMP_NUM_THREADS=1 python bench/matmul_rates.py

M = 9 x 128, 8 x 128 and 8 x 512 token rows (a perturbation batch at L = 128 and 512); each product's best of 20
calls after two warm-ups, the three forms timed in turn (round-robin) so that they see the same machine load;
torch's own thread count.
"""
import time

import torch
import torch.nn.functional as F

from sicl_fast.models.weights import mkldnn_packed, packed_linear


def best_seconds(fns, repeats: int = 20) -> list[float]:
    for fn in fns:
        fn(), fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print("| M | out x in | float32 GFLOP/s | bf16 GFLOP/s | ratio | bf16 packed GFLOP/s | packed / bf16 |")
    print("|---|---|---|---|---|---|---|")
    for M in (9 * 128, 8 * 128, 8 * 512):
        for out, inp in ((1536, 576), (576, 1536), (576, 576), (192, 576)):
            x, w = torch.randn(M, inp), torch.randn(out, inp)
            xb, wb = x.bfloat16(), w.bfloat16()
            packed = mkldnn_packed(wb)
            fns = [lambda: F.linear(x, w), lambda: F.linear(xb, wb)]
            if packed is not None:
                fns.append(lambda: packed_linear(xb, packed))
            flops = 2 * M * out * inp
            rates = [flops / s / 1e9 for s in best_seconds(fns)]
            r32, r16 = rates[:2]
            pk = f"{rates[2]:.0f} | {rates[2] / r16:.2f}x" if packed is not None else "- | -"
            print(f"| {M} | {out} x {inp} | {r32:.0f} | {r16:.0f} | {r16 / r32:.1f}x | {pk} |", flush=True)


if __name__ == "__main__":
    main()

"""float32 vs bf16 matrix-product rates on this machine at SmolLM2's projection shapes (why the fast backend's
difference products pay on CPUs with AVX512-BF16 / AMX).

    python bench/matmul_rates.py

M = 9 x 128, 8 x 128 and 8 x 512 token rows (a perturbation batch at L = 128 and 512); each product timed over 20
calls after two warm-ups, torch's own thread count.
"""
import time

import torch
import torch.nn.functional as F


def mean_seconds(fn, repeats: int = 20) -> float:
    fn(), fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print("| M | out x in | float32 GFLOP/s | bf16 GFLOP/s | ratio |")
    print("|---|---|---|---|---|")
    for M in (9 * 128, 8 * 128, 8 * 512):
        for out, inp in ((1536, 576), (576, 1536), (576, 576), (192, 576)):
            x, w = torch.randn(M, inp), torch.randn(out, inp)
            xb, wb = x.bfloat16(), w.bfloat16()
            flops = 2 * M * out * inp
            r32 = flops / mean_seconds(lambda: F.linear(x, w)) / 1e9
            r16 = flops / mean_seconds(lambda: F.linear(xb, wb)) / 1e9
            print(f"| {M} | {out} x {inp} | {r32:.0f} | {r16:.0f} | {r16 / r32:.1f}x |", flush=True)


if __name__ == "__main__":
    main()

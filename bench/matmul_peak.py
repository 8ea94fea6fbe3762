"""The machine's matmul peak: best sustained `torch.matmul` FLOP/s of large square matrices, per precision.

MFU divides a training step's model FLOPs per second by this figure, so it must be taken on the same
machine, at the same torch thread count and in the same run as the training it judges (a datasheet
peak would flatter nothing and explain nothing on a shared CPU). For each size, a few trials each
multiply the same pair of n x n matrices for at least `trial_seconds`; 2·n³ FLOPs per product. The
best trial is the peak: load from other processes only ever slows a trial down. FLOPs per CPU
second (the process's CPU time, all threads) are kept beside it: at one thread that figure does not
depend on how often the process was descheduled, so a loaded machine still gives the peak per core.

On a GPU (`--device cuda`) the products are queued: the clock is read only after
`torch.cuda.synchronize()`, every `GPU_PRODUCTS_PER_CHECK` products, so a trial times finished work
and not the launch queue. The matrices are random (all-zero inputs draw less power and run faster
than real data), 8192-square by default there. There is no per-CPU-second figure on a GPU: the host
only waits.

Run it in the process environment of the measured arms (same OMP_NUM_THREADS, same visible GPU):
    python bench/matmul_peak.py --precisions fp32,bf16        # prints JSON, ~10 s
    python bench/matmul_peak.py --device cuda --precisions bf16
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_SIZES = {"cpu": (1024, 2048), "cuda": (8192,)}
GPU_PRODUCTS_PER_CHECK = 8
"""Products queued between clock readings on a GPU: enough 2·8192³-FLOP products that one synchronize
is small beside them, few enough that a trial ends close to `trial_seconds`."""


def measure_peak(
    precision: str,
    sizes: tuple[int, ...] = DEFAULT_SIZES["cpu"],
    trials: int = 3,
    trial_seconds: float = 0.5,
    device: str = "cpu",
) -> dict[str, float | int | str]:
    """Best FLOP/s (wall) of n x n @ n x n over `trials` trials per size, the size that reached it, and
    (on CPU) the best FLOPs per CPU second."""
    on_gpu = device != "cpu"
    synchronize = torch.cuda.synchronize if on_gpu else (lambda: None)
    per_check = GPU_PRODUCTS_PER_CHECK if on_gpu else 1
    best: dict[str, float | int | str] = {"precision": precision, "device": device, "flops_per_s": 0.0}
    if not on_gpu:
        best["flops_per_cpu_s"] = 0.0
    for size in sizes:
        generator = torch.Generator().manual_seed(size)
        a = torch.randn(size, size, generator=generator).to(device=device, dtype=DTYPES[precision])
        b = torch.randn(size, size, generator=generator).to(device=device, dtype=DTYPES[precision])
        out = torch.empty(size, size, dtype=DTYPES[precision], device=device)
        torch.matmul(a, b, out=out)  # warm-up: kernel selection, page faults of `out`
        synchronize()
        for _ in range(trials):
            products, started, cpu_started = 0, time.perf_counter(), time.process_time()
            while (elapsed := time.perf_counter() - started) < trial_seconds or products == 0:
                for _ in range(per_check):
                    torch.matmul(a, b, out=out)
                synchronize()
                products += per_check
            flops = 2 * size**3 * products
            if flops / elapsed > float(best["flops_per_s"]):
                best.update(flops_per_s=flops / elapsed, size=size)
            if not on_gpu:
                cpu_seconds = time.process_time() - cpu_started
                best["flops_per_cpu_s"] = max(float(best["flops_per_cpu_s"]), flops / cpu_seconds)
    best["torch_threads"] = torch.get_num_threads()
    best["load_average_1min"] = os.getloadavg()[0]
    if on_gpu:
        best["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default="fp32", help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to multiply")
    parser.add_argument(
        "--sizes", help="matrix sizes n to try (comma-separated; default 1024,2048 on CPU, 8192 on a GPU)"
    )
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--trial-seconds", type=float, default=0.5)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    sizes = tuple(int(n) for n in args.sizes.split(",")) if args.sizes else DEFAULT_SIZES[args.device]
    peaks = {
        precision: measure_peak(precision, sizes, args.trials, args.trial_seconds, args.device)
        for precision in args.precisions.split(",")
    }
    print(json.dumps(peaks))


if __name__ == "__main__":
    main()

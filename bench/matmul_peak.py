"""The machine's matmul peak: best sustained `torch.matmul` FLOP/s of large square matrices, per precision.

MFU divides a training step's model FLOPs per second by this figure, so it must be taken on the same
machine, at the same torch thread count and in the same run as the training it judges (a datasheet
peak would flatter nothing and explain nothing on a shared CPU). For each size, a few trials each
multiply the same pair of n x n matrices for at least `trial_seconds`; 2·n³ FLOPs per product. The
best trial is the peak: load from other processes only ever slows a trial down. FLOPs per CPU
second (the process's CPU time, all threads) are kept beside it: at one thread that figure does not
depend on how often the process was descheduled, so a loaded machine still gives the peak per core.

Run it in the process environment of the measured arms (same OMP_NUM_THREADS):
    python bench/matmul_peak.py --precisions fp32,bf16        # prints JSON, ~10 s
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure_peak(
    precision: str, sizes: tuple[int, ...] = (1024, 2048), trials: int = 3, trial_seconds: float = 0.5
) -> dict[str, float | int | str]:
    """Best FLOP/s (wall) of n x n @ n x n over `trials` trials per size, the size that reached it, and
    the best FLOPs per CPU second."""
    best: dict[str, float | int | str] = {"precision": precision, "flops_per_s": 0.0, "flops_per_cpu_s": 0.0}
    for size in sizes:
        generator = torch.Generator().manual_seed(size)
        a = torch.randn(size, size, generator=generator).to(DTYPES[precision])
        b = torch.randn(size, size, generator=generator).to(DTYPES[precision])
        out = torch.empty(size, size, dtype=DTYPES[precision])
        torch.matmul(a, b, out=out)  # warm-up: kernel selection, page faults of `out`
        for _ in range(trials):
            products, started, cpu_started = 0, time.perf_counter(), time.process_time()
            while (elapsed := time.perf_counter() - started) < trial_seconds or products == 0:
                torch.matmul(a, b, out=out)
                products += 1
            flops = 2 * size**3 * products
            if flops / elapsed > float(best["flops_per_s"]):
                best.update(flops_per_s=flops / elapsed, size=size)
            cpu_seconds = time.process_time() - cpu_started
            best["flops_per_cpu_s"] = max(float(best["flops_per_cpu_s"]), flops / cpu_seconds)
    best["torch_threads"] = torch.get_num_threads()
    best["load_average_1min"] = os.getloadavg()[0]
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default="fp32", help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--sizes", default="1024,2048", help="matrix sizes n to try (comma-separated)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--trial-seconds", type=float, default=0.5)
    args = parser.parse_args(argv)
    sizes = tuple(int(n) for n in args.sizes.split(","))
    peaks = {
        precision: measure_peak(precision, sizes, args.trials, args.trial_seconds)
        for precision in args.precisions.split(",")
    }
    print(json.dumps(peaks))


if __name__ == "__main__":
    main()

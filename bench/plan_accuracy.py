"""`finetune plan --device cpu` against the peak RSS of `finetune train` as the tokens per micro-batch grow.

The plan counts tensors. On the CPU, glibc's allocator keeps the memory freed tensors leave in its heap for reuse
(after the first large block is freed it stops returning blocks under 32 MiB to the system), so a run's resident
memory can exceed the tensors alive at its peak, more so the more tokens a micro-batch holds. Each setting is
trained twice: as it runs by default, and with `MALLOC_MMAP_THRESHOLD_=65536` (every block over 64 KiB mapped on
its own and returned when freed), which shows the tensors' own peak and what the default's reuse is worth in speed.

The base is a random 56M-parameter Llama (hidden 512, 8 layers, vocabulary 32,000, float32), the data one long
text split into rows of 256 tokens, LoRA r=16 on the attention projections (the recipe default), 3 steps.

Example:
    PYTHONPATH=. python bench/plan_accuracy.py              # ~4 minutes on 2 cores
    PYTHONPATH=. python bench/plan_accuracy.py --micro-batch-sizes 4 16 --json /tmp/plan_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import build_base, run_measured

SEQ_LEN = 256
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def write_recipe(work: Path, base: Path, micro_batch_size: int) -> Path:
    words = " ".join(f"word{i % 997} and the next {i % 13}" for i in range(40_000))
    (work / "train.jsonl").write_text("".join(json.dumps({"text": words}) + "\n" for _ in range(4)))
    recipe = work / f"mb{micro_batch_size}.yaml"
    recipe.write_text(f"""
model: {{base: {base}, dtype: float32}}
data: {{train: {work / "train.jsonl"}, format: text, max_seq_len: {SEQ_LEN}}}
train: {{max_steps: 3, micro_batch_size: {micro_batch_size}, precision: fp32, report_to: [], log_every_steps: 3}}
output: {{name: mb{micro_batch_size}, dir: {work / "adapter"}, run_dir: {work / "run"}, report: false, overwrite: true}}
""")  # fmt: skip
    return recipe


def planned_bytes(recipe: Path) -> int:
    command = [sys.executable, "-m", "finetune", "plan", str(recipe), "--device", "cpu", "--json"]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)["peak_bytes"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = build_base(work / "base", hidden=512, layers=8, intermediate=1408, heads=8)
        print(f"{'tokens':>7} {'planned MiB':>12} {'peak RSS MiB':>13} {'ratio':>6} {'s':>5} | "
              f"{'mmap RSS MiB':>13} {'ratio':>6} {'s':>5}")  # fmt: skip
        for micro_batch_size in args.micro_batch_sizes:
            recipe = write_recipe(work, base, micro_batch_size)
            plan = planned_bytes(recipe)
            command = [sys.executable, "-m", "finetune", "train", str(recipe)]
            default = run_measured(command, env=dict(os.environ))
            mapped = run_measured(command, env={**os.environ, **MMAP_ENV})
            row = {"tokens": micro_batch_size * SEQ_LEN, "planned": plan, "default": default, "mmap": mapped}
            rows.append({k: v if not isinstance(v, dict) else {"peak_rss": v["peak_rss"], "seconds": v["seconds"]}
                         for k, v in row.items()})  # fmt: skip
            print(f"{row['tokens']:>7} {plan / 2**20:>12.0f} {default['peak_rss'] / 2**20:>13.0f} "
                  f"{default['peak_rss'] / plan:>6.2f} {default['seconds']:>5.1f} | {mapped['peak_rss'] / 2**20:>13.0f} "
                  f"{mapped['peak_rss'] / plan:>6.2f} {mapped['seconds']:>5.1f}", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Scale-out on this machine: one process, 2 DDP ranks, 2 FSDP ranks (and 2 DeepSpeed ZeRO-3 ranks).

Every arm runs `finetune train` as a user does (`--nproc 2 distributed.strategy=...` for the ranks) on the
same random-init Llama (built here from a config, vocabulary 32,000), the same LoRA (r=16, all-linear,
no dropout), the same instruction records and the same documents per optimizer step: one process takes
2 x `--micro-batch` documents per step, each of 2 ranks `--micro-batch` of them (the sampler deals the
very same documents out to the ranks, so all arms learn the same thing). The arms run one after the
other; on a 2-core machine, 2 ranks get 1 thread each and one process gets both.

Reported per arm, from the adapter's manifest: real tokens per second of the training steps (tokens seen
/ seconds from the first step to the last; setup and evaluation excluded), the held-out loss (the same
validation records for all, computed by `finetune` in the same way), the peak memory of each rank (resident
host memory on CPU, `max_memory_allocated` on a GPU) and the largest share of the parameters a rank held.

What to expect: on CPU ranks of one machine, DDP and FSDP do not make training faster (the ranks share
the same cores and memory bandwidth, and gloo's collectives copy through host memory); what FSDP buys is
the per-rank share of the weights. On GPUs, see the README's "Scaling out" section.

Example:
    python bench/scale_out.py                       # ~4 min on 2 idle cores
    python bench/scale_out.py --deepspeed --json /tmp/scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_base, versions

REPO = Path(__file__).resolve().parents[1]

RECIPE = """
model:
  base: {base}
lora:
  r: 16
  alpha: 32
  dropout: 0.0
data:
  train: train.jsonl
  validation: valid.jsonl
  format: instruction
  max_seq_len: {seq_len}
train:
  max_steps: {steps}
  micro_batch_size: {micro_batch}
  lr: 1.0e-3
  schedule: constant
  log_every_steps: 1
  report_to: []
output:
  name: unnamed
  report: false
"""


def write_data(workdir: Path, seed: int = 0) -> None:
    """Instruction records of varied length (a few to a few hundred tokens), 256 to train, 32 held out."""
    rng = random.Random(seed)
    words = "the adapter learns a low rank update of each frozen weight for the domain at hand".split()
    records = []
    for i in range(288):
        body = " ".join(rng.choice(words) for _ in range(rng.randint(10, 180)))
        records.append({"instruction": f"Summarise note {i}.", "input": body, "output": body[: len(body) // 3]})
    (workdir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:256]))
    (workdir / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[256:]))


def run_arm(workdir: Path, name: str, args: list[str]) -> dict:
    """One `finetune train` run as a subprocess; its manifest's figures."""
    command = [sys.executable, "-m", "finetune", "train", "recipe.yaml", f"output.name={name}", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    manifest = json.loads((workdir / "adapters" / name / "manifest.json").read_text())
    metrics = manifest["metrics"]
    return {
        "arm": name,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "train_seconds": round(metrics["elapsed_s"], 2),
        "tokens_per_second": round(metrics["tokens_seen"] / metrics["elapsed_s"], 1),
        "eval_loss": round(metrics["eval_loss"], 5),
        "peak_memory_mib_per_rank": [round(b / 2**20) for b in metrics["peak_memory_bytes_per_rank"]],
        "max_rank_param_share": round(manifest["distributed"]["max_rank_param_share"], 3),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--deepspeed", action="store_true", help="also 2 DeepSpeed ZeRO-3 ranks")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/finetune-bench-scale"))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    shape = f"h{args.hidden}-l{args.layers}-i{args.intermediate}"
    base = build_base(
        args.scratch / f"llama-{shape}", hidden=args.hidden, layers=args.layers, intermediate=args.intermediate
    )
    workdir = args.scratch / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    write_data(workdir)
    (workdir / "recipe.yaml").write_text(
        RECIPE.format(base=base, seq_len=args.seq_len, steps=args.steps, micro_batch=args.micro_batch)
    )
    arms = [
        ("one-process", [f"train.micro_batch_size={2 * args.micro_batch}"]),
        ("ddp-2", ["--nproc", "2"]),
        ("fsdp-2", ["--nproc", "2", "distributed.strategy=fsdp"]),
    ]
    if args.deepspeed:
        arms.append(("zero3-2", ["--nproc", "2", "distributed.strategy=deepspeed"]))
    print(versions(), flush=True)
    rows = []
    for name, extra in arms:
        rows.append(run_arm(workdir, name, extra + ["output.overwrite=true"]))
        print(json.dumps(rows[-1]), flush=True)
    single = rows[0]["tokens_per_second"]
    print("\n| arm | tokens/s | vs one process | held-out loss | peak memory per rank (MiB) | max param share |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['arm']} | {row['tokens_per_second']:.0f} | {row['tokens_per_second'] / single:.2f}x | "
            f"{row['eval_loss']:.4f} | {' / '.join(map(str, row['peak_memory_mib_per_rank']))} | "
            f"{row['max_rank_param_share']:.3f} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"versions": versions(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

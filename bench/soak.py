"""Soak: does a long run keep its memory flat? Not a test: `python bench/soak.py [--steps 2000]`.

Trains a LoRA on a tiny locally built Llama for `--steps` optimizer steps with an evaluation and a
checkpoint every `--every` steps, samples this process's resident memory after every step (through the
`on_step` callback), and prints the growth after warm-up (the first 10% of the run): a leak of a few
kilobytes per step shows up as tens of megabytes over 2,000 steps.

Example:
    python bench/soak.py --steps 2000 --every 50
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def rss_mib() -> float:
    with open("/proc/self/status") as handle:
        return int(next(line for line in handle if line.startswith("VmRSS:")).split()[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=50)
    args = parser.parse_args()

    from helpers import TEST_SHAPE, instruction_records, tokenizer_corpus

    from finetune.embedded.tiny import build_tiny_llama
    from finetune.embedded.tokenizer import train_tokenizer
    from finetune.training.loop import train

    work = Path(tempfile.mkdtemp(prefix="soak-"))
    os.environ["FINETUNE_HOME"] = str(work / "home")
    os.environ["HF_DATASETS_CACHE"] = str(work / "datasets")
    tokenizer = train_tokenizer(tokenizer_corpus(), vocab_size=512, max_model_len=512)
    build_tiny_llama(tokenizer, seed=0, **TEST_SHAPE).save_pretrained(work / "base")
    tokenizer.save_pretrained(work / "base")
    records = instruction_records(240)
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:200]))
    (work / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[200:]))
    recipe = {
        "model": {"base": str(work / "base")},
        "lora": {"r": 4, "alpha": 8},
        "data": {"train": str(work / "train.jsonl"), "validation": str(work / "valid.jsonl"), "format": "instruction"},
        "train": {"max_steps": args.steps, "micro_batch_size": 4, "lr": 1e-3, "log_every_steps": 10_000,
                  "eval_every_steps": args.every, "save_every_steps": args.every},
        "output": {"name": "soak", "dir": str(work / "adapter"), "run_dir": str(work / "run")},
    }  # fmt: skip
    from finetune.recipe import recipe_from_dict

    samples: dict[int, float] = {}
    started = time.perf_counter()
    train(recipe_from_dict(recipe), log=lambda m: None, on_step=lambda step, _: samples.__setitem__(step, rss_mib()))
    warm_step = max(1, args.steps // 10)
    warm, last, peak = samples[warm_step], samples[args.steps], max(samples.values())
    print(
        f"soak: {args.steps} steps, evaluation and checkpoint every {args.every}, {time.perf_counter() - started:.0f} s; "
        f"RSS at step {warm_step} {warm:.0f} MiB, at the end {last:.0f} MiB ({100 * (last / warm - 1):+.1f}%), "
        f"peak after warm-up {max(v for s, v in samples.items() if s >= warm_step):.0f} MiB "
        f"({100 * (peak / warm - 1):+.1f}%)"
    )


if __name__ == "__main__":
    main()

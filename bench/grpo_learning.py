"""Does GRPO learn? finetune's `train.objective: grpo` against trl's GRPOTrainer from the same adapter.

Both sides start from `--init` (a PEFT adapter, e.g. a short quickstart SFT run), train on the same prompt
records with the same reward function (`FILE:FUNCTION`, as trl calls it), `--prompts-per-step` prompts x
`--generations` completions of at most `--tokens` tokens per optimizer step, sampled at `--temperature`
among the `--top-k` likeliest tokens (0: all), `--steps` steps at learning rate `--lr` (trl's linear
decay, no warm-up, on both sides). Then one evaluator, plain transformers + peft (bench/grpo_rewards.py),
samples the held-out prompts of `--valid` `--samples` times each (seeded, at the training's temperature and
top-k) and once greedily, for the starting adapter and both results. The figure is the rise in mean
sampled reward over the start.

Example (the GRPO quickstart's task from a 30-step quickstart SFT adapter):
    finetune train quickstart train.max_steps=30 output.dir=/tmp/qs30
    python bench/grpo_learning.py --init /tmp/qs30 --steps 60 --lr 5e-4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from grpo_rewards import base_of, load_function, mean_rewards

REPO = Path(__file__).resolve().parents[1]


def train_ours(args: argparse.Namespace, out: Path) -> float:
    command = [
        sys.executable, "-m", "finetune", "train", str(REPO / "recipes" / "quickstart-grpo.yaml"),
        f"lora.init_from={args.init}", f"data.train={args.train}", f"data.validation={args.valid}",
        f"train.reward_functions=[{args.reward}]", f"train.num_generations={args.generations}",
        f"train.max_completion_length={args.tokens}", f"train.micro_batch_size={args.prompts_per_step}",
        f"train.lr={args.lr}", f"train.max_steps={args.steps}", "train.schedule=linear", "train.eval_max_batches=1",
        f"train.temperature={args.temperature}", f"train.top_k={args.top_k}",
        f"train.seed={args.seed}", f"output.dir={out}", "train.report_to=[]",
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    return time.perf_counter() - started


def train_trl(args: argparse.Namespace, out: Path) -> float:
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    base = base_of(Path(args.init))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), args.init, is_trainable=True)
    records = [json.loads(line) for line in Path(args.train).read_text().splitlines()]
    config = GRPOConfig(
        output_dir=str(out / "work"), per_device_train_batch_size=args.prompts_per_step * args.generations,
        num_generations=args.generations, max_completion_length=args.tokens, max_steps=args.steps,
        learning_rate=args.lr, temperature=args.temperature, top_k=args.top_k, report_to=[], use_cpu=True,
        bf16=False, logging_steps=10,
        save_strategy="no", seed=args.seed,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=[load_function(args.reward)], args=config,
                          train_dataset=Dataset.from_list(records),
                          processing_class=AutoTokenizer.from_pretrained(base))  # fmt: skip
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    trainer.model.save_pretrained(out)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init", required=True, help="the adapter both sides start from")
    parser.add_argument("--train", default=str(REPO / "data/quickstart-grpo/train.jsonl"))
    parser.add_argument("--valid", default=str(REPO / "data/quickstart-grpo/valid.jsonl"))
    parser.add_argument("--reward", default=str(REPO / "data/quickstart-grpo/reward.py") + ":bulletin_reward")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--samples", type=int, default=8, help="held-out samples per prompt")
    parser.add_argument("--limit", type=int, default=40, help="held-out prompts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["finetune", "trl"])
    parser.add_argument("--out", help="keep the trained adapters here (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.out or scratch)
        adapters, seconds = {"start": Path(args.init)}, {}
        for side, train in (("finetune", train_ours), ("trl", train_trl)):
            if args.only in (None, side):
                adapters[side] = work / side
                seconds[side] = train(args, adapters[side])
        results = evaluate(args, adapters)
    for side, (sampled, greedy) in results.items():
        took = f", trained in {seconds[side]:.0f} s" if side in seconds else ""
        rise = f" (rise {sampled - results['start'][0]:+.3f})" if side != "start" else ""
        print(f"{side}: held-out sampled reward {sampled:.3f}{rise}, greedy {greedy:.3f}{took}")


def evaluate(args: argparse.Namespace, adapters: dict[str, Path]) -> dict[str, tuple[float, float]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    records = [json.loads(line) for line in Path(args.valid).read_text().splitlines()][: args.limit]
    reward = load_function(args.reward)
    settings = argparse.Namespace(
        samples=args.samples, temperature=args.temperature, top_k=args.top_k, max_new_tokens=args.tokens, seed=args.seed
    )
    base = base_of(adapters["start"])
    tokenizer = AutoTokenizer.from_pretrained(base)
    results = {}
    for side, adapter in adapters.items():
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
        results[side] = mean_rewards(model, tokenizer, records, reward, settings)
    return results


if __name__ == "__main__":
    main()

"""Time a GRPO step: finetune's (`train.objective: grpo`) against trl's GRPOTrainer at the same settings.

Both train a LoRA (r 16 on every linear layer of the blocks) on the embedded base, one prompt per step with
`--generations` completions of at most `--tokens` tokens sampled at temperature 1, the reward the negative
completion length in characters / 100, `--steps` steps after one warm-up step. Printed per side: seconds per
step (the median of the timed steps), completion tokens per step, and for finetune the split between
generation, the reward functions and the update, from its metrics. Then what predicts generation's time on a
GPU, per generated token of the same 8 x 32 greedy tokens: aten ops (each at least one kernel launch) and
host-syncing ops, for finetune's sampler and for transformers' `generate` on the same peft model (what trl's
GRPOTrainer samples with).

Example:
    python bench/grpo_step.py --steps 5 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout: `python bench/grpo_step.py`
    sys.path.insert(0, str(REPO))
PROMPTS = [
    {"prompt": f"### Instruction:\nWrite the weather bulletin for Town{i}.\n\n### Response:\n"} for i in range(64)
]
REWARD = "def short(prompts, completions, **kwargs):\n    return [-len(c) / 100 for c in completions]\n"


def ours(work: Path, args: argparse.Namespace) -> dict[str, float]:
    from finetune.training.loop import train

    (work / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    (work / "reward.py").write_text(REWARD)
    steps: list[dict[str, float]] = []
    overrides = [
        "model.base=embedded:tiny-llama", "data.train=prompts.jsonl", "data.format=prompt", "train.objective=grpo",
        "train.reward_functions=[reward.py:short]", f"train.num_generations={args.generations}",
        f"train.max_completion_length={args.tokens}", "train.micro_batch_size=1", f"train.max_steps={args.steps + 1}",
        "train.lr=1e-4", "lora.r=16", "lora.alpha=32", "lora.dropout=0", "output.name=bench-grpo",
        "output.overwrite=true", "train.report_to=[]", "train.save_every_steps=1000",
    ]  # fmt: skip
    recipe = work / "recipe.yaml"
    recipe.write_text("data:\n  train: prompts.jsonl\noutput:\n  name: bench-grpo\n")
    train(recipe, overrides, log=lambda message: None, on_step=lambda step, metrics: steps.append(dict(metrics)))
    timed = steps[1:]
    return {
        "step_s": statistics.median(m["step_s"] for m in timed),
        "generate_s": statistics.median(m["generate_s"] for m in timed),
        "reward_s": statistics.median(m["reward_s"] for m in timed),
        "tokens": statistics.fmean(m["completion_length"] for m in timed) * args.generations,
    }


def trls(work: Path, args: argparse.Namespace) -> dict[str, float]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from finetune.embedded.cache import resolve_base_id

    base = resolve_base_id("embedded:tiny-llama")
    namespace: dict = {}
    exec(REWARD, namespace)
    times: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.started)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    config = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=args.generations, num_generations=args.generations,
        max_completion_length=args.tokens, max_steps=args.steps + 1, learning_rate=1e-4, temperature=1.0,
        report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no",
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(base),
        reward_funcs=[namespace["short"]],
        args=config,
        train_dataset=Dataset.from_list(PROMPTS),
        processing_class=AutoTokenizer.from_pretrained(base),
        peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"),
        callbacks=[Clock()],
    )
    trainer.train()
    return {"step_s": statistics.median(times[1:]), "tokens": statistics.fmean(lengths[1:]) * args.generations}


def host_work(args: argparse.Namespace, tokens: int = 32) -> dict[str, dict[str, float]]:
    """Aten ops and host-syncing ops per generated token: finetune's `sample_completions` and transformers'
    `generate`, greedy, on the embedded base with the bench's LoRA (B drawn as if trained), 8 rows of one prompt."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.host_work import OpCounter
    from finetune.embedded.cache import resolve_base_id
    from finetune.generation.sample import SampleSettings, sample_completions
    from finetune.training.host_sync import HostSyncDetector

    base = resolve_base_id("embedded:tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(base)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora).eval()
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(0, 0.02)
    prompt = tokenizer(PROMPTS[0]["prompt"])["input_ids"]
    settings = SampleSettings(max_new_tokens=tokens, temperature=0.0)

    def ours() -> None:
        sample_completions(model, [prompt] * args.generations, settings, stop_ids=set(), pad_token_id=0)

    def theirs() -> None:
        ids = torch.tensor([prompt] * args.generations)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                           min_new_tokens=tokens, do_sample=False, pad_token_id=0)  # fmt: skip

    result = {}
    for name, generate in (("finetune", ours), ("transformers generate", theirs)):
        with OpCounter() as ops, HostSyncDetector() as syncs:
            generate()
        result[name] = {"aten_ops_per_token": ops.count / tokens, "host_syncs_per_token": len(syncs.found) / tokens}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=["finetune", "trl"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        os.chdir(work)
        results = {}
        if args.only != "trl":
            results["finetune"] = ours(work, args)
        if args.only != "finetune":
            results["trl"] = trls(work, args)
    for name, result in results.items():
        print(f"{name}: {json.dumps({k: round(v, 3) for k, v in result.items()})}", file=sys.stdout)
    if len(results) == 2:
        print(f"finetune is {results['trl']['step_s'] / results['finetune']['step_s']:.2f}x trl's speed per step")
    os.chdir(REPO)  # the scratch directory is gone
    for name, figures in host_work(args).items():
        print(f"{name} sampling, per token: {json.dumps({k: round(v, 2) for k, v in figures.items()})}")


if __name__ == "__main__":
    main()

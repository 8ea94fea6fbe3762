"""How close LoRA comes to full fine-tuning on a recipe (the quickstart's by default): held-out perplexity
after the same steps.

Every arm runs the recipe through `finetune`'s own setup and loop (`training.run.start_run`,
`train.run_steps`): the same base, documents, batches, schedule, steps and held-out evaluation.
The arms differ only in what trains:

- `lora-blocks`: LoRA on every linear layer of the blocks (the quickstart: on the copying base the head
  adds nothing, see `recipes/quickstart.yaml`);
- `lora+head`: the same plus LoRA on the output head (`lora.train_lm_head: true`);
- `lora+head+embeddings`: plus LoRA on the input embeddings (`lora.train_embed_tokens: true`);
- `full`: every weight of the base, LoRA frozen at B = 0 (so it adds exactly nothing), at each of
  `--full-lrs`; the best is the reference.

"gain kept" is (base eval loss - arm's) / (base eval loss - full fine-tuning's): the share of full
fine-tuning's improvement an arm reaches.

Run from the repository root (the recipes' data paths are relative to it):
    python bench/learning_quality.py                  # ~6 min on 2 cores
    python bench/learning_quality.py --steps 30       # a quick look
    python bench/learning_quality.py --recipe recipes/tiny-llama-continued-pretraining.yaml train.embedding_lr=1e-2
It prints a Markdown table and writes bench/results/learning_quality.json (the quickstart's) or
bench/results/learning_quality-<recipe>.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from finetune.recipe import load_recipe
from finetune.training.interrupt import graceful_stop
from finetune.training.loop import run_steps
from finetune.training.run import make_optimizer, make_scheduler, start_run

RESULTS = Path(__file__).parent / "results" / "learning_quality.json"
QUICKSTART = "recipes/quickstart.yaml"
LORA_ARMS = {
    # no head or embedding LoRA, so no rate of its own (a recipe's `train.embedding_lr` would be refused)
    "lora-blocks": ["lora.train_lm_head=false", "lora.train_embed_tokens=false", "train.embedding_lr=null"],
    "lora+head": ["lora.train_lm_head=true", "lora.train_embed_tokens=false"],
    "lora+head+embeddings": ["lora.train_lm_head=true", "lora.train_embed_tokens=true"],
}


def _quiet(message: str) -> None:
    pass


def run_arm(recipe_path: str, overrides: list[str], scratch: Path, *, full_lr: float | None = None) -> dict:
    """One training run of the recipe with `overrides`; full fine-tuning when `full_lr` is given."""
    recipe = load_recipe(recipe_path, [*overrides, f"output.run_dir={scratch}/run", "output.report=false"])
    started = time.perf_counter()
    run = start_run(recipe, resume=False, say=_quiet)
    trainable = sum(p.numel() for p in run.trainable_parameters)
    if full_lr is not None:
        _switch_to_full_fine_tuning(run, full_lr)
        trainable = sum(p.numel() for p in run.trainable_parameters)
    with graceful_stop(_quiet) as stop:
        run_steps(run, stop, lambda step, metrics: None)
    final = run.evaluate()
    return {
        "base_eval_loss": run.base_eval["eval_loss"],
        "eval_loss": final["eval_loss"],
        "eval_ppl": final["eval_ppl"],
        "trainable_parameters": trainable,
        "seconds": time.perf_counter() - started,
    }


def _switch_to_full_fine_tuning(run, lr: float) -> None:
    """Train the base's own weights instead of the LoRA ones (frozen with B = 0, they add exactly nothing)."""
    base_parameters = []
    for name, parameter in run.peft_model.named_parameters():
        is_lora = ".lora_" in name
        parameter.requires_grad_(not is_lora)
        if not is_lora:
            base_parameters.append(parameter)
    assert all(p.abs().max() == 0 for n, p in run.peft_model.named_parameters() if ".lora_B" in n)
    run.trainable_parameters = base_parameters
    run.optimizer = make_optimizer(run.recipe, [{"params": base_parameters, "lr": lr}])
    run.scheduler = make_scheduler(run.recipe, run.optimizer, run.length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=QUICKSTART, help=f"the recipe every arm runs (default {QUICKSTART})")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's)")
    parser.add_argument("--full-lrs", default="1e-3,3e-3,1e-2", help="learning rates tried for full fine-tuning")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides for every arm")
    args = parser.parse_args()
    common = [*args.overrides, *([f"train.max_steps={args.steps}"] if args.steps else [])]  # every arm's
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="finetune-quality-") as scratch:
        for name, overrides in LORA_ARMS.items():
            results[name] = run_arm(args.recipe, [*common, *overrides], Path(scratch) / name)  # the arm decides
            print(f"{name}: {results[name]}", flush=True)
        for lr in (float(x) for x in args.full_lrs.split(",")):
            results[f"full lr={lr:g}"] = run_arm(args.recipe, common, Path(scratch) / f"full-{lr:g}", full_lr=lr)
            print(f"full lr={lr:g}: {results[f'full lr={lr:g}']}", flush=True)
    full = min((r for n, r in results.items() if n.startswith("full")), key=lambda r: r["eval_loss"])
    for result in results.values():
        result["gain_kept"] = (result["base_eval_loss"] - result["eval_loss"]) / (
            full["base_eval_loss"] - full["eval_loss"]
        )
    out = RESULTS if args.recipe == QUICKSTART else RESULTS.with_stem(f"{RESULTS.stem}-{Path(args.recipe).stem}")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print("\n| arm | trainable parameters | held-out perplexity | gain kept vs full | seconds |\n|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['trainable_parameters']:,} | {r['eval_ppl']:.3f} | {100 * r['gain_kept']:.1f}% | "
            f"{r['seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()

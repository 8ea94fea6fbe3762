"""What each training-step speed-up is worth: the same micro-batches, forward + backward, with and without it.

Two changes in `finetune` made a LoRA step cheaper; this script times the step with each turned off and on,
on the `python -m bench` training setting (a 19.2M-parameter Llama, vocabulary 32,000, untied head, LoRA
r=16 all-linear with dropout 0.05, micro-batches of 8 generated instruction records packed):

- `head`: the output layer runs only at the positions that predict a label (`finetune.scoring.forward_loss`),
  against all logits then cross-entropy with -100 ignored (`token_loss_sum` of the full logits);
- `dropout`: LoRA dropout drawn from 16 random bits per element (`finetune.model.UniformDropout`), against
  torch's `nn.Dropout` (peft's default).

Every variant computes the same loss on the same micro-batches (checked: the summed losses agree to 1e-4
relative with dropout off). The variants run interleaved, one micro-batch of each in turn, at one thread,
and CPU seconds are reported (a loaded machine inflates wall time, hardly CPU time at one thread); the
median over micro-batches and rounds is what the table gives.

Example:
    python bench/step_ablation.py                   # ~3 minutes on one core
    python bench/step_ablation.py --micro-batches 12 --rounds 3 --json /tmp/ablation.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_throughput  # bench/ is not a package: imported by path

VARIANTS = {  # name: (label-only head, uniform dropout)
    "before (all logits, nn.Dropout)": (False, False),
    "head only": (True, False),
    "dropout only": (False, True),
    "both (finetune now)": (True, True),
}


def prepare(workdir: Path, micro_batch_size: int, micro_batches: int) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """The `python -m bench` training model and data, and the packed micro-batches finetune would train on."""
    from finetune.data.collate import collate_batch
    from finetune.data.pipeline import build_datasets
    from finetune.data.sampler import MicroBatchStream
    from finetune.model import load_tokenizer
    from finetune.recipe import DataConfig

    _, settings = train_throughput.parse_arguments(  # the bench's own defaults for whatever is not said here
        ["--steps", str(micro_batches), "--grad-accum", "1", "--micro-batch-size", str(micro_batch_size),
         "--records", "80", "--validation-records", "8", "--seq-len", "512", "--vocab", "32000", "--hidden", "256",
         "--layers", "4", "--untied", "--warmup-steps", "0", "--lr", "1e-3", "--precision", "fp32", "--threads", "1",
         "--one-epoch", "--no-own-eval"]
    )  # fmt: skip
    spec = train_throughput.prepare(settings, workdir, "cpu")
    tokenizer = load_tokenizer(spec["base_dir"])
    data_config = DataConfig.model_validate(
        {"train": [spec["train_path"]], "format": "instruction", "prompt_template": train_throughput.PROMPT_TEMPLATE,
         "completion_only_loss": True, "max_seq_len": 512, "validation_split": 0}
    )  # fmt: skip
    data = build_datasets(data_config, tokenizer, seed=0)
    stream = MicroBatchStream(num_rows=len(data.train), micro_batch_size=micro_batch_size, seed=0)
    batches = [
        collate_batch([data.train[i] for i in stream.indices(k)], tokenizer.pad_token_id, packing=True)
        for k in range(micro_batches)
    ]
    return spec, batches


def make_model(base_dir: str, uniform_dropout: bool) -> torch.nn.Module:
    """The LoRA model as `finetune` wraps it, or (without `uniform_dropout`) as peft alone builds it from
    the same LoRA settings: the same weights either way, `nn.Dropout` in the latter."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.model import peft_lora_config, wrap_with_lora
    from finetune.recipe import LoraConfig

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="sdpa")
    lora = LoraConfig(r=16, alpha=32, dropout=0.05, target_modules="all-linear")
    model = wrap_with_lora(base, lora) if uniform_dropout else get_peft_model(base, peft_lora_config(lora, base))
    return model.train()


def step_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], label_only_head: bool) -> torch.Tensor:
    from finetune.scoring import forward_loss, token_loss_sum

    if label_only_head:
        return forward_loss(model, batch)[0]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return token_loss_sum(model(**inputs, use_cache=False).logits, batch["labels"])[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the micro-batches (first is warm-up)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="finetune-ablation-") as workdir:
        spec, batches = prepare(Path(workdir), args.micro_batch_size, args.micro_batches)
        models = {name: make_model(spec["base_dir"], dropout) for name, (_, dropout) in VARIANTS.items()}
        with torch.no_grad():  # same loss with dropout off, whichever head path
            for model in models.values():
                model.eval()
            losses = {name: float(step_loss(models[name], batches[0], head)) for name, (head, _) in VARIANTS.items()}
            for model in models.values():
                model.train()
        reference = losses["before (all logits, nn.Dropout)"]
        assert all(abs(loss - reference) <= 1e-4 * abs(reference) for loss in losses.values()), losses
        seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for round_number in range(args.rounds):
            for batch in batches:
                for name, (head, _) in VARIANTS.items():
                    start = time.process_time()
                    step_loss(models[name], batch, head).backward()
                    elapsed = time.process_time() - start
                    models[name].zero_grad(set_to_none=True)
                    if round_number > 0:
                        seconds[name].append(elapsed)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    before = medians["before (all logits, nn.Dropout)"]
    print(f"model: {spec['model']}; {args.micro_batches} packed micro-batches of {args.micro_batch_size} records")
    print("| variant | median CPU s per micro-batch | speed-up over before |\n|---|---|---|")
    for name, value in medians.items():
        print(f"| {name} | {value:.3f} | {before / value:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"model": spec["model"], "median_cpu_seconds": medians, "losses": losses}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

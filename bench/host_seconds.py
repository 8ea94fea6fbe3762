"""Host seconds per optimizer step at a GPU preset's depth: the floor the host alone puts under a GPU step.

On a GPU the host queues each operation's kernels while earlier ones run; a step cannot be shorter than the
host's time to queue it. `host_work.py` counts operations; this script times them, at the 8B QLoRA preset's
structure (32 decoder layers, LoRA r=16 on every linear layer, nf4 with double quantization and bf16 compute,
bf16 autocast, micro-batches of 2 rows, 4 per optimizer step) with every width shrunk (hidden 128, rows of 64
tokens), so that each kernel costs next to nothing on the CPU and what is timed is the dispatching: Python,
peft, bitsandbytes' wrappers, autograd, the optimizer. One thread; the median over the measured steps.

Arms: ours (`finetune.training.loop`'s device step, as `finetune train` runs it) and the HF Trainer + peft as
`host_work.py` runs it, each with every layer checkpointed (the preset) and with none (what
`gradient_checkpointing: auto` gives on a card with room). What it leaves out: bitsandbytes' CUDA wrappers
differ from its CPU ones, and a kernel launch costs more host time than a tiny CPU kernel; so the figures say
how the arms and settings compare and roughly how large the floor is, not a GPU's exact host time.

Example:
    PYTHONPATH=. python bench/host_seconds.py               # ~1 minute
    PYTHONPATH=. python bench/host_seconds.py --layers 32 --steps 4 --json /tmp/host_seconds.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.host_work import LORA, records, trainer_model

SHAPE = dict(hidden_size=128, intermediate_size=448, num_attention_heads=4, num_key_value_heads=1, head_dim=32)
"""Llama 3's 4:1 grouped-query heads, every 4-bit layer's out_features a multiple of 32 (bitsandbytes' CPU kernel)."""
MICRO_BATCH, GRAD_ACCUM, SEQ_LEN = 2, 4, 64


def ours(work: Path, base: Path, checkpointing: bool, steps: int, warmup: int) -> list[float]:
    from finetune.recipe import load_recipe
    from finetune.training.loop import PendingSteps, device_schedule, device_step, step_inputs
    from finetune.training.run import start_run

    length = steps + warmup + 1
    name = f"ours-{checkpointing}"
    (work / f"{name}.yaml").write_text(f"""
model: {{base: {base}, attn_implementation: sdpa, dtype: bfloat16, quantization: 4bit}}
lora: {{r: {LORA["r"]}, alpha: {LORA["alpha"]}, dropout: {LORA["dropout"]}, target_modules: all-linear}}
data: {{train: {work / "train.jsonl"}, format: instruction, max_seq_len: {SEQ_LEN}}}
train: {{max_steps: {length}, micro_batch_size: {MICRO_BATCH}, grad_accum_steps: {GRAD_ACCUM}, log_every_steps: {length},
         report_to: [], precision: bf16, gradient_checkpointing: {str(checkpointing).lower()}, compile: false}}
output: {{name: {name}, dir: {work / name}, run_dir: {work / f"run-{name}"}, report: false}}
""")  # fmt: skip
    run = start_run(load_recipe(work / f"{name}.yaml"), resume=False, say=lambda line: None)
    run.model_for_step.train()
    pending = PendingSteps(run, lambda step, metrics: None, device_schedule(run))
    seconds = []
    for _ in range(warmup + steps):
        started = time.perf_counter()
        pending.add(device_step(run, step_inputs(run, run.next_micro_batches()), pending.schedule), 0.0)
        seconds.append(time.perf_counter() - started)
    pending.read({})
    return seconds[warmup:]


def trainer(work: Path, base: Path, checkpointing: bool, steps: int, warmup: int) -> list[float]:
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    from finetune.data.pipeline import build_datasets
    from finetune.recipe import load_recipe

    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = build_datasets(load_recipe(work / "ours-True.yaml").data, tokenizer, seed=0).train  # the same documents
    model = trainer_model(base, qlora=True)
    model.config.use_cache = False
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], target_modules="all-linear",
                      task_type="CAUSAL_LM")  # fmt: skip
    seconds: list[float] = []
    started = [0.0]

    class Clock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            started[0] = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seconds.append(time.perf_counter() - started[0])

    arguments = TrainingArguments(
        output_dir=str(work / f"trainer-{checkpointing}"), per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=GRAD_ACCUM, max_steps=warmup + steps, learning_rate=1e-3, logging_steps=1000,
        save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, remove_unused_columns=False,
        disable_tqdm=True, bf16=True, gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )  # fmt: skip
    dataset = Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    Trainer(model=get_peft_model(model, lora), args=arguments, train_dataset=dataset, callbacks=[Clock()],
            data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)).train()  # fmt: skip
    return seconds[warmup:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (the 8B preset's 32)")
    parser.add_argument("--steps", type=int, default=4, help="measured optimizer steps per arm")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from finetune.embedded.tiny import build_tiny_llama
    from finetune.embedded.tokenizer import train_tokenizer

    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = records(400)
        (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
        tokenizer = train_tokenizer([r["instruction"] + " " + r["output"] for r in data], vocab_size=600)
        base = work / "base"
        build_tiny_llama(tokenizer, seed=0, num_hidden_layers=args.layers, **SHAPE).save_pretrained(base)
        tokenizer.save_pretrained(base)
        for checkpointing in (True, False):  # ours first: the Trainer reads ours' recipe for the same documents
            for arm, run in (("ours", ours), ("hf-trainer + peft", trainer)):
                seconds = run(work, base, checkpointing, args.steps, args.warmup_steps)
                key = f"{arm}, {'every layer' if checkpointing else 'no layer'} checkpointed"
                results[key] = statistics.median(seconds)
                print(f"{key:<48} {results[key]:.3f} s per optimizer step", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"layers": args.layers, "seconds_per_step": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

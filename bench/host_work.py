"""Host work per optimizer step: aten operations, host-syncing operations and distinct shapes, ours against
the HF Trainer + peft on the same micro-batches.

On a GPU every aten operation is at least one kernel launch queued by the host, and every host-syncing
operation (`.item()`, `nonzero`, boolean-mask indexing, a device-to-host copy) makes the host wait until the
device has run everything queued. A host-bound step (what the H100 measurement found) gets faster with fewer
of both, so they are counted here on the CPU, where the same operations are dispatched:

- `aten ops/step`: every aten operation dispatched from the start of one optimizer step to the next
  (forward, backward, clipping, optimizer, schedule, the Trainer's logging reads and ours' one read at the
  logging interval), counted by a `TorchDispatchMode`, averaged over the measured steps after warm-up steps.
  Collation is left out of both (host tensors: no kernel on a GPU): ours' `step_inputs`, the Trainer's collator;
- `syncs/step`: the operations `finetune.training.host_sync.HostSyncDetector` flags, over the same steps
  (ours: inside the steps; its one read per logging interval is given apart, `syncs_per_logging_read`);
- `shapes/epoch`: distinct (rows, columns) of the micro-batches of one epoch (ours also under `bucketed_rows`,
  the layout of varlen attention on CUDA: widths rounded up to a multiple of 128).

Dynamo refuses to compile under a user dispatch mode ("non-infra torch dispatch mode present"), so a second
count, `launches/step`, comes from torch.profiler over the same measured steps: the aten operations that call
no other plus the kernels inductor generated (`cpp.enable_kernel_profile`). It counts views and allocations
too (no kernel on a GPU) and is about 3.8x the dispatch count for the eager arms, so only its ratios between
arms mean something; inductor fuses for the CPU here, not as it would into Triton kernels on a GPU. It is taken for every arm, and for a third one, ours with `train.compile: true` (each
decoder layer compiled; the rows laid out in bucketed widths, as with varlen attention on CUDA, so the
warm-up steps compile every shape; the recompilations inside the measured steps are reported).

Both arms train LoRA r=16 on every linear layer (dropout 0.05) of the same tiny Llama, on the same documents
in the same micro-batches of 8: ours through `finetune.training.loop` (packed rows, chunked loss, fused AdamW),
the Trainer through `Trainer.train` with `DataCollatorForSeq2Seq` padding each micro-batch (its usual path).

Example:
    PYTHONPATH=. python bench/host_work.py --steps 6 --warmup-steps 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from finetune.training.host_sync import HostSyncDetector

MICRO_BATCH = 8
LORA = dict(r=16, alpha=32, dropout=0.05)
WORDS = "crate shelf amber violet teal ochre warehouse north south ledger parcel route depot count".split()


class OpCounter(TorchDispatchMode):
    """Counts every aten operation dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


class Meter:
    """Ops and syncs between marks; `per_step` averages the measured window."""

    def __init__(self) -> None:
        self.ops, self.syncs = OpCounter(), HostSyncDetector()
        self.marks: list[tuple[int, int]] = []

    def __enter__(self) -> Meter:
        self.syncs.__enter__()
        self.ops.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ops.__exit__(*exc)
        self.syncs.__exit__(*exc)

    def mark(self) -> None:
        self.marks.append((self.ops.count, len(self.syncs.found)))

    def per_step(self, warmup: int) -> tuple[float, float]:
        (ops0, syncs0), (ops1, syncs1) = self.marks[warmup], self.marks[-1]
        steps = len(self.marks) - 1 - warmup
        return (ops1 - ops0) / steps, (syncs1 - syncs0) / steps


class Launches:
    """torch.profiler over the measured steps: aten operations that call no other aten operation, plus the
    kernels inductor generated, per step (`start` after the warm-up steps, `stop` after the last)."""

    def __init__(self) -> None:
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True  # generated kernels appear as profiler events
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.count = 0

    def start(self) -> None:
        self.profiler.start()

    def stop(self, steps: int) -> float:
        self.profiler.stop()
        for event in self.profiler.events():
            if event.name.startswith("aten::"):
                self.count += not any(child.name.startswith("aten::") for child in event.cpu_children)
            elif "cpp_fused" in event.name:
                self.count += 1
        return self.count / steps


def records(count: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    for index in range(count):
        out.append({"instruction": f"Where is crate {index}? {words(rng.randint(3, 20))}",
                    "input": "", "output": words(rng.randint(5, 60))})  # fmt: skip
    return out


def build_base(workdir: Path, data: list[dict[str, str]]) -> Path:
    from finetune.embedded.tiny import build_tiny_llama
    from finetune.embedded.tokenizer import train_tokenizer

    tokenizer = train_tokenizer([r["instruction"] + " " + r["output"] for r in data], vocab_size=600)
    base = workdir / "base"
    build_tiny_llama(tokenizer, seed=0).save_pretrained(base)
    tokenizer.save_pretrained(base)
    return base


QLORA_MODEL = "dtype: bfloat16, quantization: 4bit"
QLORA_TRAIN = "precision: bf16, gradient_checkpointing: true"
"""`--qlora`: both arms on the 8B GPU preset's settings, shrunk: a bf16 base quantized to nf4 (double
quantization, bf16 compute), bf16 autocast, every layer checkpointed."""


def run_ours(workdir: Path, base: Path, steps: int, warmup: int, qlora: bool) -> dict[str, Any]:
    from finetune.data.collate import collate_batch
    from finetune.recipe import load_recipe
    from finetune.training.loop import PendingSteps, device_schedule, device_step, step_inputs
    from finetune.training.run import start_run

    model, train = (f", {QLORA_MODEL}", f", {QLORA_TRAIN}") if qlora else ("", "")
    (workdir / "ours.yaml").write_text(f"""
model: {{base: {base}, attn_implementation: sdpa{model}}}
lora: {{r: {LORA["r"]}, alpha: {LORA["alpha"]}, dropout: {LORA["dropout"]}, target_modules: all-linear}}
data: {{train: {workdir / "train.jsonl"}, format: instruction, max_seq_len: 256}}
train: {{max_steps: {steps + warmup + 1}, micro_batch_size: {MICRO_BATCH}, log_every_steps: {steps + warmup + 1},
         report_to: []{train}}}
output: {{name: ours, dir: {workdir / "adapter"}, run_dir: {workdir / "run"}, report: false}}
""")
    run = start_run(load_recipe(workdir / "ours.yaml"), resume=False, say=lambda line: None)
    shapes = {tuple(run.collate([run.data.train[i] for i in run.stream.indices(p)])["input_ids"].shape)
              for p in range(run.length.micro_batches_per_epoch)}  # fmt: skip
    bucketed = {  # the widths varlen attention gets on CUDA (`bucketed_rows`); the CPU keeps `rows`
        tuple(
            collate_batch([run.data.train[i] for i in run.stream.indices(p)], 0, True, "bucketed_rows")[
                "input_ids"
            ].shape
        )
        for p in range(run.length.micro_batches_per_epoch)
    }
    run.model_for_step.train()
    pending = PendingSteps(run, lambda step, metrics: None, device_schedule(run))
    launches = Launches()
    with Meter() as meter:
        meter.mark()
        for _ in range(warmup + steps):
            if run.step == warmup:
                launches.start()
            with _disable_current_modes():  # collation and counting on the host: not counted (see the docstring)
                inputs = step_inputs(run, run.next_micro_batches())
            pending.add(device_step(run, inputs, pending.schedule), 0.0)
            if run.step == warmup + steps:
                before = len(meter.syncs.found)
                pending.read({})  # the read of the logging interval: once per interval, its ops counted in
                read_syncs = len(meter.syncs.found) - before
            meter.mark()
    ops, syncs = meter.per_step(warmup)
    return {"aten_ops_per_step": ops, "launches_per_step": launches.stop(steps), "syncs_per_step": syncs - read_syncs / steps,
            "shapes_per_epoch": len(shapes), "shapes_per_epoch_bucketed": len(bucketed),
            "syncs_per_logging_read": read_syncs, "sync_ops": sorted(set(meter.syncs.found))}  # fmt: skip


def run_ours_compiled(workdir: Path, base: Path, steps: int, warmup: int) -> dict[str, Any]:
    """Ours with `train.compile: true` and the rows in bucketed widths, counted by torch.profiler only."""
    from torch._dynamo.utils import counters

    from finetune.recipe import load_recipe
    from finetune.training.loop import PendingSteps, device_schedule, device_step, step_inputs
    from finetune.training.run import start_run

    length = warmup + steps + 1
    overrides = ["train.compile=true", f"train.max_steps={length}", f"train.log_every_steps={length}"]
    recipe = load_recipe(workdir / "ours.yaml", [*overrides, f"output.dir={workdir / 'compiled'}"])
    run = start_run(recipe, resume=False, say=lambda line: None)
    run.objective.options = dataclasses.replace(run.objective.options, layout="bucketed_rows")
    run.model_for_step.train()
    pending = PendingSteps(run, lambda step, metrics: None, device_schedule(run))
    launches = Launches()
    for _ in range(warmup + steps):
        if run.step == warmup:
            graphs = counters["stats"]["unique_graphs"]
            launches.start()
        pending.add(device_step(run, step_inputs(run, run.next_micro_batches()), pending.schedule), 0.0)
        if run.step == warmup + steps:
            pending.read({})
    return {
        "launches_per_step": launches.stop(steps),
        "recompiles_measured": counters["stats"]["unique_graphs"] - graphs,
    }


def trainer_model(base: Path, qlora: bool) -> Any:
    """The base as a Trainer + peft user loads it; with `qlora`, as the QLoRA recipe does (nf4, double
    quantization, bf16 compute, `prepare_model_for_kbit_training` with gradient checkpointing)."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if not qlora:
        return AutoModelForCausalLM.from_pretrained(base, attn_implementation="sdpa")
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(
        base, attn_implementation="sdpa", dtype=torch.bfloat16, quantization_config=nf4, device_map={"": "cpu"}
    )
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)


def run_trainer(workdir: Path, base: Path, steps: int, warmup: int, qlora: bool) -> dict[str, Any]:
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    from finetune.data.pipeline import build_datasets
    from finetune.recipe import load_recipe

    recipe = load_recipe(workdir / "ours.yaml")
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = build_datasets(recipe.data, tokenizer, seed=0).train  # the same documents, tokenized the same way
    model = trainer_model(base, qlora)
    model.config.use_cache = False
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], target_modules="all-linear",
                      task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(model, lora)
    padder = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)

    def collator(features: list[dict]) -> dict:
        with _disable_current_modes():  # collation on the host: not counted (see the docstring)
            return padder(features)

    shapes = {tuple(collator([dict(rows[i]) for i in range(s, min(s + MICRO_BATCH, len(rows)))])["input_ids"].shape)
              for s in range(0, len(rows), MICRO_BATCH)}  # fmt: skip
    meter, launches = Meter(), Launches()

    class Marks(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 0:
                meter.mark()
            if state.global_step == warmup:
                launches.start()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            meter.mark()

    arguments = TrainingArguments(
        output_dir=str(workdir / "trainer"), per_device_train_batch_size=MICRO_BATCH, max_steps=warmup + steps,
        learning_rate=1e-3, logging_steps=warmup + steps, save_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True, bf16=qlora,
        gradient_checkpointing=qlora, gradient_checkpointing_kwargs={"use_reentrant": False},
    )  # fmt: skip
    dataset = Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    trainer = Trainer(model=model, args=arguments, train_dataset=dataset, data_collator=collator,
                      processing_class=tokenizer, callbacks=[Marks()])  # fmt: skip
    with meter:
        trainer.train()
    ops, syncs = meter.per_step(warmup)
    return {"aten_ops_per_step": ops, "launches_per_step": launches.stop(steps), "syncs_per_step": syncs,
            "shapes_per_epoch": len(shapes), "sync_ops": sorted(set(meter.syncs.found))}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="measured optimizer steps")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--records", type=int, default=400)
    parser.add_argument("--compiled", action="store_true", help="also ours with train.compile: true (minutes)")
    parser.add_argument(
        "--qlora",
        action="store_true",
        help="both arms as the 8B QLoRA preset runs: nf4 bf16 base, every layer checkpointed",
    )
    parser.add_argument("--compiled-warmup-steps", type=int, default=12, help="steps that compile every shape first")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--scratch", type=Path, help="accepted for `python -m bench`; the models are built in a temporary directory"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        data = records(args.records)
        (workdir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
        base = build_base(workdir, data)
        results = {"ours": run_ours(workdir, base, args.steps, args.warmup_steps, args.qlora),
                   "hf-trainer + peft": run_trainer(workdir, base, args.steps, args.warmup_steps, args.qlora)}  # fmt: skip
        if args.compiled:
            results["ours, compiled"] = run_ours_compiled(workdir, base, args.steps, args.compiled_warmup_steps)
    ours, theirs = results["ours"], results["hf-trainer + peft"]
    print(f"{'arm':<20}{'aten ops/step':>15}{'launches/step':>15}{'syncs/step':>12}{'shapes/epoch':>14}")
    for name, result in results.items():
        print(f"{name:<20}{result.get('aten_ops_per_step', float('nan')):>15,.0f}{result['launches_per_step']:>15,.0f}"
              f"{result.get('syncs_per_step', float('nan')):>12.1f}{result.get('shapes_per_epoch', '-'):>14}")  # fmt: skip
    print(f"ours / Trainer, aten ops per step: {ours['aten_ops_per_step'] / theirs['aten_ops_per_step']:.2f}x")
    for name in results:
        ratio = results[name]["launches_per_step"] / theirs["launches_per_step"]
        print(f"{name} / Trainer, launches per step: {ratio:.2f}x")
    if args.compiled:
        print(f"ours, compiled: {results['ours, compiled']['recompiles_measured']} compilations in the measured steps")
    for name, result in results.items():
        if "sync_ops" in result:
            print(f"{name} syncing ops: {', '.join(result['sync_ops']) or 'none'}")
    print(f"ours reads its metrics once per logging interval: {ours['syncs_per_logging_read']} syncing ops per read")
    print(f"ours' shapes per epoch in bucketed rows (varlen attention on CUDA): {ours['shapes_per_epoch_bucketed']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training throughput: `finetune.train` (packing on and off) against HF `Trainer` + peft, side by side.

Every arm trains the same model (a random-init Llama built from a config and saved with
`save_pretrained`), with the same LoRA (r=16, alpha=32, dropout 0.05, all-linear), on the same
instruction records (generated here, of varied length, so padding and packing differ), for the same
number of optimizer steps, with the same documents per step (micro-batch size x accumulation: the
Trainer's `per_device_train_batch_size` x `gradient_accumulation_steps`), learning rate, schedule
(cosine, no warmup), clipping (1.0) and precision. So every arm sees the same documents and the same
tokens; packing may only change how fast.

Arms, each in its own fresh process (so peak RSS and allocator state are its own), run one after the
other (with `--repeats N`, N rounds of all arms, interleaved, and the median ratio of each arm to the
baseline over the rounds):
- `ours-packed`:   `finetune.train(recipe)` with `data.packing=true` (each micro-batch's documents packed
                   into as few rows as fit, none longer than its longest document);
- `ours-padded`:   the same with `data.packing=false` (one row per document, padded to the longest);
- `hf-trainer`:    what a user would otherwise write: `get_peft_model`, `datasets` + `.map` tokenizing,
                   `DataCollatorForSeq2Seq` padding, `Trainer(processing_class=...)`; on a 4-bit base
                   `BitsAndBytesConfig` nf4 + `prepare_model_for_kbit_training` first (QLoRA).

Device: every arm runs on the GPU when torch sees one (the Trainer too), else on the CPU; `--device cpu`
hides the GPU from the arms. On a GPU each step's end is read after `torch.cuda.synchronize()`, and each
arm reports its peak GPU memory (`torch.cuda.max_memory_allocated`, from the arm's start to the end of
its last step, so the held-out loss afterwards is not in it) beside `finetune plan`'s estimate for the
recipe ours trains with (`bench/presets.py`).

What is timed: the steps after `--warmup-steps`, from the end of the last warm-up step to the end of the
last step (both loops report the end of each optimizer step: ours through its log line, the Trainer
through a callback). Model load, tokenizing, the base-model evaluation and the final evaluation and save
are reported apart as setup and after-training seconds. Tokens are counted from the very micro-batches
each step used: real tokens (not padding), label tokens (those that carry loss), and the tokens the
model computed (padding included). Held-out loss is computed by this script for every arm in the same
way (float32, mean over the label tokens of the validation records), from each arm's saved adapter on
the base loaded afresh (`adapter_heldout_loss`).

The machine may be shared: the load average before and after each arm is recorded, and CPU seconds of
the timed window are reported beside wall seconds. With `--threads 1` no thread waits for another, so
real tokens per CPU second measures the work alone, whatever else runs (with 2 threads on a loaded
machine CPU seconds inflate too: a thread spins while its partner is descheduled).

Utilisation: each micro-batch's model FLOPs are counted from the model config and the real length of
each of its documents (`bench/flops.py`: padding is not model work, packed documents attend within
themselves), so every arm does the same model FLOPs per step. The machine's matmul peak
(`bench/matmul_peak.py`, at the arms' thread count and precision) is measured in a fresh process before
the first arm and after the last, and the better of the two taken; MFU is model FLOPs per second over
it, by wall time and by CPU time (on a GPU: the GPU's matmul peak, by wall time only).

GPU presets (`--preset NAME`, see bench/presets.py): real-size Llama shapes from the catalog's shipped
configs with random weights, rows of about 2048 tokens, bf16; `--smoke` runs one shrunken on a CPU.

Example:
    python bench/train_throughput.py                # fp32, defaults: ~2 min on 2 idle cores, 8.5 at load 9
    python bench/train_throughput.py --threads 1 --precision bf16 --json /tmp/bf16.json   # shared machine
    python bench/train_throughput.py --threads 1 --repeats 3   # interleaved rounds, median ratios
    python bench/train_throughput.py --hidden 384 --layers 6 --seq-len 1024 --steps 30 --compile
    python bench/train_throughput.py --vocab 32000 --untied --micro-batch-size 8 --grad-accum 1 --records 80 --one-epoch
    python bench/train_throughput.py --preset llama-3.1-8b-qlora --json /tmp/qlora.json   # on a GPU
    python bench/train_throughput.py --preset llama-3.1-8b-qlora --smoke                  # shrunken, on CPU
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run from a checkout: `python bench/train_throughput.py`
    sys.path.insert(0, str(REPO_ROOT))

ARMS = ("ours-packed", "ours-padded", "hf-trainer", "hf-trainer-liger")
DEFAULT_ARMS = ARMS[:3]
BASELINE = "hf-trainer"
LIGER_ARM = "hf-trainer-liger"
"""The Trainer as its users speed it up on a GPU: `use_liger_kernel=True` (Liger Kernel's RMSNorm, RoPE, SwiGLU
and fused linear cross-entropy). Skipped, with the reason, where it cannot run."""
LORA = dict(r=16, alpha=32.0, dropout=0.05)
PROMPT_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"  # finetune's default instruction template
SEED = 0


# ---------------------------------------------------------------------------------------------------
# Shared helpers (parent and arms)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def load_average() -> float:
    return os.getloadavg()[0]


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def on_gpu() -> bool:
    """Whether torch sees a GPU: in an arm, whether it trains there (`--device cpu` hides it from the arms)."""
    import torch

    return torch.cuda.is_available()


def clock() -> tuple[float, float]:
    """(wall, CPU) seconds now; on a GPU once its queued kernels are done, so a step's end is the end of its work."""
    if on_gpu():
        import torch

        torch.cuda.synchronize()
    return time.perf_counter(), cpu_seconds()


def gpu_memory() -> dict[str, int]:
    """Peak GPU memory since the arm started (`run_arm` resets it): bytes of live tensors (what `finetune
    plan` estimates) and what the caching allocator reserved. Empty on CPU."""
    if not on_gpu():
        return {}
    import torch

    return {
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
        "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(),
    }


class StepProfiler:
    """`--profile-steps N`: torch.profiler over the N optimizer steps after the warm-up (CUDA kernels too on a
    GPU); the arm prints its busiest operations, by device time on a GPU, by CPU time here. For finding where a
    step's time goes: profiled steps run slower, so a profiled run's speeds are not figures to quote."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.first = spec["warmup_steps"]
        self.last = min(spec["steps"], self.first + spec.get("profile_steps", 0))
        self.profiler: Any = None
        self.started = self.wall_s = 0.0

    def on_step_end(self, step: int) -> None:
        """Called as each optimizer step ends, after its clock mark."""
        import torch.profiler as tp

        if step == self.first and self.last > self.first:
            activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if on_gpu() else [])
            self.profiler = tp.profile(activities=activities)
            self.profiler.start()
            self.started = time.perf_counter()
        elif step == self.last and self.profiler is not None:
            self.profiler.stop()
            self.wall_s = time.perf_counter() - self.started

    def report(self, arm: str) -> None:
        if self.profiler is None:
            return
        sort_by = "self_device_time_total" if on_gpu() else "self_cpu_time_total"
        averages = self.profiler.key_averages()
        table = averages.table(sort_by=sort_by, row_limit=40)
        busy_s = sum(event.self_device_time_total for event in averages) / 1e6
        say(
            f"{arm}: profile of steps {self.first + 1}-{self.last} (by {sort_by}; {self.wall_s:.2f} s of wall time, "
            f"{busy_s:.2f} s of device time in kernels):\n{table}"
        )


def free_gpu_memory() -> None:
    """Give the dropped training model's memory back before the held-out evaluation loads a fresh base (the
    peaks were read at the last step, so this changes no figure)."""
    import gc

    gc.collect()
    if on_gpu():
        import torch

        torch.cuda.empty_cache()


def tokenize_record(record: dict[str, str], tokenizer) -> dict[str, list[int]]:
    """User-style tokenizing of one instruction record: BOS + prompt, then response + EOS; loss on the response.

    Written as a user of `Trainer` would; it must give the very ids and labels `finetune`'s instruction
    format gives (checked against finetune's data stats in every run).
    """
    prompt = PROMPT_TEMPLATE.replace("{prompt}", record["instruction"])
    prompt_ids = [tokenizer.bos_token_id] + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = prompt_ids + response_ids
    return {
        "input_ids": input_ids,
        "attention_mask": [1] * len(input_ids),
        "labels": [-100] * len(prompt_ids) + response_ids,
    }


@functools.cache
def decoder_shape(base_dir: str):
    from transformers import AutoConfig

    from bench.flops import DecoderShape

    return DecoderShape.from_config(AutoConfig.from_pretrained(base_dir))


def micro_batch_flops(base_dir: str, document_lengths: list[int], label_tokens: int) -> int:
    """Model FLOPs of one micro-batch's forward + backward (`bench/flops.py`): real tokens, per document,
    and the head's logits only where the loss takes them (the label tokens).

    The same documents make the same figure in every arm, packed or padded: padding, and logits of the
    prompt, are not model work.
    """
    from bench.flops import ALL_LINEAR, step_flops

    shape = decoder_shape(base_dir)
    return step_flops(
        shape, document_lengths, lora_rank=int(LORA["r"]), lora_targets=ALL_LINEAR, head_positions=label_tokens
    )


def heldout_loss(model, documents: list[dict[str, list[int]]], pad_token_id: int, batch_size: int = 8) -> float:
    """Mean next-token loss over every label token of `documents`, float32, no dropout.

    The same function for every arm, so the figures compare the adapters, not the evaluation code. The
    batch is built where the model's embedding lives (a GPU, or the CPU); the loss is taken in float32 from
    the model's own logits, whatever its dtype.
    """
    import torch
    import torch.nn.functional as F

    device = model.get_input_embeddings().weight.device
    was_training = model.training
    model.eval()
    loss_sum, num_label_tokens = 0.0, 0
    with torch.no_grad():
        for first in range(0, len(documents), batch_size):
            chunk = documents[first : first + batch_size]
            max_len = max(len(d["input_ids"]) for d in chunk)
            input_ids = torch.full((len(chunk), max_len), pad_token_id, dtype=torch.long)  # (B, T)
            labels = torch.full((len(chunk), max_len), -100, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), max_len), dtype=torch.long)
            for row, document in enumerate(chunk):
                n = len(document["input_ids"])
                input_ids[row, :n] = torch.tensor(document["input_ids"])
                labels[row, :n] = torch.tensor(document["labels"])
                attention_mask[row, :n] = 1
            input_ids, labels, attention_mask = (t.to(device) for t in (input_ids, labels, attention_mask))
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
            targets = labels[:, 1:]  # (B, T-1): position t predicts token t+1
            loss_sum += float(
                F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100, reduction="sum"
                )
            )
            num_label_tokens += int((targets != -100).sum())
    model.train(was_training)
    return loss_sum / num_label_tokens


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def window(marks: dict[int, tuple[float, float]], steps: int, warmup_steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds from the end of step `warmup_steps` to the end of step `steps`."""
    missing = [s for s in (warmup_steps, steps) if s not in marks]
    assert not missing, f"no timestamp for step(s) {missing}; got steps {sorted(marks)[:5]}..."
    return marks[steps][0] - marks[warmup_steps][0], marks[steps][1] - marks[warmup_steps][1]


def summarise(
    spec: dict[str, Any],
    arm: str,
    marks: dict[int, tuple[float, float]],
    step_tokens: list[dict[str, int]],
    step_losses: dict[int, float],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Throughput over the timed window, loss at the end, token counts per step summed."""
    steps, warmup = spec["steps"], spec["warmup_steps"]
    wall, cpu = window(marks, steps, warmup)
    timed = step_tokens[warmup:steps]
    real = sum(t["real"] for t in timed)
    model_flops = sum(t["model_flops"] for t in timed)
    label = sum(t["label"] for t in timed)
    computed = sum(t["computed"] for t in timed)
    tail = [step_losses[s] for s in range(max(1, steps - spec["loss_tail_steps"] + 1), steps + 1) if s in step_losses]
    step_seconds = sorted(marks[s][0] - marks[s - 1][0] for s in range(warmup + 1, steps + 1))
    # Robust to bursts of load from other processes: the median over steps of each step's own rate.
    step_rates = sorted(
        step_tokens[s - 1]["real"] / (marks[s][0] - marks[s - 1][0]) for s in range(warmup + 1, steps + 1)
    )
    return {
        "arm": arm,
        "timed_steps": steps - warmup,
        "train_seconds": wall,
        "train_cpu_seconds": cpu,
        "median_step_seconds": step_seconds[len(step_seconds) // 2],
        "warmup_seconds": marks[warmup][0] - marks[0][0],
        "real_tokens": real,
        "label_tokens": label,
        "computed_tokens": computed,
        "padding_fraction": 1 - real / computed,
        "tokens_per_s": real / wall,
        "tokens_per_cpu_s": real / cpu,
        "median_step_tokens_per_s": step_rates[len(step_rates) // 2],
        "label_tokens_per_s": label / wall,
        "model_flops": model_flops,
        "model_flops_per_s": model_flops / wall,
        "model_flops_per_cpu_s": model_flops / cpu,
        "all_real_tokens": sum(t["real"] for t in step_tokens[:steps]),
        "final_train_loss": sum(tail) / len(tail),
        "step_losses": [step_losses.get(s) for s in range(1, steps + 1)],
        "peak_rss_mib": peak_rss_mib(),
        **extra,
    }


# ---------------------------------------------------------------------------------------------------
# Arms: each runs in its own process, reads spec.json, writes its result JSON.


def ours_recipe(spec: dict[str, Any], arm: str) -> Any:
    """The recipe `finetune.train` runs for `arm`; the parent hands the same one to `finetune plan`'s estimate."""
    from finetune import Recipe
    from finetune.recipe import apply_overrides

    work = Path(spec["workdir"]) / arm
    fields = {
        "model": {
            "base": spec["base_dir"],
            "dtype": spec["model_dtype"],
            "attn_implementation": "sdpa",
            "quantization": spec["quantization"],
        },
        "lora": {**LORA, "target_modules": "all-linear"},
        "data": {
            "train": [spec["train_path"]],
            # Without validation data, ours skips its base and final evaluations (--no-own-eval).
            "validation": [spec["validation_path"]] if spec["own_eval"] else [],
            "format": "instruction",
            "prompt_template": PROMPT_TEMPLATE,
            "completion_only_loss": True,
            "max_seq_len": spec["seq_len"],
            "packing": arm == "ours-packed",
        },
        "train": {
            "max_steps": spec["steps"],
            "micro_batch_size": spec["micro_batch_size"],
            "grad_accum_steps": spec["grad_accum_steps"],
            "lr": spec["lr"],
            "schedule": "cosine",
            "warmup_steps": 0,
            "max_grad_norm": 1.0,
            "precision": spec["precision"],
            "gradient_checkpointing": spec["gradient_checkpointing"],
            "compile": spec["compile"] or "auto",  # ours' default unless --compile
            "seed": SEED,
            "log_every_steps": 1,
        },
        "output": {"name": arm, "dir": str(work / "adapter"), "run_dir": str(work / "run"), "overwrite": True},
    }
    return Recipe.model_validate(apply_overrides(fields, spec.get("ours_overrides", [])))


def adapter_heldout_loss(
    spec: dict[str, Any], adapter_dir: Path, tokenizer, validation: list[dict[str, list[int]]]
) -> float:
    """`heldout_loss` of an arm's saved adapter on the base loaded afresh, the same way for every arm (the
    preset's dtype, 4-bit where it is quantized), on the arm's device: a quantized base is placed by
    bitsandbytes' loader, any other is moved there. An arm's in-memory training state does not enter the
    figure: the Trainer's `prepare_model_for_kbit_training` upcasts norms and embeddings to float32. Taken
    on that in-memory model, the Trainer's held-out loss was 0.2% below ours on the 8B QLoRA preset (an H100,
    2026-11-27) while the final training losses agreed to 4e-4."""
    from peft import PeftModel

    from finetune.model import load_base_from_config

    model_config = ours_recipe(spec, "ours-packed").model  # the base, its dtype and quantization
    base, _, _ = load_base_from_config(model_config, tokenizer)
    if model_config.quantization == "none":
        base.to("cuda" if on_gpu() else "cpu")
    tuned = PeftModel.from_pretrained(base, str(adapter_dir))
    return heldout_loss(tuned, validation, tokenizer.pad_token_id, spec["heldout_batch_size"])


def run_ours(spec: dict[str, Any], arm: str) -> dict[str, Any]:
    """`finetune.train` as a user calls it; step ends are read off its log lines."""
    # Import what `train` imports lazily before the clock starts, as the Trainer arm does: setup time is
    # then model load, data and the base evaluation, not Python imports.
    import accelerate  # noqa: F401
    import peft  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    from finetune.data.collate import collate_batch
    from finetune.data.pipeline import build_datasets
    from finetune.data.sampler import MicroBatchStream
    from finetune.model import load_tokenizer
    from finetune.training.loop import train

    packing = arm == "ours-packed"
    micro_batch_size, grad_accum_steps = spec["micro_batch_size"], spec["grad_accum_steps"]
    work = Path(spec["workdir"]) / arm
    shutil.rmtree(work, ignore_errors=True)
    recipe = ours_recipe(spec, arm)

    marks: dict[int, tuple[float, float]] = {}
    phases: dict[str, float] = {}

    memory: dict[str, int] = {}

    profiler = StepProfiler(spec)

    def on_step(step: int, metrics: dict[str, float]) -> None:
        marks[step] = clock()
        profiler.on_step_end(step)
        if step == spec["steps"]:
            memory.update(gpu_memory())

    def log(message: str) -> None:  # setup phases only; steps come through on_step
        now, cpu = clock()
        if message.startswith("training "):  # printed just before the first step
            marks[0] = (now, cpu)
        elif message.startswith("base model: eval loss"):  # the base evaluation is done
            phases["base_eval_done"] = now
        elif message.startswith("base "):  # model loaded, data tokenized (or read from the cache)
            phases["loaded"] = now
        if spec["verbose"]:
            say(f"{arm}: {message}")

    start = time.perf_counter()
    _, metrics = train(recipe, resume=False, log=log, progress=False, on_step=on_step)
    end = time.perf_counter()
    rss = peak_rss_mib()
    profiler.report(arm)

    # Which documents each step took: the same deterministic stream the loop uses, over the cached rows,
    # laid out by the same collate function (packed rows, or padded ones).
    tokenizer = load_tokenizer(spec["base_dir"])
    data = build_datasets(recipe.data, tokenizer, seed=SEED)
    stream = MicroBatchStream(num_rows=len(data.train), micro_batch_size=micro_batch_size, seed=SEED)
    step_tokens = []
    for step in range(spec["steps"]):
        real = label = computed = model_flops = 0
        for k in range(grad_accum_steps):
            documents = [data.train[i] for i in stream.indices(step * grad_accum_steps + k)]
            batch = collate_batch(documents, tokenizer.pad_token_id, packing=packing)
            real += sum(len(document["input_ids"]) for document in documents)
            labels = int((batch["labels"] != -100).sum())
            label += labels
            computed += batch["input_ids"].numel()
            model_flops += micro_batch_flops(spec["base_dir"], [len(d["input_ids"]) for d in documents], labels)
        step_tokens.append({"real": real, "label": label, "computed": computed, "model_flops": model_flops})
    step_losses = {}
    for line in (work / "run" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            step_losses[record["step"]] = record["loss"]

    validation = [tokenize_record(r, tokenizer) for r in read_jsonl(Path(spec["validation_path"]))]
    result = summarise(
        spec,
        arm,
        marks,
        step_tokens,
        step_losses,
        {
            "setup_seconds": marks[0][0] - start,
            "load_and_data_seconds": phases.get("loaded", start) - start,
            "base_eval_seconds": phases.get("base_eval_done", phases.get("loaded", start))
            - phases.get("loaded", start),
            "after_seconds": end - marks[spec["steps"]][0],
            "heldout_loss": adapter_heldout_loss(spec, recipe.output.adapter_dir, tokenizer, validation),
            "own_eval_loss": metrics.get("eval_loss"),
            "base_heldout_loss": metrics.get("base_eval_loss"),
            "data_stats": dict(data.stats),
            "micro_batch_size": micro_batch_size,
            "grad_accum_steps": grad_accum_steps,
            **memory,
        },
    )
    result["peak_rss_mib"] = rss
    return result


def hf_peft_model(spec: dict[str, Any]):
    """The user's model: `from_pretrained` in the base's dtype, for QLoRA with an nf4 `BitsAndBytesConfig`
    (double quantization, bf16 compute: finetune's defaults) and `prepare_model_for_kbit_training` (which
    also turns on gradient checkpointing when asked), then `get_peft_model`."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, set_seed

    dtype = getattr(torch, spec["model_dtype"])
    quantization = {}
    if spec["quantization"] == "4bit":
        quantization["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
        )
    model = AutoModelForCausalLM.from_pretrained(
        spec["base_dir"], dtype=dtype, attn_implementation="sdpa", **quantization
    )
    model.config.use_cache = False  # as ours: no KV cache while training
    if quantization:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=spec["gradient_checkpointing"])
    set_seed(SEED)
    return get_peft_model(
        model,
        LoraConfig(
            r=LORA["r"],
            lora_alpha=LORA["alpha"],
            lora_dropout=LORA["dropout"],
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        ),
    )


def why_arm_cannot_run(arm: str, device: str) -> str | None:
    """Why an optional arm is skipped on this machine (None: it runs)."""
    if arm != LIGER_ARM:
        return None
    if device != "cuda":
        return "Liger Kernel's kernels are Triton kernels for CUDA"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    return None


def run_hf_trainer(spec: dict[str, Any], arm: str) -> dict[str, Any]:
    """The baseline a user writes with transformers 5 + peft: Trainer, DataCollatorForSeq2Seq padding (with
    `use_liger_kernel` in the Liger arm)."""
    import datasets
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    work = Path(spec["workdir"]) / arm
    shutil.rmtree(work, ignore_errors=True)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(spec["base_dir"])
    model = hf_peft_model(spec)
    load_seconds = time.perf_counter() - start

    start_tokenizing = time.perf_counter()
    raw = datasets.load_dataset("json", data_files={"train": spec["train_path"], "validation": spec["validation_path"]})
    tokenized = raw.map(lambda record: tokenize_record(record, tokenizer), remove_columns=raw["train"].column_names)
    tokenize_seconds = time.perf_counter() - start_tokenizing

    padder = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    micro_batches: list[dict[str, Any]] = []  # in the order the loop asks for them

    def collate(features):
        batch = padder(features)
        micro_batches.append(
            {
                "real": int(batch["attention_mask"].sum()),
                "label": int((batch["labels"] != -100).sum()),
                "computed": int(batch["input_ids"].numel()),
                "lengths": [len(f["input_ids"]) for f in features],  # FLOPs counted after training
            }
        )
        return batch

    marks: dict[int, tuple[float, float]] = {}
    memory: dict[str, int] = {}

    profiler = StepProfiler(spec)

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks[0] = clock()

        def on_step_end(self, args, state, control, **kwargs):
            marks[state.global_step] = clock()
            profiler.on_step_end(state.global_step)
            if state.global_step == spec["steps"]:
                memory.update(gpu_memory())

    args = TrainingArguments(
        output_dir=str(work / "out"),
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["micro_batch_size"],
        per_device_eval_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["grad_accum_steps"],
        learning_rate=spec["lr"],
        lr_scheduler_type="cosine",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=spec["precision"] == "bf16",
        torch_compile=spec["compile"],
        use_liger_kernel=arm == LIGER_ARM,
        gradient_checkpointing=spec["gradient_checkpointing"],
        use_cpu=not on_gpu(),  # the model goes where ours goes: the GPU when there is one
        eval_strategy="no",
        save_strategy="no",
        logging_steps=1,
        report_to="none",
        disable_tqdm=not spec["verbose"],
        seed=SEED,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        data_collator=collate,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.train()
    end_train = time.perf_counter()
    own_eval = trainer.evaluate() if spec["own_eval"] else {}
    after_seconds = time.perf_counter() - marks[spec["steps"]][0]
    rss = peak_rss_mib()
    profiler.report(arm)

    for micro_batch in micro_batches:
        micro_batch["model_flops"] = micro_batch_flops(
            spec["base_dir"], micro_batch.pop("lengths"), micro_batch["label"]
        )
    grad_accum = spec["grad_accum_steps"]
    assert len(micro_batches) >= spec["steps"] * grad_accum, "fewer micro-batches than steps x accumulation"
    step_tokens = [
        {
            key: sum(b[key] for b in micro_batches[s * grad_accum : (s + 1) * grad_accum])
            for key in ("real", "label", "computed", "model_flops")
        }
        for s in range(spec["steps"])
    ]
    step_losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    validation = [dict(r) for r in tokenized["validation"]]
    train_docs = tokenized["train"]
    model.save_pretrained(work / "adapter")  # evaluated on a fresh base, as ours is
    del trainer, model
    free_gpu_memory()
    heldout = adapter_heldout_loss(spec, work / "adapter", tokenizer, validation)
    result = summarise(
        spec,
        arm,
        marks,
        step_tokens,
        step_losses,
        {
            "setup_seconds": marks[0][0] - start,
            "load_and_data_seconds": load_seconds + tokenize_seconds,
            "base_eval_seconds": 0.0,  # the Trainer does not evaluate the base before training
            "after_seconds": after_seconds,
            "end_train_seconds_after_last_step": end_train - marks[spec["steps"]][0],
            "heldout_loss": heldout,
            "own_eval_loss": own_eval.get("eval_loss"),
            "data_stats": {
                "num_records": len(train_docs),
                "num_tokens": sum(len(ids) for ids in train_docs["input_ids"]),
                "num_label_tokens": sum(sum(1 for t in labels if t != -100) for labels in train_docs["labels"]),
            },
            "micro_batch_size": spec["micro_batch_size"],
            "grad_accum_steps": grad_accum,
            "optimizer": str(args.optim),
            **memory,
        },
    )
    result["peak_rss_mib"] = rss
    return result


def run_arm(spec_path: Path, arm: str, out_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    if on_gpu():  # the arm's own peak, from here (a fresh process: nothing allocated yet)
        torch.cuda.reset_peak_memory_stats()
    load_before = load_average()
    result = run_hf_trainer(spec, arm) if arm.startswith(BASELINE) else run_ours(spec, arm)
    result["load_average_before"], result["load_average_after"] = load_before, load_average()
    out_path.write_text(json.dumps(result, indent=2))


# ---------------------------------------------------------------------------------------------------
# Setup (parent): words, records, tokenizer, model; all generated here, deterministic for a seed.


def make_words(rng: random.Random, count: int) -> list[str]:
    """Pseudo-words from syllables, so the tokenizer has subword structure to learn."""
    onsets = [
        "b",
        "br",
        "c",
        "ch",
        "d",
        "f",
        "g",
        "gr",
        "h",
        "k",
        "l",
        "m",
        "n",
        "p",
        "pr",
        "r",
        "s",
        "st",
        "t",
        "tr",
        "v",
        "w",
        "z",
    ]
    nuclei = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "st"]
    words: set[str] = set()
    while len(words) < count:
        words.add(
            "".join(
                rng.choice(onsets) + rng.choice(nuclei) + rng.choice(codas) for _ in range(rng.choice((1, 2, 2, 3)))
            )
        )
    return sorted(words)


def make_records(
    rng: random.Random, words: list[str], count: int, max_words: int, median_words: float = 45
) -> list[dict[str, str]]:
    """Instruction records whose lengths spread like real instruction sets: mostly short, a long tail.

    Response length in words is log-normal (median `median_words`, sigma 0.9), cut at `max_words`; prompts
    4-40 words. Words are Zipf-distributed, responses repeat words of their prompt, so there is something
    to learn. A huge median makes every response `max_words` long (`--long-records` then trims them).
    """
    weights = [1 / (rank + 1) for rank in range(len(words))]
    tasks = [
        "Summarise the notes on",
        "Explain",
        "Write a short answer about",
        "List the steps for",
        "Describe",
        "Compare",
        "Give an example of",
    ]
    records = []
    for _ in range(count):
        topic = rng.choices(words, weights, k=rng.randint(4, 40))
        n_response = max(3, min(max_words, int(rng.lognormvariate(math.log(median_words), 0.9))))
        body = rng.choices(words + topic * 20, k=n_response)
        sentences, start = [], 0
        while start < len(body):
            size = rng.randint(6, 16)
            sentences.append(" ".join(body[start : start + size]).capitalize() + ".")
            start += size
        records.append({"instruction": f"{rng.choice(tasks)} {' '.join(topic)}.", "output": " ".join(sentences)})
    return records


def trim_to_tokens(record: dict[str, str], tokenizer, max_tokens: int) -> dict[str, str]:
    """`record` with its response cut at a space to the longest prefix whose tokenized record has at most
    `max_tokens` tokens (binary search: a word more never means fewer tokens)."""
    output = record["output"]
    cuts = [i for i, char in enumerate(output) if char == " "] + [len(output)]

    def fits(index: int) -> bool:
        trimmed = {**record, "output": output[: cuts[index]]}
        return len(tokenize_record(trimmed, tokenizer)["input_ids"]) <= max_tokens

    low, high = 0, len(cuts) - 1
    while low < high:  # invariant: the answer is in [low, high]
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return {**record, "output": output[: cuts[low]]}


def make_data(args: argparse.Namespace, data_dir: Path):
    """Tokenizer (trained on the records) and the train and validation records, written as JSONL."""
    from finetune.embedded.tokenizer import train_tokenizer

    rng = random.Random(SEED)
    words = make_words(rng, 3000)
    # Enough records that every arm stays inside its first epoch (the Trainer's epochs end with a short
    # accumulation step that would blur the per-step token counts), with a margin for packing.
    rows_needed = args.steps * args.grad_accum * args.micro_batch_size
    num_train = args.records if args.one_epoch else max(args.records, int(rows_needed * 1.25) + 64)
    num_validation = args.validation_records
    max_words = int(args.seq_len * 0.55)
    wanted = num_train + num_validation
    if args.long_records:  # at least one token a word: every response overfills a row until trimmed below
        records = make_records(rng, words, wanted, args.seq_len, median_words=1e9)
    else:
        records = make_records(rng, words, wanted, max_words)
    tokenizer = train_tokenizer(
        (r["instruction"] + "\n" + r["output"] for r in records[:4000]),
        vocab_size=args.vocab,
        max_model_len=max(args.seq_len, 2048),
    )
    if args.long_records:  # each document 95-100% of a row: the rows `finetune plan` estimates, nearly
        records = [trim_to_tokens(r, tokenizer, rng.randint(int(0.95 * args.seq_len), args.seq_len)) for r in records]
    # Keep records that fit max_seq_len whole, so no arm truncates and all see exactly the same tokens.
    fits = [r for r in records if len(tokenize_record(r, tokenizer)["input_ids"]) <= args.seq_len]
    for _ in range(20):
        if len(fits) >= wanted:
            break
        more = make_records(rng, words, wanted, max_words)
        fits += [r for r in more if len(tokenize_record(r, tokenizer)["input_ids"]) <= args.seq_len]
    if len(fits) < wanted:
        raise SystemExit(f"too few generated records fit --seq-len {args.seq_len}; raise it")
    records = fits
    train, validation = records[:num_train], records[num_train : num_train + num_validation]
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("validation", validation)):
        (data_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return tokenizer, train, validation


def build_tiny_base(args: argparse.Namespace, tokenizer, base_dir: Path) -> dict[str, Any]:
    """The default base: a small random Llama of --hidden/--layers/--vocab, built on the CPU in float32."""
    import torch

    from finetune.embedded.tiny import build_tiny_llama

    heads = max(1, args.hidden // 64)
    intermediate = 32 * round(args.hidden * 8 / 3 / 32)
    model = build_tiny_llama(
        tokenizer,
        seed=SEED,
        hidden_size=args.hidden,
        intermediate_size=intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        tie_word_embeddings=not args.untied,
        max_position_embeddings=max(args.seq_len * args.micro_batch_size, 2048),
    )
    if args.vocab > len(tokenizer):
        # The tokenizer learnt fewer pieces than asked (the generated words run out): give the model the
        # vocabulary asked for anyway, as a padded vocabulary, so embedding, lm_head and the softmax cost
        # what they cost at that size. The extra rows are never a target.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model.resize_token_embeddings(args.vocab, mean_resizing=False)
    model.save_pretrained(base_dir)
    return {
        "hidden": args.hidden,
        "layers": args.layers,
        "intermediate": intermediate,
        "heads": heads,
        "kv_heads": max(1, heads // 2),
        "vocab": model.config.vocab_size,
        "tied_embeddings": not args.untied,
        "tokenizer_vocab": len(tokenizer),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def build_catalog_base(args: argparse.Namespace, tokenizer, base_dir: Path, device: str) -> dict[str, Any]:
    """A base of a catalog model's shape (`--base-config`, shrunken with `--smoke`), random weights built on
    the arms' device in `--model-dtype` (bench/presets.py)."""
    from bench.presets import base_config, build_random_base

    config = base_config(args.base_config, args.smoke, tokenizer, args.seq_len * args.micro_batch_size)
    built = build_random_base(config, base_dir, device=device, dtype=args.model_dtype, seed=SEED)
    return {
        "base_config": args.base_config + (" (shrunken: --smoke)" if args.smoke else ""),
        "hidden": config.hidden_size,
        "layers": config.num_hidden_layers,
        "intermediate": config.intermediate_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "vocab": config.vocab_size,
        "tied_embeddings": config.tie_word_embeddings,
        "tokenizer_vocab": len(tokenizer),
        **built,
    }


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The part of the spec the arms read straight from the command line."""
    return {
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "loss_tail_steps": args.loss_tail_steps,
        "micro_batch_size": args.micro_batch_size,
        "grad_accum_steps": args.grad_accum,
        "lr": args.lr,
        "seq_len": args.seq_len,
        "precision": args.precision,
        "model_dtype": args.model_dtype,
        "quantization": args.quantization,
        "gradient_checkpointing": args.gradient_checkpointing,
        "compile": args.compile,
        "ours_overrides": args.ours_set,
        "threads": args.threads,
        "verbose": args.verbose,
        "profile_steps": args.profile_steps,
        "own_eval": not args.no_own_eval,
        "heldout_batch_size": args.heldout_batch_size,
        "preset": args.preset,
        "smoke": args.smoke,
    }


def prepare(args: argparse.Namespace, workdir: Path, device: str) -> dict[str, Any]:
    """Write the base model, tokenizer and data under `workdir`; return the spec every arm reads."""
    import torch

    start = time.perf_counter()
    data_dir = workdir / "data"
    tokenizer, train, validation = make_data(args, data_dir)
    base_dir = workdir / "base"
    if args.base_config:
        model = build_catalog_base(args, tokenizer, base_dir, device)
    else:
        model = build_tiny_base(args, tokenizer, base_dir)
    tokenizer.save_pretrained(base_dir)
    lengths = sorted(len(tokenize_record(r, tokenizer)["input_ids"]) for r in train)
    return {
        "workdir": str(workdir),
        "base_dir": str(base_dir),
        "train_path": str(data_dir / "train.jsonl"),
        "validation_path": str(data_dir / "validation.jsonl"),
        "device": device,
        **run_settings(args),
        "model": model,
        "data": {
            "train_records": len(train),
            "validation_records": len(validation),
            "train_tokens": sum(lengths),
            "median_tokens": lengths[len(lengths) // 2],
            "p90_tokens": lengths[int(0.9 * len(lengths))],
            "max_tokens": lengths[-1],
        },
        "prepare_seconds": time.perf_counter() - start,
        "torch_threads": args.threads or torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------------------------
# Report


def versions() -> dict[str, str]:
    """Python's and the stack's versions, read from the installed packages' metadata (nothing imported)."""
    from importlib.metadata import version

    packages = ("torch", "transformers", "peft", "accelerate", "datasets")
    return {"python": platform.python_version(), **{name: version(name) for name in packages}}


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f}"


def format_table(results: dict[str, dict[str, Any]]) -> str:
    rows = [
        ("wall s (timed steps)", "train_seconds", "{:.1f}"),
        ("median s/step", "median_step_seconds", "{:.2f}"),
        ("CPU s (timed steps)", "train_cpu_seconds", "{:.1f}"),
        ("real tokens/s", "tokens_per_s", "{:.0f}"),
        ("real tokens/s, median step", "median_step_tokens_per_s", "{:.0f}"),
        ("real tokens per CPU s", "tokens_per_cpu_s", "{:.0f}"),
        ("label tokens/s", "label_tokens_per_s", "{:.0f}"),
        ("model GFLOP/s", "model_flops_per_s", lambda flops: f"{flops / 1e9:.1f}"),
        ("MFU (of the matmul peak)", "mfu", "{:.1%}"),
        ("MFU per CPU s", "mfu_per_cpu_s", "{:.1%}"),
        ("real tokens (timed)", "real_tokens", "{:.0f}"),
        ("padding computed", "padding_fraction", "{:.1%}"),
        ("peak RSS MiB", "peak_rss_mib", "{:.0f}"),
        ("peak GPU GiB (max allocated)", "peak_gpu_bytes", gib),
        ("peak GPU GiB reserved", "peak_gpu_reserved_bytes", gib),
        ("finetune plan GiB, less the runtime", "plan_bytes", gib),
        ("plan / measured peak", "plan_over_measured", "{:.2f}"),
        ("final train loss", "final_train_loss", "{:.4f}"),
        ("held-out loss", "heldout_loss", "{:.4f}"),
        ("setup s", "setup_seconds", "{:.1f}"),
        ("  of which load + data s", "load_and_data_seconds", "{:.1f}"),
        ("  of which base eval s", "base_eval_seconds", "{:.1f}"),
        ("warm-up s", "warmup_seconds", "{:.1f}"),
        ("after-training s", "after_seconds", "{:.1f}"),
        ("load avg before/after", None, None),
    ]
    arms = list(results)
    base = results.get(BASELINE)
    header = ["", *arms] + [f"{a} / hf" for a in arms if base and a != BASELINE]
    lines = [header]
    for label, key, fmt in rows:
        if key is None:
            cells = [f"{results[a]['load_average_before']:.1f}/{results[a]['load_average_after']:.1f}" for a in arms]
            lines.append([label, *cells] + ["" for a in arms if base and a != BASELINE])
            continue
        values = [results[a].get(key) for a in arms]
        if all(value is None for value in values):  # a GPU figure on CPU, MFU per CPU s on a GPU
            continue
        show = fmt if callable(fmt) else fmt.format
        cells = [show(value) if value is not None else "" for value in values]
        ratios = []
        if base:
            for a in arms:
                if a != BASELINE:
                    ours, theirs = results[a].get(key), base.get(key)
                    ratios.append(f"{ours / theirs:.2f}x" if ours is not None and theirs else "")
        lines.append([label, *cells, *ratios])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def check_same_data(results: dict[str, dict[str, Any]]) -> list[str]:
    """Warnings when the arms did not tokenize the records identically."""
    warnings = []
    stats = {arm: r["data_stats"] for arm, r in results.items()}
    reference = next(iter(stats.values()))
    for arm, s in stats.items():
        for key in ("num_records", "num_tokens", "num_label_tokens"):
            if s.get(key) != reference.get(key):
                warnings.append(f"{arm}: {key} {s.get(key)} differs from {reference.get(key)}")
    return warnings


def run_arm_process(arm: str, spec_path: Path, out_path: Path, env: dict[str, str]) -> dict[str, Any] | None:
    """One arm in a fresh process; its result, or None when it failed."""
    command = [sys.executable, str(Path(__file__).resolve()), "--_arm", arm, "--_spec", str(spec_path)]
    started = time.perf_counter()
    completed = subprocess.run([*command, "--_out", str(out_path)], env=env, cwd=spec_path.parent)
    if completed.returncode != 0:
        say(f"{arm} failed with exit code {completed.returncode}")
        return None
    result = json.loads(out_path.read_text())
    result["process_seconds"] = time.perf_counter() - started
    say(
        f"{arm}: {result['tokens_per_s']:.0f} real tokens/s over {result['timed_steps']} steps, held-out loss "
        f"{result['heldout_loss']:.4f}, process {result['process_seconds']:.0f} s"
    )
    return result


def measure_peaks(precision: str, env: dict[str, str], device: str = "cpu") -> dict[str, dict[str, Any]]:
    """The matmul peak (bench/matmul_peak.py) in a fresh process with the arms' environment (threads, GPU)."""
    precisions = ["fp32"] + (["bf16"] if precision == "bf16" else [])
    command = [sys.executable, str(Path(__file__).with_name("matmul_peak.py")), "--precisions", ",".join(precisions)]
    command += ["--device", device] if device != "cpu" else []
    completed = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def best_peak(measurements: list[dict[str, dict[str, Any]]], precision: str) -> dict[str, float]:
    """The best of the measurements taken before and after the arms: load only ever lowers a peak.
    A GPU's has no per-CPU-second figure."""
    keys = [key for key in ("flops_per_s", "flops_per_cpu_s") if key in measurements[0][precision]]
    return {key: max(m[precision][key] for m in measurements) for key in keys}


def add_utilisation(result: dict[str, Any], peak: dict[str, float]) -> None:
    """MFU: model FLOPs per second over the peak, by wall time and by CPU time (see bench/matmul_peak.py);
    on a GPU by wall time only (`mfu_per_cpu_s` None)."""
    result["mfu"] = result["model_flops_per_s"] / peak["flops_per_s"]
    per_cpu_s = peak.get("flops_per_cpu_s")
    result["mfu_per_cpu_s"] = result["model_flops_per_cpu_s"] / per_cpu_s if per_cpu_s else None


def add_plan(result: dict[str, Any], plan: dict[str, Any]) -> None:
    """`finetune plan`'s estimate (less its runtime part) beside the arm's measured peak GPU memory."""
    from bench.presets import plan_over_measured

    result["plan_bytes"] = plan["comparable_bytes"]
    result["plan_over_measured"] = plan_over_measured(plan["comparable_bytes"], result.get("peak_gpu_bytes"))


def describe_peak(peak: dict[str, float], precision: str, spec: dict[str, Any]) -> str:
    """One line for the printed report: the peak MFU is taken against."""
    if "flops_per_cpu_s" not in peak:
        return (
            f"matmul peak ({precision}, {spec['device']}, best of before and after the arms): "
            f"{peak['flops_per_s'] / 1e12:.1f} TFLOP/s"
        )
    return (
        f"matmul peak ({precision}, {spec['torch_threads']} threads, best of before and after the arms): "
        f"{peak['flops_per_s'] / 1e9:.1f} GFLOP/s, {peak['flops_per_cpu_s'] / 1e9:.1f} GFLOP per CPU s"
    )


RATIO_KEYS = ("tokens_per_s", "tokens_per_cpu_s", "median_step_tokens_per_s")


def median_ratios(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per figure and arm, the median over rounds of (arm / baseline) within the same round."""
    medians: dict[str, dict[str, float]] = {}
    for key in RATIO_KEYS:
        for arm in {arm for results in rounds for arm in results} - {BASELINE}:
            ratios = [r[arm][key] / r[BASELINE][key] for r in rounds if arm in r and BASELINE in r]
            if ratios:  # of an even count, the mean of the middle two (not the upper one)
                medians.setdefault(key, {})[arm] = statistics.median(ratios)
    return medians


def median_round(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each arm's result from the round where its real tokens/s was the median of its rounds."""
    results = {}
    for arm in dict.fromkeys(arm for results in rounds for arm in results):
        runs = sorted((r[arm] for r in rounds if arm in r), key=lambda result: result["tokens_per_s"])
        results[arm] = runs[len(runs) // 2]
    return results


def run_rounds(
    arms: list[str], args: argparse.Namespace, spec_path: Path, env: dict[str, str]
) -> list[dict[str, dict[str, Any]]]:
    """`--repeats` rounds of every arm, each arm in a fresh process, each round starting with another arm."""
    rounds: list[dict[str, dict[str, Any]]] = []
    for number in range(1, args.repeats + 1):
        rounds.append({})
        first = (number - 1) % len(arms)
        for arm in arms[first:] + arms[:first]:
            say(f"round {number}/{args.repeats}: running {arm} ({args.steps} steps, {args.precision})")
            result = run_arm_process(arm, spec_path, spec_path.parent / f"result-{arm}-{number}.json", env)
            if result is not None:
                rounds[-1][arm] = result
    return rounds


def print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    spec, peak = report["spec"], report["matmul_peak"]["best"]
    print(f"\n{report['date_utc']}  {report['command']}")
    if args.profile_steps:
        print(f"PROFILED ({args.profile_steps} steps under torch.profiler): the speeds below are distorted")
    machine = report["machine"] + (f", {report['gpu']}" if report["gpu"] else "")
    print(", ".join(f"{k} {v}" for k, v in report["versions"].items()) + f"; {machine}")
    m, d = spec["model"], spec["data"]
    base = m.get("base_config", "Llama")
    print(
        f"model: {base} {m['parameters'] / 1e6:.2f}M parameters (hidden {m['hidden']}, {m['layers']} layers, "
        f"vocab {m['vocab']}); LoRA r=16 all-linear; {args.steps} steps ({args.warmup_steps} warm-up), micro-batch "
        f"{args.micro_batch_size} x accumulation {args.grad_accum}, lr {args.lr}, {args.precision}"
        f"{', compiled' if args.compile else ''}; max_seq_len {args.seq_len}; records median "
        f"{d['median_tokens']} / p90 {d['p90_tokens']} / max {d['max_tokens']} tokens"
        + (f"; base {spec['model_dtype']}" if spec["model_dtype"] != "float32" else "")
        + (f", {spec['quantization']} nf4" if spec["quantization"] != "none" else "")
        + (", gradient checkpointing" if spec["gradient_checkpointing"] else "")
        + f"; on {spec['device']}"
        + (f"; ours with {' '.join(spec['ours_overrides'])}" if spec.get("ours_overrides") else "")
    )
    print(describe_peak(peak, args.precision, spec))
    if report["plan"]:
        plan = report["plan"]
        print(
            f"finetune plan ({plan['device']}): peak {plan['peak_bytes'] / 2**30:.2f} GiB, of which runtime "
            f"{plan['runtime_bytes'] / 2**30:.2f} GiB (not in torch.cuda.max_memory_allocated): "
            f"{plan['comparable_bytes'] / 2**30:.2f} GiB to compare with each arm's peak"
        )
    print(format_table(report["results"]))
    if args.repeats > 1:
        print(f"median over {args.repeats} interleaved rounds of each round's ratio to {BASELINE}:")
        for key, ratios in report["median_ratios"].items():
            print(f"  {key}: " + ", ".join(f"{arm} {ratio:.2f}x" for arm, ratio in ratios.items()))
    for warning in report["warnings"]:
        print(f"WARNING: {warning}")


def resolve_device(requested: str, parser: argparse.ArgumentParser) -> Literal["cpu", "cuda"]:
    """Where the arms train: `auto` is the GPU when torch sees one (as `finetune train` does), else the CPU."""
    if requested == "cpu":
        return "cpu"
    if requested == "cuda" and not on_gpu():
        parser.error("--device cuda: torch sees no CUDA device")
    return "cuda" if on_gpu() else "cpu"


def add_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the GPU presets (bench/presets.py); each also works alone."""
    from bench.presets import PRESETS

    group = parser.add_argument_group("GPU presets and real-size shapes")
    group.add_argument("--preset", choices=sorted(PRESETS), help="a GPU preset: sets the flags below and others")
    group.add_argument("--smoke", action="store_true", help="shrink the preset's model and rows: runs on a CPU")
    group.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where every arm trains")
    group.add_argument(
        "--base-config", help="hub id of a catalog base: its shape (finetune/plan/configs), random weights"
    )
    group.add_argument("--model-dtype", choices=("float32", "bfloat16"), default="float32", help="the base's dtype")
    group.add_argument("--quantization", choices=("none", "4bit"), default="none", help="4bit: nf4 QLoRA in every arm")
    group.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="in every arm (a preset's default; --no-gradient-checkpointing turns it off)",
    )
    group.add_argument(
        "--long-records", action="store_true", help="every record 95-100%% of --seq-len tokens (full rows)"
    )
    group.add_argument("--heldout-batch-size", type=int, default=8, help="rows per batch of the held-out loss")


def parse_arguments(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command line, a `--preset`'s values as defaults (flags given explicitly still win)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per arm (default 10)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps run before timing starts (default 2)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (heads of 64; default 256)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument(
        "--vocab",
        type=int,
        default=8192,
        help="vocabulary: the tokenizer is trained to this size, the model gets it even where the tokenizer learns fewer (default 8192)",
    )
    parser.add_argument(
        "--untied", action="store_true", help="an lm_head of its own instead of the input embedding's (same FLOPs)"
    )
    parser.add_argument("--seq-len", type=int, default=512, help="max_seq_len: longest record")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile in every arm (ours compiles on CUDA anyway: train.compile auto)",
    )
    parser.add_argument(
        "--ours-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for ours' arms only, as `finetune train` takes it (repeatable), e.g. "
        "train.compile=true: tries a setting against the same Trainer run",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per arm (default: torch's own). On a shared machine, 1 thread makes "
        "'tokens per CPU s' a measure of the work alone, since no thread waits for another",
    )
    parser.add_argument("--records", type=int, default=800, help="training records (at least enough for the steps)")
    parser.add_argument(
        "--one-epoch",
        action="store_true",
        help="train on exactly --records documents once: --steps becomes records / (micro-batch x accumulation)",
    )
    parser.add_argument("--validation-records", type=int, default=64)
    parser.add_argument(
        "--no-own-eval",
        action="store_true",
        help="skip each arm's own evaluations (ours' base and final eval, the Trainer's evaluate()), outside the "
        "timed steps; the held-out loss this script computes for every arm is kept",
    )
    parser.add_argument("--loss-tail-steps", type=int, default=3, help="final train loss = mean of the last N steps")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of all arms, interleaved; ratios are medians over rounds"
    )
    parser.add_argument("--workdir", type=Path, help="where model, data and runs go (default: a temp dir, removed)")
    parser.add_argument(
        "--reuse-prepared",
        action="store_true",
        help="with --workdir: reuse the model and data an earlier run with the same shape flags prepared there "
        "(saves building and saving a real-size base to try another setting)",
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--verbose", action="store_true", help="show each arm's own log")
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="print each arm's busiest operations over N steps after the warm-up (torch.profiler; GPU kernels "
        "on a GPU); slows those steps: a diagnosis, not figures to quote",
    )
    add_gpu_arguments(parser)
    parser.add_argument("--_arm", help=argparse.SUPPRESS)
    parser.add_argument("--_spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--_out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.preset:
        from bench.presets import PRESETS, flag_defaults

        parser.set_defaults(**flag_defaults(PRESETS[args.preset], args.smoke))
        args = parser.parse_args(argv)
    if args.one_epoch:
        args.steps = args.records // (args.micro_batch_size * args.grad_accum)
        args.records = args.steps * args.micro_batch_size * args.grad_accum
    return parser, args


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_arguments(argv)

    if args._arm:
        run_arm(args._spec, args._arm, args._out)
        return 0

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    if not 0 < args.warmup_steps < args.steps:
        parser.error("--warmup-steps must be at least 1 and below --steps")
    if args.smoke and not args.base_config:
        parser.error("--smoke shrinks a --preset (or --base-config); give one")
    device = resolve_device(args.device, parser)
    if args.base_config and device == "cpu" and not args.smoke:
        parser.error(f"--base-config {args.base_config} builds the full-size model: that needs a GPU; add --smoke")
    skipped = {arm: why for arm in arms if (why := why_arm_cannot_run(arm, device))}
    for arm, why in skipped.items():
        say(f"skipping {arm}: {why}")
    arms = [arm for arm in arms if arm not in skipped]

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="finetune-bench-train-"))
    workdir.mkdir(parents=True, exist_ok=True)
    threads_env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)} if args.threads else {}
    env = {
        **os.environ,
        **threads_env,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_CACHE": str(workdir / "hf-datasets-cache"),
        "PYTHONWARNINGS": "ignore",
        **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" and on_gpu() else {}),
    }
    os.environ.update(
        {
            k: env[k]
            for k in (
                "HF_HUB_OFFLINE",
                "HF_DATASETS_OFFLINE",
                "TRANSFORMERS_OFFLINE",
                "TOKENIZERS_PARALLELISM",
                "HF_DATASETS_CACHE",
            )
        }
    )
    try:
        spec_path = workdir / "spec.json"
        if args.reuse_prepared and spec_path.exists():
            say(f"reusing the model and data prepared in {workdir}")
            spec = {**json.loads(spec_path.read_text()), **run_settings(args)}
        else:
            say(f"preparing model and data in {workdir}")
            spec = prepare(args, workdir, device)
        spec_path.write_text(json.dumps(spec, indent=2))
        say(
            f"model {spec['model']['parameters'] / 1e6:.2f}M parameters, {spec['data']['train_records']} training "
            f"records (median {spec['data']['median_tokens']}, p90 {spec['data']['p90_tokens']}, max "
            f"{spec['data']['max_tokens']} tokens); prepared in {spec['prepare_seconds']:.1f} s"
        )
        plan = None
        if device == "cuda" or args.base_config:  # the memory figure a GPU run is judged by
            from bench.presets import plan_figures

            plan = plan_figures(ours_recipe(spec, "ours-packed"), device)
        say(f"measuring the matmul peak ({args.precision}, {device})")
        peaks = [measure_peaks(args.precision, env, device)]
        rounds = run_rounds(arms, args, spec_path, env)
        peaks.append(measure_peaks(args.precision, env, device))
        peak = best_peak(peaks, args.precision)
        for round_results in rounds:
            for result in round_results.values():
                add_utilisation(result, peak)
                if plan is not None:
                    add_plan(result, plan)
        results = median_round(rounds)
        if not results:
            return 1
        report = {
            "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python", "bench/train_throughput.py", *(argv if argv is not None else sys.argv[1:])]),
            "versions": versions(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {spec['torch_threads']}",
            "gpu": peaks[0][args.precision].get("gpu"),
            "spec": spec,
            "matmul_peak": {"best": peak, "precision": args.precision, "measurements": peaks},
            "plan": plan,
            "results": results,
            "rounds": rounds,
            "median_ratios": median_ratios(rounds),
            "skipped_arms": skipped,
            "warnings": check_same_data(results),
        }
        print_report(report, args)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
        return 0
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""Training, resuming and the command line on a CUDA device: what CPU runs cannot show.

Every test here carries the `gpu` marker and is skipped, saying so, where no CUDA device is visible
(`bench/gpu_check.sh` runs them on a GPU machine). The adapter arithmetic's exactness on CUDA is tested
beside its CPU twin (`test_adapters_inmemory.py`, the `cuda` case of each device-parametrized test), and
serving in `test_serve.py`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import finetune
from finetune.adapters.quantized import dequantize, is_quantized_linear
from finetune.cli import main
from finetune.manifest import read_manifest
from finetune.prompting import prompt_ids
from finetune.training.loop import SLOW_STEP_ENV, train

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]
# cuBLAS is deterministic run to run with a fixed workspace; eager attention has no atomics in its backward.
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _learned(adapter_dir: Path) -> dict:
    """The manifest's metrics, after checking that held-out loss fell below the base's."""
    metrics = read_manifest(adapter_dir).metrics
    assert metrics["eval_loss"] < metrics["base_eval_loss"], metrics
    return metrics


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.dtype=bfloat16", "train.precision=bf16"],
        ["model.quantization=4bit", "model.dtype=bfloat16"],
        ["model.quantization=8bit"],
    ],
    ids=["bf16-lora", "qlora-4bit", "lora-8bit"],
)
def test_training_on_the_gpu_learns_and_its_adapter_merges_there(workdir, overrides):
    adapter_dir, _ = train("recipe.yaml", [*overrides, "train.max_steps=12", "output.name=gpu"], log=lambda m: None)
    metrics = _learned(adapter_dir)
    assert max(metrics["peak_memory_bytes_per_rank"]) > 0  # measured with torch.cuda.max_memory_allocated
    m = finetune.load_model(adapter_dir)  # the base (quantized as trained) on the GPU, the adapter in use
    assert m.device.type == "cuda" and m.model.model.layers[0].mlp.up_proj.base_layer.weight.is_cuda
    m.use(None)
    module = "model.layers.0.self_attn.q_proj"
    layer = m.model.get_submodule(module).base_layer
    expected = (dequantize(layer) if is_quantized_linear(layer) else layer.weight.float()) + m.adapters[
        m.attached[0]
    ].delta(module, device=m.device)
    m.merge(m.attached[0])  # crashed on cuda:0 vs cpu before the base was one resolved value
    merged = m.model.get_submodule(module)
    merged = getattr(merged, "base_layer", merged)
    assert torch.equal(merged.weight, expected.to(merged.weight.dtype))


@pytest.mark.parametrize("compile_layers", ["false", "auto"])
def test_resume_after_sigkill_on_the_gpu_is_bit_identical(workdir, compile_layers):
    """Eager attention and a fixed cuBLAS workspace: every kernel of a step is deterministic, so bit for bit.

    Both ways of running the layers: this test failed on an H100 with `compile: auto` (which compiles an fp32 base
    on CUDA), while a resume within one process was bit for bit. A lead, not yet checked there: the killed run
    compiled each layer for its first shape, then dynamic for the later ones; the resumed process starts at
    another shape, and its first kernels are compiled for that shape alone (on the CPU the same resume is bit for
    bit)."""
    args = [
        f"train.compile={compile_layers}",
        "model.attn_implementation=eager",
        "train.max_steps=12",  # killed at step 5: 3 processes of 12 steps fit a short lease
        "train.save_every_steps=1",
        "train.log_every_steps=1",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), **DETERMINISTIC}
    command = [sys.executable, "-m", "finetune", "train", "recipe.yaml", *args]
    killed = [*command, "output.name=killed"]
    process = subprocess.Popen(
        killed, cwd=workdir, env={**env, SLOW_STEP_ENV: "0.2"}, stderr=subprocess.PIPE, text=True
    )
    assert process.stderr is not None
    for line in process.stderr:  # kill it mid-run, at step 5
        if line.startswith("step 5/"):
            process.send_signal(signal.SIGKILL)
            break
    process.wait(timeout=120)
    assert process.returncode == -signal.SIGKILL
    for run in ([*killed, "--resume"], [*command, "output.name=reference"]):  # the reference: one unbroken run
        finished = subprocess.run(run, cwd=workdir, env=env, capture_output=True, text=True)
        assert finished.returncode == 0, finished.stderr[-3000:]
    adapters = workdir / "adapters"
    expected, actual = (load_file(adapters / name / "adapter_model.safetensors") for name in ("reference", "killed"))
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


def test_checkpointing_some_layers_on_the_gpu_trains_the_same_adapter(workdir):
    """`train.gradient_checkpointing: 1` (of the tiny base's 2 layers) against none, bf16 on CUDA, each run in a
    fresh process with eager attention and layers (deterministic kernels): the recomputed layer draws the same
    dropout masks from the restored CUDA generator, so the adapters agree bit for bit; `auto` checkpoints nothing
    on a GPU with room, and says so."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **DETERMINISTIC}
    command = [sys.executable, "-m", "finetune", "train", "recipe.yaml", "train.max_steps=3", "train.compile=false",
               "model.attn_implementation=eager", "model.dtype=bfloat16", "train.precision=bf16"]  # fmt: skip
    logs = {}
    for setting in ("1", "false", "auto"):
        done = subprocess.run([*command, f"train.gradient_checkpointing={setting}", f"output.name=ckpt-{setting}"],
                              cwd=workdir, env=env, capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        logs[setting] = done.stderr + done.stdout
    assert "gradient checkpointing on for 1 of 2 layers" in logs["1"]
    assert "gradient checkpointing off (auto)" in logs["auto"]
    adapters = workdir / "adapters"
    one, none = (load_file(adapters / f"ckpt-{name}" / "adapter_model.safetensors") for name in ("1", "false"))
    assert one.keys() == none.keys() and all(torch.equal(one[name], none[name]) for name in one)


def test_eval_and_generate_run_on_the_gpu_and_agree_with_the_cpu(workdir, capsys):
    adapter_dir, _ = train("recipe.yaml", ["train.max_steps=6", "output.name=small"], log=lambda m: None)
    perplexities = {}
    for device in ("cuda", "cpu"):
        assert main(["eval", "--adapter", str(adapter_dir), "--data", "valid.jsonl", "--format", "instruction",
                     "--device", device]) == 0  # fmt: skip
        line = capsys.readouterr().out.splitlines()[-1]  # base + adapter: perplexity P (...)
        perplexities[device] = float(line.split("perplexity ")[1].split()[0])
    assert perplexities["cuda"] == pytest.approx(perplexities["cpu"], rel=1e-4)  # other kernels; TF32 matmuls
    m = finetune.load_model(adapter_dir, device="cuda")
    prompt = "### Instruction:\nName a crate.\n\n### Response:\n"
    ids = torch.tensor([prompt_ids(m.tokenizer, prompt)], device=m.device)  # `finetune generate`'s own rule
    with torch.no_grad():
        expected = m.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
            pad_token_id=m.tokenizer.pad_token_id, eos_token_id=m.tokenizer.eos_token_id,
        )  # fmt: skip
    assert main(["generate", "--adapter", str(adapter_dir), "--device", "cuda", "--max-new-tokens", "12", prompt]) == 0
    text = m.tokenizer.decode(expected[0, ids.shape[1] :], skip_special_tokens=True)
    assert capsys.readouterr().out == text + "\n"


def test_more_processes_than_gpus_is_refused_before_any_launch(workdir, capsys):
    assert main(["train", "recipe.yaml", "--nproc", str(torch.cuda.device_count() + 1)]) == 2
    assert "GPU(s) are visible" in capsys.readouterr().err


def test_grpo_samples_and_trains_on_the_gpu(tmp_path, tiny_base_dir, tiny_tokenizer, monkeypatch):
    """GRPO's sampler on CUDA (in-place KV cache, shared prefill, lean LoRA layers): greedy rows equal a full
    forward per token on each prompt alone; then a bf16 GRPO run samples, scores and updates there."""
    from grpo_helpers import write_grpo_run
    from transformers import AutoModelForCausalLM

    from finetune.generation.sample import SampleSettings, sample_completions

    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir).to("cuda").eval()
    prompts = [tiny_tokenizer(text)["input_ids"] for text in ("def add(a, b):", "for i in", "x", "for i in")]
    got = sample_completions(model, prompts, SampleSettings(12, temperature=0.0), stop_ids=set(), pad_token_id=0)
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            for _ in range(12):
                ids = torch.cat([ids, model(input_ids=ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
        assert tokens == ids[0, len(prompt) :].tolist()

    monkeypatch.chdir(tmp_path)
    recipe = write_grpo_run(tmp_path, tiny_base_dir, "lengths.py:short")
    adapter_dir, _ = train(recipe, ["model.dtype=bfloat16", "train.precision=bf16", "train.report_to=[]"],
                           log=lambda m: None)  # fmt: skip
    lines = [json.loads(line) for line in (tmp_path / "runs" / "grpo-run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward" in line]
    assert len(steps) == 3 and all(-1.0 <= line["reward"] <= 0.0 and line["generate_s"] > 0 for line in steps)
    assert read_manifest(adapter_dir).metrics["peak_memory_bytes_per_rank"][0] > 0  # CUDA memory: it ran there


def test_moe_rows_on_the_gpu_compute_with_their_adapter_merged(tmp_path, tiny_tokenizer):
    """Per-request MoE adapters (`finetune serve`) on CUDA in bf16: the whole batch with one adapter in use is
    the merged model bit for bit; each row of a mixed batch is within a few ulps of its merged model."""
    from helpers import ROUNDED_ULPS, assert_within_ulps
    from moe_helpers import build_moe, merged_logits, moe_adapter

    from finetune.serve.settings import BASE_ROW

    base_dir = build_moe("qwen3_moe", tmp_path / "base", tiny_tokenizer)
    adapters = {n: str(moe_adapter(base_dir, tmp_path / n, seed=s, linear=False)) for n, s in (("one", 1), ("two", 2))}
    m = finetune.load_model(str(base_dir), adapters, dtype="bfloat16", device="cuda", force=True)
    rows = ["two", BASE_ROW, "one", "two"]
    ids = torch.arange(3, 3 + 8 * len(rows), device="cuda").reshape(len(rows), 8)
    expected = merged_logits(m, [None, "one", "two"], ids)
    m.use("one")
    with torch.no_grad():
        assert torch.equal(m.model(input_ids=ids).logits, expected["one"])
    m.attach("two")
    with torch.no_grad():
        logits = m.use_per_row()(input_ids=ids, adapter_names=rows).logits
    assert logits.is_cuda
    for row, name in enumerate(rows):
        reference = expected[None if name == BASE_ROW else name][row]
        assert_within_ulps(logits[row], reference, ROUNDED_ULPS, dtype=torch.bfloat16, what=f"row {row} ({name})")


def test_auto_dtype_and_precision_train_in_bf16_on_the_gpu(workdir):
    """`model.dtype: auto` and `train.precision: auto` resolve to bf16 on a bf16-capable GPU, and say so."""
    log: list[str] = []
    adapter_dir, _ = train("recipe.yaml", ["model.dtype=auto", "train.precision=auto", "train.max_steps=4",
                                           "output.name=auto"], log=log.append)  # fmt: skip
    recipe = yaml.safe_load((adapter_dir / "recipe.yaml").read_text())
    assert recipe["model"]["dtype"] == "bfloat16" and recipe["train"]["precision"] == "bf16", recipe
    _learned(adapter_dir)

"""The benchmarks' own logic, cheaply: `python -m bench`'s command line, the GPU presets' shapes and recipe
against the shipped configs and `finetune plan`, the figures (MFU, plan ratio, the GPU check's table).

Nothing here trains or times anything (the smallest training run, `python -m bench --gpu --quick`, takes
minutes on 2 cores, which the suite's budget does not have), and no GPU is needed: the GPU paths'
arithmetic is fed figures shaped like a GPU run's.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `bench` is a directory of the checkout, not an installed package
    sys.path.insert(0, str(REPO))

from bench import check_table, matmul_peak, presets, train_throughput  # noqa: E402
from bench.report import GPU_HEADER, gpu_rows, skipped_arms  # noqa: E402

GiB = 2**30


def run_bench(*arguments: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "bench", *arguments], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_unknown_part_is_refused_with_the_valid_ones():
    completed = run_bench("--only", "swap,trian")
    assert completed.returncode == 2
    assert "unknown part(s) ['trian']; choose from train, swap, merge" in completed.stderr


def meta_model(config):
    """The model of `config` with shapes and no storage."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


# Published parameter counts of the two bases the presets take their shapes from.
@pytest.mark.parametrize(
    ("preset", "parameters"), [("llama-3.2-1b-lora", 1_235_814_400), ("llama-3.1-8b-qlora", 8_030_261_248)]
)
def test_preset_bases_have_the_real_models_shape_and_vocabulary(preset, parameters, tiny_tokenizer):
    config = presets.base_config(presets.PRESETS[preset].base_config, False, tiny_tokenizer, 2048)
    assert sum(p.numel() for p in meta_model(config).parameters()) == parameters  # tied once, as published
    assert config.vocab_size == 128_256 > len(tiny_tokenizer)  # the bench's tokenizer ids fit below it
    assert (config.bos_token_id, config.pad_token_id) == (tiny_tokenizer.bos_token_id, tiny_tokenizer.pad_token_id)


@pytest.mark.parametrize("preset", sorted(presets.PRESETS))
def test_smoke_shapes_suit_bitsandbytes_cpu_4bit_forward(preset, tiny_tokenizer):
    """bitsandbytes' CPU nf4 forward in eval mode needs every quantized layer's out_features divisible by 32."""
    config = presets.base_config(presets.PRESETS[preset].base_config, True, tiny_tokenizer, 512)
    layers = [m for m in meta_model(config).model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(layer.out_features % 32 == 0 for layer in layers)
    assert config.vocab_size > len(tiny_tokenizer)


def test_head_flops_are_counted_over_the_models_full_vocabulary(tmp_path, tiny_tokenizer):
    """The bench's tokenizer knows 512 pieces, the model 128,256: the head's FLOPs are the model's."""
    presets.base_config("meta-llama/Llama-3.2-1B", False, tiny_tokenizer, 2048).save_pretrained(tmp_path)
    with_head = train_throughput.micro_batch_flops(str(tmp_path), [100], label_tokens=60)
    without = train_throughput.micro_batch_flops(str(tmp_path), [100], label_tokens=0)
    # forward and input gradient of lm_head (2048 x 128,256) at each of the 60 labelled positions
    assert with_head - without == 60 * 4 * 2048 * 128_256


def test_a_preset_sets_defaults_that_explicit_flags_override():
    _, args = train_throughput.parse_arguments(["--preset", "llama-3.1-8b-qlora", "--steps", "4"])
    assert (args.quantization, args.model_dtype, args.precision) == ("4bit", "bfloat16", "bf16")
    assert (args.micro_batch_size, args.grad_accum, args.seq_len) == (2, 4, 2048)
    assert args.gradient_checkpointing and args.long_records and args.steps == 4
    _, smoke = train_throughput.parse_arguments(["--preset", "llama-3.1-8b-qlora", "--smoke"])
    assert (smoke.seq_len, smoke.steps, smoke.records) == (256, 3, 3 * 2 * 4)
    _, plain = train_throughput.parse_arguments([])
    assert (plain.quantization, plain.model_dtype, plain.heldout_batch_size, plain.device) == (
        "none",
        "float32",
        8,
        "auto",
    )


def _spec_on_the_8b_config(args) -> dict:
    """An arm's spec from parsed flags, without preparing anything: enough for ours' recipe and its plan."""
    return {
        **train_throughput.run_settings(args),
        "workdir": "/nonexistent",
        "base_dir": "meta-llama/Llama-3.1-8B",  # finetune plan finds the shipped config by hub id
        "train_path": "/nonexistent/train.jsonl",
        "validation_path": "/nonexistent/validation.jsonl",
    }


def test_the_qlora_presets_plan_is_finetune_plans_estimate_of_ours_recipe():
    _, args = train_throughput.parse_arguments(["--preset", "llama-3.1-8b-qlora"])
    spec = _spec_on_the_8b_config(args)
    plan = presets.plan_figures(train_throughput.ours_recipe(spec, "ours-packed"), "cuda")
    notes = {name: part["note"] for name, part in plan["parts"].items()}
    assert notes["weights"] == "8,030,261,248 frozen, 4-bit nf4"
    assert notes["activations"].startswith("checkpointed: 32 layer inputs")
    assert notes["logits"] == "chunks of 261 of 4096 tokens x 128,256 vocabulary"  # the chunked loss
    assert plan["comparable_bytes"] == plan["peak_bytes"] - plan["runtime_bytes"] > 5 * GiB  # 4-bit weights: 5.3


def test_a_setting_tried_on_ours_alone_reaches_ours_recipe_and_its_plan():
    """`--no-gradient-checkpointing` turns a preset's default off; `--ours-set` overrides ours' recipe only."""
    argv = ["--preset", "llama-3.1-8b-qlora", "--no-gradient-checkpointing", "--ours-set", "train.compile=true"]
    _, args = train_throughput.parse_arguments(argv)
    spec = _spec_on_the_8b_config(args)
    recipe = train_throughput.ours_recipe(spec, "ours-packed")
    assert (recipe.train.gradient_checkpointing, recipe.train.compile) == (False, True)
    plan = presets.plan_figures(recipe, "cuda")
    assert plan["parts"]["activations"]["note"] == "32 layers x 4096 tokens"  # nothing recomputed


def test_gpu_mfu_has_no_per_cpu_second_figure_and_the_plan_ratio_is_plan_over_measured():
    measurements = [{"bf16": {"flops_per_s": 700e12}}, {"bf16": {"flops_per_s": 786e12}}]
    peak = train_throughput.best_peak(measurements, "bf16")
    assert peak == {"flops_per_s": 786e12}
    result = {"model_flops_per_s": 393e12, "model_flops_per_cpu_s": 1e15, "peak_gpu_bytes": 20 * GiB}
    train_throughput.add_utilisation(result, peak)
    train_throughput.add_plan(result, {"comparable_bytes": 18 * GiB})
    assert (result["mfu"], result["mfu_per_cpu_s"]) == (0.5, None)
    assert result["plan_over_measured"] == 0.9
    cpu = {"model_flops_per_s": 30e9, "model_flops_per_cpu_s": 40e9}
    train_throughput.add_utilisation(cpu, {"flops_per_s": 60e9, "flops_per_cpu_s": 80e9})
    assert (cpu["mfu"], cpu["mfu_per_cpu_s"]) == (0.5, 0.5)
    assert presets.plan_over_measured(18 * GiB, None) is None  # measured on a CPU: no GPU peak


def test_matmul_peak_counts_two_n_cubed_per_product_on_cpu():
    peak = matmul_peak.measure_peak("fp32", sizes=(32,), trials=1, trial_seconds=0.01)
    assert peak["device"] == "cpu" and peak["size"] == 32
    assert peak["flops_per_s"] > 0 and peak["flops_per_cpu_s"] > 0


def test_long_records_are_trimmed_to_the_token_budget(tiny_tokenizer):
    record = {"instruction": "Explain things.", "output": " ".join(["Lorem ipsum dolor sit amet."] * 200)}
    trimmed = train_throughput.trim_to_tokens(record, tiny_tokenizer, 300)
    length = len(train_throughput.tokenize_record(trimmed, tiny_tokenizer)["input_ids"])
    one_more_word = record["output"][: record["output"].index(" ", len(trimmed["output"]) + 1)]
    longer = len(train_throughput.tokenize_record({**record, "output": one_more_word}, tiny_tokenizer)["input_ids"])
    assert length <= 300 < longer


def preset_figures(peak_bytes: int | None) -> dict:
    """A GPU preset's figures as train_throughput writes them, reduced to what the rows read."""
    arm = {"tokens_per_s": 5000.0, "mfu": 0.31, "plan_bytes": 16 * GiB, "heldout_loss": 11.9}
    return {
        "results": {
            "ours-packed": {**arm, "peak_gpu_bytes": peak_bytes, "plan_over_measured": 1.0 if peak_bytes else None},
            "hf-trainer": {**arm, "tokens_per_s": 4000.0, "peak_gpu_bytes": peak_bytes},
        },
        "median_ratios": {"tokens_per_s": {"ours-packed": 1.25}},
    }


def test_gpu_rows_show_each_arm_in_the_header_columns():
    rows = gpu_rows(preset_figures(16 * GiB))
    assert all(len(row) == len(GPU_HEADER) for row in rows)
    assert rows[0] == ["ours, packed", "5000", "1.25x", "31.0%", "16.00", "16.00", "1.00", "11.9000"]
    assert rows[1][2] == "1.00x"
    assert gpu_rows(preset_figures(None))[0][4:7] == ["n/a", "16.00", "n/a"]  # a CPU smoke run


def test_gpu_check_reports_no_collected_tests_without_failing_and_fails_a_failed_part(tmp_path):
    words, ok = check_table.summarise_tests(5, None)
    assert ok and "NO TESTS COLLECTED" in words
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1"/></testsuites>')
    counts = check_table.junit_counts(junit)
    assert counts == {"passed": 3, "failed": 1, "errors": 0, "skipped": 1}
    assert check_table.summarise_tests(1, counts) == (
        "FAILED: 3 passed, 1 failed, 0 errors, 1 skipped (pytest exit 1)",
        False,
    )
    bench = {"parts": {"a": {"figures": preset_figures(GiB)}, "b": {"error": "exit code 1; see b.log"}}}
    rows, ok = check_table.check_rows("3 passed", bench, 1)
    assert not ok and [row[0] for row in rows] == ["`pytest -m gpu`", "a", "a", "b"]
    assert rows[-1][1] == "FAILED: exit code 1; see b.log"
    assert check_table.check_rows("3 passed", {"parts": {"a": {"figures": preset_figures(GiB)}}}, 0)[1]


def test_on_a_gpu_step_ends_wait_for_the_gpu_and_memory_comes_from_the_allocator(monkeypatch):
    """The GPU branches call torch's real CUDA API (monkeypatch refuses a name torch does not have)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: 5 * GiB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *args: 6 * GiB)
    wall, cpu = train_throughput.clock()
    assert calls == ["synchronize"] and wall > 0 and cpu > 0
    assert train_throughput.gpu_memory() == {"peak_gpu_bytes": 5 * GiB, "peak_gpu_reserved_bytes": 6 * GiB}


def test_the_trainer_with_liger_kernel_is_skipped_saying_why_where_it_cannot_run():
    assert train_throughput.why_arm_cannot_run("hf-trainer", "cpu") is None
    assert "Triton kernels for CUDA" in train_throughput.why_arm_cannot_run("hf-trainer-liger", "cpu")
    installed = importlib.util.find_spec("liger_kernel") is not None
    assert (train_throughput.why_arm_cannot_run("hf-trainer-liger", "cuda") is None) == installed
    figures = {**preset_figures(None), "skipped_arms": {"hf-trainer-liger": "no CUDA"}}
    assert skipped_arms(figures) == ["\nNot run: HF Trainer + peft + Liger Kernel (`use_liger_kernel`): no CUDA."]
    assert all("hf-trainer-liger" in presets.flag_defaults(p, smoke=False)["arms"] for p in presets.PRESETS.values())


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_the_short_gpu_run_keeps_each_presets_sizes_with_one_round_of_six_steps(name):
    """`bench/gpu_check.sh --short` (`python -m bench --gpu --short`): for a GPU lent for minutes."""
    from bench.__main__ import GPU_PARTS

    _, full = train_throughput.parse_arguments(GPU_PARTS[name]["full"].split())
    _, short = train_throughput.parse_arguments(GPU_PARTS[name]["short"].split())
    assert (short.repeats, short.steps, short.warmup_steps) == (1, 6, 2)
    changed = {key for key, value in vars(short).items() if vars(full)[key] != value}
    assert changed == {"repeats", "steps"}  # the same records: enough for the full run, so for 6 steps


def test_the_step_profiler_covers_the_steps_after_the_warm_up_and_no_others(capsys):
    profiler = train_throughput.StepProfiler({"warmup_steps": 1, "steps": 5, "profile_steps": 2})
    matrix = torch.ones(8, 8)
    for step in range(1, 6):  # each step's end, then the next step's work: one product per step
        profiler.on_step_end(step)
        matrix @ matrix
        time.sleep(0.05)
    counts = {event.key: event.count for event in profiler.profiler.key_averages()}
    assert counts["aten::mm"] == 2  # steps 2 and 3, between the warm-up's end and step 3's end
    assert 0.1 <= profiler.wall_s < 1.0  # the two profiled steps' wall time: what the device time is set against
    profiler.report("ours-packed")
    assert (
        f"profile of steps 2-3 (by self_cpu_time_total; {profiler.wall_s:.2f} s of wall time" in capsys.readouterr().err
    )
    assert train_throughput.StepProfiler({"warmup_steps": 2, "steps": 6}).last == 2  # off unless asked


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA device is visible")
@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_levers.sh"])
def test_the_gpu_scripts_stop_at_once_without_a_cuda_device_saying_so(script):
    """Both share `bench/gpu_setup.sh`: on a machine without a GPU they stop before installing or running anything."""
    done = subprocess.run(["bash", str(REPO / "bench" / script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert (
        done.stderr.strip() == f"{script[:-3]}: FAILED: no CUDA device: torch.cuda.is_available() is False (or "
        "torch is missing); this needs a GPU"
    )


def test_the_step_ablation_prepares_the_benchs_model_and_packed_micro_batches(tmp_path):
    """bench/step_ablation.py built the bench's settings by hand and fell behind `train_throughput.prepare` (a
    TypeError, then an AttributeError): it now takes them from the bench's own parser."""
    from bench import step_ablation

    spec, batches = step_ablation.prepare(tmp_path, micro_batch_size=2, micro_batches=1)
    assert len(batches) == 1 and batches[0]["input_ids"].shape[0] >= 1
    assert (tmp_path / "base" / "config.json").is_file() and spec["base_dir"]

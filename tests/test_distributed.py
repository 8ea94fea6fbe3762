"""Two CPU processes over gloo, launched the way users launch them, train the same adapter as one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_within_ulps
from safetensors.torch import load_file

from finetune.training.loop import train

ADAM_STEPS_ULPS = 256  # of the largest LoRA weight after 2 steps (4.9 seen on an Intel Xeon without AMX)


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process(workdir):
    # Same global batch (2 ranks x 2 rows = 1 process x 4 rows), no dropout: the runs differ only in
    # how gradients are summed, so the adapters agree to float rounding.
    common = ["lora.dropout=0", "train.max_steps=2", "train.save_every_steps=100"]
    single, _ = train("recipe.yaml", [*common, "train.micro_batch_size=4", "output.name=single"])

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",  # of the launching process only: the launcher and ranks it starts run without it
            "-m",
            "finetune",
            "train",
            "recipe.yaml",
            *common,
            "train.micro_batch_size=2",
            "output.name=ranks",
            "--nproc",
            "2",
            "--cpu",  # CPU ranks over gloo, also where GPUs are
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es)" in result.stderr
    # The process that hands a CPU run to accelerate's launcher loads no torch (1.3 s of every such launch)
    launcher_imports = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if "import time:" in line}
    assert "finetune.recipe" in launcher_imports and "torch" not in launcher_imports
    distributed = json.loads(Path("adapters/ranks/manifest.json").read_text())["distributed"]
    assert distributed == {"strategy": "ddp", "world_size": 2, "max_rank_param_share": 1.0}

    expected = load_file(single / "adapter_model.safetensors")
    actual = load_file(Path("adapters/ranks/adapter_model.safetensors"))
    assert expected.keys() == actual.keys()
    largest = max(tensor.abs().max().item() for tensor in expected.values())
    for name in expected:  # two AdamW steps from gradients summed in another order: Adam's 1/sqrt(v) amplifies it
        assert_within_ulps(actual[name], expected[name], ADAM_STEPS_ULPS, scale=largest, what=name)
    assert any(t.abs().max() > 0 for t in actual.values())


@pytest.mark.slow
def test_a_bad_record_under_two_ranks_ends_in_its_one_line_error_and_exit_2(workdir):
    """Rank 0 refuses the record; rank 1, waiting for it at a barrier, says the process group broke; the launcher
    ends with 2, and neither torch.distributed's traceback nor its failure table is printed."""
    with open("train.jsonl", "a") as handle:
        handle.write(json.dumps({"instruction": "no output field"}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [sys.executable, "-m", "finetune", "train", "recipe.yaml", "--nproc", "2", "--cpu"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error: train.jsonl line 41 (record 41): no field 'output'")]
    assert all(line.startswith(("error: ", "[W")) for line in lines), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr


@pytest.mark.slow
def test_an_error_every_rank_finds_is_printed_once(workdir):
    """LoRA targets that match nothing are found by each rank after the launch (the base is loaded there): the line
    was printed once per rank, and two ranks' lines now and then ran together into one."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [sys.executable, "-m", "finetune", "train", "recipe.yaml", "lora.target_modules=[nothing_here]",
               "--nproc", "2", "--cpu"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("error:") == 1, result.stderr[-3000:]
    assert "error: lora.target_modules ['nothing_here'] match no module of the base model" in result.stderr


@pytest.mark.parametrize("max_batches", [None, 1, 2, 5])
@pytest.mark.parametrize("processes", [1, 2, 3])
def test_the_ranks_evaluate_the_rows_one_process_evaluates(processes, max_batches):
    """`train.eval_max_batches` is the first N micro-batches of the held-out data: taken per rank, two ranks
    evaluated twice the rows one process did (other held-out figures for the same model)."""
    from finetune.training.sharding import lockstep_batches

    expected = [row for batch, _ in lockstep_batches(11, 3, 0, 1, max_batches) for row in batch]
    shares = [lockstep_batches(11, 3, rank, processes, max_batches) for rank in range(processes)]
    counted = sorted(row for share in shares for batch, kept in share if kept for row in batch)
    assert counted == expected
    assert len({len(share) for share in shares}) == 1  # every rank runs as many forwards (a collective under FSDP)


@pytest.mark.slow
def test_held_out_figures_under_two_ranks_are_one_process_figures_with_eval_max_batches(workdir):
    common = ["train.max_steps=1", "train.micro_batch_size=3", "train.eval_max_batches=1"]
    train("recipe.yaml", [*common, "output.name=single"], log=lambda line: None)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [sys.executable, "-m", "finetune", "train", "recipe.yaml", *common, "output.name=ranks", "--nproc", "2"]
    result = subprocess.run([*command, "--cpu"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    single, ranks = ({**json.loads(Path(f"adapters/{name}/manifest.json").read_text())["metrics"]}
                     for name in ("single", "ranks"))  # fmt: skip
    assert ranks["eval_tokens"] == single["eval_tokens"] and ranks["base_eval_loss"] == pytest.approx(
        single["base_eval_loss"], abs=1e-6
    )

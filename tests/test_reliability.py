"""Numerics, reproducibility, security and endurance: the properties a long unattended run relies on."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import greedy_text
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from finetune.adapters.ledger import LEDGER_KEY, read_ledger
from finetune.commands.adapters import parse_adapter_spec
from finetune.embedded import build
from finetune.embedded.pretrain import PretrainSettings
from finetune.errors import FinetuneError, TrainingError
from finetune.recipe import apply_overrides, load_recipe, parse_override
from finetune.training.loop import train

REPO = Path(__file__).resolve().parents[1]


def quiet(message: str) -> None:
    """A `log` for runs whose lines nobody reads."""


# ---- numerics -------------------------------------------------------------------------------------------


def test_a_nonfinite_step_stops_the_run_naming_the_step_and_writing_no_adapter(workdir):
    with pytest.raises(TrainingError, match=r"step \d+: loss .* not finite.*no adapter was written") as caught:
        train("recipe.yaml", ["train.lr=1e30", "train.max_grad_norm=null", "train.save_every_steps=1"], log=quiet)
    assert "the last good checkpoint is runs/crates/checkpoint-" in str(caught.value)
    assert not (workdir / "adapters" / "crates").exists()


def test_allowed_nonfinite_steps_are_skipped_and_counted(workdir):
    """With skips allowed, a poisoned step changes nothing; the run ends and says how many it skipped. Its
    metrics.jsonl stays strict JSON (jq and JSON.parse refuse NaN and Infinity): a non-finite loss is null."""
    overrides = ["train.lr=1e30", "train.max_grad_norm=null", "train.nonfinite_skips=100", "train.log_every_steps=1"]
    adapter_dir, metrics = train("recipe.yaml", overrides, log=quiet)
    assert 1 <= metrics["skipped_steps"] < metrics["step"]
    assert all(torch.isfinite(t).all() for t in load_file(adapter_dir / "adapter_model.safetensors").values())

    def refuse(constant: str) -> None:
        raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON")

    lines = (workdir / "runs" / "crates" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=refuse) for line in lines]
    assert any(r.get("loss", 0.0) is None for r in records)  # the skipped steps' loss, written as null


def _equal_state(expected, actual, where: str = "") -> None:
    """Nested optimizer or scheduler state dicts equal bit for bit (tensors with torch.equal)."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(expected, actual), where
    elif isinstance(expected, dict):
        assert expected.keys() == actual.keys(), where
        for key in expected:
            _equal_state(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), where
        for index, (a, b) in enumerate(zip(expected, actual)):
            _equal_state(a, b, f"{where}[{index}]")
    else:
        assert expected == actual, where


def test_the_skip_budget_and_count_hold_across_a_resume(workdir):
    """train.nonfinite_skips is a budget for the whole run: a resumed run counted its skips from 0 again (and
    could skip more than allowed), and its manifest said fewer than it had skipped."""
    overrides = ["train.lr=1e30", "train.max_grad_norm=null", "train.nonfinite_skips=100", "train.save_every_steps=2"]
    _, whole = train("recipe.yaml", [*overrides, "train.max_steps=6", "output.name=whole"], log=quiet)
    train("recipe.yaml", [*overrides, "train.max_steps=4", "output.name=parts"], log=quiet)
    _, resumed = train("recipe.yaml", [*overrides, "train.max_steps=6", "output.name=parts", "output.overwrite=true"],
                       resume=True, log=quiet)  # fmt: skip
    assert resumed["skipped_steps"] == whole["skipped_steps"] >= 3, (resumed, whole)


def test_a_skipped_step_leaves_weights_adam_state_and_schedule_unchanged_bit_for_bit(workdir, monkeypatch):
    """Step 3's forward is poisoned (NaN from the embeddings on): with a skip allowed, the LoRA weights,
    AdamW's moments and step counts, the scheduler's state and the learning rate after step 3 are those
    after step 2, bit for bit; step 4 then trains. (The schedule used to advance on a skipped step.)"""
    import copy

    import finetune.training.loop as loop

    runs = []
    start_run = loop.start_run
    monkeypatch.setattr(loop, "start_run", lambda *args, **kwargs: runs.append(start_run(*args, **kwargs)) or runs[0])
    poisoned = {"on": False}
    snapshots = {}

    def on_step(step: int, metrics: dict) -> None:
        run = runs[0]
        if step == 1:
            run.peft_model.get_input_embeddings().register_forward_hook(
                lambda module, inputs, output: output * float("nan") if poisoned["on"] else None
            )
        weights = {n: p.detach().clone() for n, p in run.peft_model.named_parameters() if p.requires_grad}
        optimizer = copy.deepcopy(run.optimizer.state_dict())
        snapshots[step] = (weights, optimizer, copy.deepcopy(run.scheduler.state_dict()), metrics["lr"])
        poisoned["on"] = step == 2

    # Read every step (log_every_steps 1): on_step then runs before the next step is queued, and can poison it.
    overrides = [
        "train.nonfinite_skips=1",
        "train.max_steps=4",
        "train.eval_every_steps=null",
        "train.log_every_steps=1",
    ]
    _, metrics = train("recipe.yaml", [*overrides, "train.schedule=linear"], log=quiet, on_step=on_step)
    assert metrics["skipped_steps"] == 1 and sorted(snapshots) == [1, 2, 3, 4]
    (weights, optimizer, scheduler, lr), after = snapshots[2], snapshots[3]
    _equal_state(weights, after[0], "weights")
    _equal_state(optimizer, after[1], "optimizer")
    _equal_state(scheduler, after[2], "scheduler")
    # each step logs the rate it trained at: step 4 trains at the rate skipped step 3 did not take
    assert after[3] == snapshots[4][3] and after[3] != lr  # the schedule moves on a step, not on a skipped one
    assert optimizer["state"] and all(int(state["step"]) == 2 for state in optimizer["state"].values())
    assert any(not torch.equal(weights[n], snapshots[4][0][n]) for n in weights)  # step 4 trains again


# ---- reproducibility ------------------------------------------------------------------------------------

MINI_BASE = build.BuildSettings(
    corpus_max_bytes=200_000,
    corpus_file_max_bytes=8_000,
    vocab_size=512,
    seq_len=64,
    pretraining=PretrainSettings(steps=20, micro_batch_size=8, lr=3e-3, warmup_steps=2),
    num_threads=1,
)


def test_the_same_recipe_trains_the_same_adapter_whether_or_not_the_base_was_built_in_the_process(
    workdir, monkeypatch, tmp_path
):
    """The first run on a machine builds the embedded base in-process; later runs find it cached."""
    monkeypatch.setitem(build.EMBEDDED_BASES, "mini-llama", MINI_BASE)
    monkeypatch.setenv("FINETUNE_HOME", str(tmp_path / "fresh-home"))
    overrides = ["model.base=embedded:mini-llama", "train.max_steps=4"]
    first, _ = train("recipe.yaml", [*overrides, "output.name=first"], log=quiet)  # builds the base
    second, _ = train("recipe.yaml", [*overrides, "output.name=second"], log=quiet)  # finds it cached
    a, b = load_file(first / "adapter_model.safetensors"), load_file(second / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- security -------------------------------------------------------------------------------------------


def test_nothing_is_unpickled_without_weights_only():
    """Every torch.load in the package passes weights_only=True (pickle runs code on load)."""
    for path in (REPO / "finetune").rglob("*.py"):
        for call in re.findall(r"torch\.load\((.*)\)", path.read_text()):
            assert "weights_only=True" in call, f"{path}: torch.load({call})"


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/b", ".hidden", "x" * 65])
def test_names_that_would_escape_their_directory_are_refused(workdir, name):
    with pytest.raises(FinetuneError, match="output.name"):
        load_recipe("recipe.yaml", [f"output.name={name}"])


def test_a_merged_checkpoint_whose_ledger_names_a_path_is_refused(tmp_path, tiny_base_dir):
    model_dir = tmp_path / "merged"
    shutil.copytree(tiny_base_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    ledger = {"base": {"path": str(tiny_base_dir), "fingerprint": "sha256:x"}, "adapters": {"../../etc": {"weight": 1}}}
    config[LEDGER_KEY] = json.dumps(ledger)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(FinetuneError, match="ledger names an invalid adapter"):
        read_ledger(model_dir)


def test_an_adapter_reached_through_a_symlink_is_read_as_data_only(tmp_path, adapter_dirs, tiny_base_dir):
    """A symlinked adapter directory merges like the real one; writing never follows into it."""
    from finetune.cli import main

    link = tmp_path / "linked"
    link.symlink_to(adapter_dirs["legal"], target_is_directory=True)
    before = sorted(p.name for p in adapter_dirs["legal"].iterdir())
    assert (
        main(["adapters", "merge", "--base", str(tiny_base_dir), "--adapter", str(link), "--out", str(tmp_path / "m")])
        == 0
    )
    assert sorted(p.name for p in adapter_dirs["legal"].iterdir()) == before


def test_trust_remote_code_is_announced(workdir, capsys):
    from finetune.cli import main

    main(["train", "recipe.yaml", "model.trust_remote_code=true", "train.max_steps=1"])
    assert "warning: model.trust_remote_code is on" in capsys.readouterr().err


# ---- the network ----------------------------------------------------------------------------------------


def test_a_cached_hub_model_loads_without_asking_the_hub(tmp_path, tiny_base_dir):
    """HF_HUB_OFFLINE is not set and the hub endpoint is a local socket that never answers: the cached model
    loads without a single connection to it (before the fix, retries against an unreachable hub took 167 s)."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--local--tiny"
    shutil.copytree(tiny_base_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    hub = socket.socket()
    hub.bind(("127.0.0.1", 0))
    hub.listen(8)  # connections complete in the kernel's backlog; nothing ever answers them
    hub.setblocking(False)
    endpoint = f"http://127.0.0.1:{hub.getsockname()[1]}"
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT=endpoint, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "finetune", "generate", "--base", "local/tiny", "the model", "--max-new-tokens", "3"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == greedy_text(tiny_base_dir, None, "the model", 3) + "\n"  # the cached model's tokens
    assert result.stderr == ""  # our lines only: no progress bars, no library warnings
    with pytest.raises(BlockingIOError):  # no connection is waiting: the hub was never asked
        hub.accept()
    hub.close()


def test_an_adapter_trained_on_a_cached_hub_model_records_the_hub_id_for_peft(tmp_path, tiny_base_dir, monkeypatch):
    """adapter_config.json's `base_model_name_or_path` (what `AutoPeftModelForCausalLM` and other tools load the base
    from) is the hub id the recipe named, as plain peft writes it, not this machine's snapshot directory (it was,
    while the model card peft writes beside it already named the hub id)."""
    from huggingface_hub import constants
    from peft import PeftModel

    from finetune.model import load_base, wrap_with_lora
    from finetune.recipe import LoraConfig

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--local--tiny"
    shutil.copytree(tiny_base_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model, _, _ = load_base("local/tiny")
    peft_model = wrap_with_lora(model, LoraConfig(r=2, alpha=4, target_modules=["q_proj"]))
    assert isinstance(peft_model, PeftModel)
    peft_model.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "local/tiny"
    assert "base_model:adapter:local/tiny" in (tmp_path / "adapter" / "README.md").read_text()


# ---- endurance ------------------------------------------------------------------------------------------


def _rss_mib() -> float:
    with open("/proc/self/status") as handle:
        return int(next(line for line in handle if line.startswith("VmRSS:")).split()[1]) / 1024


def test_memory_stays_flat_over_a_run_with_evaluations_and_checkpoints(workdir):
    """A small soak: 120 steps, evaluation and a checkpoint every 10; resident memory after warm-up grows < 5%.

    The full size (2,000 steps, both every 50) is `python bench/soak.py`; its figure is in bench/README.md.
    """
    samples: dict[int, float] = {}
    overrides = ["train.max_steps=120", "train.eval_every_steps=10", "train.save_every_steps=10", "output.name=soak"]
    train("recipe.yaml", overrides, log=quiet, on_step=lambda step, metrics: samples.__setitem__(step, _rss_mib()))
    warm = samples[30]
    assert max(samples[s] for s in samples if s >= 30) < warm * 1.05, {s: round(v) for s, v in samples.items()}


# ---- fuzzing --------------------------------------------------------------------------------------------

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_fuzz_recipe_loader_raises_only_our_errors(tmp_path, text):
    path = tmp_path / "fuzzed.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    try:
        load_recipe(path)
    except FinetuneError:
        pass


@FUZZ
@given(st.lists(st.text(max_size=40), max_size=5))
def test_fuzz_override_parser_raises_only_our_errors(overrides):
    try:
        for text in overrides:
            parse_override(text)
        apply_overrides({"train": {"lr": 1.0}}, overrides)
    except FinetuneError:
        pass


@FUZZ
@given(st.text(max_size=60))
def test_fuzz_adapter_spec_parser_raises_only_our_errors(spec):
    try:
        parsed = parse_adapter_spec(spec)
    except FinetuneError:
        return
    assert parsed.weight is None or parsed.weight == parsed.weight  # a weight, when given, is a number

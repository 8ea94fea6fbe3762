"""The README's quickstart, run as users run it: trains on the shipped embedded base, cuts held-out perplexity
by at least 30% (the promise of the front door), to at most 1.9: within 95% of the eval-loss gain full
fine-tuning reaches in the same steps (bench/learning_quality.py), and the adapter's greedy bulletins
follow their input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.cli import main
from finetune.embedded.quickstart_data import bulletin_fields
from finetune.recipe import DataConfig

REPO = Path(__file__).resolve().parents[1]
NUM_BULLETINS = 5


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    # FINETUNE_HOME is the session's scratch cache (conftest): a fresh machine's, as far as caches go.
    tmp_path = tmp_path_factory.mktemp("quickstart")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "finetune",
            "train",
            "recipes/quickstart.yaml",
            f"output.dir={tmp_path / 'adapter'}",
            f"output.run_dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result, tmp_path / "adapter"


@pytest.mark.slow
def test_quickstart_cuts_held_out_perplexity_by_30_percent(quickstart):
    result, adapter = quickstart
    match = re.search(
        r"held-out perplexity: base ([\d.]+) -> base \+ adapter ([\d.]+) \(([\d.]+)% lower\)", result.stderr
    )
    assert match, result.stderr[-3000:]
    base_ppl, adapter_ppl, cut = map(float, match.groups())
    assert adapter_ppl <= 0.7 * base_ppl
    assert adapter_ppl <= 1.9  # LoRA with the head trained (lora.train_lm_head); blocks alone reach about 9
    assert cut == pytest.approx(100 * (1 - adapter_ppl / base_ppl), abs=0.1)
    assert (adapter / "adapter_model.safetensors").is_file()
    assert f"adapter: {adapter}" in result.stdout


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="issue 13 not met yet: on the copying base (copy score 0.93) the quickstart LoRA's greedy bulletins got "
    "the figures right in 2 of 20 held-out ones; strict, so the test says when a base or recipe passes",
)
def test_quickstart_adapter_copies_the_figures_of_held_out_bulletins(quickstart, capsys):
    """`finetune generate` (greedy) on held-out bulletins gets the high/low figures right in at least 4 of 5."""
    _, adapter = quickstart
    template = DataConfig.model_fields["prompt_with_input_template"].default
    valid = (REPO / "data" / "quickstart" / "valid.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in valid[:NUM_BULLETINS]]
    right = []
    for record in records:
        prompt = template.format(prompt=record["instruction"], input=record["input"])
        assert main(["generate", "--adapter", str(adapter), "--max-new-tokens", "96", prompt]) == 0
        generated = capsys.readouterr().out
        right.append(bulletin_fields(generated)["figures"] == bulletin_fields(record["output"])["figures"])
    assert sum(right) >= 4, right

"""The README's quickstart, run as users run it: trains on the shipped embedded base, cuts held-out perplexity
by at least 30% (the promise of the front door), to at most 1.9: within 95% of the eval-loss gain full
fine-tuning reaches in the same steps (bench/learning_quality.py), and the adapter's greedy bulletins
follow their input. Then the DPO quickstart on its adapter: held-out reward accuracy of at least 95%, and
greedy bulletins at least as faithful as the quickstart adapter's."""

from __future__ import annotations

import contextlib
import io
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
    assert adapter_ppl <= 1.9  # about 1.01 on the copying base (bench/learning_quality.py)
    assert cut == pytest.approx(100 * (1 - adapter_ppl / base_ppl), abs=0.1)  # all three printed rounded
    assert (adapter / "adapter_model.safetensors").is_file()
    assert f"adapter: {adapter}" in result.stdout


def fields_right(adapter: Path) -> dict[str, int]:
    """How many of the first held-out bulletins `finetune generate` (greedy) writes with the input's town, sky
    phrase, wind and high/low figures."""
    template = DataConfig.model_fields["prompt_with_input_template"].default
    valid = (REPO / "data" / "quickstart" / "valid.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in valid[:NUM_BULLETINS]]
    right = dict.fromkeys(("city", "sky", "wind", "figures"), 0)
    for record in records:
        prompt = template.format(prompt=record["instruction"], input=record["input"])
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(["generate", "--adapter", str(adapter), "--max-new-tokens", "160", prompt]) == 0
        generated, expected = bulletin_fields(printed.getvalue()), bulletin_fields(record["output"])
        for name in right:
            right[name] += generated[name] == expected[name]
    return right


@pytest.fixture(scope="module")
def quickstart_fields(quickstart) -> dict[str, int]:
    """The quickstart adapter's `fields_right`, generated once for the tests that read it."""
    return fields_right(quickstart[1])


@pytest.mark.slow
def test_quickstart_adapter_follows_the_input_of_held_out_bulletins(quickstart_fields):
    """`finetune generate` (greedy) on held-out bulletins gets the town, sky phrase, wind and high/low figures
    right in at least 4 of 5: the adapter reads its input, it does not just write the house style."""
    assert min(quickstart_fields.values()) >= 4, quickstart_fields


@pytest.mark.slow
def test_quickstart_dpo_prefers_the_faithful_bulletin_and_writes_as_faithfully(quickstart, quickstart_fields, tmp_path):
    """`recipes/quickstart-dpo.yaml` on the quickstart's adapter, as the README runs it but for the first 50 of
    its 100 steps (the suite's longest test, 189 s of a 9-minute suite at 100): the held-out chosen bulletin
    gets the higher implicit reward in at least 95% of pairs, its likelihood does not fall, and the greedy
    bulletins get as many fields right as the quickstart adapter's, counted over the four fields of five
    bulletins, less one (one bulletin's field may flip either way between CPU kinds: on an AMD EPYC the town was
    right in 4 and the wind in 5, against the adapter's 5 and 4; with torch's AVX2 kernels there, 18 fields
    against the adapter's 19). At 50 steps from the shipped quickstart adapter: 99.2%
    of pairs, perplexity of the chosen +0.5%, wind right in 5 of 5 bulletins against the adapter's 4 (Intel
    Xeon, 2026-11-27); the README quotes the full run."""
    _, sft_adapter = quickstart
    result = subprocess.run(
        [sys.executable, "-m", "finetune", "train", "recipes/quickstart-dpo.yaml", f"lora.init_from={sft_adapter}",
         "train.max_steps=50", f"output.dir={tmp_path / 'adapter'}", f"output.run_dir={tmp_path / 'run'}",
         "output.report=false"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "adapter" / "manifest.json").read_text())["metrics"]
    assert metrics["eval_reward_accuracy"] >= 0.95, metrics
    assert metrics["eval_ppl"] <= 1.05 * metrics["start_eval_ppl"], metrics  # the chosen bulletins stay likely
    sft, dpo = quickstart_fields, fields_right(tmp_path / "adapter")
    assert sum(dpo.values()) >= sum(sft.values()) - 1, (dpo, sft)  # one field may flip either way

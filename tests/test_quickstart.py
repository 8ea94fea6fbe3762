"""The README's quickstart, run as users run it: builds the embedded base from nothing, trains, and cuts
held-out perplexity by at least 30% (the promise of the front door), to at most 1.9: within 95% of
the eval-loss gain full fine-tuning reaches in the same steps (bench/learning_quality.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_cuts_held_out_perplexity_by_30_percent(tmp_path):
    # FINETUNE_HOME is the session's scratch cache (conftest), so the embedded base is built here from scratch.
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
    match = re.search(
        r"held-out perplexity: base ([\d.]+) -> base \+ adapter ([\d.]+) \(([\d.]+)% lower\)", result.stderr
    )
    assert match, result.stderr[-3000:]
    base_ppl, adapter_ppl, cut = map(float, match.groups())
    assert adapter_ppl <= 0.7 * base_ppl
    assert adapter_ppl <= 1.9  # LoRA with the head trained (lora.train_lm_head); blocks alone reach about 9
    assert cut == pytest.approx(100 * (1 - adapter_ppl / base_ppl), abs=0.1)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert f"adapter: {tmp_path / 'adapter'}" in result.stdout

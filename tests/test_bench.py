"""`python -m bench` as a user runs it, on its smallest part (`--quick --only swap`: tiny models, ~20 s).

No timing is asserted: the figures depend on the machine. What must hold anywhere: the command exits 0,
latest.json records the machine and the load, the swap part's exactness results are there and true
(ours equals a fresh merge; ours returns to the base bit for bit after merge/unmerge cycles), and
latest.md shows the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_bench(*arguments: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "bench", *arguments], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_quick_swap_writes_latest_json_and_markdown(tmp_path):
    out = tmp_path / "results"
    completed = run_bench("--quick", "--only", "swap", "--out", str(out), "--scratch", str(tmp_path / "models"))
    assert completed.returncode == 0, completed.stdout + completed.stderr

    report = json.loads((out / "latest.json").read_text())
    machine = report["machine"]
    assert machine["cores"] == os.cpu_count() and machine["memory_gib"] > 0 and machine["cpu"]
    assert set(machine["versions"]) >= {"python", "torch", "transformers", "peft"}
    assert len(report["load_average_start"]) == 3 and len(report["load_average_end"]) == 3
    assert list(report["parts"]) == ["swap"] and report["quick"] is True

    part = report["parts"]["swap"]
    assert part["exit_code"] == 0 and part["wall_seconds"] > 0 and len(part["load_average_before"]) == 3
    swap, drift = part["figures"]["swap"][0], part["figures"]["drift"][0]
    assert swap["ours_equals_fresh_merge"] is True and swap["ours_vs_fresh_max_abs"] == 0
    assert drift["ours_bit_exact_after_n"] is True and drift["cycles"] == 3

    markdown = (out / "latest.md").read_text()
    assert report["date_utc"] in markdown and machine["cpu"] in markdown
    assert "## Adapter swap and drift" in markdown and "## Training" not in markdown
    assert markdown in completed.stdout  # the printed table is the file's


def test_unknown_part_is_refused_with_the_valid_ones():
    completed = run_bench("--only", "swap,trian")
    assert completed.returncode == 2
    assert "unknown part(s) ['trian']; choose from train, swap, merge" in completed.stderr

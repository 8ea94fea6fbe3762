"""`python -m bench` as a user runs it: its command line. The benchmark itself is not run here (its
smallest part, `python -m bench --quick --only swap`, takes ~20 s, which the suite's 10-minute budget
does not have); no timing is ever asserted.
"""

from __future__ import annotations

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


def test_unknown_part_is_refused_with_the_valid_ones():
    completed = run_bench("--only", "swap,trian")
    assert completed.returncode == 2
    assert "unknown part(s) ['trian']; choose from train, swap, merge" in completed.stderr

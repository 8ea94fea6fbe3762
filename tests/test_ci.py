"""`.ci/run`, CI's script: it runs the README's test command, which installs the project once, then lints.

The script itself cannot run inside the suite (it installs packages and runs this very suite), so its
commands are checked twice: as text against the README, and by running the real script with `pip`,
`python`, `ruff` and `mypy` on PATH replaced by stubs that log their arguments, which shows what it
runs, in what order, and that a failure of any step fails CI.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CI_SCRIPT = REPO / ".ci" / "run"
LINT = ["ruff check finetune tests bench", "ruff format --check finetune tests bench", "mypy"]


def readme_test_command() -> str:
    """The README's one command line that installs the project and runs the tests."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    found = [line for line in lines if line.startswith("pip install") and line.endswith("python -m pytest")]
    assert len(found) == 1, found
    return found[0]


def script_commands() -> list[str]:
    """`.ci/run`'s commands, one per `&&`/`||`/`;`-separated part of each line, comments left out."""
    commands = []
    for line in CI_SCRIPT.read_text(encoding="utf-8").splitlines():
        code = line.split("#", 1)[0].strip() if not line.startswith("#!") else ""
        commands += [part.strip() for part in re.split(r"&&|\|\||;", code) if part.strip()]
    return commands


def test_ci_runs_the_readmes_test_command_and_installs_once():
    command = readme_test_command()
    assert command == "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest"
    script = CI_SCRIPT.read_text(encoding="utf-8")
    assert [line for line in script.splitlines() if line.startswith(command)] == [f"{command} || exit"]
    installs = [c for c in script_commands() if c.startswith("pip install")]
    assert installs == ["pip install torch==2.13.0", "pip install -e '.[test]'"]  # each once, the README's
    assert "set -euo pipefail" in script.splitlines()


@pytest.mark.parametrize(
    ("failing", "status", "ran"),
    [
        (None, 0, ["pip install torch==2.13.0", "pip install -e .[test]", "python -m pytest", *LINT]),
        ("pip", 3, ["pip install torch==2.13.0"]),
        ("python", 3, ["pip install torch==2.13.0", "pip install -e .[test]", "python -m pytest"]),
        ("ruff", 3, ["pip install torch==2.13.0", "pip install -e .[test]", "python -m pytest", LINT[0]]),
        ("mypy", 3, ["pip install torch==2.13.0", "pip install -e .[test]", "python -m pytest", *LINT]),
    ],
)
def test_ci_script_runs_each_step_once_and_stops_at_a_failure(tmp_path, failing, status, ran):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for tool in ("pip", "python", "ruff", "mypy"):
        stub = stubs / tool
        stub.write_text(f'#!/bin/sh\necho "{tool} $*" >> "$CI_LOG"\n[ "$CI_FAIL" = {tool} ] && exit 3\nexit 0\n')
        stub.chmod(0o755)
    log = tmp_path / "ran.log"
    env = {
        **os.environ,
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "CI_LOG": str(log),
        "CI_FAIL": failing or "",
    }
    result = subprocess.run(["bash", str(CI_SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == status, result.stderr
    assert [line.rstrip() for line in log.read_text().splitlines()] == ran

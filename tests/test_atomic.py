"""Leftovers of writers: what a new writer of the same target removes, and what it must leave alone."""

from __future__ import annotations

import os
import subprocess
import sys

from finetune.atomic import remove_dead_writers_staging, remove_stale_staging


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_the_leftovers_of_writers_that_are_gone_are_removed(tmp_path):
    """A second `adapters merge --out m` deleted the staging directory of the first, still running, as a killed
    writer's leftover: the first then failed with a FileNotFoundError traceback. A live writer's staging stays."""
    final = tmp_path / "merged"
    live, dead = os.getppid(), _dead_pid()
    for name in (f".merged.partial-{live}", f".merged.old-{live}", f".merged.partial-{dead}", f".merged.old-{dead}"):
        (tmp_path / name).mkdir()
    (tmp_path / f".merged.partial-{os.getpid()}").mkdir()  # this process's own, from an earlier failed attempt
    remove_stale_staging(final)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".merged.old-{live}", f".merged.partial-{live}"]

    model = tmp_path / "model.gguf"
    for pid in (live, dead):
        (tmp_path / f".model.gguf.partial-{pid}").write_bytes(b"GGUF")
    remove_dead_writers_staging(model)
    assert (tmp_path / f".model.gguf.partial-{live}").is_file()
    assert not (tmp_path / f".model.gguf.partial-{dead}").exists()

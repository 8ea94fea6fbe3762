"""Leftovers of writers: what a new writer of the same target removes, and what it must leave alone."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

from finetune.atomic import _USER_FIXABLE_ERRNOS, remove_dead_writers_staging, remove_stale_staging


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


TOKENIZER_ON_A_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from transformers import AutoTokenizer
from finetune.atomic import atomic_directory
from finetune.errors import OutputError
from finetune.training.finish import save_tokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))  # tokenizer.json is 120 KiB: a full disk midway
try:
    with atomic_directory(Path(sys.argv[2])) as staging:
        save_tokenizer(tokenizer, None, staging)
except OutputError as error:
    print(error)
"""


def test_a_full_disk_while_the_tokenizer_is_saved_is_one_error_and_leaves_nothing(tmp_path):
    """tokenizers' Rust error is a plain `Exception` ("File too large (os error 27)"; ENOSPC alike): the last file
    of a trained adapter, it came out of `finetune train` as a traceback and exit 1 instead of one line."""
    base = Path(__file__).resolve().parents[1] / "finetune" / "embedded" / "base" / "tiny-llama"
    target = tmp_path / "adapter"
    result = subprocess.run(
        [sys.executable, "-c", TOKENIZER_ON_A_FULL_DISK, str(base), str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"cannot write {target}: File too large; {_USER_FIXABLE_ERRNOS[errno.EFBIG]}"
    assert list(tmp_path.iterdir()) == []

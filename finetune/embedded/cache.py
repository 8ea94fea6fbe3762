"""Where embedded bases live (shipped in the package, or built into a cache), and what `embedded:` ids resolve to.

A recipe whose `model.base` is `embedded:tiny-llama` gets a normal Hugging Face model directory, so
everything downstream, the adapter's `base_model_name_or_path` included, is a plain local path that
`from_pretrained` loads. A registered base is shipped with the package (`finetune/embedded/base/<name>/`,
built once by `python -m finetune.embedded.build`): its weights are checked against the sha256 in its
build record and used in place. A base that is not shipped (other build settings, as the tests use, or a
source tree without the weights) is built on first use under `$FINETUNE_HOME/embedded/` (default
`~/.cache/finetune/embedded/`).

The cache directory name carries the build format version and a hash of the build settings and Python
version, so a change of recipe builds a new base and never alters one an adapter was trained on. A base
is built into a temporary directory beside its final place and renamed into place when complete, under
a file lock: a reader never sees half a model, and two processes asking at once build it once.

Example:
    path = ensure_embedded_base("tiny-llama")      # the shipped directory (weights checked)
    resolve_base_id("embedded:tiny-llama")         # the same path, as a string
    resolve_base_id("meta-llama/Llama-3.2-1B")     # returned unchanged
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from finetune.atomic import remove_directory
from finetune.embedded.settings import BUILD_FORMAT_VERSION, EMBEDDED_BASES, BuildSettings, settings_record
from finetune.embedded.shipped import RECORD_FILE, check_shipped_base, shipped_base_dir
from finetune.errors import ModelError
from finetune.paths import finetune_home

EMBEDDED_PREFIX = "embedded:"


def _print_to_stderr(message: str) -> None:
    print(f"[finetune.embedded] {message}", file=sys.stderr, flush=True)


def embedded_base_dir(name: str, settings: BuildSettings, root: str | Path | None = None) -> Path:
    """Where the base built from `settings` lives (whether or not it is built yet)."""
    key = json.dumps(
        {"name": name, "settings": settings_record(settings), "python": platform.python_version()}, sort_keys=True
    )
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]
    return (
        (Path(root) if root is not None else finetune_home()) / "embedded" / f"{name}-v{BUILD_FORMAT_VERSION}-{digest}"
    )


def _is_built(path: Path) -> bool:
    return (path / RECORD_FILE).is_file()


def existing_embedded_base(name: str) -> Path | None:
    """Registered base `name`'s directory if it is already there (shipped, else built in the cache); None
    otherwise. Nothing is built or checked: for readers of its config such as `finetune plan`."""
    shipped = shipped_base_dir(name)
    if _is_built(shipped):
        return shipped
    cached = embedded_base_dir(name, EMBEDDED_BASES[name])
    return cached if _is_built(cached) else None


def ensure_embedded_base(
    name: str = "tiny-llama",
    *,
    root: str | Path | None = None,
    settings: BuildSettings | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The local model directory of embedded base `name`: the shipped one, else built first if not cached.

    Args:
        name: a key of `finetune.embedded.build.EMBEDDED_BASES`; its shipped directory is used when present.
        root: cache root; default `finetune.paths.finetune_home()`.
        settings: build settings other than the registered ones (tests build small bases this way);
            they get a directory of their own.
        progress: receives one-line progress messages; default prints them to stderr.

    Raises:
        ModelError: `name` is not an embedded base, or its shipped weights are damaged.
    """
    from filelock import FileLock, Timeout

    if settings is None:
        if name not in EMBEDDED_BASES:
            raise ModelError(
                f"unknown embedded base {EMBEDDED_PREFIX}{name}; known: "
                + ", ".join(EMBEDDED_PREFIX + known for known in sorted(EMBEDDED_BASES))
                + "; or set model.base to a local model directory or hub id"
            )
        shipped = shipped_base_dir(name)
        if _is_built(shipped):
            check_shipped_base(shipped)
            return shipped
        settings = EMBEDDED_BASES[name]
    report = progress if progress is not None else _print_to_stderr
    final_dir = embedded_base_dir(name, settings, root)
    if _is_built(final_dir):
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(final_dir.parent / f"{final_dir.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        report(f"another process is building {final_dir}; waiting for it")
        lock.acquire()
    try:
        if not _is_built(final_dir):  # else built by the process we waited for
            _build_into(final_dir, name, settings, report)
        return final_dir
    finally:
        lock.release()


def _build_into(final_dir: Path, name: str, settings: BuildSettings, report: Callable[[str], None]) -> None:
    """Build in a temporary directory beside `final_dir`, then rename it into place (the caller holds the lock)."""
    # Leftovers of a build that was killed before it could clean up; nobody else holds the lock.
    for stale in final_dir.parent.glob(f".{final_dir.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if final_dir.exists():  # neither complete nor ours to trust
        remove_directory(final_dir)
    report(f"building embedded base {EMBEDDED_PREFIX}{name} into {final_dir} (first use only)")
    start_seconds = time.perf_counter()
    work_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=final_dir.parent))
    work_dir.chmod(0o755)  # mkdtemp makes it private; a model directory is ordinary data
    from finetune.embedded.build import build_embedded_base  # torch, transformers: only when a base is built

    try:
        build_embedded_base(work_dir, settings, report)
        os.rename(work_dir, final_dir)
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    report(f"built {EMBEDDED_PREFIX}{name} in {time.perf_counter() - start_seconds:.0f} s")


def resolve_base_id(base: str, progress: Callable[[str], None] | None = None) -> str:
    """Turn a recipe's `model.base` into something `from_pretrained` loads.

    `embedded:<name>` becomes the local directory of that embedded base (shipped, or built on first use); any other
    string (a local path or a hub id) is returned unchanged.

    Raises:
        ModelError: `embedded:<name>` names no embedded base; the message lists the known ones.
    """
    if not base.startswith(EMBEDDED_PREFIX):
        return base
    return str(ensure_embedded_base(base.removeprefix(EMBEDDED_PREFIX), progress=progress))

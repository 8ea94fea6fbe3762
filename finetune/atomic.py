"""Directories and files that appear whole or not at all: build beside the target, flush, rename into place.

Adapters, checkpoints, merged models and built bases are directories of several files. A reader must
never take a half-written one for a whole one, whatever kills the writer (an exception, SIGKILL, a full
disk). Everything is written into a hidden `.<name>.partial-<pid>` sibling (same filesystem, so the
final `rename` is atomic), its files are flushed to disk, and only then is it renamed to the target. A
failure deletes the staging directory; a SIGKILL leaves only a hidden `.partial-*` sibling, which the
next writer of the same target removes. Deleting goes the other way (`remove_directory`): renamed to a
hidden `.<name>.old-<pid>` sibling first, so a kill mid-delete never leaves a half-deleted directory in view.

Single files (a GGUF export, a report page) go the same way through `atomic_file`; the next writer of a file
removes the staging files of killed writers only (`remove_dead_writers_staging`).

Example:
    with atomic_directory(Path("adapters/legal"), replace=True) as staging:
        (staging / "adapter_config.json").write_text(...)
    # adapters/legal now holds exactly what was written, or (on failure) what it held before
    with atomic_file(Path("runs/legal/report.html")) as staging:
        staging.write_text(page)
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Collection, Iterator
from pathlib import Path

from finetune.errors import FinetuneError, OutputError

STAGING_MARK = ".partial-"
SET_ASIDE_MARK = ".old-"
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
_USER_FIXABLE_ERRNOS = {
    errno.ENOSPC: "free disk space (nothing was left behind) and run again",
    errno.EDQUOT: "free space within your disk quota (nothing was left behind) and run again",
    errno.EACCES: "write somewhere you have permission to, or fix the directory's permissions",
    errno.EROFS: "the filesystem is read-only; write somewhere else",
    errno.EPERM: "the directory does not allow writing (read-only or immutable); write somewhere else",
    errno.EFBIG: "the file size limit or free space was reached (nothing was left behind); free space and run again",
}


# What only a write fails with: a block that also reads can convert these and leave the rest to its reader
WRITE_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def staging_path(final: Path) -> Path:
    """The hidden sibling this process builds `final` in."""
    return final.parent / f".{final.name}{STAGING_MARK}{os.getpid()}"


def remove_stale_staging(final: Path) -> None:
    """Delete hidden siblings of `final` (staging or set aside) left by writers that were killed (or by this process).

    A sibling of a writer still running is kept: two commands writing the same target at once (two `adapters
    merge --out m` in two terminals) each deleted the other's staging directory under it, and the first to start
    failed with a FileNotFoundError traceback; now the second to finish is told the target appeared meanwhile.
    """
    for stale in _left_by_gone_writers(final, (STAGING_MARK, SET_ASIDE_MARK)):
        shutil.rmtree(stale, ignore_errors=True)


def remove_dead_writers_staging(final: Path) -> None:
    """Delete staging files of `final` whose writer is gone (killed: SIGKILL, or SIGTERM, which Python does not
    turn into an exception), as `atomic_directory` deletes stale staging directories; otherwise each killed
    GGUF export leaves a hidden file of up to the model's size that nothing removes. Only dead writers' files
    go: a process still writing the same file keeps its staging."""
    for stale in _left_by_gone_writers(final, (STAGING_MARK,)):
        if stale.is_file():
            stale.unlink(missing_ok=True)


def _left_by_gone_writers(final: Path, marks: tuple[str, ...]) -> Iterator[Path]:
    """Hidden siblings of `final` with one of `marks` whose writer (the pid after the mark) is no other live
    process: gone, this process itself, or no pid at all."""
    for mark in marks:
        for sibling in final.parent.glob(f".{final.name}{mark}*"):
            pid = sibling.name.rsplit(mark, 1)[1]
            if not pid.isdigit() or int(pid) == os.getpid() or not process_alive(int(pid)):
                yield sibling


def process_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this machine (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_directory(path: Path) -> None:
    """Delete `path` so that no reader sees part of it: one rename out of view, then the deletion."""
    shutil.rmtree(_set_aside(path), ignore_errors=True)


def _set_aside(final: Path) -> Path:
    """Rename `final` to a hidden sibling (atomic: from here a reader finds no `final`, never a partial one)."""
    old = final.parent / f".{final.name}{SET_ASIDE_MARK}{os.getpid()}"
    os.rename(final, old)
    return old


def _flush_to_disk(directory: Path) -> None:
    """fsync every file and the directory itself, so the rename publishes data that is on disk; each file gets
    the permissions the user's umask gives new files (`_usual_mode`)."""
    mode = _usual_mode()
    for path in directory.rglob("*"):
        if path.is_file():
            os.chmod(path, mode)
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _usual_mode() -> int:
    """0o666 less the process's umask: what `open()` gives a new file. safetensors writes its files 0600 (through a
    private temporary file), so an adapter or merged model was unreadable to the other users of a shared machine
    (a server running as another user, a team's adapter store) while the files beside it were not."""
    umask = os.umask(0o022)  # read by setting it; put back at once
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_directory(
    final: Path, *, replace: bool = False, error: type[FinetuneError] = OutputError, hint: str = "choose another path"
) -> Iterator[Path]:
    """Yield an empty staging directory that becomes `final` when the block completes.

    Args:
        final: the directory to publish.
        replace: an existing `final` is replaced (the old one is removed only after the new one is whole);
            otherwise an existing `final` raises `error` before anything is written.
        error: the `FinetuneError` subclass raised for an existing target or an unwritable place.
        hint: how to fix an existing target, appended to the message.
    """
    final = Path(final)
    if final.exists() and not replace:
        raise error(f"{final} already exists; {hint}")
    with unwritable_as(error, final):
        _make_parent(final)
        remove_stale_staging(final)
        staging = staging_path(final)
        staging.mkdir()
    try:
        yield staging
        _flush_to_disk(staging)
        _publish(staging, final, replace=replace, error=error, hint=hint)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        number, reason = _os_error_of(exc)
        if number not in _USER_FIXABLE_ERRNOS:
            raise
        raise error(f"cannot write {final}: {reason}; {_USER_FIXABLE_ERRNOS[number]}") from None


@contextlib.contextmanager
def unwritable_as(
    error: type[FinetuneError], final: Path, *, elsewhere: str = "", only: Collection[int] | None = None
) -> Iterator[None]:
    """An OSError preparing to write `final` (or appending to it: metrics.jsonl) raised as `error`, one line saying
    what to do; `elsewhere` is added where no path of the user's names the place (the tokenized-data cache).
    `only`: the errnos converted, where the block also reads (the user's data: their errors are not the writer's).

    The reason is the errno's own words: pyarrow's is "Error writing bytes to file. Detail: [errno 28] ..."."""
    try:
        yield
    except OSError as exc:
        number = exc.errno or 0
        if only is not None and number not in only:
            raise
        fix = _USER_FIXABLE_ERRNOS.get(number, "check the path and its permissions")
        reason = os.strerror(number) if number in _USER_FIXABLE_ERRNOS else exc.strerror or exc
        raise error(f"cannot write {final}: {reason}; {fix}{elsewhere}") from None


def check_writable(final: Path, error: type[FinetuneError]) -> None:
    """Refuse now, as `error`, a place `final` could not be written into later: its directory cannot be made (a
    file on the way) or takes no new entry (a read-only filesystem, no permission). A training run that found it
    only when it wrote its adapter had spent its whole time for nothing. A full disk cannot be foreseen. No
    directory is made: a run refused later (bad data) leaves none."""
    final = Path(final)
    with unwritable_as(error, final):
        probe = _nearest_directory(final) / staging_path(final).name  # made and removed at once: nothing is left
        probe.mkdir()
        probe.rmdir()


def _make_parent(final: Path) -> None:
    """Create `final`'s directory; a file on the way is named (mkdir says only "File exists")."""
    _nearest_directory(final)
    final.parent.mkdir(parents=True, exist_ok=True)


def _nearest_directory(final: Path) -> Path:
    """The nearest of `final`'s ancestors that exists ("/" or "." at the last), which must be a directory.

    Raises:
        OSError: ENOTDIR, naming the file that is on the way.
    """
    existing = next(p for p in (final.parent, *final.parent.parents) if p.exists())
    if not existing.is_dir():
        raise OSError(errno.ENOTDIR, f"{existing} is a file, not a directory")
    return existing


def _os_error_of(exc: BaseException) -> tuple[int | None, str]:
    """(errno, reason) of an I/O failure: an `OSError`, or a Rust library's error carrying "(os error N)":
    safetensors' `SafetensorError`, or tokenizers', a plain `Exception` ("No space left on device (os error 28)"
    from `tokenizer.save_pretrained`, the last file of a trained adapter: a traceback and exit 1, not one line)."""
    if isinstance(exc, OSError):
        return exc.errno, exc.strerror or str(exc)
    rust = type(exc).__name__ == "SafetensorError" or type(exc) is Exception
    match = _RUST_OS_ERROR.search(str(exc)) if rust else None
    if match is None:
        return None, ""
    number = int(match.group(1))
    return number, os.strerror(number)


def _publish(staging: Path, final: Path, *, replace: bool, error: type[FinetuneError], hint: str) -> None:
    if not final.exists():
        os.rename(staging, final)
        return
    if not replace:
        raise error(f"{final} appeared while it was being written; {hint}")
    old = _set_aside(final)
    os.rename(staging, final)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(
    final: Path, *, replace: bool = True, error: type[FinetuneError] = OutputError, hint: str = "choose another path"
) -> Iterator[Path]:
    """Yield a staging file path beside `final`; what the block writes there becomes `final` when it completes.

    Args:
        final: the file to publish.
        replace: an existing `final` is replaced in one rename; otherwise it raises `error` before anything
            is written.
        error: the `FinetuneError` subclass raised for an existing target or an unwritable place.
        hint: how to fix an existing target, appended to the message.
    """
    final = Path(final)
    if final.exists() and not replace:
        raise error(f"{final} already exists; {hint}")
    staging = staging_path(final)
    with unwritable_as(error, final):  # checked before the block runs: one line, not its traceback
        _make_parent(final)
        remove_dead_writers_staging(final)
        staging.touch()
    try:
        yield staging
        os.chmod(staging, _usual_mode())
        with open(staging, "rb") as handle:
            os.fsync(handle.fileno())
        if not replace and final.exists():
            raise error(f"{final} appeared while it was being written; {hint}")
        os.replace(staging, final)
    except BaseException as exc:
        staging.unlink(missing_ok=True)
        number, reason = _os_error_of(exc)
        if number not in _USER_FIXABLE_ERRNOS:
            raise
        raise error(f"cannot write {final}: {reason}; {_USER_FIXABLE_ERRNOS[number]}") from None

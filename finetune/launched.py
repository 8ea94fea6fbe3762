"""What a process started by a distributed launcher (accelerate, torchrun) knows of itself: that it is one, and
the one line it ends with when a collective broke under it.

Kept apart from `finetune.training` so that the CLI, which turns such an error into that line, starts without
the training stack (`generate`, `eval` and `serve` never import it).

Example:
    if already_launched(): ...                       # a rank: train here, do not launch again
    line = broken_collective(error)                 # None, or "error: rank 1 stopped: the process group broke ..."
    say_once("error: lora.target_modules ...")      # printed by the first rank to say it, not by every rank
"""

from __future__ import annotations

import hashlib
import os
import sys
import traceback

from finetune.errors import first_line


def already_launched() -> bool:
    """True inside a process started by a distributed launcher (accelerate, torchrun)."""
    return "LOCAL_RANK" in os.environ or "RANK" in os.environ


def end_if_launched(code: int) -> None:
    """In a launched rank, end the process now with `code`, output flushed, without the interpreter's teardown;
    elsewhere, nothing. Left to interpreter exit, the communication backends' C++ threads (gloo's; DeepSpeed's
    shared-memory op on CPU ranks) were torn down mid-flight now and then, and a rank died of SIGABRT ("terminate
    called without an active exception") after it had finished, or after printing its one-line error."""
    if already_launched():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def is_first_rank() -> bool:
    """True in a process that is not a launched rank, or is rank 0: the one that speaks for a run all ranks
    end alike (an interrupted run's checkpoint line, once, not once per rank)."""
    return os.environ.get("RANK", "0") == "0"


SAID_DIR_ENV = "FINETUNE_SAID_LINES"
"""A directory the launching `finetune train --nproc N` makes for its ranks (and removes): one empty file per line
a rank has said, named by the line's digest."""


def say_once(line: str) -> None:
    """Print `line` to stderr unless another rank of this launch printed the very same line.

    Errors that every rank finds alike after the launch (LoRA targets that match nothing, a checkpoint of another
    recipe, a NaN step, Ctrl-C during loading) were printed once per rank: N identical lines, now and then run
    together into one. The first rank to claim the line's file (`O_EXCL`: exactly one wins) prints it; a line only
    one rank says (out of memory on one GPU) is still said. Outside a launch, or launched by `accelerate launch`
    directly (no directory), every line is printed."""
    said = os.environ.get(SAID_DIR_ENV)
    if said and already_launched():
        digest = hashlib.sha256(line.encode()).hexdigest()[:32]
        try:
            os.close(os.open(os.path.join(said, digest), os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        except OSError:
            pass  # the directory is gone or unwritable: say it rather than lose it
    sys.stderr.write(line + "\n")  # one write: `print` writes the newline apart, and ranks' lines ran together
    sys.stderr.flush()


_COLLECTIVE_CODE = ("/torch/distributed/", "/torch/nn/parallel/", "/deepspeed/comm/")
_TRANSPORT_WORDS = ("gloo/transport", "ProcessGroupNCCL", "Connection reset by peer", "Connection closed by peer")


def broken_collective(error: BaseException) -> str | None:
    """The line a launched rank ends with when a collective failed under it (most often: another rank ended
    with its own error, and its socket closed), or None for any other error (a traceback then).

    Told by where the error came from (its innermost frame is in the collectives' code: torch.distributed, DDP,
    DeepSpeed's comm) or by what it says (the transports' own words)."""
    if not already_launched() or error.__traceback__ is None:
        return None
    innermost = traceback.extract_tb(error.__traceback__)[-1].filename.replace("\\", "/")
    in_collective = any(part in innermost for part in _COLLECTIVE_CODE)
    if not in_collective and not any(words in str(error) for words in _TRANSPORT_WORDS):
        return None
    rank = os.environ.get("RANK", "?")
    return (
        f"error: rank {rank} stopped: the process group broke ({type(error).__name__}: {first_line(error)}); another "
        "rank has most likely failed and printed why above (--verbose shows this rank's traceback)"
    )

"""Hand a `finetune train` run to accelerate's launcher for several processes or nodes.

No home-made process management: `finetune train RECIPE --nproc N` re-runs the same command under
`accelerate launch`, which starts N processes (DDP on GPUs; gloo on CPUs) and sets the rank variables
the training loop's `Accelerator` reads. On a machine without CUDA, `ACCELERATE_USE_CPU=true` plus
`--multi_gpu` is what gives N synchronised CPU ranks (`--cpu --num_processes N` starts one process).

Example:
    finetune train recipes/quickstart.yaml --nproc 2          # two ranks on this machine
    finetune train r.yaml --nproc 8 --nnodes 2 --node-rank 0 --main-address 10.0.0.1
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from finetune.errors import FinetuneError
from finetune.launched import SAID_DIR_ENV


def hide_gpus() -> None:
    """Make this process (and every rank it launches) see no GPU: `finetune train --cpu`.

    Must run before CUDA is first used; torch reads `CUDA_VISIBLE_DEVICES` when it initialises CUDA.
    DeepSpeed, which picks its accelerator by itself, is told to take the CPU's.
    """
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["DS_ACCELERATOR"] = "cpu"


def check_gpu_count(nproc: int, visible: int) -> None:
    """Refuse more processes per node than GPUs: two ranks on one GPU share it over NCCL and can hang."""
    if nproc > visible:
        raise FinetuneError(
            f"--nproc {nproc} asks for {nproc} processes on this node but {visible} GPU(s) are visible; use "
            f"--nproc {visible}, or add --cpu for CPU ranks over gloo"
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(
    train_args: Sequence[str],
    *,
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    main_address: str | None = None,
    main_port: int | None = None,
    use_cpu: bool,
    verbose: bool = False,
) -> list[str]:
    """The `accelerate launch` command line that runs `finetune train <train_args>` on every rank."""
    threads_per_process = max(1, (os.cpu_count() or 1) // nproc) if use_cpu else 1
    command = [
        sys.executable,
        "-m",
        __name__,  # accelerate's launcher, run by `launch_quietly` below
        "--multi_gpu",
        "--mixed_precision",  # the recipe sets precision; named here, accelerate warns of no default
        "no",
        "--dynamo_backend",
        "no",
        "--num_processes",
        str(nproc * nnodes),
        "--num_machines",
        str(nnodes),
        "--machine_rank",
        str(node_rank),
        "--main_process_port",
        str(main_port or _free_port()),
        "--num_cpu_threads_per_process",
        str(threads_per_process),
    ]
    if main_address:
        command += ["--main_process_ip", main_address]
    return [*command, "-m", "finetune", *(["--verbose"] if verbose else []), "train", *train_args]


def run_launched(command: list[str], *, use_cpu: bool, deepspeed: bool = False) -> int:
    """Run the launcher in the foreground and return its exit code.

    DeepSpeed on CPU must not get `ACCELERATE_USE_CPU` (accelerate would ignore DeepSpeed and run DDP);
    DeepSpeed itself falls back to gloo there.
    """
    env = dict(os.environ)
    if use_cpu and not deepspeed:
        env["ACCELERATE_USE_CPU"] = "true"
    said = tempfile.mkdtemp(prefix="finetune-said-")  # where the ranks claim the error lines they say (`say_once`)
    env[SAID_DIR_ENV] = said
    # The launcher runs in a session of its own and hears SIGINT/SIGTERM only through this process, once each:
    # a Ctrl-C (sent to the whole foreground group) or a SIGTERM to this process alone (a supervisor, `kill`) both
    # reach the ranks, which checkpoint and stop; this process waits for them and returns their status. Left to
    # `subprocess.call`, a SIGTERM killed this process alone (the ranks trained on, orphaned) and a Ctrl-C
    # SIGKILLed the launcher and returned at once while the ranks were still writing their checkpoint.
    try:
        process = subprocess.Popen(command, env=env, start_new_session=True)
    except BaseException:
        shutil.rmtree(said, ignore_errors=True)
        raise

    def forward(signal_number: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal_number)

    previous = {number: signal.signal(number, forward) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        return process.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        shutil.rmtree(said, ignore_errors=True)


def launch_quietly(argv: Sequence[str]) -> int:
    """`accelerate launch argv`, ending as a finetune command ends: each rank has printed its own one-line error,
    so a failed rank gives the launcher's exit code 2 (a bad input on a rank) or the rank's own, and not
    torch.distributed's traceback and failure table on top."""
    import logging

    from accelerate.commands.launch import launch_command as accelerate_launch
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if "--verbose" not in argv:
        import torch.distributed.run  # noqa: F401  (creates the elastic agent's loggers)

        # torch's elastic loggers each set their own level (WARNING), so the parent's is not enough: a SIGTERM
        # printed "W... Received 15 death signal, shutting down workers" above the ranks' own line
        for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        accelerate_launch(launch_command_parser().parse_args(list(argv)))
    except ChildFailedError as failed:
        codes = [failure.exitcode for failure in failed.failures.values()]
        for rank, failure in sorted(failed.failures.items()):
            # a signal: that rank could print nothing of its own; but a SIGTERM beside a rank that failed with its
            # own error is the launcher stopping the others for it (an error every rank finds, said once, came
            # with "rank 1 was ended by SIGTERM" when rank 0 got there first)
            for_another = failure.signal_name() == "SIGTERM" and any(code > 0 for code in codes)
            if failure.exitcode < 0 and not for_another:
                print(f"error: rank {rank} was ended by {failure.signal_name()} (pid {failure.pid})", file=sys.stderr)
        return 2 if 2 in codes else next((code for code in codes if code > 0), 1)
    except SignalException as stopped:  # SIGINT/SIGTERM: handed on to the ranks, which said what they did
        return 128 + int(stopped.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(launch_quietly(sys.argv[1:]))

"""Interruptions lose nothing: SIGTERM/SIGINT checkpoint and say how to resume, a second signal stops at
once, SIGKILL at random moments never leaves a partial directory, and `--resume` ends bit for bit where an
uninterrupted run ends. Real subprocesses and real signals."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.tensorfile import safetensors_problem
from finetune.training.checkpoint import save_checkpoint
from finetune.training.loop import SLOW_STEP_ENV, train
from finetune.training.run_files import list_checkpoints

REPO = Path(__file__).resolve().parents[1]
LONG_RUN = ["train.max_steps=60", "train.log_every_steps=1", "output.name=long"]


def start(args: list[str], cwd: Path, **env_extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), **env_extra}
    return subprocess.Popen(
        [sys.executable, "-m", "finetune", "train", "recipe.yaml", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_step(process: subprocess.Popen, step: int, lines: list[str]) -> None:
    """Read stderr until the run reports `step` (the loop is then well inside training)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        lines.append(line)
        if line.startswith(f"step {step}/"):
            return
        assert line or process.poll() is None, "".join(lines)
    raise AssertionError("the run did not reach step {step}: " + "".join(lines))


def stop_with_sigterm(process: subprocess.Popen, lines: list[str], workdir: Path) -> str:
    """SIGTERM the run `long`; check it ends with 128 + SIGTERM and one line naming the checkpoint of the step it
    stopped at and `--resume`; return the rest of its stderr."""
    process.send_signal(signal.SIGTERM)
    _, rest = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, "".join(lines) + rest
    errors = [line for line in rest.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "interrupted at step" in errors[0] and "--resume" in errors[0], rest
    interrupted_at = int(errors[0].split("interrupted at step ")[1].split()[0])
    assert list_checkpoints(workdir / "runs" / "long")[-1].name == f"checkpoint-{interrupted_at:06d}"
    return rest


def adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "adapter_model.safetensors")


def assert_same_tensors(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


@pytest.mark.slow
def test_sigterm_checkpoints_says_how_to_resume_and_resume_is_exact(workdir):
    process = start(LONG_RUN, workdir)
    lines: list[str] = []
    wait_for_step(process, 5, lines)
    rest = stop_with_sigterm(process, lines, workdir)
    assert "Traceback" not in rest
    assert not (workdir / "adapters" / "long").exists()

    resumed = start([*LONG_RUN[:1], "train.log_every_steps=50", "output.name=long", "--resume"], workdir)
    _, log = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, log[-3000:]
    reference, _ = train("recipe.yaml", [*LONG_RUN[:1], "output.name=reference"], log=lambda message: None)
    assert_same_tensors(adapter_tensors(reference), adapter_tensors(workdir / "adapters" / "long"))


@pytest.mark.slow
def test_sigterm_to_a_run_of_two_ranks_checkpoints_once_and_says_so_once(workdir):
    """`kill PID` on `finetune train --nproc 2`: both ranks stop at the same step and checkpoint, and the run's
    checkpoint line is printed once (every rank printed it), with 128 + SIGTERM."""
    process = start([*LONG_RUN, "--nproc", "2"], workdir, **{SLOW_STEP_ENV: "0.5"})
    lines: list[str] = []
    wait_for_step(process, 2, lines)
    rest = stop_with_sigterm(process, lines, workdir)
    assert "death signal" not in rest  # torch elastic's own log line


@pytest.mark.slow
def test_a_signal_during_the_final_evaluation_lets_the_run_end_whole(workdir):
    """After the last step only the final evaluation and the adapter are left: a SIGTERM then killed the process
    without a word (and SIGINT ended it with a bare "interrupted"); the run now finishes them and ends whole. The
    run sleeps 5 s after each step and before its final evaluation (the test hook): the signal comes 2 s into
    that last sleep."""
    process = start(["train.max_steps=2", "train.log_every_steps=1", "output.name=whole"], workdir,
                    **{SLOW_STEP_ENV: "5"})  # fmt: skip
    lines: list[str] = []
    wait_for_step(process, 2, lines)  # the last step is read: its checkpoint, then the sleep before the evaluation
    time.sleep(2)
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    _, rest = process.communicate(timeout=300)
    assert process.returncode == 0, "".join(lines) + rest
    assert "SIGTERM: the steps are done; finishing the final evaluation and writing the adapter" in rest
    assert (workdir / "adapters" / "whole" / "adapter_model.safetensors").is_file()


def test_a_second_signal_stops_at_once(workdir):
    process = start(LONG_RUN, workdir, **{SLOW_STEP_ENV: "2"})  # 2 s after each step: time for two signals
    lines: list[str] = []
    wait_for_step(process, 1, lines)
    process.send_signal(signal.SIGINT)
    assert process.stderr.readline().startswith("SIGINT: finishing this step")
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGINT
    assert not (workdir / "adapters" / "long").exists()


def assert_no_partial_directory(work: Path, name: str) -> None:
    """Whatever a reader can see is whole: every checkpoint loads, the adapter (if any) is complete."""
    run_dir = work / "runs" / name
    for path in list_checkpoints(run_dir):
        for file in ("trainable.safetensors", "optimizer.safetensors"):
            assert safetensors_problem(path / file) is None, path
        assert (path / "trainer_state.json").is_file(), path
    adapter = work / "adapters" / name
    if adapter.exists():
        for file in ("adapter_config.json", "manifest.json", "recipe.yaml"):
            assert (adapter / file).is_file(), file
        assert safetensors_problem(adapter / "adapter_model.safetensors") is None


KILLS = 4


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_gives_the_uninterrupted_adapter(workdir):
    """SIGKILLs at random moments, then finish: the first during start-up, the others at a random time after the
    run says it is training, where its time goes to steps and to the checkpoint written after each one.

    A kill timed from the process start lands in the imports (several seconds), so the later ones are timed
    from the run's own "training" line. Each kill costs a start-up; KILLS keeps the suite within its time."""
    args = ["train.max_steps=100", "train.save_every_steps=1", "train.log_every_steps=1000", "output.name=killed"]
    randomness = random.Random(0)

    def attempt(kill: str | None) -> bool:
        """One run (resumed when a checkpoint exists), killed during start-up or training; True when killed."""
        resume = ["--resume"] if list_checkpoints(workdir / "runs" / "killed") else []
        # 10 ms more per step: no three kill delays add up to the 100 steps, even on a fast machine
        process = start([*args, *resume], workdir, **{SLOW_STEP_ENV: "0.01" if kill else "0"})
        if kill == "start-up":
            time.sleep(randomness.uniform(0.2, 2.0))
        elif kill == "training":
            lines: list[str] = []
            while not (lines and lines[-1].startswith("training ")):
                lines.append(process.stderr.readline())
                assert lines[-1] or process.poll() is None, "".join(lines)
            time.sleep(randomness.uniform(0.0, 0.8))
        if kill:
            process.kill()
        _, log = process.communicate()
        if process.returncode == -signal.SIGKILL:
            assert_no_partial_directory(workdir, "killed")
            return True
        assert process.returncode == 0, log[-2000:]
        return False

    kills = sum(attempt(kind) for kind in ["start-up"] + ["training"] * (KILLS - 1))
    assert kills == KILLS, f"only {kills} of {KILLS} attempts were killed; the others finished"
    assert list_checkpoints(workdir / "runs" / "killed"), "no kill came after a checkpoint"
    while not (workdir / "adapters" / "killed").exists():
        attempt(None)
    assert_no_partial_directory(workdir, "killed")
    reference, _ = train("recipe.yaml", [*args[:1], "output.name=reference"], log=lambda message: None)
    assert_same_tensors(adapter_tensors(reference), adapter_tensors(workdir / "adapters" / "killed"))
    assert list_checkpoints(workdir / "runs" / "killed")[-1].name == "checkpoint-000100"


def test_a_kill_while_an_old_checkpoint_is_deleted_leaves_none_half_deleted_in_view(tmp_path, monkeypatch):
    """Pruning renames a checkpoint out of view before deleting it: a kill mid-delete (found by the random
    SIGKILLs above: a visible checkpoint without its weights) leaves only a hidden sibling, which the next
    checkpoint write removes. The kill is a deletion that stops after its first file."""
    import shutil

    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), lambda s: 1)

    def save(step: int) -> None:
        trainable = {"w": torch.full((2,), float(step))}
        save_checkpoint(tmp_path, step=step, trainable=trainable, optimizer_state={"state": {}, "param_groups": []},
                        scheduler=scheduler, state={}, keep=1)  # fmt: skip

    class Killed(BaseException):
        pass

    def killed_midway(path, ignore_errors=False):
        next(p for p in Path(path).iterdir() if p.is_file()).unlink()
        raise Killed

    save(1)
    with monkeypatch.context() as patched:
        patched.setattr(shutil, "rmtree", killed_midway)
        with pytest.raises(Killed):
            save(2)  # writes checkpoint 2, then dies deleting checkpoint 1
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-000002"]
    assert len(list(tmp_path.glob(".checkpoint-000001.old-*"))) == 1  # out of view, not yet deleted
    save(3)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-000003"]


def test_a_signal_on_a_saving_step_writes_its_checkpoint_once(workdir, monkeypatch):
    """SIGTERM read at a step that saves anyway: the checkpoint it just wrote is the one the stop names. It was
    written a second time, replacing the first (a whole gather and write more; out of view in between)."""
    from finetune.training import checkpoint as ckpt
    from finetune.training.interrupt import TrainingInterrupted

    written: list[int] = []
    real_save = ckpt.save_checkpoint
    monkeypatch.setattr(
        ckpt, "save_checkpoint", lambda run_dir, **kw: written.append(kw["step"]) or real_save(run_dir, **kw)
    )

    def sigterm_at_step_1(step: int, metrics: dict) -> None:
        if step == 1:  # read at step 2 (log_every_steps 2), which saves
            os.kill(os.getpid(), signal.SIGTERM)

    overrides = ["train.save_every_steps=2", "train.log_every_steps=2", "output.name=long"]
    with pytest.raises(TrainingInterrupted, match="interrupted at step 2 of 6; checkpoint runs/long/checkpoint-000002"):
        train("recipe.yaml", overrides, log=lambda message: None, on_step=sigterm_at_step_1)
    assert written == [2]
    assert [p.name for p in list_checkpoints(workdir / "runs" / "long")] == ["checkpoint-000002"]


TOKENIZING = """
import sys
from finetune.data.workers import ordered_map

def chunk(state, item):  # a worker's result: bigger than a pipe holds, so workers are often caught writing it
    return b"x" * 20_000_000

print("started", flush=True)
for result in ordered_map(chunk, range(100_000), state=None, num_proc=2):
    pass
"""


@pytest.mark.parametrize("how", ["SIGTERM to the process", "Ctrl-C to its group"])
def test_a_signal_while_workers_tokenize_ends_the_process_and_its_workers_without_a_word(tmp_path, how):
    """Before training installs its handler: SIGTERM left the workers writing into a pipe nobody read (a
    BrokenPipeError traceback from each), and Ctrl-C interrupted them mid-write (a KeyboardInterrupt traceback
    from each) and the process then hung, its pool waiting for the rest of a result that never came."""
    stderr = tmp_path / "stderr.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(stderr, "w") as err:
        process = subprocess.Popen([sys.executable, "-c", TOKENIZING], stdout=subprocess.PIPE, stderr=err,
                                   text=True, env=env, start_new_session=True)  # fmt: skip
    try:
        assert process.stdout.readline() == "started\n"
        time.sleep(1.0)
        if how == "Ctrl-C to its group":
            os.killpg(process.pid, signal.SIGINT)
        else:
            process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=30)
        process.stdout.read()  # EOF once every worker has ended too (they hold the pipe)
    finally:
        with_workers = _live_processes_of_group(process.pid)
        if with_workers:
            os.killpg(process.pid, signal.SIGKILL)
    assert with_workers == []
    if how == "SIGTERM to the process":
        assert returncode == -signal.SIGTERM and stderr.read_text() == ""
    else:  # the parent's own KeyboardInterrupt (the CLI says "interrupted"), and no worker's
        assert returncode == -signal.SIGINT and "ForkPoolWorker" not in stderr.read_text()


def _live_processes_of_group(group: int) -> list[str]:
    """The processes of `group` still running after a moment (killed workers may stay zombies until reaped)."""
    deadline = time.monotonic() + 10
    while True:
        listing = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(group)], capture_output=True, text=True).stdout
        live = [line.split()[0] for line in listing.splitlines() if not line.split()[1].startswith("Z")]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.1)

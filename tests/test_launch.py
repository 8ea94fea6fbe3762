"""The `accelerate launch` command line `finetune train --nproc/--nnodes/...` hands over to, without launching.

Exact argv for several option sets; accelerate's own parser reads each as intended; the CLI builds it from
its options (overrides and `--resume` passed through, a bad recipe refused before any launch); and
`run_launched` passes `ACCELERATE_USE_CPU` and the exit status. `tests/test_distributed.py` (slow) launches
two real ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.cli import main
from finetune.errors import FinetuneError
from finetune.launched import already_launched
from finetune.training import launch
from finetune.training.launch import launch_command, run_launched
from finetune.training.loop import train

CPU_COUNT = 8
LAUNCHER = [sys.executable, "-m", "finetune.training.launch", "--multi_gpu", "--mixed_precision", "no",
            "--dynamo_backend", "no"]  # fmt: skip


@pytest.fixture()
def eight_cpus(monkeypatch):
    """Threads per process depend on the machine's CPU count: fix it."""
    monkeypatch.setattr(os, "cpu_count", lambda: CPU_COUNT)


CASES = [
    pytest.param(
        dict(train_args=["recipe.yaml"], nproc=2, main_port=29500, use_cpu=True),
        [*LAUNCHER, "--num_processes", "2", "--num_machines", "1", "--machine_rank", "0",
         "--main_process_port", "29500", "--num_cpu_threads_per_process", "4",
         "-m", "finetune", "train", "recipe.yaml"],
        id="two-cpu-ranks",
    ),
    pytest.param(
        dict(train_args=["r.yaml"], nproc=3, main_port=1, use_cpu=True),
        [*LAUNCHER, "--num_processes", "3", "--num_machines", "1", "--machine_rank", "0",
         "--main_process_port", "1", "--num_cpu_threads_per_process", "2",
         "-m", "finetune", "train", "r.yaml"],
        id="threads-rounded-down",
    ),
    pytest.param(
        dict(train_args=["r.yaml"], nproc=16, main_port=2, use_cpu=True),
        [*LAUNCHER, "--num_processes", "16", "--num_machines", "1", "--machine_rank", "0",
         "--main_process_port", "2", "--num_cpu_threads_per_process", "1",
         "-m", "finetune", "train", "r.yaml"],
        id="more-ranks-than-cpus-still-one-thread",
    ),
    pytest.param(
        dict(train_args=["r.yaml", "train.lr=1e-4", "--resume"], nproc=4, nnodes=2, node_rank=1,
             main_address="10.0.0.1", main_port=1234, use_cpu=False, verbose=True),
        [*LAUNCHER, "--num_processes", "8", "--num_machines", "2", "--machine_rank", "1",
         "--main_process_port", "1234", "--num_cpu_threads_per_process", "1", "--main_process_ip", "10.0.0.1",
         "-m", "finetune", "--verbose", "train", "r.yaml", "train.lr=1e-4", "--resume"],
        id="gpus-on-two-nodes-verbose-resume",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("options", "expected"), CASES)
def test_launch_command_is_exactly(eight_cpus, options, expected):
    options = dict(options)
    assert launch_command(options.pop("train_args"), **options) == expected


@pytest.mark.parametrize(("options", "expected"), CASES)
def test_accelerate_reads_the_command_as_meant(eight_cpus, options, expected):
    """accelerate's own parser: total processes over all nodes, `-m finetune` run as a module with our args."""
    from accelerate.commands.launch import launch_command_parser

    options = dict(options)
    train_args = options.pop("train_args")
    parsed = launch_command_parser().parse_args(launch_command(train_args, **options)[3:])
    nproc, nnodes = options["nproc"], options.get("nnodes", 1)
    assert parsed.multi_gpu and parsed.module and parsed.training_script == "finetune"
    assert (parsed.num_processes, parsed.num_machines, parsed.machine_rank) == (
        nproc * nnodes,
        nnodes,
        options.get("node_rank", 0),
    )
    assert parsed.main_process_port == options["main_port"]
    assert parsed.main_process_ip == options.get("main_address")
    verbose = ["--verbose"] if options.get("verbose") else []
    assert parsed.training_script_args == [*verbose, "train", *train_args]


def test_without_a_port_a_free_one_is_chosen(eight_cpus):
    command = launch_command(["r.yaml"], nproc=2, use_cpu=True)
    port = int(command[command.index("--main_process_port") + 1])
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free when chosen (raises if something holds it)


def test_the_cli_hands_its_options_to_the_launcher(workdir, eight_cpus, monkeypatch):
    launched = []
    monkeypatch.setattr(
        launch, "run_launched", lambda command, *, use_cpu, deepspeed: launched.append((command, use_cpu)) or 7
    )
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    for hidden_by_cpu in ("CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR"):  # --cpu sets them; restored afterwards
        monkeypatch.setenv(hidden_by_cpu, os.environ.get(hidden_by_cpu, ""))
    checkpoint = workdir / "runs" / "crates" / "checkpoint-000001"  # what --resume is checked against before launching
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"rng": [{}] * 4}))  # written by 2 x 2 processes
    argv = ["-v", "train", "recipe.yaml", "--nproc", "2", "--nnodes", "2", "--node-rank", "1", "train.lr=1e-4"]
    argv += ["--main-address", "10.0.0.1", "--main-port", "29501", "--resume", "--cpu"]
    assert main(argv) == 7  # the launcher's exit status is the command's
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and os.environ["DS_ACCELERATOR"] == "cpu"  # what ranks inherit
    use_cpu, threads = True, str(CPU_COUNT // 2)
    assert launched == [
        (
            [*LAUNCHER, "--num_processes", "4", "--num_machines", "2", "--machine_rank", "1",
             "--main_process_port", "29501", "--num_cpu_threads_per_process", threads,
             "--main_process_ip", "10.0.0.1",
             "-m", "finetune", "--verbose", "train", "recipe.yaml", "train.lr=1e-4", "--resume"],
            use_cpu,
        )
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["train", "recipe.yaml", "--nproc", "2", "train.lr=fast"], "train.lr"),
        (["train", "recipe.yaml", "--nproc", "0"], "--nproc 0 --nnodes 1: both must be at least 1"),
        (["train", "recipe.yaml", "--nnodes", "0"], "--nproc 1 --nnodes 0: both must be at least 1"),
        (["train", "recipe.yaml", "--nproc", "2", "--main-port", "70000"], "--main-port 70000: give a TCP port"),
        (["train", "recipe.yaml", "--nproc", "2", "--main-port", "-1"], "--main-port -1: give a TCP port"),
    ],
)
def test_bad_options_or_recipes_are_refused_before_any_launch(workdir, monkeypatch, capsys, argv, fragment):
    launched = []
    monkeypatch.setattr(launch, "run_launched", lambda command, *, use_cpu, deepspeed: launched.append(command) or 0)
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err
    assert launched == []


def test_already_launched_reads_the_rank_variables_launchers_set(monkeypatch):
    """`accelerate launch` re-runs `finetune train ... --nproc N` on every rank: there it must not launch again."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert already_launched()
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("RANK", "3")
    assert already_launched()
    monkeypatch.delenv("RANK")
    assert not already_launched()


@pytest.mark.parametrize(("use_cpu", "expected"), [(True, "true"), (False, "unset")])
def test_run_launched_sets_accelerate_use_cpu_and_returns_the_exit_status(monkeypatch, use_cpu, expected):
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    script = "import os, sys; sys.exit({'true': 11, 'unset': 12}[os.environ.get('ACCELERATE_USE_CPU', 'unset')])"
    assert run_launched([sys.executable, "-c", script], use_cpu=use_cpu) == {"true": 11, "unset": 12}[expected]


def test_ranks_of_one_launch_say_a_line_they_share_once_and_their_own_lines_each(monkeypatch):
    """Four ranks (real processes, as `run_launched` starts them) each end with the same error and one of their own:
    the shared one used to be printed once per rank, now and then run together into one line."""
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    rank = (
        "import os, sys\n"
        "from finetune.launched import say_once\n"
        "for r in range(4):\n"
        "    if os.fork() == 0:\n"
        "        os.environ['RANK'] = str(r)\n"
        "        say_once('error: lora.target_modules match no module')\n"
        "        say_once(f'error: rank {r} is out of memory')\n"
        "        os._exit(0)\n"
        "for _ in range(4): os.wait()\n"
    )
    env_path = str(Path(__file__).resolve().parents[1])
    script = f"import sys; sys.path.insert(0, {env_path!r}); exec({rank!r})"
    command = [sys.executable, "-c", f"from finetune.training.launch import run_launched; import sys; "
               f"sys.exit(run_launched([sys.executable, '-c', {script!r}], use_cpu=False))"]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": env_path}
    )
    lines = result.stderr.splitlines()
    assert result.returncode == 0 and lines.count("error: lora.target_modules match no module") == 1, result.stderr
    assert sorted(line for line in lines if "memory" in line) == [f"error: rank {r} is out of memory" for r in range(4)]
    assert len(lines) == 5, result.stderr


def test_more_processes_than_gpus_is_refused_saying_what_fits():
    """Two ranks on one GPU share it over NCCL and hung past 150 s on an H100: refused before any launch."""
    with pytest.raises(FinetuneError, match=r"--nproc 2 .* but 1 GPU\(s\) are visible; use --nproc 1, or add --cpu"):
        launch.check_gpu_count(2, 1)
    launch.check_gpu_count(2, 2)  # one rank per GPU: fine


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_a_signal_to_finetune_reaches_the_launcher_once_and_finetune_waits_for_it(tmp_path, signal_name):
    """`kill PID` (a supervisor, Kubernetes) or Ctrl-C on `finetune train --nproc N` must reach the ranks, once, and
    `finetune` must wait for them to checkpoint: it used to die alone on SIGTERM (the ranks trained on, orphaned)
    and to SIGKILL the launcher on SIGINT, returning while the ranks were still writing."""
    import signal
    import subprocess
    import time

    marker = tmp_path / "child"
    child = (
        "import os, signal, sys, time, pathlib\n"
        f"p = pathlib.Path({str(marker)!r})\n"
        "got = []\n"
        "def h(n, f): got.append(n)\n"
        "signal.signal(signal.SIGINT, h); signal.signal(signal.SIGTERM, h)\n"
        "p.write_text(f'ready {os.getpid()}')\n"
        "while not got: time.sleep(0.01)\n"
        "time.sleep(0.5)\n"  # 'writing a checkpoint'
        "p.write_text(f'stopped {got}')\n"
        "sys.exit(128 + got[0])\n"
    )
    parent = (
        "import sys\n"
        "from finetune.training.launch import run_launched\n"
        f"sys.exit(run_launched([sys.executable, '-c', {child!r}], use_cpu=False))\n"
    )
    number = getattr(signal, signal_name)
    process = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (marker.exists() and marker.read_text()):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.02)
        if signal_name == "SIGINT":
            os.killpg(process.pid, number)  # Ctrl-C: the terminal signals the whole foreground group
        else:
            process.send_signal(number)  # a supervisor: this process alone
        assert process.wait(timeout=30) == 128 + number
        assert marker.read_text() == f"stopped [{int(number)}]"  # handed on once, and waited for
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        if marker.read_text().startswith("ready"):  # not stopped: an orphan (as before the fix) must not outlive it
            os.kill(int(marker.read_text().split()[1]), signal.SIGKILL)


def _launch_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for name in ("LOCAL_RANK", "RANK"):
        env.pop(name, None)
    command = [sys.executable, "-m", "finetune", "train", "recipe.yaml", "--nproc", "2", "--cpu", *argv]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_what_every_rank_would_refuse_is_refused_once_before_any_launch(workdir):
    """A --resume with no checkpoint or with one of another process count, and a fresh run into an earlier one's
    adapter, used to be found by each rank: the same error twice (or once and "rank 0 was ended by SIGTERM")."""
    train("recipe.yaml", ["train.max_steps=1", "output.name=one"], log=lambda line: None)
    cases = [
        (["output.name=none", "--resume"], "error: --resume: no checkpoint in runs/none; run without --resume"),
        (["output.name=one", "--resume"], "error: runs/one/checkpoint-000001 was written by 1 process(es) but this "
                                          "run has 2; resume with --nproc 1"),
        (["output.name=one"], "error: output: adapters/one already exists; choose another output.name"),
    ]  # fmt: skip
    for argv, line in cases:
        result = _launch_cli(*argv)
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.startswith(line) and result.stderr.count("\n") == 1, result.stderr  # one line, once
    # the first run's directory, as it is, without its adapter: an earlier run in the way of a fresh one
    shutil.rmtree("adapters/one")
    result = _launch_cli("output.name=one")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: output: runs/one holds an earlier run's checkpoints or metrics")

"""Experiment trackers: what TensorBoard, MLflow (local file store) and wandb (offline) recorded, read back.

Run `b` of `trained_runs` (tests/run_fixtures.py) reported to all three; each must hold exactly the
series of its metrics.jsonl, and the base model's held-out metrics.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from finetune.cli import main as cli_main
from finetune.training.tracking import flat_config

TRAIN_KEYS = ("loss", "lr", "tokens_per_s", "tokens_seen", "grad_norm", "epoch")
EVAL_KEYS = ("eval_loss", "eval_ppl")


def _expected_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(step, value)] from metrics.jsonl, plus the base model's metrics at step 0."""
    series: dict[str, list[tuple[int, float]]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key in TRAIN_KEYS + EVAL_KEYS:
            if key in record:
                series.setdefault(key, []).append((record["step"], record[key]))
    manifest = json.loads((run_dir / "run.json").read_text())["manifest"]
    for key in EVAL_KEYS:
        series[f"base_{key}"] = [(0, manifest["metrics"][f"base_{key}"])]
    return series


def _wandb_records(path: Path):
    """The protobuf records of a wandb run file: ':W&B' + magic + version (7 bytes), then LevelDB-log
    blocks of 32 KiB holding chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block_size = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    position, parts = 7, []
    while position + 7 <= len(data):
        left_in_block = block_size - position % block_size
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left_in_block < 7 or (kind == 0 and length == 0):  # block trailer / padding
            position += left_in_block
            continue
        parts.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def _assert_series_equal(recorded: dict[str, list[tuple[int, float]]], expected: dict) -> None:
    for key, points in expected.items():
        got = sorted(recorded.get(key, []))
        assert [step for step, _ in got] == [step for step, _ in points], key
        # TensorBoard stores float32: each value rounded once from the float64 logged
        assert [value for _, value in got] == pytest.approx([value for _, value in points], rel=2**-24), key


def test_mlflow_file_store_holds_the_run_metrics_and_recipe(trained_runs):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(trained_runs["root"] / "mlruns").as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "finetune"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "b"
    assert (
        run.data.params["lora.r"] == "4" and run.data.params["train.report_to"] == '["tensorboard", "mlflow", "wandb"]'
    )
    expected = _expected_series(trained_runs["b"])
    recorded = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] for key in expected}
    _assert_series_equal(recorded, expected)


def test_wandb_offline_run_holds_the_run_metrics_and_recipe(trained_runs):
    (run_file,) = (trained_runs["b"] / "wandb").glob("offline-run-*/run-*.wandb")
    recorded: dict[str, list[tuple[int, float]]] = {}
    config = {}
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in row.items():
                if not key.startswith("_"):
                    recorded.setdefault(key, []).append((row["_step"], value))
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    _assert_series_equal(recorded, _expected_series(trained_runs["b"]))
    assert config["lora.r"] == 4 and config["output.name"] == "b"


def test_tensorboard_holds_the_run_metrics(trained_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trained_runs["b"] / "tensorboard")).Reload()
    recorded = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    _assert_series_equal(recorded, _expected_series(trained_runs["b"]))


def test_flat_config_gives_trackers_scalars_only():
    assert flat_config({"lora": {"r": 8, "targets": ["q", "v"]}, "model": {"revision": None}}) == {
        "lora.r": 8,
        "lora.targets": '["q", "v"]',
        "model.revision": "null",
    }


@pytest.mark.parametrize("command", ["train", "validate"])
def test_a_tracker_that_is_not_installed_is_a_one_line_error_before_training(workdir, command, monkeypatch, capsys):
    """wandb made unimportable as on a machine without it (`sys.modules[name] = None` is Python's own marker
    for that: `import wandb` fails and `importlib.util.find_spec` answers None): one line naming the package."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert cli_main([command, "recipe.yaml", "train.report_to=[tensorboard,wandb]"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("error: recipe.yaml: 1 problem: train.report_to")
    assert "wandb is not installed; pip install wandb (or pip install 'finetune[wandb]')" in error
    assert not (workdir / "runs").exists() and not (workdir / "adapters").exists()


def test_a_directory_named_like_a_tracker_is_not_taken_for_it(workdir, monkeypatch, capsys):
    """`python -m finetune` and a notebook put the working directory on sys.path, and a `trackio/` there (its data
    under `TRACKIO_DIR=./trackio`; a `wandb/` wandb leaves) is a namespace package to `find_spec`: the check passed,
    accelerate (which also asks for the installed distribution) dropped the tracker with a debug line, and the run
    trained reporting to nothing. Now the one-line error of a tracker that is not installed."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("trackio")
        pytest.skip("trackio is installed here: a directory cannot stand in for it")
    except PackageNotFoundError:
        pass
    (workdir / "trackio").mkdir()
    monkeypatch.syspath_prepend(str(workdir))
    assert cli_main(["train", "recipe.yaml", "train.report_to=[tensorboard,trackio]"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "trackio is not installed; pip install trackio" in error
    assert not (workdir / "runs").exists() and not (workdir / "adapters").exists()


def test_a_tracker_that_fails_to_start_is_a_one_line_error(workdir, monkeypatch, capsys):
    """MLflow with a tracking URI of no store it knows: its exception came out as a traceback after the model
    had loaded; now one line naming train.report_to, exit 2, and no adapter."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchstore://here")
    assert cli_main(["train", "recipe.yaml", "train.report_to=[mlflow]", "train.max_steps=1"]) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert error.startswith("error: train.report_to ['mlflow']: a tracker failed to start"), error
    assert not (workdir / "adapters").exists()


def _interrupted_and_resumed(name: str, report_to: str, between: Callable[[Path], None] | None = None) -> Path:
    """A run of 4 steps with a checkpoint at step 2, interrupted once step 3 was logged (before the adapter), then
    resumed from step 2: its trackers first saw steps 1-3, the resumed process trains 3 and 4 again."""
    import finetune

    overrides = ["train.max_steps=4", "train.save_every_steps=2", "train.log_every_steps=1", f"output.name={name}"]
    overrides += [f"train.report_to={report_to}"]

    def stop_at_4(step: int, metrics: dict) -> None:
        if step == 4:
            raise KeyboardInterrupt  # after step 3 was logged, before the adapter

    with pytest.raises(KeyboardInterrupt):
        finetune.train("recipe.yaml", overrides, log=lambda line: None, on_step=stop_at_4)
    if between is not None:
        between(Path("runs") / name)
    finetune.train("recipe.yaml", overrides, log=lambda line: None, resume=True)
    return Path("runs") / name


def test_a_resumed_runs_tensorboard_holds_each_step_once(workdir):
    """metrics.jsonl drops what a resumed run trains again; TensorBoard showed those steps twice (the stale ones
    with another throughput) and the base model's figures again at the resume step. The resumed writer purges
    what comes after the checkpoint, so the event files read back as metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = _interrupted_and_resumed("tb", "[tensorboard]")
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    recorded = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    _assert_series_equal(recorded, _expected_series(run_dir))


def test_a_run_resumed_in_the_same_second_still_purges_the_steps_trained_again(workdir):
    """TensorBoard reads event files in name order, `...tfevents.<second>.<host>.<pid>.<n>`: a run resumed in the
    same second and process as the one it resumes sorted first once n gained a digit (`.10` before `.9`), and the
    steps trained again showed twice ([1, 2, 3, 3, 4, 4], seen in a suite run). Here the interrupted run's file is
    given the next second, as such a file sorts: the resumed writer waits until its own sorts after it."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def sorted_last(run_dir: Path) -> None:
        (earlier,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
        parts = earlier.name.split(".")
        parts[3] = f"{int(time.time()) + 1:010d}"
        earlier.rename(earlier.with_name(".".join(parts)))

    run_dir = _interrupted_and_resumed("tb", "[tensorboard]", between=sorted_last)
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]


def test_a_resumed_runs_mlflow_and_wandb_runs_hold_each_step_once(workdir, monkeypatch):
    """The resumed process started new runs in MLflow and wandb holding only steps 3-4 (no base figures, none of
    steps 1-2), beside the interrupted runs' step 3 of other values: the history was in two runs, one step in both.
    The new runs are first sent the history metrics.jsonl keeps, so each reads back as metrics.jsonl."""
    from mlflow.tracking import MlflowClient
    from run_fixtures import tracker_environment

    for key, value in tracker_environment(workdir).items():
        monkeypatch.setenv(key, value)
    run_dir = _interrupted_and_resumed("twice", "[tensorboard,mlflow,wandb]")
    expected = _expected_series(run_dir)

    client = MlflowClient()
    (experiment,) = [e for e in client.search_experiments() if e.name == "finetune"]
    resumed, interrupted = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"])
    assert resumed.info.run_name == interrupted.info.run_name == "twice"
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(resumed.info.run_id, key)] for key in expected
    }
    _assert_series_equal(history, expected)

    (run_file,) = (run_dir / "wandb" / "latest-run").glob("run-*.wandb")
    recorded: dict[str, list[tuple[int, float]]] = {}
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in row.items():
                recorded.setdefault(key, []).append((row["_step"], value))
    _assert_series_equal(recorded, expected)


def test_a_resumed_runs_trackio_run_holds_each_step_once(workdir, monkeypatch):
    """trackio, where installed: the resumed run's records (its local database) are metrics.jsonl's, each step once."""
    pytest.importorskip("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    monkeypatch.setattr("trackio.sqlite_storage.TRACKIO_DIR", workdir / "trackio")  # read once, at import
    run_dir = _interrupted_and_resumed("twice", "[trackio]")
    expected = _expected_series(run_dir)
    interrupted, resumed = SQLiteStorage.get_run_records("finetune")
    assert interrupted["name"] == resumed["name"] == "twice"
    recorded: dict[str, list[tuple[int, float]]] = {}
    for row in SQLiteStorage.get_logs("finetune", resumed["name"], run_id=resumed["id"]):
        for key in expected.keys() & row.keys():
            recorded.setdefault(key, []).append((row["step"], row[key]))
    _assert_series_equal(recorded, expected)


def test_wandb_keeps_a_runs_history_after_the_process_changed_directory(workdir, tmp_path_factory, monkeypatch):
    """Two runs in one process, the second after a chdir, each with a relative run directory: wandb's service,
    started in the first directory, resolved the second run's against it and wrote its run file nowhere (the
    offline run directory held logs and no history). Each run directory now holds its own run's records."""
    import shutil

    from run_fixtures import tracker_environment

    import finetune

    for key, value in tracker_environment(workdir).items():
        monkeypatch.setenv(key, value)
    other = tmp_path_factory.mktemp("other")
    for name in ("recipe.yaml", "train.jsonl", "valid.jsonl"):
        shutil.copy(workdir / name, other / name)
    overrides = ["train.max_steps=2", "train.report_to=[wandb]"]
    finetune.train("recipe.yaml", overrides, log=lambda line: None)
    monkeypatch.chdir(other)
    finetune.train("recipe.yaml", overrides, log=lambda line: None)
    for root in (workdir, other):
        run_dir = root / "runs" / "crates"
        (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
        steps = {
            json.loads(item.value_json)
            for record in _wandb_records(run_file)
            if record.WhichOneof("record_type") == "history"
            for item in record.history.item
            if (item.key or ".".join(item.nested_key)) == "_step"
        }
        assert steps == {0, 2}, root  # the base model at 0, then every log_every_steps (2)

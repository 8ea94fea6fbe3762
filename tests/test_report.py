"""Run reports: what `finetune train` leaves in the run directory, the plotted points, the page, the CLI.

The runs are `trained_runs` (tests/run_fixtures.py): `a` writes its report at the end of training, `b`
has `output.report: false`. The browser check (a real Chromium rendering the page) is
`bench/check_report_in_browser.py`, not a test: CI machines may have no Chromium.
"""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from finetune.cli import main as cli_main
from finetune.errors import FinetuneError
from finetune.report import read_run, write_report
from finetune.report.plots import BASE_SUFFIX, FIGURE_NAMES, START_SUFFIX, make_figures


def _jsonl(run_dir: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "eval_loss" in r]


def _line(axes, label: str):
    (line,) = [line for line in axes.get_lines() if line.get_label() == label]
    return list(line.get_xdata()), list(line.get_ydata())


def test_train_writes_the_report_unless_the_recipe_turns_it_off(trained_runs):
    a, b = trained_runs["a"], trained_runs["b"]
    assert (a / "report.html").is_file() and (a / "run.json").is_file()
    assert sorted(p.name for p in (a / "plots").iterdir()) == sorted(f"{name}.png" for name in FIGURE_NAMES)
    assert not (b / "report.html").exists() and not (b / "plots").exists()
    assert (b / "run.json").is_file()  # the record of the run is written either way
    record = json.loads((a / "run.json").read_text())
    assert record["adapter_dir"].endswith("adapters/a")
    assert record["manifest"]["metrics"]["wall_seconds"] > 0


def test_plotted_points_are_the_records_of_metrics_jsonl(trained_runs):
    train_records, eval_records = _jsonl(trained_runs["a"])
    manifest = json.loads((trained_runs["a"] / "run.json").read_text())["manifest"]
    figures = make_figures([read_run(trained_runs["a"])])
    steps = [r["step"] for r in train_records]
    assert len(steps) == 4 and len(eval_records) == 2  # steps 2, 4, 6, 8; evaluations at 4 and 8

    for name, key in (("loss", "loss"), ("lr", "lr")):
        by_step, by_tokens = figures[name].axes
        assert _line(by_step, "a") == (steps, [r[key] for r in train_records])
        assert _line(by_tokens, "a") == ([r["tokens_seen"] for r in train_records], [r[key] for r in train_records])
    loss_axes, ppl_axes = figures["eval"].axes
    for axes, key in ((loss_axes, "eval_loss"), (ppl_axes, "eval_ppl")):
        assert _line(axes, "a") == ([r["step"] for r in eval_records], [r[key] for r in eval_records])
        assert _line(axes, "a" + BASE_SUFFIX)[1] == [manifest["metrics"][f"base_{key}"]] * 2
    (throughput_axes,) = figures["throughput"].axes
    assert _line(throughput_axes, "a") == (steps, [r["tokens_per_s"] for r in train_records])


def test_the_pngs_are_images_and_the_page_embeds_them_with_nothing_external(trained_runs):
    page = (trained_runs["a"] / "report.html").read_text()
    embedded = re.findall(r'<img alt="(\w+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)">', page)
    assert [name for name, _ in embedded] == list(FIGURE_NAMES)
    for name, data in embedded:
        path = trained_runs["a"] / "plots" / f"{name}.png"
        assert base64.b64decode(data) == path.read_bytes()
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size == ((1040, 340) if name != "throughput" else (520, 340))
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", page) and "<script" not in page
    manifest = json.loads((trained_runs["a"] / "run.json").read_text())["manifest"]
    base_ppl, ppl = manifest["metrics"]["base_eval_ppl"], manifest["metrics"]["eval_ppl"]
    assert f"{base_ppl:.3f} → {ppl:.3f}" in page
    assert manifest["base"]["fingerprint"][:23] in page and "r=4, alpha=8" in page


def test_cli_overlays_several_runs_in_one_report(trained_runs, tmp_path):
    out = tmp_path / "compare"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "finetune",
            "report",
            str(trained_runs["a"]),
            str(trained_runs["b"]),
            "--out",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    written = json.loads(done.stdout)
    assert written["html"] == str(out / "report.html") and set(written["plots"]) == set(FIGURE_NAMES)
    figures = make_figures([read_run(trained_runs["a"]), read_run(trained_runs["b"])])
    labels = {line.get_label() for line in figures["loss"].axes[0].get_lines()}
    assert labels == {"a", "b"}
    page = (out / "report.html").read_text()
    assert "<th>a</th><th>b</th>" in page


def test_an_unfinished_run_is_reported_from_its_metrics_alone(trained_runs, tmp_path):
    run_dir = tmp_path / "killed"
    run_dir.mkdir()
    lines = (trained_runs["a"] / "metrics.jsonl").read_text().splitlines()
    # A resumed run writes some steps twice (the later one counts); a killed one may leave a torn last line.
    rewritten = lines[:2] + [json.dumps({**json.loads(lines[0]), "loss": 9.5})] + lines[2:] + ['{"step": 9, "lo']
    (run_dir / "metrics.jsonl").write_text("\n".join(rewritten))
    files = write_report([run_dir])
    run = read_run(run_dir)
    assert run.manifest is None and run.series("loss")[1][0] == 9.5 and run.series("loss")[0] == [2, 4, 6, 8]
    assert "not written yet (run unfinished?)" in files.html.read_text()


def test_a_fresh_run_over_a_finished_one_leaves_no_run_record_to_report_as_its_own(trained_runs, tmp_path):
    """`output.overwrite` deleted an earlier run's checkpoints, metrics and report but kept its run.json: killed,
    the new run was reported with the old run's adapter, recipe and held-out figures beside its own curves. Without
    `output.overwrite` a directory holding only a run record is an earlier run in the way, like its metrics."""
    from finetune.recipe import load_recipe
    from finetune.training.run import start_run_dir_afresh

    run_dir, adapter_dir = tmp_path / "runs" / "a", tmp_path / "adapters" / "a"
    shutil.copytree(trained_runs["a"], run_dir)
    overrides = [f"output.run_dir={run_dir}", f"output.dir={adapter_dir}"]
    recipe = load_recipe(trained_runs["root"] / "a.yaml", [*overrides, "output.overwrite=true"])
    start_run_dir_afresh(recipe)
    assert sorted(path.name for path in run_dir.iterdir()) == []
    (run_dir / "metrics.jsonl").write_text('{"step": 2, "loss": 3.0}\n')  # the new run, killed after step 2
    run = read_run(run_dir)
    assert run.manifest is None and run.adapter_dir is None
    assert "not written yet (run unfinished?)" in write_report([run_dir]).html.read_text()

    (run_dir / "metrics.jsonl").unlink()
    shutil.rmtree(run_dir / "plots")
    (run_dir / "report.html").unlink()
    shutil.copy(trained_runs["a"] / "run.json", run_dir / "run.json")
    with pytest.raises(FinetuneError, match="holds an earlier run's checkpoints or metrics"):
        start_run_dir_afresh(load_recipe(trained_runs["root"] / "a.yaml", overrides))


def test_a_directory_without_metrics_is_a_one_line_error(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1 and "has no metrics.jsonl" in error
    assert not (tmp_path / "report.html").exists()


@pytest.mark.parametrize(
    "damaged, torn_tail",
    [(b'{"step": 1, "loss": 2.0}\n\xff\xfe garbage\n{"step": 2, "loss": 1.0}\n', False),  # not UTF-8, line 2
     (b'{"step": 1, "loss": 2.0}\n{"step": Infinity, "loss": 1.0}\n{"step": 2, "loss": 1.0}\n', False),
     (b'{"step": 1, "loss": 2.0}\n{"step": 2.5, "loss": 1.0}\n{"step": 3, "loss": 1.0}\n', False),  # not a step
     (b'{"step": 1, "loss": 2.0}\n{"step": "2", "loss": 1.0}\n{"step": 3, "loss": 1.0}\n', False),
     (b'{"step": 1, "loss": 2.0}\n{"step": 2, "lo\xc3', True)],  # a torn last line, cut inside a character
)  # fmt: skip
def test_a_damaged_metrics_line_is_a_one_line_error_naming_it(tmp_path, capsys, damaged, torn_tail):
    """Bytes that are not UTF-8 or a step of Infinity were a UnicodeDecodeError or OverflowError traceback, and a
    step of 2.5 a ValueError one from the run table; they are a bad record like any other (and a torn last line is
    still skipped)."""
    (tmp_path / "metrics.jsonl").write_bytes(damaged)
    code = cli_main(["report", str(tmp_path)])
    error = capsys.readouterr().err
    if torn_tail:
        assert code == 0 and (tmp_path / "report.html").is_file()
        return
    assert code == 2 and error.count("\n") == 1, error
    assert error.startswith(f"error: {tmp_path / 'metrics.jsonl'}:2 is not a metrics record; fix or delete that line")
    assert not (tmp_path / "report.html").exists()


def test_copying_a_run_elsewhere_keeps_its_report_working(trained_runs, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(trained_runs["a"], moved, ignore=shutil.ignore_patterns("checkpoint-*", "plots", "report.html"))
    files = write_report([moved])
    assert files.html == moved / "report.html" and "adapters/a" in files.html.read_text()


def test_perplexity_ticks_are_labelled_at_decades_across_decades_and_at_minor_ticks_within_one(tmp_path):
    """Across decades (perplexity 2000 to 1.01, as the quickstart goes) every minor tick was labelled too, and the
    labels piled into one smear; within a decade there are no major ticks, so the minor ones are labelled."""
    from matplotlib.ticker import FuncFormatter

    def perplexity_axes(values: list[float]):
        run_dir = tmp_path / f"run{len(values)}-{values[0]:g}"
        run_dir.mkdir()
        records = [{"step": i + 1, "eval_loss": math.log(v), "eval_ppl": v} for i, v in enumerate(values)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return make_figures([read_run(run_dir)])["eval"].axes[1]

    across = perplexity_axes([2000.0, 40.0, 1.01])
    within = perplexity_axes([3.0, 2.0, 1.5])
    assert not isinstance(across.yaxis.get_minor_formatter(), FuncFormatter)
    assert isinstance(within.yaxis.get_minor_formatter(), FuncFormatter)


def test_a_grpo_runs_loss_and_perplexity_of_its_own_samples_are_not_shown_as_held_out(trained_runs, tmp_path):
    """GRPO evaluates by sampling: the loss and perplexity it records are of completions the model wrote itself,
    not held-out text. Beside an SFT run in one report, its reward is shown; they are not plotted or tabled."""
    run_dir = tmp_path / "grpo"
    run_dir.mkdir()
    records = [{"step": 2, "loss": 0.01, "lr": 1e-3, "tokens_seen": 100, "tokens_per_s": 50.0, "reward": 0.2},
               {"step": 2, "eval_loss": 0.0, "eval_ppl": 1.7, "eval_reward": 0.25}]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    runs = [read_run(trained_runs["a"]), read_run(run_dir)]
    loss_axes, ppl_axes = make_figures(runs)["eval"].axes
    assert {line.get_label() for line in ppl_axes.get_lines()} == {"a", "a" + BASE_SUFFIX}
    page = write_report([trained_runs["a"], run_dir]).html.read_text()
    assert "not held-out (GRPO scores its own samples" in page


def test_a_run_from_a_starting_adapter_shows_its_figures_before_training_as_that_adapters(trained_runs, tmp_path):
    """A preference or GRPO run from `lora.init_from` records its figures before training as `start_...`: the
    report plots and tables them as the starting adapter's, not as the base model's."""
    run_dir = tmp_path / "from-adapter"
    shutil.copytree(trained_runs["a"], run_dir)
    record = json.loads((run_dir / "run.json").read_text())
    metrics = record["manifest"]["metrics"]
    for key in [key for key in metrics if key.startswith("base_")]:
        metrics["start_" + key.removeprefix("base_")] = metrics.pop(key)
    (run_dir / "run.json").write_text(json.dumps(record))
    loss_axes, ppl_axes = make_figures([read_run(run_dir)])["eval"].axes
    assert _line(ppl_axes, "a" + START_SUFFIX)[1] == [metrics["start_eval_ppl"]] * 2
    page = write_report([run_dir]).html.read_text()
    assert f"starting adapter {metrics['start_eval_ppl']:.3f} → {metrics['eval_ppl']:.3f}" in page

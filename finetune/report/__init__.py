"""Run reports: PNG plots and one self-contained HTML page for one run, or several overlaid.

Modules, one job each: `runs` reads a run directory (metrics.jsonl + run.json); `plots` draws the
matplotlib figures; `html` renders the page. `write_report` puts them together and writes
`<out>/report.html` and `<out>/plots/<name>.png`, each file to a temporary name first and renamed into
place, so a reader never sees half a page. `finetune train` calls `report_finished_run` at the end of
every run (unless `output.report: false`).

Example:
    files = write_report([Path("runs/a"), Path("runs/b")], Path("reports/a-vs-b"))
    files.html      # reports/a-vs-b/report.html
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from finetune.atomic import atomic_file
from finetune.manifest import read_manifest
from finetune.report.html import render_page
from finetune.report.plots import make_figures, png_bytes
from finetune.report.runs import RunHistory, read_run, write_run_record
from finetune.version import __version__

REPORT_NAME = "report.html"
PLOTS_DIR = "plots"

__all__ = ["ReportFiles", "write_report", "report_finished_run", "read_run", "default_out_dir"]


@dataclass(frozen=True)
class ReportFiles:
    """What `write_report` wrote."""

    html: Path
    plots: dict[str, Path]


def default_out_dir(run_dirs: Sequence[Path]) -> Path:
    """One run: its own directory. Several: `reports/<a>-vs-<b>...` in the current directory."""
    if len(run_dirs) == 1:
        return Path(run_dirs[0])
    return Path("reports") / "-vs-".join(Path(d).resolve().name for d in run_dirs)


def render_runs(runs: Sequence[RunHistory], out_dir: Path) -> ReportFiles:
    """Write the plots and the page of already-read runs into `out_dir`."""
    out_dir = Path(out_dir)
    images = {name: png_bytes(figure) for name, figure in make_figures(runs).items()}
    plots = {}
    for name, png in images.items():
        plots[name] = out_dir / PLOTS_DIR / f"{name}.png"
        with atomic_file(plots[name]) as staging:
            staging.write_bytes(png)
    html_path = out_dir / REPORT_NAME
    with atomic_file(html_path) as staging:
        staging.write_text(render_page(runs, images, version=__version__), encoding="utf-8")
    return ReportFiles(html_path, plots)


def write_report(run_dirs: Sequence[str | Path], out_dir: str | Path | None = None) -> ReportFiles:
    """Read each run directory and write its report (several runs: overlaid) into `out_dir`.

    Raises:
        ReportError: a run directory without metrics.jsonl, or with a malformed record.
    """
    runs = [read_run(run_dir) for run_dir in run_dirs]
    return render_runs(runs, Path(out_dir) if out_dir is not None else default_out_dir([Path(d) for d in run_dirs]))


def report_finished_run(
    run_dir: Path, adapter_dir: Path, *, html: bool, say: Callable[[str], None]
) -> ReportFiles | None:
    """At the end of training: record the run (run.json), then write its report if `html` (`output.report`).

    The adapter is already written when this runs, so a report that cannot be written is a warning line,
    not a failed run.
    """
    try:
        write_run_record(run_dir, adapter_dir, read_manifest(adapter_dir))
        files = write_report([run_dir]) if html else None
    except Exception as exc:  # any failure here must not turn a finished run into a failed one
        say(f"warning: no report written ({str(exc).splitlines()[0]}); retry with: finetune report {run_dir}")
        return None
    if files is not None:
        say(f"report written to {files.html}")
    return files

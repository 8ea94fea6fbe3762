"""`finetune report RUN_DIR [RUN_DIR ...] [--out DIR]`: plots and a self-contained HTML page of training runs.

One run: written into its own directory (report.html, plots/*.png). Several: overlaid, written to
`reports/<a>-vs-<b>` unless `--out` says where. The work is in `finetune.report`.

Example:
    finetune report runs/quickstart
    finetune report runs/lr-1e-3 runs/lr-1e-2 --out reports/lr
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("report", help="plots and an HTML page of one or several training runs")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory written by finetune train")
    parser.add_argument("--out", help="output directory (default: the run's own; several runs: reports/A-vs-B)")
    parser.add_argument("--json", action="store_true", help="print the written paths as JSON")
    parser.set_defaults(handler=run_report)


def run_report(args: argparse.Namespace) -> int:
    import json

    from finetune.report import write_report

    files = write_report(args.run_dirs, args.out)
    if args.json:
        print(json.dumps({"html": str(files.html), "plots": {k: str(v) for k, v in files.plots.items()}}))
    else:
        print(f"report: {files.html}")
    return 0

"""The one table bench/gpu_check.sh ends with: the `pytest -m gpu` summary and the GPU presets' rows.

Reads what the two steps left (pytest's exit status and JUnit XML; `python -m bench --gpu`'s exit status
and latest.json), prints one Markdown table, and exits 1 when anything failed. pytest's exit 5 (no test
collected: no `gpu`-marked test exists yet) is reported in the table and under it, not counted as a
failure: the bench rows still say whether the GPU paths run.

Example:
    python -m bench.check_table --tests-exit 0 --junit OUT/gpu-tests.xml --bench-exit 0 --bench OUT/latest.json
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from bench.report import GPU_HEADER, gpu_rows, table

NO_TESTS_COLLECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


def junit_counts(junit_path: Path) -> dict[str, int] | None:
    """passed, failed, errors, skipped summed over the report's test suites; None without a readable report."""
    try:
        root = ElementTree.parse(junit_path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return {"passed": passed, "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"]}


def summarise_tests(exit_code: int, counts: dict[str, int] | None) -> tuple[str, bool]:
    """What `pytest -m gpu` did in words, and whether it counts as passed."""
    if exit_code == NO_TESTS_COLLECTED:
        return "NO TESTS COLLECTED (pytest exit 5): no gpu-marked test in tests/", True
    if counts is None:
        return f"FAILED: pytest exit {exit_code}, no JUnit report", False
    words = ", ".join(f"{counts[key]} {key}" for key in ("passed", "failed", "errors", "skipped"))
    return (words, True) if exit_code == 0 else (f"FAILED: {words} (pytest exit {exit_code})", False)


def check_rows(tests_words: str, bench: dict[str, Any] | None, bench_exit: int) -> tuple[list[list[str]], bool]:
    """The table's rows (the tests first, then each preset's arms) and whether the bench part passed."""
    blank = [""] * (len(GPU_HEADER) - 1)
    rows = [["`pytest -m gpu`", tests_words, *blank]]
    if bench is None:
        return rows + [["bench", f"FAILED: python -m bench --gpu exit {bench_exit}, no latest.json", *blank]], False
    ok = bench_exit == 0
    for name, part in bench["parts"].items():
        if "figures" not in part:
            rows.append([name, f"FAILED: {part.get('error', 'no figures')}", *blank])
            ok = False
            continue
        rows += [[name, *row] for row in gpu_rows(part["figures"])]
    return rows, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests-exit", type=int, required=True, help="exit status of `pytest -m gpu`")
    parser.add_argument("--junit", type=Path, required=True, help="its --junitxml report")
    parser.add_argument("--bench-exit", type=int, required=True, help="exit status of `python -m bench --gpu`")
    parser.add_argument("--bench", type=Path, required=True, help="its latest.json")
    args = parser.parse_args(argv)
    tests_words, tests_ok = summarise_tests(args.tests_exit, junit_counts(args.junit))
    bench = json.loads(args.bench.read_text()) if args.bench.is_file() else None
    rows, bench_ok = check_rows(tests_words, bench, args.bench_exit)
    print("\n".join(table(["check", *GPU_HEADER], rows)))
    print(
        "\npeak GiB: torch.cuda.max_memory_allocated from the arm's start to its last step; plan GiB: `finetune "
        "plan` for ours' recipe less its CUDA context; MFU against the bf16 matmul peak measured in the same run."
    )
    if args.tests_exit == NO_TESTS_COLLECTED:
        print("WARNING: `pytest -m gpu` collected no test: the GPU tests were not run (not counted as a failure).")
    ok = tests_ok and bench_ok
    print(f"gpu_check: {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

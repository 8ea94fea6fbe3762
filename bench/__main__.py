"""`python -m bench`: the benchmarks the README quotes, in one command, into bench/results/latest.{json,md}.

Runs the existing scripts as subprocesses, each with its own `--json`, at settings sized to finish in
under 15 minutes on 2 CPU cores (`--quick`: a smoke run of a minute or two on tiny models), then writes
every figure they report, with the machine, the date and the load average before and after each part,
to `latest.json`, and a Markdown summary (the tables the README quotes) to `latest.md`, and prints it.

Parts (`--only` picks some):
- `train`: bench/train_throughput.py, one epoch of generated instruction records (long tail to 512
  tokens) on a 19.2M-parameter Llama (hidden 256, 4 layers, 32k vocabulary, untied lm_head), ours
  packed, ours padded and HF Trainer + peft, same LoRA (r=16 all-linear), 8 documents per step, in
  interleaved rounds; held-out loss computed alike for every arm; MFU against the matmul peak.
- `swap`: bench/adapter_swap.py, exact in-place swap against reload + merge and peft's in-place swap,
  and drift after merge/unmerge cycles, on a 58M-parameter Llama.
- `merge`: bench/streaming_merge.py, peak memory of the streaming on-disk merge against peft's, on a
  sharded 0.7 GB checkpoint.
- `startup`: bench/startup.py, `finetune --help`, `finetune generate` of 40 tokens with an adapter, and
  the import seconds of a one-step `finetune train`, each the median of fresh processes.
- `host`: bench/host_work.py, aten ops and host-syncing ops per optimizer step and distinct shapes per epoch,
  ours against the HF Trainer + peft on the same micro-batches (a tiny Llama; about 2 minutes).

Models are built under `--scratch` (reused on the next run). Timing figures depend on what else runs:
the summary says so when the load average exceeded half the cores during a part.

`--gpu` runs the GPU presets instead (bench/presets.py), each a part of its own through
bench/train_throughput.py: a Llama-3.2-1B-shaped bf16 LoRA and a Llama-3.1-8B-shaped nf4 QLoRA at
2048-token rows, ours against the HF Trainer + peft on the same GPU, with MFU against the GPU's matmul
peak measured in the run and each arm's peak GPU memory beside `finetune plan`'s estimate. It refuses
to start without a CUDA device; `--gpu --quick` runs the presets shrunken, on a CPU too.

Example:
    python -m bench                 # sized for < 15 min on 2 quiet cores (16 min measured at load 2.4-5.2)
    python -m bench --quick --only swap --out /tmp/bench-smoke
    python -m bench --gpu           # on a GPU machine (bench/gpu_check.sh runs it)
    python -m bench --gpu --quick --out /tmp/bench-gpu-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.presets import PRESETS
from bench.report import format_markdown
from bench.startup import cpu_model
from bench.train_throughput import versions

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent

# Per part: the script and its arguments, full size and --quick. Sized on the shared 2-core machine
# (see bench/README.md, "One command"): train about 60%, swap 20%, merge 20% of the time.
PARTS: dict[str, dict[str, Any]] = {
    "train": {
        "script": "train_throughput.py",
        "full": "--hidden 256 --layers 4 --vocab 32000 --untied --micro-batch-size 8 --grad-accum 1 --records 80 "
        "--one-epoch --warmup-steps 2 --repeats 2 --validation-records 32 --no-own-eval",
        "quick": "--hidden 64 --layers 2 --vocab 1024 --micro-batch-size 8 --grad-accum 1 --records 24 --one-epoch "
        "--warmup-steps 1 --validation-records 8 --no-own-eval",
    },
    "swap": {
        "script": "adapter_swap.py",
        "full": "--hidden 512 --layers 8 --intermediate 1376 --skip memory --dtype bfloat16,float32 "
        "--drift-dtypes bfloat16,float32 --cycles 50 --repeats 3",
        "quick": "--hidden 64 --layers 2 --intermediate 128 --skip memory --dtype bfloat16 --drift-dtypes bfloat16 "
        "--cycles 3 --repeats 1",
    },
    "merge": {
        "script": "streaming_merge.py",
        "full": "--hidden 1024 --layers 8 --intermediate 2816 --shard-size 100MB",
        "quick": "--hidden 128 --layers 2 --intermediate 256 --shard-size 2MB",
    },
    "startup": {"script": "startup.py", "full": "--repeats 5", "quick": "--repeats 1"},
    "host": {"script": "host_work.py", "full": "--steps 6 --warmup-steps 2", "quick": "--steps 2 --warmup-steps 1"},
}


# The GPU presets (--gpu): one part each, the preset's own settings, shrunken with --quick; --short keeps the
# sizes and runs one round of 6 steps (4 timed), for a GPU lent for minutes (bench/gpu_check.sh --short).
GPU_PARTS: dict[str, dict[str, Any]] = {
    name: {
        "script": "train_throughput.py",
        "full": f"--preset {name}",
        "quick": f"--preset {name} --smoke",
        "short": f"--preset {name} --repeats 1 --steps 6",
    }
    for name in PRESETS
}


def machine() -> dict[str, Any]:
    """What the figures were taken on: CPU model, cores, memory, library versions."""

    import torch

    with open("/proc/meminfo") as handle:
        mem_kib = next(int(line.split()[1]) for line in handle if line.startswith("MemTotal:"))
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "gpu": torch.cuda.is_available(),
        "gpu_name": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "versions": versions(),
    }


def run_part(name: str, script: str, arguments: list[str], log_dir: Path) -> dict[str, Any]:
    """One script as a subprocess; its JSON figures, wall seconds and the load average around it."""
    json_path = log_dir / f"{name}.json"
    log_path = log_dir / f"{name}.log"
    command = [sys.executable, str(BENCH_DIR / script), *arguments, "--json", str(json_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    part: dict[str, Any] = {"command": " ".join(["python", f"bench/{script}", *arguments])}
    part["load_average_before"] = os.getloadavg()
    print(f"[bench] {name}: {part['command']} (log: {log_path})", flush=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        completed = subprocess.run(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    part["wall_seconds"] = time.perf_counter() - started
    part["load_average_after"] = os.getloadavg()
    part["exit_code"] = completed.returncode
    if completed.returncode == 0 and json_path.is_file():
        part["figures"] = json.loads(json_path.read_text())
    else:
        part["error"] = f"exit code {completed.returncode}; see {log_path}"
    print(f"[bench] {name}: {part['wall_seconds']:.0f} s, exit code {completed.returncode}", flush=True)
    return part


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny models: checks the command works, figures mean little"
    )
    parser.add_argument(
        "--gpu", action="store_true", help=f"the GPU presets instead: parts {', '.join(GPU_PARTS)} (needs CUDA)"
    )
    parser.add_argument(
        "--short", action="store_true", help="with --gpu: full sizes, one round of 6 steps per arm (a GPU lent briefly)"
    )
    parser.add_argument("--only", help=f"comma-separated parts of {', '.join(PARTS)} (with --gpu: of the presets)")
    parser.add_argument(
        "--out",
        type=Path,
        help="where latest.json and latest.md go (default bench/results, with --gpu bench/results/gpu)",
    )
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/bench-models"), help="where models are built")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the training arms (default: all)")
    args = parser.parse_args(argv)
    available = GPU_PARTS if args.gpu else PARTS
    args.out = args.out or BENCH_DIR / "results" / ("gpu" if args.gpu else "")
    parts = [p.strip() for p in (args.only or ",".join(available)).split(",") if p.strip()]
    unknown = sorted(set(parts) - set(available))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {', '.join(available)}")
    if args.short and (not args.gpu or args.quick):
        parser.error("--short goes with --gpu and without --quick")
    if args.gpu and not args.quick:
        import torch

        if not torch.cuda.is_available():
            parser.error("--gpu: torch sees no CUDA device; `--gpu --quick` runs the presets shrunken on this CPU")

    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = args.out / "logs"
    log_dir.mkdir(exist_ok=True)
    scratch = args.scratch / "quick" if args.quick else args.scratch
    report: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick,
        "short": args.short,
        "machine": machine(),
        "load_average_start": os.getloadavg(),
        "parts": {},
    }
    started = time.perf_counter()
    for name in parts:
        arguments = available[name]["quick" if args.quick else "short" if args.short else "full"].split()
        if available[name]["script"] == "train_throughput.py":  # builds model and data in a temporary directory
            arguments += ["--threads", str(args.threads)] if args.threads else []
        else:
            arguments += ["--scratch", str(scratch)]
        report["parts"][name] = run_part(name, available[name]["script"], arguments, log_dir)
    report["wall_seconds"] = time.perf_counter() - started
    report["load_average_end"] = os.getloadavg()

    (args.out / "latest.json").write_text(json.dumps(report, indent=2))
    markdown = format_markdown(report)
    (args.out / "latest.md").write_text(markdown)
    print(markdown)
    print(f"[bench] wrote {args.out / 'latest.json'} and {args.out / 'latest.md'} in {report['wall_seconds']:.0f} s")
    return 0 if all("error" not in part for part in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

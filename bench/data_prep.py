"""Data preparation speed and peak memory: `build_datasets` against the raw fast tokenizer, at 1x and 4x.

Not a test. One run prints, side by side:
- **raw**: MB/s of `tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)` on the
  corpus texts, already in memory, 1000 texts a call, on every core (the tokenizers library's default
  thread pool). This is the bar: the issue asks data preparation to use every core, and the library's
  default is what a user who tokenizes by hand gets.
- **ours**: MB/s of `finetune.data.build_datasets` as `finetune train` calls it (text format,
  max_seq_len 1024, overlength split, a fresh cache directory): fingerprinting the source bytes, reading
  and parsing the JSONL, tokenizing, splitting, and writing and memory-mapping the Arrow cache entry.
  Each run is a fresh subprocess, so its memory is its own.
- **peak memory** of each `build_datasets` run: the main process's peak RSS (VmHWM), and the peak of the
  sum over the process and its workers of RSS and of PSS (shared pages split between processes), sampled
  every 0.1 s.

The corpus: every `*.py` file under `--root` (default: this Python's library directory, site-packages
included), sorted by path, UTF-8 files only, up to `--corpus-mb` MB, written as one JSONL record
`{"text": <file>}` per file; at scale k the same records k times over (k copies of the file tree). MB are
10^6 bytes of file content. Raw and ours alternate (`--repeats`), and the load average is recorded
beside every figure, because this machine is shared.

    python bench/data_prep.py                       # 1x: about 3-4 minutes on 2 cores
    python bench/data_prep.py --scale 1,4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZER = REPOSITORY / "finetune" / "embedded" / "base" / "tiny-llama"


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def corpus_texts(root: Path, limit_bytes: int) -> tuple[list[str], int, int]:
    """(texts, files, bytes): the UTF-8 `*.py` files under `root` in path order, up to `limit_bytes`."""
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        if total + len(data) > limit_bytes:
            break
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        total += len(data)
    return texts, len(texts), total


def write_corpus(texts: list[str], scale: int, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(scale):
            for text in texts:
                handle.write(json.dumps({"text": text}) + "\n")


def raw_tokenizer_seconds(tokenizer, texts: list[str]) -> tuple[float, int]:
    backend = tokenizer.backend_tokenizer
    start, tokens = time.perf_counter(), 0
    for first in range(0, len(texts), 1000):
        tokens += sum(len(e.ids) for e in backend.encode_batch(texts[first : first + 1000], add_special_tokens=False))
    return time.perf_counter() - start, tokens


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    pids, index = [pid], 0
    while index < len(pids):
        try:
            children = Path(f"/proc/{pids[index]}/task/{pids[index]}/children").read_text().split()
        except OSError:
            children = []
        pids += [int(child) for child in children]
        index += 1
    return pids


def _kib(path: str, key: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_ours(corpus: Path, tokenizer_dir: Path, scratch: Path, num_proc: int | None) -> dict:
    """`build_datasets` on `corpus` in a fresh subprocess with a fresh cache; its result and peak memory."""
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=scratch))
    command = [sys.executable, __file__, "--_child", str(corpus), str(tokenizer_dir), str(cache), str(num_proc or 0)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPOSITORY)}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=REPOSITORY)
    peaks = {"tree_rss": 0, "tree_pss": 0, "workers": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            pids = _tree(process.pid)
            rss = sum(_kib(f"/proc/{pid}/status", "VmRSS") for pid in pids)
            pss = sum(_kib(f"/proc/{pid}/smaps_rollup", "Pss") for pid in pids)
            peaks.update(
                tree_rss=max(peaks["tree_rss"], rss),
                tree_pss=max(peaks["tree_pss"], pss),
                workers=max(peaks["workers"], len(pids) - 1),
            )
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = process.communicate()
    done.set()
    sampler.join()
    if process.returncode != 0:
        raise SystemExit(f"build_datasets failed (exit {process.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    subprocess.run(["rm", "-rf", str(cache)], check=True)
    return {
        **result,
        **{f"peak_{key}_bytes" if key != "workers" else "worker_processes": v for key, v in peaks.items()},
    }


def child(corpus: str, tokenizer_dir: str, cache: str, num_proc: int) -> None:
    """Runs in the subprocess: load the tokenizer, then time `build_datasets` alone."""
    from transformers import AutoTokenizer

    from finetune.data.pipeline import build_datasets
    from finetune.recipe import DataConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = DataConfig(train=[corpus], format="text", max_seq_len=1024, num_proc=num_proc or None)
    start = time.perf_counter()
    bundle = build_datasets(config, tokenizer, seed=0, cache_dir=cache)
    seconds = time.perf_counter() - start
    peak_main = _kib("/proc/self/status", "VmHWM")
    print(json.dumps({"seconds": seconds, "num_tokens": bundle.stats["num_tokens"], "peak_main_rss_bytes": peak_main}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--corpus-mb", type=float, default=161.0)
    parser.add_argument("--scale", default="1", help="comma-separated corpus multiples, e.g. 1,4")
    parser.add_argument("--repeats", type=int, default=1, help="raw/ours pairs at 1x (alternating)")
    parser.add_argument("--num-proc", type=int, default=None, help="data.num_proc (default: every core)")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/bench-data-prep"))
    parser.add_argument("--json", type=Path, default=None, help="also write every figure here")
    parser.add_argument("--_child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        corpus, tokenizer_dir, cache, num_proc = args._child
        return child(corpus, tokenizer_dir, cache, int(num_proc))

    from transformers import AutoTokenizer

    scales = [int(s) for s in args.scale.split(",")]
    args.scratch.mkdir(parents=True, exist_ok=True)
    texts, files, corpus_bytes = corpus_texts(args.root, int(args.corpus_mb * 1e6))
    print(f"corpus: {files} files, {corpus_bytes / 1e6:.1f} MB of *.py under {args.root}; cores: {os.cpu_count()}")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    report: dict = {"corpus": {"root": str(args.root), "files": files, "bytes": corpus_bytes}, "runs": []}
    report["tokenizer"] = str(args.tokenizer)
    for scale in scales:
        corpus = args.scratch / f"corpus-x{scale}.jsonl"
        write_corpus(texts, scale, corpus)
        megabytes = scale * corpus_bytes / 1e6
        for repeat in range(args.repeats if scale == 1 else 1):
            if scale == 1:
                load = load_average()
                seconds, tokens = raw_tokenizer_seconds(tokenizer, texts)
                run = {"what": "raw", "scale": 1, "repeat": repeat, "seconds": seconds, "tokens": tokens}
                run.update(mb_per_s=megabytes / seconds, load_before=load, load_after=load_average())
                report["runs"].append(run)
                print(f"raw  x1  {run['mb_per_s']:6.2f} MB/s  {seconds:6.1f} s  load {load} -> {run['load_after']}")
            load = load_average()
            ours = run_ours(corpus, args.tokenizer, args.scratch, args.num_proc)
            run = {"what": "ours", "scale": scale, "repeat": repeat, **ours, "mb_per_s": megabytes / ours["seconds"]}
            run.update(load_before=load, load_after=load_average())
            report["runs"].append(run)
            print(
                f"ours x{scale}  {run['mb_per_s']:6.2f} MB/s  {ours['seconds']:6.1f} s  "
                f"peak RSS main {ours['peak_main_rss_bytes'] / 2**20:.0f} MiB, "
                f"all processes RSS {ours['peak_tree_rss_bytes'] / 2**20:.0f} MiB / "
                f"PSS {ours['peak_tree_pss_bytes'] / 2**20:.0f} MiB ({ours['worker_processes']} workers)  "
                f"load {load} -> {run['load_after']}"
            )
        corpus.unlink()
    raw = [r["mb_per_s"] for r in report["runs"] if r["what"] == "raw"]
    ours_1x = [r["mb_per_s"] for r in report["runs"] if r["what"] == "ours" and r["scale"] == 1]
    if raw and ours_1x:
        pairs = [o / r for o, r in zip(ours_1x, raw)]
        report["ours_over_raw"] = pairs
        print(f"ours / raw at 1x, pair by pair: {', '.join(f'{p:.2f}' for p in pairs)}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

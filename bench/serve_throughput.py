"""Serving throughput: N concurrent requests spread over 1, 2 and 4 adapters, batched, against one at a time.

Not a test. One `finetune serve` subprocess (real HTTP, uvicorn) serves a random-init Llama (built from a
config, saved with `save_pretrained`, no download) with 4 LoRA adapters (r=16, all-linear, random
non-zero A and B) under `--scratch`; a second one serves adapter `a0` merged (`--merge a0`). The client
(this process, one thread per request, httpx) sends greedy completions of `--max-tokens` tokens each
(prompts of varied length), and every run is one of:
- **batched**: all `--requests` requests at once; request i asks for adapter `a{i mod k}`, k = 1, 2, 4
  (k = 0 is the base alone). The server puts them in shared forward passes (per-row adapters).
- **one at a time**: the same requests, each sent after the previous answer came back.
- **merged** (k = 1 only): the same against the `--merge a0` server, batched and one at a time.

Runs are interleaved (for every repetition: every k, batched then one at a time), and the figure that
counts is the ratio batched / one-at-a-time tokens per second within a repetition (median over
repetitions), so load from other processes hits both sides alike. Every batched answer is also checked
against the same request answered alone: the token ids must be equal. The machine this ran on was
shared: absolute tokens/s are noisy; re-run on a quiet machine before quoting them.

Example:
    python bench/serve_throughput.py                         # ~4 min on 2 busy cores
    python bench/serve_throughput.py --requests 16 --max-tokens 64 --repeats 5 --json /tmp/serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run from a checkout: `python bench/serve_throughput.py`
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import build_adapter, build_base, versions  # noqa: E402

ADAPTER_COUNTS = (0, 1, 2, 4)  # 0: the base alone
WORDS = "def f(x): return x + 1 the quick brown fox jumps over the lazy dog".split()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8, help="concurrent requests per batched run")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server (1: steadier when shared)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/bench-models"))
    parser.add_argument("--json", type=Path, help="also write every figure here")
    return parser.parse_args()


class Server:
    """A `finetune serve` subprocess on 127.0.0.1 with a free port."""

    def __init__(self, arguments: list[str], threads: int):
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": str(threads)}
        command = [sys.executable, "-m", "finetune", "serve", *arguments, "--port", "0"]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        line = ""
        while not line.startswith("finetune serve: "):
            line = self.process.stderr.readline()
            if not line:
                raise SystemExit(f"finetune serve did not start: {' '.join(command)}")
        self.client = httpx.Client(base_url=line.split()[2].removesuffix("/v1"), timeout=600)

    def complete(self, model: str, prompt: str, max_tokens: int) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
        response = self.client.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()

    def stats(self) -> dict:
        return self.client.get("/stats").json()

    def close(self) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(60)
        self.process.stderr.close()


def requests_for(count: int, adapters: int) -> list[tuple[str, str]]:
    """(model, prompt) pairs: adapters round-robin (or the base), prompts of 4 to 4 + count words."""
    models = [f"a{i % adapters}" if adapters else "base" for i in range(count)]
    prompts = [" ".join(WORDS[j % len(WORDS)] for j in range(i, i + 4 + i)) for i in range(count)]
    return list(zip(models, prompts))


def run(server: Server, jobs: list[tuple[str, str]], max_tokens: int, batched: bool) -> dict:
    """Send `jobs` at once or one by one; seconds, generated tokens, token ids per job, rows per forward."""
    before = server.stats()
    started = time.perf_counter()
    if batched:
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda job: server.complete(*job, max_tokens), jobs))
    else:
        answers = [server.complete(*job, max_tokens) for job in jobs]
    seconds = time.perf_counter() - started
    after = server.stats()
    forwards = after["forward_passes"] - before["forward_passes"]
    return {
        "seconds": seconds,
        "tokens": sum(answer["usage"]["completion_tokens"] for answer in answers),
        "token_ids": [answer["choices"][0]["token_ids"] for answer in answers],
        "rows_per_forward": (after["rows_total"] - before["rows_total"]) / max(forwards, 1),
    }


def main() -> None:
    args = parse_args()
    base = build_base(
        args.scratch / f"serve-llama-{args.hidden}x{args.layers}",
        hidden=args.hidden,
        layers=args.layers,
        intermediate=args.intermediate,
    )
    adapters = [build_adapter(base, args.scratch / f"{base.name}-a{i}", seed=i + 1) for i in range(4)]
    limits = ["--max-batch-size", str(args.requests), "--max-wait-ms", "20", "--max-pending", str(4 * args.requests)]
    limits += ["--max-tokens-limit", str(args.max_tokens), "--base-name", "base"]
    specs = [argument for i, path in enumerate(adapters) for argument in ("--adapter", f"a{i}={path}")]
    per_row = Server([str(base), *specs, *limits], args.threads)
    merged = Server([str(base), *specs, "--merge", "a0", *limits], args.threads)
    arms = [(per_row, k, f"{k} adapters" if k else "base only") for k in ADAPTER_COUNTS] + [(merged, 1, "merged a0")]
    results: dict[str, list[dict]] = {label: [] for _, _, label in arms}
    try:
        for server, k, _ in arms:  # warm-up: first forwards allocate
            run(server, requests_for(2, k), 4, batched=True)
        for repeat in range(args.repeats):
            load = os.getloadavg()[0]
            for server, k, label in arms:
                jobs = requests_for(args.requests, k)
                together, alone = run(server, jobs, args.max_tokens, True), run(server, jobs, args.max_tokens, False)
                results[label].append({"batched": together, "alone": alone, "load": load})
                same = together["token_ids"] == alone["token_ids"]
                print(
                    f"repeat {repeat + 1} {label:>11}: batched {together['seconds']:6.2f} s, one at a time "
                    f"{alone['seconds']:6.2f} s, same tokens {same}, load {load:.1f}",
                    flush=True,
                )
    finally:
        per_row.close()
        merged.close()
    report(args, results)


def report(args: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    print(
        f"\n{versions()}; servers with {args.threads} torch thread(s); {args.requests} requests x {args.max_tokens} "
        f"tokens, {args.repeats} repeats"
    )
    print(
        "| requests for | batched tok/s | one at a time tok/s | batched / one at a time | rows per forward | same tokens |"
    )
    print("|---|---|---|---|---|---|")
    summary = {}
    for label, runs in results.items():
        speed = lambda run: run["tokens"] / run["seconds"]
        ratios = [speed(r["batched"]) / speed(r["alone"]) for r in runs]
        row = {
            "batched_tokens_per_s": statistics.median(speed(r["batched"]) for r in runs),
            "alone_tokens_per_s": statistics.median(speed(r["alone"]) for r in runs),
            "ratio_median": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "rows_per_forward": statistics.median(r["batched"]["rows_per_forward"] for r in runs),
            "same_tokens": all(r["batched"]["token_ids"] == r["alone"]["token_ids"] for r in runs),
            "load": [r["load"] for r in runs],
        }
        summary[label] = row
        print(
            f"| {label} | {row['batched_tokens_per_s']:.0f} | {row['alone_tokens_per_s']:.0f} | "
            f"**{row['ratio_median']:.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) | {row['rows_per_forward']:.1f} | "
            f"{row['same_tokens']} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": summary}))


if __name__ == "__main__":
    main()

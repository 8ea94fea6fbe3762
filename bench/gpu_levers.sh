#!/usr/bin/env bash
# The 8B QLoRA preset's untried levers on a GPU, in one command sized for a brief loan (not yet run on a GPU:
# about 7 minutes by the earlier runs' times, 48 s for the base and 70-90 s an arm, on an
# H100 or H200 after the wheels' install). The preset (bench/README.md, "On a GPU") ran at 1.26-1.38x the HF
# Trainer + peft and 20-24% MFU with every layer checkpointed and eager 4-bit layers; the goal is 2x and 40%.
# What is left to try, each a recipe key of ours (`--ours-set`), against the same Trainer run:
#   1. train.gradient_checkpointing=auto: finetune checkpoints only the layers the card's memory needs (none on an
#      80 GiB card, where `finetune plan` says 30.67 GiB): a third of the step's FLOPs and ~40% of its host work
#      gone (bench/host_seconds.py). The Trainer arm keeps the preset's checkpointing, as a QLoRA script sets it.
#   2. the same with train.compile=true: compiled 4-bit decoder layers (0.22x the Trainer's kernel launches per
#      step, counted on the CPU: bench/host_work.py --qlora --compiled); `compile: auto` leaves them eager.
#   3. setting 1 again under torch.profiler for 2 steps: each step's busiest GPU kernels and its wall time beside
#      its kernel time, which says whether the step waits on the host (its speeds are not figures to quote).
# Each run prints its own table (tokens/s, ratio, MFU, peak GiB, held-out loss) and has a time limit of its own ($LEVER_TIMEOUT_S, default 240 s), so one that hangs leaves the others.
# Usage, from anywhere on the GPU machine:  bench/gpu_levers.sh
# JSON and logs go to $GPU_LEVERS_OUT (default bench/results/gpu-levers/); the 16 GB base is built once in
# $GPU_LEVERS_WORKDIR (default a temporary directory, removed at the end). $PYTHON picks the interpreter.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PYTHON=${PYTHON:-python3}
OUT=${GPU_LEVERS_OUT:-bench/results/gpu-levers}
LIMIT=${LEVER_TIMEOUT_S:-240}
[ $# -eq 0 ] || { echo "usage: bench/gpu_levers.sh (no arguments; see its header)" >&2; exit 2; }

source bench/gpu_setup.sh
mkdir -p "$OUT"
WORK=${GPU_LEVERS_WORKDIR:-$(mktemp -d)}
[ -n "${GPU_LEVERS_WORKDIR:-}" ] || trap 'rm -rf "$WORK"' EXIT
PRESET=(bench/train_throughput.py --preset llama-3.1-8b-qlora --repeats 1 --steps 6 --workdir "$WORK")
AUTO=(--ours-set train.gradient_checkpointing=auto)

failed=0
lever() {  # NAME ARGS...: one run of the preset, its log and JSON under $OUT
  local name=$1
  shift
  echo "$SCRIPT_NAME: $name (log: $OUT/$name.log)"
  timeout "$LIMIT" "$PYTHON" "${PRESET[@]}" "$@" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
  local status=${PIPESTATUS[0]}
  [ "$status" -eq 0 ] || { echo "$SCRIPT_NAME: $name ended with exit status $status" >&2; failed=1; }
}

lever checkpointing-auto --arms ours-packed,hf-trainer "${AUTO[@]}"
lever checkpointing-auto-compiled --reuse-prepared --arms ours-packed "${AUTO[@]}" --ours-set train.compile=true
lever checkpointing-auto-profiled --reuse-prepared --arms ours-packed "${AUTO[@]}" --profile-steps 2

[ "$failed" -eq 0 ] && echo "$SCRIPT_NAME: DONE" || { echo "$SCRIPT_NAME: a run FAILED (see above)"; exit 1; }

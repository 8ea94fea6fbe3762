#!/usr/bin/env bash
# One command that checks this project on a GPU machine, offline:
#   1. refuses to go on (exit 1) unless torch sees a CUDA device;
#   2. if a folder of wheels is there ($FINETUNE_WHEELS, default .whl/; bench/README.md, "On a GPU", says
#      how to fetch it), installs them and this checkout with pip --no-index: nothing comes from the network;
#   3. runs the gpu-marked tests (`pytest -m gpu`); "no tests collected" (exit 5) is reported, not failed;
#   4. runs the GPU presets (`python -m bench --gpu`: bf16 LoRA on a Llama-3.2-1B shape, nf4 QLoRA on a
#      Llama-3.1-8B shape, ours against the HF Trainer + peft);
#   5. prints one table: the tests' summary and every arm's tokens/s, ratio to the Trainer, MFU, peak GPU
#      memory, `finetune plan`'s estimate and their ratio, held-out loss; exits 1 if anything failed.
#
# Usage, from anywhere:  bench/gpu_check.sh            # the full presets
#                        bench/gpu_check.sh --short    # full sizes, one round of 6 steps, tests on 8 workers:
#                                                      # about 10 minutes on an H100, for a GPU lent briefly
#                        bench/gpu_check.sh --quick    # the presets shrunken: checks the script, measures nothing
# Logs and JSON go to $GPU_CHECK_OUT (default bench/results/gpu-check/). $PYTHON picks the interpreter.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PYTHON=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-bench/results/gpu-check}
QUICK=()
TEST_WORKERS=()
case "${1:-}" in
  "") ;;
  --quick) QUICK=(--quick) ;;
  --short) QUICK=(--short) ;;
  *) echo "usage: bench/gpu_check.sh [--short | --quick]" >&2; exit 2 ;;
esac

# The CUDA check, the wheels and the import check (exits 1 with a reason if one fails).
source bench/gpu_setup.sh

if [ "${QUICK[*]-}" = "--short" ] && "$PYTHON" -c "import xdist, pytest_timeout" 2>/dev/null; then
  TEST_WORKERS=(-n 8 --timeout 150)  # the tests are small: 8 processes share the GPU; none may hang the run
fi
mkdir -p "$OUT"
# Only the files that hold gpu tests: another file's optional dependency (llama-cpp-python, which CI builds from
# source) missing on a GPU machine would otherwise stop the run at collection.
mapfile -t GPU_TEST_FILES < <(grep -l "mark.gpu" tests/test_*.py)
echo "gpu_check: pytest -m gpu over ${#GPU_TEST_FILES[@]} files (log: $OUT/gpu-tests.log)"
# -v: each test's verdict is printed as it ends, so a run stopped early still names what passed and failed;
# --durations: the slow ones, for sizing the next lease
"$PYTHON" -m pytest -m gpu -v -rfEs --durations=10 -p no:cacheprovider ${TEST_WORKERS[@]+"${TEST_WORKERS[@]}"} \
  --junitxml="$OUT/gpu-tests.xml" "${GPU_TEST_FILES[@]}" 2>&1 | tee "$OUT/gpu-tests.log"
tests_exit=${PIPESTATUS[0]}

echo "gpu_check: python -m bench --gpu ${QUICK[*]} (log: $OUT/bench.log)"
rm -f "$OUT/latest.json"
"$PYTHON" -m bench --gpu ${QUICK[@]+"${QUICK[@]}"} --out "$OUT" 2>&1 | tee "$OUT/bench.log"
bench_exit=${PIPESTATUS[0]}

echo
"$PYTHON" -m bench.check_table --tests-exit "$tests_exit" --junit "$OUT/gpu-tests.xml" \
  --bench-exit "$bench_exit" --bench "$OUT/latest.json"

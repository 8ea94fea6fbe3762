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
REPO=$(pwd)
PYTHON=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-bench/results/gpu-check}
WHEELS=${FINETUNE_WHEELS:-.whl}
QUICK=()
TEST_WORKERS=()
case "${1:-}" in
  "") ;;
  --quick) QUICK=(--quick) ;;
  --short) QUICK=(--short) ;;
  *) echo "usage: bench/gpu_check.sh [--short | --quick]" >&2; exit 2 ;;
esac

fail() {
  echo "gpu_check: FAILED: $*" >&2
  exit 1
}

# Subprocesses (the CLI tests, the bench's arms) import this checkout, whatever else is installed.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

"$PYTHON" - <<'EOF' || fail "no CUDA device: torch.cuda.is_available() is False (or torch is missing); this check needs a GPU"
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(1)
print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF

if compgen -G "$WHEELS/*.whl" > /dev/null; then
  echo "gpu_check: installing the wheels in $WHEELS and this checkout, without the network"
  "$PYTHON" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || fail "pip install of $WHEELS/*.whl"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e . || fail "pip install -e ."
fi
"$PYTHON" -c "import finetune, bitsandbytes, peft, datasets" \
  || fail "finetune or a dependency does not import; bring wheels in $WHEELS (see bench/README.md, On a GPU)"

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

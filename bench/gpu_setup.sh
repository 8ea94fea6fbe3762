# Sourced by the GPU scripts (gpu_check.sh, gpu_levers.sh), never run alone: what a lent GPU machine needs
# before anything else, in one place. From the repository root, with PYTHON set, it
#   1. exports PYTHONPATH (this checkout, for the tests' and the arms' subprocesses) and the offline switches;
#   2. stops (exit 1, "<script>: FAILED: no CUDA device") unless torch sees a CUDA device;
#   3. installs the wheels in $FINETUNE_WHEELS (default .whl/) and this checkout with pip --no-index, if any:
#      nothing comes from the network (bench/README.md, "On a GPU", says how to fetch them);
#   4. checks that finetune, bitsandbytes, peft and datasets import.
# Defines `fail MESSAGE` (exit 1 with the calling script's name) for the caller too.

SCRIPT_NAME=$(basename "$0" .sh)
fail() {
  echo "$SCRIPT_NAME: FAILED: $*" >&2
  exit 1
}

export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

SCRIPT_NAME=$SCRIPT_NAME "$PYTHON" - <<'PY' || fail "no CUDA device: torch.cuda.is_available() is False (or torch is missing); this needs a GPU"
import os
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(1)
print(f"{os.environ['SCRIPT_NAME']}: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY

WHEELS=${FINETUNE_WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  echo "$SCRIPT_NAME: installing the wheels in $WHEELS and this checkout, without the network"
  "$PYTHON" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || fail "pip install of $WHEELS/*.whl"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e . || fail "pip install -e ."
fi
"$PYTHON" -c "import finetune, bitsandbytes, peft, datasets" \
  || fail "finetune or a dependency does not import; bring wheels in $WHEELS (see bench/README.md, On a GPU)"

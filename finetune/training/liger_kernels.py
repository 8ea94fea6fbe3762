"""`train.liger_kernels`: Liger Kernel's Triton RMSNorm, RoPE and SwiGLU in the base's decoder layers, on CUDA.

The step of a small or medium model on a GPU waits on many small elementwise kernels (normalisation, the
rotary embedding, the gated activation): Liger Kernel (`pip install 'finetune[liger]'`) fuses each into one
Triton kernel, for values and gradients. It is applied to the loaded base before LoRA wraps it, through
Liger's own per-family function (`MODEL_TYPE_TO_APPLY_LIGER_FN`): the RMSNorm and MLP modules of this model
get Liger's forwards (the MLP's projections stay `nn.Linear`, so LoRA wraps them as before), and the family's
rotary function is replaced in transformers' module, which is process-wide (every model of that family
in the process then uses it: a training process holds one). Liger's loss kernels are not asked for: the
loss is finetune's (`finetune.chunked_loss`), which never holds whole logits either and measured faster on
an H100 with no host sync (`bench/gpu_chunked_loss.py`: 23.4 ms against Liger's 41.5 ms with per-token
losses, whose backward recomputes the logits, and two `.item()` syncs in Liger's forward).

Off by default. On the CPU (Triton kernels need CUDA) or for a family Liger has no kernels for, one log line
says so and the model keeps PyTorch's modules. `compile: auto` does not compile layers that hold Liger's
kernels (not yet run together on a GPU; `compile: true` still asks for it).

Example:
    use_liger_kernels(recipe.train.liger_kernels, model, torch.device("cuda"), say)  # before wrap_with_lora
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from finetune.errors import ModelError

KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}
"""What is asked of Liger's per-family function: its RoPE, RMSNorm and SwiGLU, none of its losses."""


def use_liger_kernels(enabled: bool, model: Any, device: torch.device, say: Callable[[str], None]) -> bool:
    """Put Liger's kernels into `model` (a transformers causal LM, not yet LoRA-wrapped) when `enabled` and
    they can run; returns whether they did.

    Raises:
        ModelError: asked for on CUDA without liger-kernel installed.
    """
    if not enabled:
        return False
    if device.type != "cuda":
        say(f"train.liger_kernels: Liger's kernels are Triton kernels for CUDA; not used on the {device.type}")
        return False
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        raise ModelError(
            "train.liger_kernels: liger-kernel is not installed; pip install 'finetune[liger]', or set "
            "train.liger_kernels=false"
        ) from None
    family = getattr(model.config, "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(family)
    if apply is None:
        say(f"train.liger_kernels: Liger Kernel has no kernels for {family} models; the model keeps PyTorch's")
        return False
    accepted = inspect.signature(apply).parameters
    apply(model=model, **{name: on for name, on in KERNELS.items() if name in accepted})
    used = [name for name in ("rms_norm", "rope", "swiglu") if name in accepted]
    say(f"Liger Kernel for {family}: {', '.join(used)}")
    return True

"""`distributed.strategy: fsdp`: torch's FSDP2 (`fully_shard`), one shard unit per decoder layer.

Parameters, gradients and optimizer state are sharded (dim 0) over the ranks. The model is sharded with
`fully_shard` *before* the optimizer is built (the optimizer must hold the sharded parameters), and only
the optimizer goes through `accelerator.prepare`: accelerate's own FSDP plugin is silently ignored on
CPU, where the run would quietly become DDP, and one code path for CPU and GPU is one that is tested here.

Example:
    sharding = FsdpSharding(recipe.distributed, recipe.train.precision)
    sharding.shard(peft_model, accelerator)
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from finetune.errors import ModelError
from finetune.model import decoder_layers
from finetune.recipe import DistributedConfig
from finetune.training.sharding import GatheredState, StateIO


class FsdpSharding:
    """FSDP2: parameters, gradients and optimizer state are sharded (dim 0) over the ranks."""

    name = "fsdp"

    def __init__(self, config: DistributedConfig, precision: str):
        self.config = config.fsdp
        self.precision = precision
        self.state: StateIO = GatheredState()  # DTensor shards gathered whole, split back on resume

    def shard(self, model: Any, accelerator: Any) -> None:
        mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
        options: dict[str, Any] = dict(
            mesh=mesh,
            reshard_after_forward=self.config.sharding == "full",
            mp_policy=_mixed_precision_policy(model, self.precision),
            offload_policy=CPUOffloadPolicy() if self.config.cpu_offload else OffloadPolicy(),
        )
        causal_lm = model.get_base_model()
        for layer in _decoder_layers(causal_lm):
            fully_shard(layer, **options)
        fully_shard(causal_lm, **options)  # the root unit: embeddings, final norm, head

    def prepare(self, accelerator: Any, model: Any, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        return model, accelerator.prepare(optimizer)

    def gradient_sync(self, accelerator: Any, model: Any, sync: bool) -> AbstractContextManager[Any]:
        model.get_base_model().set_requires_gradient_sync(sync)
        return nullcontext()

    def backward(self, accelerator: Any, loss: torch.Tensor) -> None:
        accelerator.backward(loss)

    def clip_grad_norm(self, accelerator: Any, parameters: list[torch.nn.Parameter], max_norm: float) -> Any:
        accelerator.unscale_gradients()
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # on the device: nothing waits for it


def _decoder_layers(causal_lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The shard units: the model's decoder layers (`finetune.model.decoder_layers`)."""
    layers = decoder_layers(causal_lm)
    if not layers:
        raise ModelError(
            f"distributed.strategy fsdp: {type(causal_lm).__name__} names no decoder layer class "
            "(_no_split_modules); use strategy ddp for this model"
        )
    return layers


def _mixed_precision_policy(model: torch.nn.Module, precision: str) -> Any:
    """Compute in the autocast dtype and reduce gradients in float32; a base in 16 bits with float32
    LoRA weights (mixed dtypes in one shard unit, which FSDP2 refuses otherwise) computes in the base's dtype."""
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    dtypes = {parameter.dtype for parameter in model.parameters()}
    if compute is None and len(dtypes) > 1:
        compute = next(dtype for dtype in dtypes if dtype != torch.float32)
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None)

"""LoRA on raw parameters in unmerged forwards: per row of a batch, each row computing what a merge computes.

peft reaches a mixture of experts' fused expert tensors, and a router that is not an `nn.Linear`, through
`target_parameters` (a `ParamWrapper` around the module holding them). It applies that LoRA by adding ΔW to
the weight in the model's dtype, for the whole batch, and refuses a batch whose rows name different adapters
("does not support mixed batch inference"). So `finetune serve` could not give each request its own MoE
adapter, and in bf16 an unmerged forward rounded differently from the merged model.

Here the outermost wrapper of each such module (experts, router) gets its own `forward` (an attribute of
that one module object, gone with it when peft unloads): the tokens are grouped by the adapter their row
names (peft's `adapter_names`, which its forward hook hands every LoRA layer; "__base__" for none), and
each group runs the plain module (`torch.func.functional_call`) with the tensors that merging its adapter
would write (`tensor_for`, see `LoadedModel`). A row's experts (and router) therefore compute with the
merged model's tensors bit for bit; rows without an adapter use the model's own. Without `adapter_names`
every row gets what peft has switched on (`use(name)`), or the base's tensors when adapters are disabled.

Rows map to tokens because every MoE block of transformers 5 flattens its input row-major,
(batch, seq, hidden) -> (batch·seq, hidden) before its router and experts, and passes per-token routing
tensors beside it: row r owns tokens r·seq to (r+1)·seq - 1, and the router's and an expert's output for a
token depend on that token alone.

Linear layers inside a mixture-of-experts block see those flattened tokens too (Qwen2-MoE's and Llama 4's
shared expert, HunYuan-MoE's and JetMoE's routers are `nn.Linear`), and peft's per-row LoRA refuses an input
whose first dimension is not the batch ("Length of `adapter_names` should be the same as the number of
inputs"): their LoRA layers get a forward that repeats each row's adapter name for its tokens (`_per_token`).

Cost: each forward computes, per adapter present in the batch, every expert tensor of that adapter once
(round(W + ΔW) in fp32, as a merge does), which is what peft's unmerged path does too (a full W + ΔW per
forward). For a large MoE served with one adapter, `finetune serve --merge` avoids it.

Example:
    rows = ExpertRows(lambda tensor, adapters: merged_tensor(tensor, adapters))
    rows.install(peft_model)            # after each adapter is attached; idempotent
    peft_model(input_ids=ids, adapter_names=["legal", "__base__"])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from finetune.adapters.experts import BASE_LAYER, clean_name, unwrapped
from finetune.errors import AdapterError

BASE_ROW = "__base__"
"""peft's name for a row without an adapter."""

TensorFor = Callable[[str, tuple[str, ...]], torch.Tensor]
"""(tensor name: `owner.parameter`, adapters of a row) -> the tensor that row computes with."""


def is_parameter_wrapper(module: torch.nn.Module) -> bool:
    """peft's LoRA wrapper of a raw parameter (`ParamWrapper`): around fused experts, or a router's weight."""
    return hasattr(module, "parameter_name") and hasattr(module, "lora_A")


class ExpertRows:
    """Gives the outermost parameter wrappers of a peft model a per-row forward (see the module docstring)."""

    def __init__(self, tensor_for: TensorFor):
        self._tensor_for = tensor_for

    def install(self, model: torch.nn.Module) -> int:
        """Give every outermost parameter wrapper of `model` the per-row forward, and every linear LoRA layer
        one that takes flattened tokens (`_per_token`); returns how many parameter wrappers have theirs."""
        installed = 0
        for name, module in model.named_modules():
            if name.endswith(BASE_LAYER):
                continue  # an inner wrapper is called by the outer one, which now bypasses it
            if not is_parameter_wrapper(module):
                if _is_linear_lora(module) and "forward" not in module.__dict__:
                    module.forward = partial(_per_token, module.forward)
                continue
            if "forward" not in module.__dict__:
                module.forward = partial(self._forward, module, clean_name(name))
            installed += 1
        return installed

    def _forward(
        self,
        wrapper: torch.nn.Module,
        owner: str,
        hidden_states: torch.Tensor,
        *args: Any,
        adapter_names: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        experts = unwrapped(wrapper)
        targeted = _targeted(wrapper)
        rows = _row_adapters(wrapper, adapter_names)
        groups: dict[tuple[str, ...], list[int]] = {}
        for row, adapters in enumerate(rows):
            groups.setdefault(adapters, []).append(row)
        if len(groups) == 1:
            (adapters,) = groups
            return self._run(experts, owner, targeted, adapters, hidden_states, args, kwargs)
        tokens = hidden_states.shape[0]
        _check_row_major(experts, owner, tokens, args, kwargs)
        assert tokens % len(rows) == 0, f"{tokens} tokens cannot be {len(rows)} rows of equal length"
        per_row = tokens // len(rows)
        parts = []
        for adapters, members in groups.items():
            index = (torch.tensor(members)[:, None] * per_row + torch.arange(per_row)).flatten()
            index = index.to(hidden_states.device)
            part_args = [_rows_of(value, index, tokens) for value in args]
            part_kwargs = {key: _rows_of(value, index, tokens) for key, value in kwargs.items()}
            part = self._run(experts, owner, targeted, adapters, hidden_states[index], part_args, part_kwargs)
            parts.append((index, part))
        return _gathered(parts, tokens)

    def _run(
        self,
        experts: torch.nn.Module,
        owner: str,
        targeted: list[str],
        adapters: tuple[str, ...],
        hidden_states: torch.Tensor,
        args: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> Any:
        """The plain module on these tokens, with the tensors of rows using `adapters`."""
        if not adapters:
            return experts(hidden_states, *args, **kwargs)
        tensors = {p: self._tensor_for(f"{owner}.{p}", adapters) for p in targeted}
        return torch.func.functional_call(experts, tensors, (hidden_states, *args), kwargs, strict=False)


def _check_row_major(module: torch.nn.Module, owner: str, tokens: int, args: Sequence[Any], kwargs: dict) -> None:
    """AdapterError unless `module`'s tokens can be told apart by row: a router's (its input is the block's), or
    experts given a per-token routing tensor beside them. Llama 4's experts take each token once per expert
    (`repeat`) and JetMoE's take them sorted by expert with a list of counts: grouped by row, each row's
    experts computed with other rows' tokens, silently."""
    if all(parameter.dim() != 3 for parameter in module.parameters(recurse=False)):
        return  # a router
    if any(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == tokens for v in (*args, *kwargs.values())):
        return
    raise AdapterError(
        f"{owner} ({type(module).__name__}) takes its tokens in an order of its own, not row by row, so rows of "
        "different adapters (or base rows beside adapter rows) cannot share one forward on it; serve one adapter "
        "merged (finetune serve --merge NAME), or apply one adapter to the whole batch (finetune generate --adapter)"
    )


def _is_linear_lora(module: torch.nn.Module) -> bool:
    """peft's LoRA layer around a linear layer (plain or quantized: bitsandbytes' subclass nn.Linear)."""
    return hasattr(module, "lora_A") and isinstance(getattr(module, "base_layer", None), torch.nn.Linear)


def _per_token(forward: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """A linear LoRA layer's forward on tokens flattened row-major inside a mixture-of-experts block, (batch·seq,
    hidden) rather than (batch, seq, hidden): each row's adapter name repeated for its tokens, as peft's per-row
    LoRA needs one name per input."""
    names = kwargs.get("adapter_names")
    if names is not None and x.dim() == 2 and len(names) and x.shape[0] != len(names):
        per_row, rest = divmod(x.shape[0], len(names))
        assert rest == 0, f"{x.shape[0]} tokens cannot be {len(names)} rows of equal length"
        kwargs["adapter_names"] = [name for name in names for _ in range(per_row)]
    return forward(x, *args, **kwargs)


def _targeted(wrapper: torch.nn.Module) -> list[str]:
    """The parameter names the chain of wrappers from `wrapper` inwards holds LoRA for."""
    names: list[str] = []
    module: Any = wrapper  # peft's attributes are untyped for torch's `Module.__getattr__`
    while hasattr(module, "parameter_name"):
        names.append(module.parameter_name)
        module = module.base_layer
    return names


def _row_adapters(wrapper: torch.nn.Module, adapter_names: Sequence[str] | None) -> list[tuple[str, ...]]:
    """The adapters each row uses: named per row (peft's mixed batch), else what peft switched on for all."""
    if adapter_names is not None:
        return [() if name == BASE_ROW else (name,) for name in adapter_names]
    layer: Any = wrapper  # a peft LoraLayer
    if layer.disable_adapters:
        return [()]
    return [tuple(sorted(a for a in layer.active_adapters if a in layer.lora_A))]


def _gathered(parts: list[tuple[torch.Tensor, Any]], tokens: int) -> Any:
    """The outputs of token groups put back in token order: a tensor, or a tuple of them (a router's logits,
    weights and indices), each with one row per token, or per token of rows it was given whole (DeepSeek-V3's
    router takes (batch, seq, hidden) and returns (batch·seq, experts))."""
    first = parts[0][1]
    if isinstance(first, tuple):
        return tuple(_gathered([(index, part[i]) for index, part in parts], tokens) for i in range(len(first)))
    per_input, rest = divmod(first.shape[0], len(parts[0][0]))
    assert rest == 0 and per_input > 0, f"{first.shape[0]} outputs for {len(parts[0][0])} inputs"
    output = first.new_empty((tokens * per_input, *first.shape[1:]))
    for index, part in parts:
        output[(index[:, None] * per_input + torch.arange(per_input, device=index.device)).flatten()] = part
    return output


def _rows_of(value: Any, index: torch.Tensor, tokens: int) -> Any:
    """`value`'s entries for the tokens `index` when it has one per token (routing tensors), else `value`."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == tokens:
        return value[index]
    return value

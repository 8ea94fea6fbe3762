"""A detector of host-device synchronisation: the operations that make the host wait for the device.

On a GPU the host queues kernels and runs ahead; an operation whose result the host must read (a scalar, a
shape that depends on the data, a copy to host memory) makes it wait until every queued kernel has run, and
the GPU then idles while the host queues the next ones. A step with no such operation keeps the GPU fed. On
the CPU nothing waits, but the same operations are dispatched, so running a step under `HostSyncDetector`
on the CPU finds exactly what would synchronise it on a GPU:

- `_local_scalar_dense` (`.item()`, `float(t)`, `int(t)`, `bool(t)`, `if t:`), `is_nonzero`, `equal`;
- output shapes that depend on values: `nonzero`, `argwhere`, `masked_select`, `unique`, boolean-mask
  indexing (`t[mask]`, `t[mask] = v`), `repeat_interleave` without `output_size`;
- `.tolist()`, `.numpy()` (they read memory without an aten operation: caught as torch functions), and
  `.item()`, `int(t)`, `float(t)` of an inference tensor (under `torch.inference_mode` they dispatch
  nothing either; `bool(t)` still dispatches `is_nonzero`);
- a copy from an accelerator to the host (`.cpu()`, `.to("cpu")`).

Used by `tests/test_host_sync.py` on whole optimizer steps, and by `bench/host_work.py` to count them.

Example:
    with HostSyncDetector() as detector:
        step(...)
    detector.found          # [] when nothing synchronised; else ["aten.nonzero.default", ...]
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_SYNCING_OPS = frozenset(
    {
        "_local_scalar_dense",
        "is_nonzero",
        "equal",
        "nonzero",
        "argwhere",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "allclose",
    }
)
_READING_METHODS = frozenset({"tolist", "numpy"})
_SCALAR_METHODS = frozenset({"item", "__int__", "__float__", "__index__"})
"""Reads of one value. Of an ordinary tensor they dispatch `_local_scalar_dense` (caught there); of an
inference tensor (made under `torch.inference_mode`, as sampling's) they read it without dispatching it.
(`bool(t)` dispatches `is_nonzero` either way.)"""


class _DispatchWatch(TorchDispatchMode):
    def __init__(self, found: list[str], where: list[str]) -> None:
        super().__init__()
        self.found, self.where = found, where

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            self.found.append(reason)
            self.where.append("".join(traceback.format_stack(limit=12)[:-2]))
        return func(*args, **kwargs)


class _FunctionWatch(TorchFunctionMode):
    def __init__(self, found: list[str], where: list[str]) -> None:
        super().__init__()
        self.found, self.where = found, where

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        reads = args and isinstance(args[0], torch.Tensor)
        if reads and (name in _READING_METHODS or (name in _SCALAR_METHODS and args[0].is_inference())):
            self.found.append(f"Tensor.{name}")
            self.where.append("".join(traceback.format_stack(limit=12)[:-2]))
        return func(*args, **(kwargs or {}))


def _sync_reason(func: Any, args: tuple, kwargs: dict) -> str | None:
    name = func._schema.name.split("::")[-1]
    if name in _SYNCING_OPS:
        return str(func)
    if name == "repeat_interleave" and kwargs.get("output_size") is None and isinstance(args[0], torch.Tensor):
        return f"{func} without output_size"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            return f"{func} with a boolean mask"
    if name in ("_to_copy", "copy_", "_copy_from"):
        return _host_copy(func, args, kwargs)
    return None


def _host_copy(func: Any, args: tuple, kwargs: dict) -> str | None:
    """A copy from an accelerator into host memory (the host waits for it unless it is asynchronous)."""
    name = func._schema.name.split("::")[-1]
    if name == "_to_copy":
        source, target = args[0], kwargs.get("device")
        to_host = target is not None and torch.device(target).type == "cpu"
    else:
        target_tensor, source = args[0], args[1]
        to_host = isinstance(target_tensor, torch.Tensor) and target_tensor.device.type == "cpu"
    if to_host and isinstance(source, torch.Tensor) and source.device.type not in ("cpu", "meta"):
        return f"{func} from {source.device} to the host"
    return None


class HostSyncDetector:
    """Record every synchronising operation run inside the `with` block (see the module docstring).

    `found` lists them in order (one name each) and `where` the Python stack of each, for the message.
    """

    def __init__(self) -> None:
        self.found: list[str] = []
        self.where: list[str] = []
        self._modes = (_FunctionWatch(self.found, self.where), _DispatchWatch(self.found, self.where))

    def __enter__(self) -> HostSyncDetector:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def describe(self, limit: int = 3) -> str:
        """The operations found, with the stacks of the first `limit` of them."""
        lines = [f"{len(self.found)} host-syncing operation(s): {sorted(set(self.found))}"]
        for name, stack in list(zip(self.found, self.where))[:limit]:
            lines.append(f"--- {name} at\n{stack}")
        return "\n".join(lines)

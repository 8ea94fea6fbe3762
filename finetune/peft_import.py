"""peft without bitsandbytes where no base is quantized: seconds of start-up that only QLoRA needs.

peft imports bitsandbytes whenever it is installed: `import peft` (its `helpers` module) and every time it
wraps a model (its LoRA dispatchers). bitsandbytes in turn imports torch's dynamo and inductor, 1-2 s of
start-up for every `finetune generate`, `eval`, `serve` and training process, though only a 4-/8-bit base
(loaded by transformers, which imports bitsandbytes itself) has any use for it.

So peft is imported, and wraps models, with bitsandbytes hidden (`sys.modules["bitsandbytes"] = None`, which
`importlib.util.find_spec` reads as "not installed") unless bitsandbytes is already loaded, and peft's cached
answers about it are cleared afterwards, so a quantized base later in the same process finds it as usual.

Every finetune module gets peft through `import_peft()`, so whichever imports it first hides bitsandbytes.

Example:
    peft = import_peft()
    with bitsandbytes_hidden():
        model = peft.get_peft_model(model, config)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

BITSANDBYTES = "bitsandbytes"


@contextmanager
def bitsandbytes_hidden() -> Iterator[None]:
    """Inside: bitsandbytes looks uninstalled, unless something (a quantized base) has already loaded it."""
    if sys.modules.get(BITSANDBYTES) is not None:
        yield
        return
    sys.modules[BITSANDBYTES] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get(BITSANDBYTES, "absent") is None:
            del sys.modules[BITSANDBYTES]
        _forget_peft_answers()


def _forget_peft_answers() -> None:
    """peft caches "is bitsandbytes available" (functools.lru_cache): drop what it learnt while hidden."""
    import_utils = sys.modules.get("peft.import_utils")
    for name in ("is_bnb_available", "is_bnb_4bit_available"):
        cached = getattr(import_utils, name, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()


def import_peft() -> ModuleType:
    """The `peft` module, imported (the first time) with bitsandbytes hidden."""
    if "peft" not in sys.modules:
        with bitsandbytes_hidden():
            importlib.import_module("peft")
    return sys.modules["peft"]

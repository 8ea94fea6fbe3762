"""What `finetune serve` is told: the models to load and the limits it enforces, checked once at startup.

Example:
    settings = ServeSettings(base="models/tiny", adapters={"legal": "adapters/legal"}, port=0)
    settings.check()        # ServeError on values out of range
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field

from finetune.errors import ServeError

DEFAULT_HOST = "127.0.0.1"
MAX_WAIT_MS = 60_000
"""A minute: an idle server holds its first request this long at most. nan passed the check and the worker spun
waiting, inf (or 1e300) raised OverflowError in it, and either way the server took requests and never answered."""
BASE_ROW = "__base__"
"""peft's name for a row of a mixed batch that runs on the base alone."""


@dataclass
class ServeSettings:
    """Settings of one server.

    Attributes:
        base: base model directory, hub id or `embedded:tiny-llama`; None takes the first adapter's base.
        adapters: served name -> adapter directory, loaded at startup.
        base_name: the `model` id of the base (default: `base` as given).
        merge: serve this adapter merged into the weights (merged mode) instead of per-row adapters.
        host, port: where to listen; port 0 picks a free port.
        api_key: if set, every /v1 request needs `Authorization: Bearer <api_key>`.
        max_batch_size: most rows (sequences) in one forward pass.
        max_wait_ms: how long an idle server waits for more requests before it starts a batch.
        max_tokens_limit: the largest `max_tokens` a request may ask for.
        max_pending: most sequences queued or running at once; more are refused with 429.
        dtype: float32 | bfloat16 | float16; None: as `finetune.load_model` chooses (float32, or the dtype
            the adapters' runs loaded a quantized base in).
        device: where the model runs: auto (a GPU when there is one), cpu, cuda or cuda:N.
        log_level: uvicorn's log level.
    """

    base: str | None = None
    adapters: dict[str, str] = field(default_factory=dict)
    base_name: str | None = None
    merge: str | None = None
    host: str = DEFAULT_HOST
    port: int = 8000
    api_key: str | None = None
    max_batch_size: int = 8
    max_wait_ms: float = 10.0
    max_tokens_limit: int = 1024
    max_pending: int = 64
    dtype: str | None = None
    device: str = "auto"
    log_level: str = "warning"

    def check(self) -> None:
        """Raise `ServeError` naming the first setting out of range."""
        bounds = {
            "max_batch_size": (self.max_batch_size, 1),
            "max_tokens_limit": (self.max_tokens_limit, 1),
            "max_pending": (self.max_pending, 1),
            "max_wait_ms": (self.max_wait_ms, 0),
            "port": (self.port, 0),
        }
        for name, (value, lowest) in bounds.items():
            if value < lowest:
                raise ServeError(f"--{name.replace('_', '-')} must be at least {lowest}, got {value}")
        if not (math.isfinite(self.max_wait_ms) and self.max_wait_ms <= MAX_WAIT_MS):
            raise ServeError(f"--max-wait-ms must be a number of at most {MAX_WAIT_MS}, got {self.max_wait_ms}")
        if self.port > 65535:
            raise ServeError(f"--port must be at most 65535, got {self.port}")
        if self.merge is not None and self.merge not in self.adapters:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise ServeError(
                f"--merge {self.merge}: no adapter of that name (adapters: {known}); add --adapter NAME=PATH"
            )
        if self.base is None and not self.adapters:
            raise ServeError("give a BASE model, or at least one --adapter whose manifest names its base")


SERVE_PACKAGES = ("fastapi", "uvicorn")


def require_serve_packages() -> None:
    """ServeError naming the first missing package of the `serve` extra: checked before the server's
    modules are imported, so a user without them reads how to install them, not an ImportError."""
    for package in SERVE_PACKAGES:
        if importlib.util.find_spec(package) is None:
            raise ServeError(f"finetune serve needs {package}: pip install 'finetune[serve]'")

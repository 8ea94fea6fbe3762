"""`finetune serve`: argument parsing only; the server lives in `finetune.serve`.

Example:
    finetune serve embedded:tiny-llama --adapter legal=adapters/legal --adapter med=adapters/med
    finetune serve --adapter adapters/quickstart --merge quickstart --port 8001 --api-key secret
"""

from __future__ import annotations

import argparse
import os

from finetune.commands.inference import QUANTIZED_DTYPE_HELP
from finetune.commands.numbers import non_negative_float, port_number, positive_int
from finetune.commands.warning_lines import warnings_as_lines
from finetune.serve.settings import DEFAULT_HOST

API_KEY_VARIABLE = "FINETUNE_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a base and its adapters over an OpenAI-compatible HTTP API",
        description="Serve a base and its LoRA adapters over HTTP with OpenAI's endpoints (/v1/models, "
        "/v1/completions, /v1/chat/completions) and vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter. "
        "A request's `model` names the base or an adapter; concurrent requests for different adapters share "
        "forward passes.",
    )
    parser.add_argument(
        "base",
        nargs="?",
        help="base model directory, hub id or embedded:tiny-llama (default: the first adapter's base)",
    )
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="an adapter to serve as model NAME (repeatable; PATH alone: named by its manifest)",
    )
    parser.add_argument("--base-name", help="the model id of the base in requests (default: BASE as given)")
    parser.add_argument(
        "--merge",
        metavar="NAME",
        help="serve adapter NAME merged into the weights (exact, fastest); "
        "POST /v1/load_lora_adapter then swaps another adapter in",
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=port_number, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_VARIABLE),
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_VARIABLE})",
    )
    _add_limits(parser)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help=QUANTIZED_DTYPE_HELP)
    parser.add_argument(
        "--device", default="auto", help="auto (a GPU when there is one, else the CPU), cpu, cuda or cuda:N"
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="uvicorn's log level; info logs every request (default warning)",
    )
    parser.set_defaults(handler=warnings_as_lines(run_serve))


def _add_limits(parser: argparse.ArgumentParser) -> None:
    """The batching and admission limits."""
    parser.add_argument(
        "--max-batch-size", type=positive_int, default=8, help="most sequences in one forward pass (default 8)"
    )
    parser.add_argument(
        "--max-wait-ms",
        type=non_negative_float,
        default=10.0,
        help="how long an idle server waits to fill a batch (default 10, at most 60000)",
    )
    parser.add_argument(
        "--max-tokens-limit",
        type=positive_int,
        default=1024,
        help="largest max_tokens a request may ask (default 1024)",
    )
    parser.add_argument(
        "--max-pending",
        type=positive_int,
        default=64,
        help="most sequences queued or running; more get 429 (default 64)",
    )


def _adapter_specs(specs: list[str]) -> dict[str, str]:
    """NAME=PATH (or PATH, named by its manifest or directory) -> {name: path}."""
    from finetune.adapters.lora import read_adapter
    from finetune.errors import ServeError

    adapters: dict[str, str] = {}
    for spec in specs:
        name, separator, path = spec.partition("=")
        if not separator:
            name, path = read_adapter(spec).name, spec
        elif not name or not path:  # `legal=` read as the current directory; `=PATH` served under another name
            raise ServeError(f"--adapter {spec}: give NAME=PATH with both parts, or PATH alone")
        if name in adapters:
            raise ServeError(f"--adapter {spec}: the name {name!r} is given twice; use NAME=PATH to name them apart")
        adapters[name] = path
    return adapters


def run_serve(args: argparse.Namespace) -> int:
    from finetune.serve.settings import ServeSettings, require_serve_packages

    require_serve_packages()
    from finetune.serve.server import serve_forever

    settings = ServeSettings(
        base=args.base,
        adapters=_adapter_specs(args.adapter),
        base_name=args.base_name,
        merge=args.merge,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        max_tokens_limit=args.max_tokens_limit,
        max_pending=args.max_pending,
        dtype=args.dtype,
        device=args.device,
        log_level=args.log_level,
    )
    return serve_forever(settings)  # 128 + the signal that stopped it

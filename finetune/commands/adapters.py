"""`finetune adapters ...`: merge, subtract, swap, combine, list and inspect LoRA adapters on disk.

Every command that writes builds its result in a temporary directory beside `--out` and renames it into
place at the end, so an interrupted run leaves nothing at `--out`. The arithmetic lives in
`finetune.adapters`; this module only parses arguments and prints.

Example:
    finetune adapters merge --base embedded:tiny-llama --adapter adapters/legal:1.0 --out merged/legal
    finetune adapters swap --model merged/legal --remove legal --add adapters/med --out merged/med
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from finetune.commands.numbers import positive_int
from finetune.commands.warning_lines import warnings_as_lines
from finetune.quantization import METHODS


def parse_adapter_spec(spec: str):
    """`adapters/legal:0.5` -> AdapterSpec('adapters/legal', 0.5); a suffix that is not a number is part of the path."""
    from finetune.adapters.ondisk import AdapterSpec
    from finetune.errors import AdapterError

    ref, separator, tail = spec.rpartition(":")
    if separator and ref:
        try:
            weight = float(tail)
        except ValueError:
            return AdapterSpec(spec)
        if not math.isfinite(weight):
            raise AdapterError(f"adapter {spec!r}: weight {tail!r} is not a finite number; write e.g. {ref}:0.5")
        return AdapterSpec(ref, weight)
    return AdapterSpec(spec)


class _Once(argparse.Action):
    """An option given at most once. argparse keeps the last of repeated options, so `subtract --adapter a
    --adapter b` (repeated as `merge --adapter` is) would take out b alone and report success; refused instead."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        earlier = getattr(namespace, self.dest, None)
        if earlier is not None:
            parser.error(
                f"{option_string} given twice ({earlier!r} and {values!r}) but takes one adapter; "
                "run the command once per adapter"
            )
        setattr(namespace, self.dest, values)


def _add_arithmetic_flags(parser: argparse.ArgumentParser) -> None:
    """What merge, subtract and swap share: what the user vouches for, and where the arithmetic runs."""
    parser.add_argument("--force", action="store_true", help="apply adapters even if the base fingerprint differs")
    parser.add_argument(
        "--allow-pickle", action="store_true", help="accept adapter_model.bin (pickle) files, loaded weights-only"
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="where updates (and a quantized base's round trip) are computed: auto (a GPU when there is one), cpu, cuda",
    )


def _register_merge(sub: argparse._SubParsersAction) -> None:
    merge = sub.add_parser("merge", help="merge adapters into a base, writing a full model directory")
    merge.add_argument(
        "--base", required=True, help="base model: local dir, hub id, embedded:tiny-llama or a merged model"
    )
    merge.add_argument(
        "--adapter",
        action="append",
        required=True,
        metavar="PATH[:WEIGHT]",
        help="adapter dir, optional weight (repeat)",
    )
    merge.add_argument("--out", required=True, help="output directory (must not exist)")
    merge.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="write tensors as (default: as stored)",
    )
    merge.add_argument(
        "--quantization",
        default=None,
        choices=METHODS,
        help="bitsandbytes quantization the adapters were trained on (default: their manifest's); the merge "
        "dequantizes it and writes 16/32-bit weights",
    )
    merge.add_argument(
        "--requantize",
        action="store_true",
        help="write the merged model quantized like the base, printing the error added",
    )
    _add_arithmetic_flags(merge)
    merge.set_defaults(handler=warnings_as_lines(_merge))


def _register_subtract_and_swap(sub: argparse._SubParsersAction) -> None:
    subtract = sub.add_parser("subtract", help="take an adapter back out of a merged model")
    subtract.add_argument("--model", required=True, help="a merged model directory written by `adapters merge`")
    subtract.add_argument(
        "--adapter", required=True, action=_Once, metavar="NAME|PATH[:WEIGHT]", help="adapter to take out"
    )
    subtract.add_argument("--out", required=True)
    subtract.add_argument("--base", default=None, help="pristine base (default: the one the ledger records)")
    subtract.add_argument(
        "--negate", action="store_true", help="subtract an adapter that was never merged (task negation)"
    )
    _add_arithmetic_flags(subtract)
    subtract.set_defaults(handler=warnings_as_lines(_subtract))

    swap = sub.add_parser("swap", help="replace one merged adapter by another")
    swap.add_argument("--model", required=True)
    swap.add_argument("--remove", required=True, action=_Once, metavar="NAME|PATH")
    swap.add_argument("--add", required=True, action=_Once, metavar="PATH[:WEIGHT]")
    swap.add_argument("--out", required=True)
    swap.add_argument("--base", default=None, help="pristine base (default: the one the ledger records)")
    _add_arithmetic_flags(swap)
    swap.set_defaults(handler=warnings_as_lines(_swap))


def _register_combine(sub: argparse._SubParsersAction) -> None:
    combine = sub.add_parser("combine", help="combine adapters into one adapter (weighted sum of updates)")
    combine.add_argument("adapters", nargs="+", metavar="ADAPTER")
    combine.add_argument("--weights", default=None, help="comma-separated, e.g. 1,-0.5 (default: all 1)")
    combine.add_argument("--method", default="cat", choices=["cat", "svd", "ties", "dare"])
    combine.add_argument(
        "--rank", type=positive_int, default=None, help="rank of svd/ties/dare results (default: max input rank)"
    )
    combine.add_argument("--density", type=float, default=None, help="fraction kept by ties/dare (default 0.5)")
    combine.add_argument("--seed", type=int, default=None, help="dare's random drop seed (default 0)")
    combine.add_argument("--out", required=True)
    combine.add_argument("--allow-pickle", action="store_true")
    combine.set_defaults(handler=warnings_as_lines(_combine))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("adapters", help="merge, subtract, swap, combine, list and inspect adapters")
    sub = parser.add_subparsers(dest="adapters_command", required=True, metavar="SUBCOMMAND")
    _register_merge(sub)
    _register_subtract_and_swap(sub)
    _register_combine(sub)

    listing = sub.add_parser("list", help="list the adapters in a store directory")
    listing.add_argument(
        "store", nargs="?", default="adapters", help="directory holding adapter dirs (default: adapters)"
    )
    listing.add_argument("--json", action="store_true", help="a JSON array, one object per adapter")
    listing.set_defaults(handler=warnings_as_lines(_list))

    info = sub.add_parser("info", help="show one adapter or merged model in detail")
    info.add_argument("adapter", help="adapter dir, merged model dir, or a name in --store")
    info.add_argument("--store", default="adapters")
    info.add_argument(
        "--json", action="store_true", help='one JSON object: "kind" is "adapter" or "merged_model" (see README)'
    )
    info.set_defaults(handler=warnings_as_lines(_info))


def _merge(args: argparse.Namespace) -> int:
    from finetune.adapters.ondisk import merge_checkpoint

    specs = [parse_adapter_spec(spec) for spec in args.adapter]
    report = merge_checkpoint(
        args.base, specs, args.out, dtype=args.dtype, quantization=args.quantization, requantize=args.requantize,
        **_trust(args),
    )  # fmt: skip
    print(report.summary())
    return 0


def _trust(args: argparse.Namespace) -> dict[str, Any]:
    """What the user vouches for (another base: --force, pickle files: --allow-pickle), and the --device."""
    return dict(force=args.force, allow_pickle=args.allow_pickle, device=args.device)


def _subtract(args: argparse.Namespace) -> int:
    from finetune.adapters.ondisk import subtract_checkpoint

    spec = parse_adapter_spec(args.adapter)
    print(subtract_checkpoint(args.model, spec, args.out, base=args.base, negate=args.negate, **_trust(args)).summary())
    return 0


def _swap(args: argparse.Namespace) -> int:
    from finetune.adapters.ondisk import swap_checkpoint

    remove, add = parse_adapter_spec(args.remove), parse_adapter_spec(args.add)
    print(swap_checkpoint(args.model, remove, add, args.out, base=args.base, **_trust(args)).summary())
    return 0


def _combine(args: argparse.Namespace) -> int:
    from finetune.adapters.combine import combine_adapters, parse_weights
    from finetune.errors import AdapterError

    takes = {"--rank": ("svd", "ties", "dare"), "--density": ("ties", "dare"), "--seed": ("dare",)}
    for option, methods in takes.items():  # else silently unused: the result is not what the command line says
        if getattr(args, option.removeprefix("--")) is not None and args.method not in methods:
            raise AdapterError(
                f"{option} applies to --method {' or '.join(methods)}, not {args.method}; leave it out or choose one of those"
            )
    report = combine_adapters(
        args.adapters,
        args.out,
        weights=parse_weights(args.weights, len(args.adapters)),
        method=args.method,
        rank=args.rank,
        density=0.5 if args.density is None else args.density,
        seed=args.seed or 0,
        allow_pickle=args.allow_pickle,
    )
    print(report.summary())
    return 0


def _list(args: argparse.Namespace) -> int:
    from finetune.adapters.store import as_json, format_table, list_store

    rows = list_store(args.store)
    print(as_json(rows) if args.json else format_table(rows))
    return 0


def _info(args: argparse.Namespace) -> int:
    from finetune import strict_json  # a metric that is NaN or infinite is null, not JSON's missing NaN
    from finetune.adapters.store import describe, describe_json, resolve_adapter_path

    path = resolve_adapter_path(args.adapter, args.store)
    print(strict_json.dumps(describe_json(path), indent=2) if args.json else describe(path))
    return 0

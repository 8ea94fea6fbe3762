"""`finetune export gguf (--model MODEL_DIR | --adapter ADAPTER_DIR) --out FILE.gguf [--dtype ...]`.

A model (a base, or one with adapters merged by `finetune adapters merge`) becomes one GGUF file for
llama.cpp; an adapter alone becomes a GGUF LoRA adapter that llama.cpp applies to the base's GGUF at load
time. The work is in `finetune.export`; this module parses arguments and prints one line.

Example:
    finetune export gguf --model merged/legal --out legal.gguf --dtype q8_0
    finetune export gguf --adapter adapters/legal --out legal-lora.gguf
"""

from __future__ import annotations

import argparse

DTYPE_CHOICES = ("f32", "f16", "bf16", "q8_0")  # finetune.export.gguf_file.DTYPES, without importing numpy here


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help="export a model or an adapter to another format (GGUF)")
    sub = parser.add_subparsers(dest="export_format", required=True, metavar="FORMAT")
    gguf = sub.add_parser("gguf", help="GGUF for llama.cpp: a Llama-family model, or a LoRA adapter alone")
    source = gguf.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model directory (merged or base), embedded:tiny-llama, or cached hub id")
    source.add_argument("--adapter", help="adapter directory, written as a GGUF LoRA adapter")
    gguf.add_argument("--out", required=True, help="the .gguf file to write (must not exist)")
    gguf.add_argument(
        "--dtype", choices=DTYPE_CHOICES, help="weight encoding (default: f16 for a model, f32 for an adapter)"
    )
    gguf.add_argument("--base", help="--adapter: the base model directory (default: the one the adapter records)")
    gguf.add_argument(
        "--force", action="store_true", help="--adapter: export over a --base other than the one it was trained on"
    )
    gguf.add_argument("--name", help="--model: general.name in the file (default: the directory name)")
    gguf.set_defaults(handler=run_export_gguf)


def run_export_gguf(args: argparse.Namespace) -> int:
    from finetune.errors import FinetuneError

    pairs = (
        ("--base", args.base, "--adapter"),
        ("--name", args.name, "--model"),
        ("--force", args.force or None, "--base"),
    )
    for option, value, goes_with in pairs:
        if value is not None and getattr(args, goes_with.removeprefix("--")) is None:  # else ignored, unsaid
            raise FinetuneError(f"{option} goes with {goes_with}; leave it out or export with {goes_with}")
    if args.model is not None:
        from finetune.export.gguf_model import export_model_gguf

        report = export_model_gguf(args.model, args.out, dtype=args.dtype or "f16", name=args.name)
    else:
        from finetune.export.gguf_lora import export_lora_gguf

        report = export_lora_gguf(args.adapter, args.out, dtype=args.dtype or "f32", base=args.base, force=args.force)
    print(report.summary())
    return 0

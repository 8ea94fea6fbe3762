"""`finetune eval` (perplexity on a data file) and `finetune generate` (text from a prompt).

Both load a base with an optional adapter switched on unmerged through `finetune.load_model`; the base
may be left out when the adapter's manifest names it. A greedy plain-text `generate` on the CPU first tries
`finetune.generation.light_model`, which computes the same tokens without importing transformers' model code
(seconds of start-up on a small machine), and falls back to `load_model` for what it declines.

Example:
    finetune eval --adapter adapters/quickstart --data data/quickstart/valid.jsonl --format instruction [--json]
    finetune generate --adapter adapters/quickstart "### Instruction:\\nWhat is ...\\n\\n### Response:\\n"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from finetune.commands.numbers import non_negative_float, positive_int
from finetune.commands.warning_lines import warnings_as_lines
from finetune.errors import FinetuneError

ADAPTER_NAME = "adapter"
QUANTIZED_DTYPE_HELP = (
    "the model's dtype (default: float32; on a base quantized as its adapter's run quantized it, the dtype that run "
    "loaded it in, which decides the quantized weights)"
)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", help="base model directory, hub id or embedded:tiny-llama (default: the adapter's)")
    parser.add_argument("--adapter", help="adapter directory, applied unmerged")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help=QUANTIZED_DTYPE_HELP,
    )
    parser.add_argument("--force", action="store_true", help="apply an adapter trained on another base")
    parser.add_argument(
        "--device", default="auto", help="auto (a GPU when there is one, else the CPU), cpu, cuda or cuda:N"
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    evaluate = subparsers.add_parser("eval", help="perplexity of a base (and base + adapter) on a data file")
    _add_model_arguments(evaluate)
    evaluate.add_argument("--data", required=True, help="a .jsonl/.json/.csv/.parquet/.txt file or saved dataset")
    evaluate.add_argument("--format", default="text", choices=["text", "instruction", "chat"])
    evaluate.add_argument(
        "--max-seq-len",
        type=positive_int,
        default=1024,
        help="tokens per record: longer text is split into pieces scored apart, longer prompt+response cut "
        "(data.overlength sets which; each is said on stderr)",
    )
    evaluate.add_argument("--batch-size", type=positive_int, default=8)
    evaluate.add_argument(
        "--json",
        action="store_true",
        help='print {"base": {eval_ppl, eval_loss, eval_tokens}, "adapter": {...} or null without --adapter}',
    )
    evaluate.add_argument(
        "overrides", nargs="*", default=[], metavar="data.KEY=VALUE",
        help="any other setting of a recipe's data section, e.g. data.messages_field=conversations",
    )  # fmt: skip
    evaluate.set_defaults(handler=warnings_as_lines(run_eval))

    generate = subparsers.add_parser("generate", help="continue a prompt with a base (and adapter)")
    _add_model_arguments(generate)
    generate.add_argument("prompt", help="the prompt text")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    generate.add_argument("--max-new-tokens", type=positive_int, default=64)
    generate.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    generate.add_argument("--seed", type=int, default=0)
    generate.set_defaults(handler=warnings_as_lines(run_generate))


def _load(args: argparse.Namespace):
    """(LoadedModel, adapter name or None) for the --base/--adapter arguments."""
    from finetune.api import load_model

    if args.base is None and args.adapter is None:
        raise FinetuneError("give --base, --adapter, or both")
    options = dict(dtype=args.dtype, force=args.force, device=args.device)
    if args.base is None:
        _require_adapter_directory(args.adapter)
        loaded = load_model(args.adapter, **options)
        return loaded, loaded.active
    adapters = {ADAPTER_NAME: args.adapter} if args.adapter else None
    loaded = load_model(args.base, adapters, **options)
    if args.adapter:
        loaded.use(ADAPTER_NAME)
    return loaded, (ADAPTER_NAME if args.adapter else None)


def _require_adapter_directory(path: str) -> None:
    """Refuse an --adapter that is no adapter directory. `load_model` takes a lone path as a base or an adapter, so
    a base's directory or hub id given as --adapter loaded the base alone: `eval` printed its figure with no
    adapter line ("adapter": null under --json, exit 0), and a path that does not exist failed as a base model
    that could not be downloaded."""
    from finetune.adapters.lora import CONFIG_NAME, nested_adapters_hint

    if not (Path(path) / CONFIG_NAME).is_file():
        hint = nested_adapters_hint(Path(path), "give the directory a run wrote its adapter to, or the base as --base")
        raise FinetuneError(f"--adapter {path}: not an adapter directory (no {CONFIG_NAME}); {hint}")


def _coverage_warnings(stats: dict, max_seq_len: int) -> list[str]:
    """Lines saying which tokens of --data the figure leaves out: records cut to --max-seq-len (their tails are not
    scored), split into pieces (text's default: the pieces are scored without the text before them, which moved the
    tiny base's perplexity on 20 bulletins from 8991 to 1671 at --max-seq-len 40) or dropped with nothing left to
    score. Without them a short --max-seq-len changed the perplexity (the quickstart adapter's 4.71 read 1.68 at
    --max-seq-len 120) without a word."""
    lines, total = [], stats["num_records"] + stats.get("num_dropped", 0)  # num_records counts the kept ones
    if stats.get("num_truncated"):
        lines.append(
            f"warning: {stats['num_truncated']} of {total} records are longer than --max-seq-len="
            f"{max_seq_len} tokens and were cut: their tails are not in the figure; raise --max-seq-len to score them"
        )
    if stats.get("num_split"):  # text's default data.overlength=split: tails scored, but as pieces of their own
        lines.append(
            f"warning: {stats['num_split']} of {total} records are longer than --max-seq-len={max_seq_len} tokens "
            f"and were split into pieces scored apart: each later piece's first token is not in the figure and its "
            f"tokens are predicted without the text before it; raise --max-seq-len to score them whole"
        )
    if stats.get("num_dropped"):
        lines.append(
            f"warning: {stats['num_dropped']} of {total} records had nothing to score (an empty response or text, no "
            f"assistant turn, or a prompt filling --max-seq-len={max_seq_len}) and are not in the figure"
        )
    return lines


def run_eval(args: argparse.Namespace) -> int:
    from finetune.data.collate import collate_batch
    from finetune.data.pipeline import build_datasets
    from finetune.scoring import perplexity as score

    config = _eval_data_config(args)
    loaded, adapter = _load(args)
    bundle = build_datasets(config, loaded.tokenizer, seed=0)
    rows = bundle.train
    for line in _coverage_warnings(bundle.stats, config.max_seq_len):
        print(line, file=sys.stderr)

    def collate(batch_rows):
        return collate_batch(batch_rows, pad_token_id=loaded.tokenizer.pad_token_id, packing=True)

    def perplexity() -> dict[str, float]:  # on the model's device
        return score(loaded.model, rows, collate=collate, micro_batch_size=args.batch_size)

    if adapter is not None:
        loaded.use(None)
    base = perplexity()
    tuned = None
    if adapter is not None:
        loaded.use(adapter)
        tuned = perplexity()
    if args.json:  # for scripts: the figures alone, warnings stay on stderr
        from finetune import strict_json  # a perplexity past float range is null, not JSON's missing Infinity

        print(strict_json.dumps({"base": base, "adapter": tuned}))
        return 0
    print(f"base: perplexity {base['eval_ppl']:.4f} (loss {base['eval_loss']:.4f} over {base['eval_tokens']:,} tokens)")
    if tuned is not None:
        from finetune.report.runs import perplexity_change

        change = perplexity_change(base["eval_ppl"], tuned["eval_ppl"])
        print(f"base + adapter: perplexity {tuned['eval_ppl']:.4f} (loss {tuned['eval_loss']:.4f}; {change})")
    return 0


_EVAL_FLAGS = {"data.train": "--data", "data.format": "--format", "data.max_seq_len": "--max-seq-len"}
"""The data settings `eval` takes as options of its own."""
_NOT_FOR_EVAL = ("data.validation", "data.validation_split")
"""Settings of a training run's held-out data: eval scores `train` (its --data) whole, so `validation_split` held a
share of the file out of the figure without a word, and `validation` was read for nothing."""


def _eval_data_config(args: argparse.Namespace):
    """The data section `eval` reads with: --data, --format and --max-seq-len, then any `data.KEY=VALUE`, checked
    as a recipe's data section is (so the data errors' "set data.X" hints can be followed here too)."""
    from finetune.recipe import apply_overrides, recipe_from_dict

    outside = [text for text in args.overrides if not text.startswith("data.")]
    if outside:
        raise FinetuneError(f"{outside[0]!r}: finetune eval takes data.KEY=VALUE settings only")
    for text in args.overrides:  # else one of the two would be dropped without a word
        key = text.split("=", 1)[0]
        flag = _EVAL_FLAGS.get(key)
        if flag:
            raise FinetuneError(f"{text!r}: finetune eval sets that with {flag}; give {flag} instead")
        if key in _NOT_FOR_EVAL:
            raise FinetuneError(
                f"{text!r}: finetune eval scores every record of --data, so it has no held-out part to split off or "
                f"read; leave {key} out, and give the file to score as --data"
            )
    data = {"train": [args.data], "format": args.format, "max_seq_len": args.max_seq_len, "packing": True}
    settings = apply_overrides(
        {"model": {"base": "embedded:tiny-llama"}, "output": {"name": "eval"}, "data": data}, args.overrides
    )
    return recipe_from_dict(settings, "finetune eval").data


def run_generate(args: argparse.Namespace) -> int:
    try:  # bytes that are not UTF-8 reach argv as lone surrogates, which tokenizers refuse with a TypeError
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise FinetuneError("the prompt is not valid UTF-8 text; check the terminal's or the file's encoding") from None
    if not args.chat and args.temperature == 0:  # greedy on plain text: first without transformers' model code
        from finetune.generation.light_model import light_generate

        text = light_generate(
            base=args.base, adapter=args.adapter, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
            dtype=args.dtype or "float32", device=args.device, force=args.force,
        )  # fmt: skip
        if text is not None:
            print(text)
            return 0
    import torch

    from finetune.data.chat_turns import chat_turn_closer_ids
    from finetune.prompting import chat_prompt_ids, model_stop_token_ids, prompt_ids, require_tokens

    loaded, _ = _load(args)
    tokenizer = loaded.tokenizer
    closers: frozenset[int] = frozenset()  # a chat reply also ends at its template's end of turn
    if args.chat:
        ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": args.prompt}])
        closers = chat_turn_closer_ids(tokenizer)
    else:
        ids = require_tokens(prompt_ids(tokenizer, args.prompt))
    input_ids = torch.tensor([ids], device=loaded.device)
    torch.manual_seed(args.seed)
    sampling = dict(do_sample=True, temperature=args.temperature) if args.temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        output = loaded.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=args.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=sorted(model_stop_token_ids(loaded.model, tokenizer) | closers) or None,
            **sampling,
        )
    print(tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True))
    return 0

"""`finetune data preview RECIPE [key=value ...] [--limit N] [--json]`: see what training will train on.

Tokenizes the first N documents exactly as training does (template, label mask, and a record longer than
max_seq_len split into the pieces training uses, or truncated, per `data.overlength`) with only the
tokenizer loaded, no model: the check to make before spending GPU hours. The human view marks trained
tokens (green on a terminal without NO_COLOR, `[[...]]` otherwise); `--json` prints one object per document,
`{"record": 1, "piece": 1, "pieces": 1, "input_ids": [...], "labels": [...]}` with -100 where no loss
is taken. Preference pairs show the prompt once and chosen | rejected side by side (`--json`:
`{"record", "chosen": {"input_ids", "labels"}, "rejected": {...}}`); unpaired examples their label.

Example:
    finetune data preview llama-3.1-8b-instruct-chat data.train=chats.jsonl --limit 3
"""

from __future__ import annotations

import argparse
import json
import sys

from finetune.console import colour_wanted


def register(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser("data", help="inspect a recipe's data")
    actions = data.add_subparsers(dest="action", required=True, metavar="ACTION")
    preview = actions.add_parser("preview", help="tokenize the first records as training would, marking trained tokens")
    preview.add_argument("recipe", help="a recipe file or catalog name")
    preview.add_argument("overrides", nargs="*", default=[], metavar="key=value")
    preview.add_argument("--limit", type=int, default=3, help="documents to show (default 3)")
    preview.add_argument("--json", action="store_true", help="one JSON object per document: input_ids and labels")
    preview.set_defaults(handler=run_preview)


def run_preview(args: argparse.Namespace) -> int:
    from finetune.commands.preference_view import marked_text
    from finetune.data.pipeline import preview_documents
    from finetune.errors import FinetuneError
    from finetune.model import load_tokenizer_for
    from finetune.recipe import load_recipe

    if args.limit < 1:
        raise FinetuneError(f"--limit {args.limit}: show at least 1 document")
    recipe = load_recipe(args.recipe, args.overrides)
    tokenizer = load_tokenizer_for(recipe.model)
    if recipe.data.format in ("preference", "unpaired_preference"):
        return _preview_preference(recipe, tokenizer, args)
    if recipe.data.format == "prompt":
        return _preview_prompts(recipe, tokenizer, args)
    documents = preview_documents(recipe.data, tokenizer, args.limit)
    if args.json:
        for d in documents:
            print(json.dumps({"record": d.record, "piece": d.piece, "pieces": d.pieces, "input_ids": d.input_ids,
                              "labels": d.labels, "dropped": d.dropped}))  # fmt: skip
        return 0
    colour = colour_wanted(sys.stdout)
    for number, document in enumerate(documents, start=1):
        if document.dropped:
            print(f"--- document {number}: record {document.record} is dropped by training: nothing to train on "
                  "(empty text or response, no assistant turn, or a prompt filling all of max_seq_len)")  # fmt: skip
            continue
        trained = sum(label != -100 for label in document.labels)
        piece = (
            f", piece {document.piece} of {document.pieces} of record {document.record}" if document.pieces > 1 else ""
        )
        print(f"--- document {number}: {len(document.input_ids)} tokens, {trained} trained{piece} "
              f"({'green' if colour else '[[marked]]'})")  # fmt: skip
        print(marked_text(tokenizer, document.input_ids, document.labels, colour))
    return 0


def _preview_prompts(recipe, tokenizer, args: argparse.Namespace) -> int:
    """Prompt records as grpo sees them: the tokens completions continue from, and the columns the reward
    functions receive."""
    from finetune.data.prompts import preview_prompts

    for record, row in preview_prompts(recipe.data, tokenizer, args.limit):
        columns = {key: value for key, value in json.loads(row["columns"]).items() if key != "prompt"}
        if args.json:
            print(json.dumps({"record": record, "input_ids": row["input_ids"], "columns": columns}))
            continue
        print(f"--- record {record}: prompt of {len(row['input_ids'])} tokens; reward columns: "
              f"{', '.join(sorted(columns)) or 'none'}")  # fmt: skip
        print(tokenizer.decode(row["input_ids"]))
        for key, value in sorted(columns.items()):
            print(f"  {key}: {json.dumps(value, ensure_ascii=False)[:200]}")
    return 0


def _preview_preference(recipe, tokenizer, args: argparse.Namespace) -> int:
    import shutil

    from finetune.commands.preference_view import marked_text, side_by_side
    from finetune.data.labels import IGNORE_INDEX
    from finetune.data.preference import preview_records

    rows = preview_records(recipe.data, tokenizer, args.limit)
    paired = recipe.data.format == "preference"
    if args.json:
        for record, row in rows:
            if paired:
                sides = {side: {"input_ids": row[f"{side}_input_ids"], "labels": row[f"{side}_labels"]}
                         for side in ("chosen", "rejected")}  # fmt: skip
                print(json.dumps({"record": record, **sides}))
            else:
                print(json.dumps({"record": record, **row}))
        return 0
    colour = colour_wanted(sys.stdout)
    width = shutil.get_terminal_size((120, 24)).columns
    for record, row in rows:
        if paired:
            trained = [sum(label != IGNORE_INDEX for label in row[f"{side}_labels"]) for side in ("chosen", "rejected")]
            print(f"--- record {record}: chosen {trained[0]} trained tokens, rejected {trained[1]} "
                  f"({'green' if colour else '[[marked]]'})")  # fmt: skip
            chosen = (row["chosen_input_ids"], row["chosen_labels"])
            print(side_by_side(tokenizer, chosen, (row["rejected_input_ids"], row["rejected_labels"]), width, colour))
        else:
            label = "desirable" if row["desirable"] else "undesirable"
            print(
                f"--- record {record}: {label}, {sum(label != IGNORE_INDEX for label in row['labels'])} trained tokens"
            )
            print(marked_text(tokenizer, row["input_ids"], row["labels"], colour))
    return 0

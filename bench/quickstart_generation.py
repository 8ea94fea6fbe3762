"""Does a quickstart adapter follow its input? Greedy generation on held-out bulletins, scored field by field.

Not a test (the quickstart test checks the figures on 5 bulletins): this prints, for `--num` held-out
bulletins of `data/quickstart/valid.jsonl`, how often the generated bulletin has the input's town, date,
sky phrase, wind and high/low figures (`finetune.embedded.quickstart_data.bulletin_fields` on the
generated text against the reference), with a few outputs to read. Generation is the project's own
path: `finetune.load_model` on the adapter (its manifest names the base), the prompt encoded as
`finetune generate` encodes it, greedy decoding.

Example:
    finetune train recipes/quickstart.yaml && python bench/quickstart_generation.py --adapter adapters/quickstart
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from finetune.api import load_model
from finetune.embedded.quickstart_data import BULLETIN_FIELDS, bulletin_fields
from finetune.prompting import prompt_ids
from finetune.recipe import DataConfig

REPO = Path(__file__).resolve().parents[1]


def bulletin_prompt(record: dict[str, str]) -> str:
    """The prompt the quickstart trains on: the instruction format's default template with input."""
    return DataConfig.model_fields["prompt_with_input_template"].default.format(
        prompt=record["instruction"], input=record["input"]
    )


def generate_bulletins(adapter: Path, records: list[dict[str, str]], max_new_tokens: int = 160) -> list[str]:
    """Greedy continuations of each record's prompt by base + adapter, as `finetune generate` decodes them."""
    loaded = load_model(adapter)
    tokenizer = loaded.tokenizer
    outputs = []
    with torch.no_grad():
        for record in records:
            input_ids = torch.tensor([prompt_ids(tokenizer, bulletin_prompt(record))])
            output = loaded.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            outputs.append(tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True))
    return outputs


def field_matches(records: list[dict[str, str]], outputs: list[str]) -> dict[str, int]:
    """How many outputs have each field as the reference bulletin has it."""
    matches = dict.fromkeys(BULLETIN_FIELDS, 0)
    for record, output in zip(records, outputs):
        expected, got = bulletin_fields(record["output"]), bulletin_fields(output)
        for name in BULLETIN_FIELDS:
            matches[name] += got[name] is not None and got[name] == expected[name]
    return matches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", type=Path, default=REPO / "adapters" / "quickstart")
    parser.add_argument("--data", type=Path, default=REPO / "data" / "quickstart" / "valid.jsonl")
    parser.add_argument("--num", type=int, default=20, help="held-out bulletins to generate (the first N)")
    parser.add_argument("--show", type=int, default=3, help="outputs to print")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    records = [json.loads(line) for line in args.data.read_text().splitlines()[: args.num]]
    outputs = generate_bulletins(args.adapter, records)
    for record, output in list(zip(records, outputs))[: args.show]:
        print(f"--- input:\n{record['input']}\n--- generated:\n{output}\n")
    matches = field_matches(records, outputs)
    for name, count in matches.items():
        print(f"{name:8s} {count}/{len(records)}")
    if args.json:
        args.json.write_text(json.dumps({"num": len(records), "matches": matches}, indent=2) + "\n")


if __name__ == "__main__":
    main()

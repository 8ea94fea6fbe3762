"""Regenerate this folder's prompts from the quickstart's bulletins: `python data/quickstart-grpo/make_prompts.py`.

Each record is `{"prompt": <the quickstart's instruction prompt>, "reference": <its bulletin>}`: the prompt
is the instruction format's default template, as the quickstart adapter was trained on it, and the
reference bulletin is the column `reward.py` scores a completion against. The first 300 training and the
first 40 held-out reports are taken, in order, so the files regenerate byte for byte.
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "quickstart"
TEMPLATE = "### Instruction:\n{prompt}\n\n### Input:\n{input}\n\n### Response:\n"


def convert(source: Path, target: Path, count: int) -> None:
    lines = source.read_text(encoding="utf-8").splitlines()[:count]
    with target.open("w", encoding="utf-8") as out:
        for line in lines:
            record = json.loads(line)
            prompt = TEMPLATE.format(prompt=record["instruction"], input=record["input"])
            out.write(json.dumps({"prompt": prompt, "reference": record["output"]}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    convert(SOURCE / "train.jsonl", HERE / "train.jsonl", 300)
    convert(SOURCE / "valid.jsonl", HERE / "valid.jsonl", 40)

"""The DPO quickstart's preference pairs, made from the quickstart's bulletins (`data/quickstart/`).

For each bulletin record the pair's prompt is exactly the prompt the SFT quickstart trains on (the
instruction format's template with the forecast as input), the chosen completion is its bulletin, and the
rejected one is a bulletin in the same house style for a forecast that differs from the input in one or
two of the values a bulletin repeats (the high/low figures, the wind, the sky, the town or the date):
fluent, well-formed and wrong. A model that prefers the chosen one must read the input, which is what
the SFT adapter gets wrong most often (the figures and the wind, bench/README.md).

Pure Python and seeded: the same sources and seed always give the same bytes. Training pairs come from
`train.jsonl`, held-out pairs from `valid.jsonl`, so the held-out forecasts are new to both adapters.

Example:
    python -m finetune.data.quickstart_pairs --source data/quickstart --out data/quickstart-dpo
    # {"prompt": "### Instruction:\\nWrite the weather bulletin for ...", "chosen": "...", "rejected": "..."}
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from finetune.data.formats import render_prompt
from finetune.embedded.quickstart_data import _SKIES, _WIND_DIRECTIONS, MONTHS, bulletin, towns, write_jsonl
from finetune.recipe import DataConfig

_FORECAST = re.compile(
    r"Day: (?P<day>\d+) (?P<month>\w+)\nSky: (?P<sky>[^\n]+)\nWind: (?P<wind_kmh>\d+) km/h from the "
    r"(?P<wind_from>[\w-]+)\nHigh: (?P<high>(?:minus )?\d+)\nLow: (?P<low>(?:minus )?\d+)\nRain: (?P<rain>\d+)%"
)
_TOWN = re.compile(r"Write the weather bulletin for (\w+)\.")
PERTURBED_FIELDS = ("figures", "wind", "sky", "town", "day")
_WEIGHTS = (3, 3, 1, 1, 1)
"""How often each field is the one made wrong: the figures and the wind most, as the SFT adapter misses those."""


def _degrees(text: str) -> int:
    return -int(text.removeprefix("minus ")) if text.startswith("minus ") else int(text)


def forecast_of(record: dict[str, str]) -> dict:
    """The arguments of `quickstart_data.bulletin` that made `record` (read back from its instruction and input)."""
    match, town = _FORECAST.fullmatch(record["input"]), _TOWN.fullmatch(record["instruction"])
    assert match is not None and town is not None, f"not a quickstart record: {record}"
    values = match.groupdict()
    return {
        "town": town.group(1), "day": int(values["day"]), "month": values["month"], "sky": values["sky"],
        "wind_kmh": int(values["wind_kmh"]), "wind_from": values["wind_from"], "high": _degrees(values["high"]),
        "low": _degrees(values["low"]), "rain_percent": int(values["rain"]),
    }  # fmt: skip


def _perturb(forecast: dict, field: str, rng: random.Random) -> dict:
    """`forecast` with one field made different (never equal to what it was)."""
    changed = dict(forecast)
    if field == "figures":
        shift = rng.choice((-6, -5, -4, -3, -2, 2, 3, 4, 5, 6))
        changed["high"] += shift
        changed["low"] += shift if rng.random() < 0.5 else -shift
    elif field == "wind":
        if rng.random() < 0.5:
            changed["wind_kmh"] = rng.choice([s for s in range(2, 81) if s != forecast["wind_kmh"]])
        else:
            changed["wind_from"] = rng.choice([d for d in _WIND_DIRECTIONS if d != forecast["wind_from"]])
    elif field == "sky":
        changed["sky"] = rng.choice([s for s in sorted(_SKIES) if s != forecast["sky"]])
    elif field == "town":
        changed["town"] = rng.choice([t for t in towns() if t != forecast["town"]])
    else:
        changed["day"] = rng.choice([d for d in range(1, 29) if d != forecast["day"]])
        changed["month"] = rng.choice(MONTHS) if rng.random() < 0.3 else forecast["month"]
    return changed


def preference_pair(record: dict[str, str], rng: random.Random) -> dict[str, str]:
    """One `{prompt, chosen, rejected}` record from a quickstart bulletin record."""
    forecast = forecast_of(record)
    wrong = forecast
    fields: list[str] = []
    count = rng.choice((1, 1, 2))
    while len(fields) < count:
        field = rng.choices(PERTURBED_FIELDS, weights=_WEIGHTS)[0]
        if field not in fields:
            fields.append(field)
            wrong = _perturb(wrong, field, rng)
    template = DataConfig.model_fields["prompt_with_input_template"].default
    rejected = bulletin(**wrong)["output"]
    assert rejected != record["output"]
    return {"prompt": render_prompt(template, record["instruction"], record["input"]), "chosen": record["output"],
            "rejected": rejected}  # fmt: skip


def write_pairs(source_dir: Path, out_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """`train.jsonl` and `valid.jsonl` of pairs in `out_dir`, one per bulletin of the same file in `source_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for offset, split in enumerate(("train", "valid")):
        rng = random.Random(seed * 2 + offset)
        records = [
            json.loads(line) for line in (source_dir / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
        ]
        path = out_dir / f"{split}.jsonl"
        write_jsonl(path, [preference_pair(record, rng) for record in records])
        written.append(path)
    return written[0], written[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the DPO quickstart's preference pairs.")
    parser.add_argument("--source", type=Path, default=Path("data/quickstart"), help="the quickstart's data")
    parser.add_argument("--out", type=Path, required=True, help="directory for train.jsonl and valid.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write_pairs(args.source, args.out, args.seed):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()

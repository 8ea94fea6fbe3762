"""The quickstart's domain data: weather bulletins for the fictional towns of the Vael coast.

Each record asks for the bulletin of one town on one day of a fictional calendar, gives the forecast as
`Key: value` lines, and answers in a fixed house style with rules a fine-tune can learn: a sky phrase
for each kind of sky, wind strength words from the speed, a frost line when the low is below zero,
"percent" for "%", and advice from the chance of rain. No base model has seen this calendar, these
towns or this style, so the held-out perplexity shows clearly what an adapter learnt. Pure Python and
seeded: the same arguments always give the same bytes.

Every value the bulletin repeats from its input (town, day, sky word, wind speed and direction, high
and low) is written so that it is the same tokens on both sides, and follows the same key tokens
("Wind:", "High:", ...): a byte-level BPE splits " Velrith" and "Velrith" (line start, no space) into
different tokens, and "-4" and " 4" too, so a model could not copy such a value from its context, only
guess it (greedy bulletins then had the wrong town in 17 of 20 and the wrong figures in 17 of 20).

Example:
    python -m finetune.embedded.quickstart_data --out data/quickstart
    # {"instruction": "Write the weather bulletin for Harrowmere.", "input": "Day: 12 Frostmonth\\n...", ...}
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

_TOWN_STARTS = ("Har", "Vel", "Ost", "Brin", "Cal", "Dun", "Elm", "Fen", "Gral", "Kes", "Lor", "Mav", "Quill", "Tarn")
_TOWN_ENDS = ("mere", "wick", "holt", "ford", "stead", "moor", "haven", "by", "gate", "rith")
MONTHS = (
    "Frostmonth", "Thawmonth", "Seedmonth", "Rainmonth", "Bloommonth", "Sunmonth",
    "Hightide", "Harvestmonth", "Mistmonth", "Leaffall", "Stormmonth", "Darkmonth",
)  # fmt: skip
_SKIES = {
    "clear": "clear skies all day",
    "sunny spells": "sunny spells between passing clouds",
    "overcast": "overcast and grey",
    "fog": "fog at first, lifting by noon",
    "drizzle": "drizzle from low cloud",
    "thunder": "thunder later, under heavy cloud",
}
_WIND_DIRECTIONS = ("north", "north-east", "east", "south-east", "south", "south-west", "west", "north-west")

INSTRUCTION = "Write the weather bulletin for {town}."


def towns() -> list[str]:
    """Every town name, in a fixed order."""
    return [start + end for start in _TOWN_STARTS for end in _TOWN_ENDS]


def _degrees(value: int) -> str:
    return f"minus {-value}" if value < 0 else str(value)


def _wind_strength(speed_kmh: int) -> str:
    if speed_kmh < 10:
        return "a light breeze"
    if speed_kmh < 30:
        return "a steady breeze"
    if speed_kmh < 50:
        return "a strong wind"
    return "a gale"


def _rain_advice(rain_percent: int) -> str:
    if rain_percent >= 70:
        return "Take an umbrella."
    if rain_percent >= 30:
        return "Showers are possible."
    return "It should stay dry."


def bulletin(
    town: str, day: int, month: str, sky: str, wind_kmh: int, wind_from: str, high: int, low: int, rain_percent: int
) -> dict[str, str]:
    """One instruction record: the forecast as input, the bulletin in house style as output."""
    forecast = (
        f"Day: {day} {month}\nSky: {sky}\nWind: {wind_kmh} km/h from the {wind_from}\n"
        f"High: {_degrees(high)}\nLow: {_degrees(low)}\nRain: {rain_percent}%"
    )
    sentences = [
        f"Weather bulletin for {town}. Day: {day} {month}.",
        f"Sky: {_SKIES[sky]}.",
        f"Wind: {wind_kmh} km/h, {_wind_strength(wind_kmh)} from the {wind_from}.",
        f"High: {_degrees(high)} degrees. Low: {_degrees(low)} degrees.",
    ]
    if low < 0:
        sentences.append("Frost is likely overnight.")
    sentences.append(f"Rain: {rain_percent} percent. {_rain_advice(rain_percent)}")
    return {"instruction": INSTRUCTION.format(town=town), "input": forecast, "output": " ".join(sentences)}


_BULLETIN_PATTERNS = {
    "city": re.compile(r"bulletin for ([^,.\n]+)\. Day: "),
    "day": re.compile(r"Day: (\d+ \w+)\."),
    "sky": re.compile(r"Sky: ([^.\n]+)\. Wind: "),
    "wind": re.compile(r"Wind: (\d+ km/h, [\w -]+? from the [\w-]+)\."),
    "figures": re.compile(r"High: ((?:minus )?\d+) degrees\. Low: ((?:minus )?\d+) degrees\."),
}
BULLETIN_FIELDS = tuple(_BULLETIN_PATTERNS)
"""What a bulletin says that depends on its input: the town, the date, the sky phrase, the wind (strength word,
direction and speed) and the high/low figures."""


def bulletin_fields(text: str) -> dict[str, str | None]:
    """Each of `BULLETIN_FIELDS` as written in a bulletin (None where the text does not say it in house style).

    Comparing the fields of a generated bulletin with those of the reference one tells whether a model
    followed its input, field by field, whatever else it wrote.

    Example:
        bulletin_fields("Weather bulletin for Kesgate. Day: 3 Hightide. ...")["city"]   # "Kesgate"
    """
    fields = {}
    for name, pattern in _BULLETIN_PATTERNS.items():
        match = pattern.search(text)
        fields[name] = None if match is None else " / ".join(match.groups())
    return fields


def generate_records(num_records: int, seed: int = 0) -> list[dict[str, str]]:
    """`num_records` distinct bulletins (no two share town, day and month), drawn with `random.Random(seed)`.

    Temperatures follow the month (cold in Frostmonth, warm in Sunmonth), so the values are plausible
    and the month carries information a model can use.
    """
    all_towns = towns()
    assert num_records <= len(all_towns) * len(MONTHS) * 28, "more records than distinct town-days"
    rng = random.Random(seed)
    seen: set[tuple[str, int, str]] = set()
    records: list[dict[str, str]] = []
    while len(records) < num_records:
        town, day, month_index = rng.choice(all_towns), rng.randint(1, 28), rng.randrange(len(MONTHS))
        if (town, day, MONTHS[month_index]) in seen:
            continue
        seen.add((town, day, MONTHS[month_index]))
        season_warmth = [-6, -3, 2, 7, 12, 17, 20, 18, 13, 8, 2, -3][month_index]
        high = season_warmth + rng.randint(-3, 6)
        low = high - rng.randint(3, 10)
        sky = rng.choice(sorted(_SKIES))
        rain_percent = rng.randrange(0, 101, 5)
        # Steady winds are the most common; every strength word occurs. All five draws are always made.
        wind_kmh = rng.choice(
            (rng.randint(2, 9), rng.randint(10, 29), rng.randint(10, 29), rng.randint(30, 49), rng.randint(50, 80))
        )
        wind_from = rng.choice(_WIND_DIRECTIONS)
        records.append(bulletin(town, day, MONTHS[month_index], sky, wind_kmh, wind_from, high, low, rain_percent))
    return records


def write_jsonl(path: Path, records: list[dict[str, str]]) -> None:
    """One JSON object per line, `\\n` line ends, UTF-8: the same records always give the same bytes."""
    with path.open("w", encoding="utf-8", newline="\n") as file:
        for record in records:
            file.write(json.dumps(record, ensure_ascii=False) + "\n")


def write_dataset(out_dir: Path, num_train: int = 1200, num_valid: int = 120, seed: int = 0) -> tuple[Path, Path]:
    """Write `train.jsonl` and the held-out `valid.jsonl` (disjoint records) into `out_dir`."""
    records = generate_records(num_train + num_valid, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, valid_path = out_dir / "train.jsonl", out_dir / "valid.jsonl"
    write_jsonl(train_path, records[:num_train])
    write_jsonl(valid_path, records[num_train:])
    return train_path, valid_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the quickstart's weather-bulletin data set.")
    parser.add_argument("--out", type=Path, required=True, help="directory for train.jsonl and valid.jsonl")
    parser.add_argument("--train", type=int, default=1200, help="training records (default 1200)")
    parser.add_argument("--valid", type=int, default=120, help="held-out records (default 120)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write_dataset(args.out, args.train, args.valid, args.seed):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()

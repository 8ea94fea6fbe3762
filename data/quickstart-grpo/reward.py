"""The quickstart GRPO reward, written as for trl's GRPOTrainer: how faithfully a bulletin follows its report.

`bulletin_reward(prompts, completions, reference, **kwargs)` gives each completion −(share of the five
fields it gets wrong): the town, the date, the sky phrase, the wind and the high/low figures, each read in
house style from the completion and from the record's `reference` bulletin (the column of that name). 0 is
a faithful bulletin, −1 one with no field right. Standalone: it imports nothing of finetune, so trl can
run it unchanged (`bench/grpo_rewards.py --trl`).

Three more: `town_named` (0 when the bulletin names the reference's town, else −1: the GRPO quickstart's
reward), `similarity` (difflib's ratio to the reference bulletin, minus 1) and `values_named` (−(share of the
report's values the bulletin leaves out)), each measured in the README's and the recipe's runs against trl.
"""

import difflib
import re

FIELDS = {
    "city": re.compile(r"bulletin for ([^,.\n]+)\. Day: "),
    "day": re.compile(r"Day: (\d+ \w+)\."),
    "sky": re.compile(r"Sky: ([^.\n]+)\. Wind: "),
    "wind": re.compile(r"Wind: (\d+ km/h, [\w -]+? from the [\w-]+)\."),
    "figures": re.compile(r"High: ((?:minus )?\d+) degrees\. Low: ((?:minus )?\d+) degrees\."),
}


def fields(text):
    found = {}
    for name, pattern in FIELDS.items():
        match = pattern.search(text)
        found[name] = None if match is None else match.groups()
    return found


def bulletin_reward(prompts, completions, reference, **kwargs):
    rewards = []
    for completion, bulletin in zip(completions, reference):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        got, want = fields(text), fields(bulletin)
        wrong = sum(got[name] is None or got[name] != want[name] for name in FIELDS)
        rewards.append(-wrong / len(FIELDS))
    return rewards


def town_named(prompts, completions, reference, **kwargs):
    rewards = []
    for completion, bulletin in zip(completions, reference):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        town = FIELDS["city"].search(bulletin).group(1)
        rewards.append(0.0 if town in text else -1.0)
    return rewards


def similarity(prompts, completions, reference, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [difflib.SequenceMatcher(None, text, bulletin).ratio() - 1.0 for text, bulletin in zip(texts, reference)]


INPUT_LINE = re.compile(r"^(Day|Sky|Wind|High|Low): (.+)$", re.MULTILINE)
TOWN = re.compile(r"bulletin for ([^.\n]+)\.")


def values_named(prompts, completions, **kwargs):
    """−(share of the report's values the bulletin leaves out): the town, the day, the sky, the wind's speed and
    direction and the two temperatures, each looked for as written in the report (`minus 3` for -3)."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        values = [TOWN.search(prompt).group(1)]
        for name, value in INPUT_LINE.findall(prompt):
            if name == "Wind":
                speed, direction = value.split(" from ")
                values += [speed, "from " + direction]
            else:
                values.append(value)
        rewards.append(-sum(value not in text for value in values) / len(values))
    return rewards

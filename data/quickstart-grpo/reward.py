"""The quickstart GRPO reward, written as for trl's GRPOTrainer: how faithfully a bulletin follows its report.

`bulletin_reward(prompts, completions, reference, **kwargs)` gives each completion −(share of the five
fields it gets wrong): the town, the date, the sky phrase, the wind and the high/low figures, each read in
house style from the completion and from the record's `reference` bulletin (the column of that name). 0 is
a faithful bulletin, −1 one with no field right. Standalone: it imports nothing of finetune, so trl can
run it unchanged (`bench/grpo_rewards.py --trl`).
"""

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

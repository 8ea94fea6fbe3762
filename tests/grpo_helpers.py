"""GRPO runs for tests: reward functions and a small GRPO recipe over prompts, written into a directory.

Example:
    recipe = write_grpo_run(tmp_path, tiny_base_dir, "lengths.py:short")   # then train(recipe, ...)
"""

from __future__ import annotations

import json
from pathlib import Path


def write_rewards(tmp_path: Path) -> Path:
    path = tmp_path / "rewards.py"
    path.write_text(
        "def good(prompts, completions, answer, **kwargs):\n"
        "    return [float(c == a) for c, a in zip(completions, answer)]\n"
        "def raises(prompts, completions, **kwargs):\n    raise ValueError('no answer column')\n"
        "def short(prompts, completions, **kwargs):\n    return [1.0]\n"
        "def words(prompts, completions, **kwargs):\n    return ['high' for _ in completions]\n"
        "def maybe(prompts, completions, **kwargs):\n    return [None for _ in completions]\n"
        "def exits(prompts, completions, **kwargs):\n    import sys\n    sys.exit(3)\n"
        "def huge(prompts, completions, **kwargs):\n    return [1e300 for _ in completions]\n"
        "def lines(prompts, completions, **kwargs):\n    raise ValueError('shapes differ\\n  left: (2,)\\n  right: (3,)')\n"
        "def scalar(prompts, completions, **kwargs):\n    import torch\n    return torch.tensor(1.0)\n"
        "def array(prompts, completions, **kwargs):\n"
        "    import numpy\n    return numpy.arange(len(completions), dtype=numpy.float64) / 2\n"
    )
    return path


def write_grpo_run(tmp_path: Path, base_dir: Path, reward: str) -> Path:
    prompts = [{"prompt": f"def f{i}(a, b):", "answer": str(i)} for i in range(8)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    write_rewards(tmp_path)
    (tmp_path / "lengths.py").write_text(
        "def short(prompts, completions, answer, **kwargs):\n"
        "    assert len(answer) == len(completions)\n"
        "    return [-len(c) / 40 for c in completions]\n"
    )
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(
        f"""
model:
  base: {base_dir}
lora:
  r: 4
  alpha: 8
data:
  train: prompts.jsonl
  validation: prompts.jsonl
  format: prompt
  max_seq_len: 64
train:
  objective: grpo
  reward_functions: [{reward}]
  num_generations: 4
  max_completion_length: 12
  max_steps: 3
  micro_batch_size: 2
  lr: 0.01
  log_every_steps: 1
  eval_max_batches: 1
output:
  name: grpo-run
"""
    )
    return recipe

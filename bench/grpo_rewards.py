"""Held-out reward of adapters, measured with plain transformers + peft (nothing of finetune's generation).

For each adapter (or `base`), every prompt of `--data` is completed `--samples` times with
`model.generate(do_sample=True, temperature=...)` (seeded), and greedily once; the reward function
(`FILE:FUNCTION`, called as trl calls it, the record's other fields as keyword arguments) scores every
completion. Prints the mean sampled reward and the mean greedy reward per adapter: the figure GRPO
should raise.

Example:
    python bench/grpo_rewards.py adapters/quickstart adapters/quickstart-grpo \\
        --data data/quickstart-grpo/valid.jsonl --reward data/quickstart-grpo/reward.py:bulletin_reward
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer


def load_function(entry: str):
    path, _, name = entry.rpartition(":")
    spec = importlib.util.spec_from_file_location("bench_reward", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def base_of(adapter: Path) -> str:
    manifest = adapter / "manifest.json"
    if manifest.exists():
        recorded = json.loads(manifest.read_text())["base"]
        return recorded.get("path") or recorded["id"]
    return json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]


def completions_of(
    model, tokenizer, prompt: str, samples: int, max_new_tokens: int, temperature: float, top_k: int = 0
) -> list[str]:
    input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    settings = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    with torch.no_grad():
        if samples:
            output = model.generate(input_ids.repeat(samples, 1), attention_mask=torch.ones_like(input_ids).repeat(
                samples, 1), do_sample=True, temperature=temperature, top_k=top_k, top_p=1.0, **settings)  # fmt: skip
        else:
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, **settings)
    return tokenizer.batch_decode(output[:, input_ids.shape[1] :], skip_special_tokens=True)


def mean_rewards(model, tokenizer, records, reward, args) -> tuple[float, float]:
    sampled, greedy = [], []
    torch.manual_seed(args.seed)
    for record in records:
        columns = {key: value for key, value in record.items() if key != "prompt"}
        for samples, into in ((args.samples, sampled), (0, greedy)):
            texts = completions_of(
                model, tokenizer, record["prompt"], samples, args.max_new_tokens, args.temperature, args.top_k
            )
            repeated = {key: [value] * len(texts) for key, value in columns.items()}
            into.extend(reward(prompts=[record["prompt"]] * len(texts), completions=texts, **repeated))
    return statistics.fmean(sampled), statistics.fmean(greedy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapters", nargs="+", help="adapter directories")
    parser.add_argument("--data", required=True, help="prompt records (JSON lines with `prompt`)")
    parser.add_argument("--reward", required=True, help="FILE:FUNCTION")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    records = [json.loads(line) for line in Path(args.data).read_text().splitlines()][: args.limit]
    reward = load_function(args.reward)
    for adapter in map(Path, args.adapters):
        base = base_of(adapter)
        tokenizer = AutoTokenizer.from_pretrained(base)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
        sampled, greedy = mean_rewards(model, tokenizer, records, reward, args)
        print(f"{adapter}: sampled reward {sampled:.3f} ({args.samples} per prompt, T={args.temperature}, "
              f"top-k {args.top_k}), "
              f"greedy {greedy:.3f}, {len(records)} prompts")  # fmt: skip


if __name__ == "__main__":
    main()

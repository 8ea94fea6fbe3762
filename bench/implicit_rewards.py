"""Held-out implicit rewards of a preference adapter, computed with nothing but transformers and peft.

For each `{prompt, chosen, rejected}` pair (string records): r(y) = log π(y|x) − log π_base(y|x), the
completion's tokens and EOS summed, π the base with the adapter, π_base the same model with it disabled;
prints how many pairs give the chosen completion the higher reward. The check of the preference issue,
independent of finetune's own metrics (which measure against the run's reference policy: for
`quickstart-dpo`, the quickstart adapter it started from, not the base).

Example:
    python bench/implicit_rewards.py --base finetune/embedded/base/tiny-llama \\
        --adapter adapters/quickstart-dpo --pairs data/quickstart-dpo/valid.jsonl
"""

from __future__ import annotations

import argparse
import json

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer


def completion_logp(model, tokenizer, prompt: str, completion: str) -> float:
    """Σ log π of the completion's tokens and EOS after the prompt (BOS first, as the tokenizer adds it)."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    ids = prompt_ids + tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    inputs = torch.tensor([ids])
    logps = torch.log_softmax(model(inputs).logits[0, :-1].float(), dim=-1)
    token_logps = logps.gather(1, inputs[0, 1:, None])[:, 0]
    return token_logps[len(prompt_ids) - 1 :].sum().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the base model directory")
    parser.add_argument("--adapter", required=True, help="the adapter directory")
    parser.add_argument("--pairs", required=True, help="a .jsonl of {prompt, chosen, rejected} strings")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, args.adapter).eval()
    wins = total = 0
    with torch.no_grad():
        for line in open(args.pairs, encoding="utf-8"):
            pair = json.loads(line)
            rewards = {}
            for side in ("chosen", "rejected"):
                policy = completion_logp(model, tokenizer, pair["prompt"], pair[side])
                with model.disable_adapter():
                    rewards[side] = policy - completion_logp(model, tokenizer, pair["prompt"], pair[side])
            wins += rewards["chosen"] > rewards["rejected"]
            total += 1
    print(f"chosen reward higher in {wins} of {total} pairs ({wins / total:.1%})")


if __name__ == "__main__":
    main()

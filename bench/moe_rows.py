"""Decode-step time of a mixture of experts with its adapters per row (`finetune serve`'s default) against merged.

Per-row MoE adapters (`finetune.adapters.expert_rows`) compute, in every forward, each expert tensor once per
adapter present in the batch, as merging would write it. This measures what that costs on a locally built
Qwen3-MoE (the 89.5M-parameter shape of tests/test_plan.py: 8 layers of 16 experts, 4 routed per token) with
two random rank-8 adapters on its linear layers and experts: the median time of one decode step (4 rows,
KV cache of 64 tokens) with base rows only, with one adapter merged, and per row with one and two adapters.

    python bench/moe_rows.py --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import finetune
from finetune.model import wrap_with_lora
from finetune.recipe import LoraConfig

SHAPE: dict[str, Any] = dict(
    vocab_size=32_000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_experts=16,
    num_experts_per_tok=4, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
    max_position_embeddings=1024, tie_word_embeddings=False,
)  # fmt: skip


def build(root: Path) -> tuple[Path, dict[str, Path]]:
    """The base and two seeded adapters (every linear layer and expert tensor, rank 8), saved under `root`."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3MoeConfig(**SHAPE)).save_pretrained(root / "base")
    adapters = {}
    for name, seed in (("one", 1), ("two", 2)):
        model = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
        peft_model = wrap_with_lora(model, LoraConfig(r=8, alpha=16, dropout=0.0))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for key, parameter in peft_model.named_parameters():
                if "lora_" in key:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
        peft_model.save_pretrained(root / name)
        adapters[name] = root / name
    return root / "base", adapters


def decode_step_seconds(forward, repeats: int) -> float:
    """Median seconds of one decode step of 4 rows after a 64-token prefill."""
    prompt = torch.randint(0, 500, (4, 64), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            prefilled = forward(prompt, None)
            token = prefilled.logits[:, -1].argmax(-1, keepdim=True)
            started = time.perf_counter()
            forward(token, prefilled.past_key_values)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base, adapters = build(Path(tmp))
        m = finetune.load_model(str(base), {n: str(p) for n, p in adapters.items()}, dtype="float32", device="cpu")

        def plain(ids, cache):
            return m.model(input_ids=ids, past_key_values=cache, use_cache=True)

        figures = {"base rows only": decode_step_seconds(plain, args.repeats)}
        m.merge("one")
        figures["one adapter merged"] = decode_step_seconds(plain, args.repeats)
        m.subtract("one")
        m.attach("one")
        m.attach("two")
        model = m.use_per_row()
        for label, rows in (
            ("per row: one adapter", ["one"] * 4),
            ("per row: one, two, base", ["one", "two", "__base__", "one"]),
        ):
            figures[label] = decode_step_seconds(
                lambda ids, cache, rows=rows: model(
                    input_ids=ids, past_key_values=cache, use_cache=True, adapter_names=rows
                ),
                args.repeats,
            )
    print(f"torch threads {torch.get_num_threads()}; decode step of 4 rows, median of {args.repeats}:")
    for label, seconds in figures.items():
        print(f"  {label:<26} {seconds * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()

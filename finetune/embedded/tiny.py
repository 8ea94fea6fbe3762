"""Tiny Llama-family models built from a config, deterministically, with no download.

These are the bases the embedded default and the test-suite use: small enough to train on two CPU
cores in seconds, but the real `LlamaForCausalLM` architecture, so every code path (peft targeting,
attention implementations, packing, merging) is the one a full-size model takes.

Example:
    model = build_tiny_llama(tokenizer, seed=0, hidden_size=64, num_hidden_layers=2)
    model.save_pretrained("tiny/"); tokenizer.save_pretrained("tiny/")
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

# The embedded default's shape: about 1.0M parameters with its 2048-token vocabulary. Every quantizable
# linear layer has out_features divisible by 32, which bitsandbytes' CPU 4-bit forward requires.
TINY_LLAMA_SHAPE = dict(
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def tiny_llama_config(tokenizer: PreTrainedTokenizerBase, **shape: int | bool | float) -> LlamaConfig:
    """A `LlamaConfig` sized for CPU training, with token ids taken from `tokenizer`.

    Args:
        tokenizer: supplies vocab size and the BOS/EOS/PAD ids.
        **shape: overrides of `TINY_LLAMA_SHAPE` or any other `LlamaConfig` field.
    """
    fields: dict[str, Any] = {**TINY_LLAMA_SHAPE, **shape}  # checked by LlamaConfig
    return LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-5,
        **{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **fields},
    )


def build_tiny_llama(
    tokenizer: PreTrainedTokenizerBase, seed: int = 0, **shape: int | bool | float
) -> LlamaForCausalLM:
    """A randomly initialised tiny Llama; the same `seed` and shape give the same weights."""
    config = tiny_llama_config(tokenizer, **shape)
    with torch.random.fork_rng(devices=[]):  # seed locally; leave the caller's RNG untouched
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()

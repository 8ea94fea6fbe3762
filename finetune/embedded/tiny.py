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

from finetune.embedded.settings import TINY_LLAMA_SHAPE


# The embedded default's shape: about 1.1M parameters with its 2048-token vocabulary. Every quantizable
# linear layer has out_features divisible by 32, which bitsandbytes' CPU 4-bit forward requires.
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


def wire_previous_token_head(model: LlamaForCausalLM, scale: float = 1.0, seed: int = 7) -> None:
    """Set the first layer's first attention head to attend to the previous position and pass that token on.

    Copying from the context (induction) takes two heads that must be learnt together: one that writes
    "the token before me" into each position, and one that looks for the position whose previous token
    is the current one and copies what followed. From random weights, a small model on a CPU budget
    stayed on the plateau before that pair forms (copy score 0.001 after 2,000 steps); with the first
    head given, the second formed within 250 steps. Pretraining then adapts both like any other weight.

    How: every token embedding gets a constant first coordinate (1.0), so after RMSNorm the head's query
    and key see a constant; with the key equal to the query turned by one position's rotary angle in
    each frequency pair, q·k peaks at a distance of exactly one position. The value and output
    projections carry the other coordinates (a fixed random projection, `seed`) into the residual stream.
    """
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert config.num_key_value_heads == config.num_attention_heads, "head 0 must have a key/value head of its own"
    rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    frequencies = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))  # (head_dim / 2,)
    half = head_dim // 2
    generator = torch.Generator().manual_seed(seed)
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0  # tied: the head's logits shift all alike (softmax-invariant)
        query, key = attention.q_proj.weight, attention.k_proj.weight  # (heads * head_dim, hidden)
        query[:head_dim], key[:head_dim] = 0.0, 0.0
        query[:half, 0] = scale
        key[:half, 0], key[half:head_dim, 0] = scale * torch.cos(frequencies), scale * torch.sin(frequencies)
        value, output = attention.v_proj.weight, attention.o_proj.weight
        value[:head_dim] = 0.0
        value[:head_dim, 1:] = (
            torch.randn(head_dim, config.hidden_size - 1, generator=generator) / (config.hidden_size - 1) ** 0.5
        )
        output[:, :head_dim] = 0.0
        output[1:, :head_dim] = torch.randn(config.hidden_size - 1, head_dim, generator=generator) * 0.08

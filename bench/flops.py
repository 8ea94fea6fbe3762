"""Model FLOPs of a LoRA training step on a dense Llama-style decoder, from its config and document lengths.

Utilisation (MFU) is model FLOPs per second over the machine's matmul peak. Model FLOPs count the work
the model needs for the real tokens, not what a kernel happens to compute: padding is excluded, and a
packed row's documents attend only within themselves, so attention is counted per document.

Only matrix multiplications are counted (2 FLOPs per multiply-add); norms, RoPE, softmax, SiLU and the
loss are elementwise and left out, as in PaLM's definition of MFU. With a frozen base and LoRA on
projections of every decoder layer, per document of n tokens (d_attn = heads x head_dim, L layers):

    forward           2·N_matmul·n + 2·N_lora·n + 4·L·d_attn·n²
    backward          2·N_matmul·n + 4·N_lora·n + 8·L·d_attn·n²     (minus the first layer's terms below)

N_matmul is the base's weights that multiply activations (every projection of every layer, plus
`lm_head`; the embedding is a lookup), N_lora = Σ r·(in + out) over the targeted projections. The base's
backward computes the gradient of its *input* only (2·N per token), never of its frozen weights, so
the total is 4·N_matmul + 6·N_lora per token, not the 6·N of full fine-tuning (which also computes
2·N of weight gradients). LoRA's backward: the gradients of B (2·r·out), of A's output (2·r·out), of A
(2·r·in) and of its input (2·r·in). Attention counts the full n x n score and value products, forward
(2) and backward (4), as PaLM does (a causal kernel may skip half of them).

The first layer gets less: the embedding is frozen, so nothing upstream of it needs a gradient, and
the input gradients of its q, k and v projections (base and LoRA) are skipped, as autograd skips them.
`step_flops` follows that through the layer (which outputs need a gradient at all), so a LoRA on only
some projections is counted exactly too. The head (`lm_head`) is counted at the positions whose logits
the loss needs, `head_positions` (every token by default; only the response with a masked prompt). Activation checkpointing recomputes the forward; that is
hardware work, not model FLOPs, and is not counted.

Example:
    shape = DecoderShape.from_config(model.config)
    flops = step_flops(shape, document_lengths=[120, 37, 480], lora_rank=16, lora_targets=ALL_LINEAR)
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

# The projections of one decoder layer, in the order data flows through them.
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DecoderShape:
    """The sizes that set a dense Llama-style decoder's matmul FLOPs (no biases counted, no MoE)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: Any) -> DecoderShape:
        """From a transformers config (Llama, Mistral, Qwen2 and the like share these names)."""
        num_heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=config.num_key_value_heads or num_heads,
            # transformers' own rule: an explicit head_dim, else hidden / heads.
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
        )

    @property
    def attention_width(self) -> int:
        """heads x head_dim: the width of Q, and of K and V once repeated for grouped-query attention."""
        return self.num_heads * self.head_dim

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each projection of one decoder layer."""
        d, d_attn, d_kv = self.hidden_size, self.attention_width, self.num_kv_heads * self.head_dim
        f = self.intermediate_size
        return {
            "q_proj": (d, d_attn),
            "k_proj": (d, d_kv),
            "v_proj": (d, d_kv),
            "o_proj": (d_attn, d),
            "gate_proj": (d, f),
            "up_proj": (d, f),
            "down_proj": (f, d),
        }

    def matmul_parameters(self) -> int:
        """N_matmul: weights that multiply activations, lm_head included, the embedding lookup not."""
        per_layer = sum(fan_in * fan_out for fan_in, fan_out in self.projections().values())
        return self.num_layers * per_layer + self.hidden_size * self.vocab_size


@dataclass(frozen=True)
class _Costs:
    """FLOPs of one document of the decoder layers: `per_token` x n + `per_token_pair` x n² (the head apart)."""

    per_token: int
    per_token_pair: int
    head_needs_input_grad: bool


def _step_costs(shape: DecoderShape, lora_rank: int, lora_targets: Collection[str]) -> _Costs:
    """Walk the layers as autograd does, tracking whether the residual stream needs a gradient yet."""
    unknown = set(lora_targets) - set(ALL_LINEAR)
    assert not unknown, f"unknown projections {sorted(unknown)}; expected names from {ALL_LINEAR}"
    projections = shape.projections()
    per_token = 0
    pair = 2 * shape.attention_width  # one n x n x d_attn product, per token pair

    def linear(name: str, input_needs_grad: bool) -> bool:
        """Add one projection's FLOPs per token; return whether its output needs a gradient."""
        nonlocal per_token
        fan_in, fan_out = projections[name]
        per_token += 2 * fan_in * fan_out  # forward
        if input_needs_grad:
            per_token += 2 * fan_in * fan_out  # gradient of the input (the frozen weight gets none)
        if name in lora_targets:
            per_token += 2 * lora_rank * (fan_in + fan_out)  # forward: x·A, then ·B
            per_token += 2 * lora_rank * fan_out * 2 + 2 * lora_rank * fan_in  # grads of B, of A's output, of A
            if input_needs_grad:
                per_token += 2 * lora_rank * fan_in  # gradient of the input through A
        return input_needs_grad or name in lora_targets

    stream_needs_grad = False  # the embedding's output: frozen, so no gradient
    per_token_pair = 0
    for _ in range(shape.num_layers):
        q, k, v = (linear(name, stream_needs_grad) for name in ("q_proj", "k_proj", "v_proj"))
        per_token_pair += 2 * pair  # forward: Q·Kᵀ and P·V
        # backward: dP = dO·Vᵀ and dQ, dK from it when Q or K needs a gradient; dV = Pᵀ·dO when V does
        per_token_pair += pair * ((q or k) + v + q + k)
        attention_needs_grad = q or k or v
        stream_needs_grad = linear("o_proj", attention_needs_grad) or stream_needs_grad
        gate = linear("gate_proj", stream_needs_grad)
        up = linear("up_proj", stream_needs_grad)
        stream_needs_grad = linear("down_proj", gate or up) or stream_needs_grad
    return _Costs(per_token=per_token, per_token_pair=per_token_pair, head_needs_input_grad=stream_needs_grad)


def step_flops(
    shape: DecoderShape,
    document_lengths: Iterable[int],
    lora_rank: int,
    lora_targets: Collection[str] = ALL_LINEAR,
    head_positions: int | None = None,
) -> int:
    """Model FLOPs of one forward + backward over these documents (each its own attention span).

    Args:
        shape: the decoder's sizes (`DecoderShape.from_config`).
        document_lengths: real tokens of each document the step computed, padding excluded; a packed
            row contributes each of its documents.
        lora_rank: r of the LoRA on every decoder layer.
        lora_targets: which projections carry LoRA (`ALL_LINEAR` is peft's "all-linear" on a Llama).
        head_positions: positions whose logits the loss needs (those that predict a label token); default
            every token. With a masked prompt the loss needs far fewer: logits elsewhere are not model
            work, however many an implementation computes.
    """
    lengths = list(document_lengths)
    costs = _step_costs(shape, lora_rank, frozenset(lora_targets))
    layers = sum(costs.per_token * n + costs.per_token_pair * n * n for n in lengths)
    lm_head = shape.hidden_size * shape.vocab_size
    head_per_position = 2 * lm_head + (2 * lm_head if costs.head_needs_input_grad else 0)
    return layers + head_per_position * (sum(lengths) if head_positions is None else head_positions)

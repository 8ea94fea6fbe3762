"""Peak memory of a LoRA run per device, in parts, from parameter counts and the recipe.

The peak of a training step comes at the start of the backward pass, when everything is live at once:
the frozen weights, the LoRA parameters with their gradients and optimizer states (from the second step
on), the activations saved for backward, and the largest single tensor family of the step, the logits.
Each part is a small formula below, with where it comes from; `estimate` adds them per process (rank).

Example:
    plan = estimate(recipe, model_shape(config, recipe.lora), device="cuda", nproc=1)
    plan.peak_bytes, [(part.name, part.num_bytes) for part in plan.parts]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from finetune.generation.lean_decoder import FAMILIES, MEMORY_SHARE
from finetune.plan.shape import ModelShape
from finetune.recipe import Recipe

MiB = 2**20
GiB = 2**30

CUDA_CONTEXT_BYTES = 500 * MiB
"""CUDA context and kernels resident on a GPU before any tensor (a few hundred MB, by GPU and CUDA version).
Not in `torch.cuda.max_memory_allocated`, which is what most published peaks report."""
CPU_RUNTIME_BYTES = 605 * MiB
"""Peak resident memory of `finetune train` itself on CPU (Python, torch, transformers, peft, accelerate,
datasets, the tokenizer and data pipeline), measured as the peak RSS of a 3-step run on a 0.1M-parameter
Llama (README, "Will it fit?"); the model's own parts come on top."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
NF4_BLOCK = 64
"""bitsandbytes 4-bit: one absmax per 64 weights, itself quantized to 8 bits per block of 256 with double_quant."""


@dataclass(frozen=True)
class Implementation:
    """Choices of the training code that change its memory, so that another tool's published peak can be
    compared with this model of it (tests/test_plan.py compares torchtune's)."""

    name: str
    lora_bytes: int
    """Bytes per trainable parameter (and per gradient): finetune trains LoRA in float32."""
    upcast_unquantized: frozenset[str]
    """Base dtypes whose weights bitsandbytes left unquantized (embeddings, output head, norms) go to float32
    on a quantized base (peft's `prepare_model_for_kbit_training`), the residual stream with them. finetune:
    float16 only (`finetune.model._upcasts_unquantized`)."""
    logits_bytes: float
    """Bytes per logit alive at the peak of the loss, for the logits it holds at once (all B·T of them, or a
    chunk of `chunk_logits`). finetune's loss (`finetune.chunked_loss`) computes the logits only at labelled
    positions (all of them for `text` data, the plan's bound), a chunk of about 2^25 at a time: 10 bytes per
    logit of the chunk as torch's MemTracker measured it (tests/test_chunked_loss.py): the chunk in the head's
    dtype, its float32 copy rewritten in place into the softmax gradient, and that gradient cast back for the matmul."""
    chunk_logits: int = 0
    """Logits computed at once (0: all B·T·V). A chunked loss also keeps the hidden states' gradient, (B·T, H)."""


FINETUNE = Implementation(
    "finetune", lora_bytes=4, upcast_unquantized=frozenset({"float16"}), logits_bytes=10.0, chunk_logits=1 << 25
)
WHOLE_LOGITS = Implementation(
    "finetune before chunking", lora_bytes=4, upcast_unquantized=frozenset({"float16", "bfloat16"}), logits_bytes=12.0
)
"""finetune's loss before `finetune.chunked_loss`: the (B·T, V) logits upcast to float32, the float32 log-softmax kept
for backward, and the backward holding the incoming gradient, the saved output and the outgoing one: 3 x 4 bytes."""
TORCHTUNE = Implementation(
    "torchtune (bf16 LoRA weights, chunked cross-entropy, compiled)",
    lora_bytes=2,
    upcast_unquantized=frozenset(),
    logits_bytes=3.0,  # bf16 logit chunks kept for backward (2) + one float32 chunk of 8 and its gradient (2 x 4/8)
)


@dataclass(frozen=True)
class Part:
    name: str
    num_bytes: int
    where: Literal["device", "host"] = "device"
    note: str = ""


@dataclass
class MemoryPlan:
    """The parts of one rank's peak; `peak_bytes` is what must fit on the device."""

    device: Literal["cpu", "cuda"]
    nproc: int
    strategy: str
    parts: list[Part] = field(default_factory=list)
    checkpointed_layers: int = 0
    """Decoder layers recomputed in the backward (`train.gradient_checkpointing`, `auto` resolved), of `num_layers`."""
    num_layers: int = 0
    moe: dict[str, int] = field(default_factory=dict)
    """Mixture of experts: parameter counts (total, active, experts, router, expert LoRA); empty for a dense model."""

    @property
    def peak_bytes(self) -> int:
        """Device memory at the peak; on CPU the host is the device, so offloaded parts count too."""
        return sum(p.num_bytes for p in self.parts if p.where == "device" or self.device == "cpu")

    @property
    def host_bytes(self) -> int:
        return sum(p.num_bytes for p in self.parts if p.where == "host")

    def as_json(self) -> dict:
        parts = {p.name: {"bytes": p.num_bytes, "where": p.where, "note": p.note} for p in self.parts}
        return {
            "peak_bytes": self.peak_bytes,
            "host_bytes": self.host_bytes,
            "device": self.device,
            "nproc": self.nproc,
            "strategy": self.strategy,
            "checkpointed_layers": self.checkpointed_layers,
            "num_layers": self.num_layers,
            "parts": parts,
            **({"moe": self.moe} if self.moe else {}),
        }


PAIRED_OBJECTIVES = ("dpo", "orpo", "simpo")


def sequences_per_record(recipe: Recipe) -> int:
    """Sequences one micro-batch record puts through the forward pass with gradients: 2 for a preference pair
    (chosen and rejected, packed side by side), 1 otherwise (KTO's KL sequences go through without gradient)."""
    return 2 if recipe.train.objective in PAIRED_OBJECTIVES else 1


def micro_batch_tokens(recipe: Recipe) -> int:
    """Tokens of one micro-batch at the length limit: records x sequences per record x `max_seq_len` (grpo:
    prompts x `num_generations` x (prompt + completion))."""
    train = recipe.train
    if train.objective == "grpo":
        assert train.num_generations is not None and train.max_completion_length is not None
        return train.micro_batch_size * train.num_generations * (recipe.data.max_seq_len + train.max_completion_length)
    return train.micro_batch_size * sequences_per_record(recipe) * recipe.data.max_seq_len


def generation_part(recipe: Recipe, shape: ModelShape) -> Part | None:
    """GRPO's KV cache while it samples: every completion of the step at once (prompts x grad_accum_steps x
    num_generations rows of prompt + completion tokens), keys and values of every layer in the model's dtype,
    at the full attention width (an upper bound with grouped-query attention). It is freed before the step's
    forward, so counting it beside the activations overstates the peak when they are the larger."""
    train = recipe.train
    if train.objective != "grpo":
        return None
    assert train.num_generations is not None and train.max_completion_length is not None
    rows = train.micro_batch_size * train.grad_accum_steps * train.num_generations
    tokens = rows * (recipe.data.max_seq_len + train.max_completion_length)
    size = 2 * shape.num_layers * shape.hidden_size * DTYPE_BYTES[recipe.model.dtype] * tokens
    return Part(
        "kv cache", size, "device", f"generation: {rows} rows x {tokens // rows} tokens, {shape.num_layers} layers"
    )


def sampling_weights_part(recipe: Recipe, shape: ModelShape, how: _Sharding, device_bytes: int | None) -> Part | None:
    """GRPO's merged weights while it samples (`finetune.generation.lean_decoder`): a copy of every decoder
    layer's linear weights and of the output head in the model's dtype, for the architectures the lean decode
    step takes on a whole base (not quantized, not sharded), unless they are over `MEMORY_SHARE` of the
    device's memory (with `device_bytes` unknown, they are counted). Freed after sampling, like the cache."""
    if recipe.train.objective != "grpo" or shape.model_type not in FAMILIES:
        return None
    if recipe.model.quantization != "none" or how.weights_share < 1:
        return None
    size = (shape.quantizable_params + shape.vocab_size * shape.hidden_size) * DTYPE_BYTES[recipe.model.dtype]
    if device_bytes is not None and size > MEMORY_SHARE * device_bytes:
        return None
    return Part("sampling weights", size, "device", "LoRA merged into a copy of the layers and head while sampling")


def reference_part(recipe: Recipe) -> Part | None:
    """What the reference policy of DPO/KTO costs: nothing on the device with the adapter disabled (the trained
    model's own base, run without gradient before the step's forward, so not at the peak), or 8 bytes per pair
    kept with the rows when precomputed. None for objectives without a reference."""
    if recipe.train.objective not in ("dpo", "kto"):
        return None
    if recipe.train.precompute_reference:
        return Part("reference", 0, "host", "precomputed: 8 bytes per pair with the data, no forward pass per step")
    return Part("reference", 0, "device", "the base with the adapter disabled: no second copy, no gradient")


def weight_bytes(recipe: Recipe, shape: ModelShape, impl: Implementation) -> int:
    """Frozen base weights: 16/32-bit as `model.dtype`, or bitsandbytes 4/8-bit for the decoder's linear layers."""
    model = recipe.model
    dtype_bytes = DTYPE_BYTES[model.dtype]
    if model.quantization == "none":
        return shape.base_params * dtype_bytes
    if model.quantization == "4bit":
        absmax = 1 / NF4_BLOCK + 4 / (NF4_BLOCK * 256) if model.bnb_4bit_use_double_quant else 4 / NF4_BLOCK
        per_weight = 0.5 + absmax
    else:  # 8-bit: int8 plus one float32 scale per output row
        per_weight = 1 + 4 / shape.hidden_size
    other_bytes = 4 if model.dtype in impl.upcast_unquantized else dtype_bytes
    # Expert tensors are not nn.Linear: bitsandbytes leaves them, and training keeps them in the model's dtype.
    others = (shape.other_params - shape.expert_params) * other_bytes + shape.expert_params * dtype_bytes
    return int(shape.quantizable_params * per_weight) + others


def optimizer_bytes_per_param(recipe: Recipe, impl: Implementation) -> float:
    """AdamW keeps two moments per parameter in its dtype; the 8-bit ones one byte each plus block scales."""
    if recipe.train.optimizer == "adamw":
        return 2 * impl.lora_bytes
    return 2 * (1 + 4 / 256)  # bitsandbytes blockwise (256) 8-bit state, one float32 absmax per block


def _compute_bytes(recipe: Recipe) -> int:
    """Bytes of the activations: 16-bit under bf16/fp16 autocast or on a 16-bit base, else 4."""
    if recipe.train.precision != "fp32" or recipe.model.dtype != "float32":
        return 2
    return 4


def layer_activation_bytes_per_token(
    recipe: Recipe, shape: ModelShape, tokens_per_row: int, device: Literal["cpu", "cuda"] = "cuda"
) -> float:
    """Bytes one decoder layer saves for backward per token, LoRA on a frozen base.

    The coefficients were counted on a Llama decoder layer with LoRA on every linear layer, traced with
    `torch.autograd.graph.saved_tensors_hooks` (distinct storages, weights excluded), at three pairs of hidden
    and intermediate sizes (d, i) = (1024, 2048), (2048, 2048), (2048, 8192):
    - float32: 33·d + 16·i bytes;
    - a 16-bit base under bf16/fp16 autocast: 25.7·d + 8.2·i (RMSNorm keeps its float32 input and output);
    - a 16-bit base without autocast: 37·d + 10·i (peft casts each LoRA input to the float32 LoRA weights).
    Under autocast training turns that cast off (`finetune.model._UnlessAutocast`): traced since, an eager layer
    without LoRA dropout keeps 19.7·d + 8.2·i (three (d, i), within 2%), and with dropout what it kept before,
    each layer's dropped copy taking the place of the cast one (counted 2·d higher than before: the trace's figure).
    Training's lean RMSNorm and gated MLP (`finetune.training.lean_activations`, eager layers only) keep less:
    traced the same way, 4·i less in float32 (the SiLU's output), 6·d + 2·i less in 16 bits (the norms' float32
    copies of their inputs, and the SiLU's output); a quantized MLP keeps its own forward, so there only the
    norms' share applies.
    LoRA dropout adds a dropped copy and a mask per targeted layer's input where torch's dropout runs (CUDA,
    uncompiled): 36·d + 4·i in float32, 24·d + 4·i in 16 bits; on the CPU `UniformDropout` adds 22·d + i in
    float32 and its masks only, 6·d + i, in 16 bits (both traced exactly at three (d, i)); compiled layers (inductor recomputes the mask from the random seed) added nothing on an
    H100 (a 1B Llama LoRA with dropout 0.05 measured 120.5 kB per token and layer, the traced 16-bit figure
    without dropout 120.1 kB). Eager attention also keeps the (heads, T, T) scores; sdpa's fused kernels and
    varlen attention keep only a log-sum-exp per row, but on the CPU SDPA keeps the document mask, made additive in
    the compute dtype, once per layer (T elements per token, traced); Gemma 2's soft-capped scores keep one more
    (heads, T, T) in eager attention. On a mixture of experts the MLP's share (the i terms)
    is that of its experts (`expert_activation_bytes_per_token`), averaged with any dense layers.
    Norms beyond Llama's two (`ModelShape.extra_norm_elements`, `extra_norm_rows`) keep their input in the
    compute dtype and a float32 rsqrt per row: traced on Qwen 3 and Gemma 3 layers to the byte, 16-bit (lean) and
    float32.
    """
    d, i = shape.hidden_size, shape.intermediate_size
    quantized = recipe.model.quantization != "none"
    compiled = recipe.train.compiles(device, quantized)
    per_token, mlp = _dense_bytes_per_token(recipe, d, i, device, compiled=compiled, quantized=quantized)
    if shape.moe_layers:
        dense_layers = shape.num_layers - shape.moe_layers
        experts = expert_activation_bytes_per_token(recipe, shape)
        mlp = (shape.moe_layers * experts + dense_layers * mlp) / shape.num_layers
    per_token += mlp + shape.extra_norm_elements * _compute_bytes(recipe) + 4 * shape.extra_norm_rows
    if recipe.model.attn_implementation == "eager":
        score_bytes = 4 + _compute_bytes(recipe) * (2 if shape.softcapped_attention else 1)
        per_token += shape.num_heads * tokens_per_row * score_bytes
    elif device == "cpu":  # the CPU's SDPA kernel keeps the document mask, made additive, in each layer
        per_token += tokens_per_row * _compute_bytes(recipe)
    return per_token + dora_bytes_per_token(recipe, shape)


def dora_bytes_per_token(recipe: Recipe, shape: ModelShape) -> int:
    """What peft's DoRA (`lora.use_dora`) keeps per token and decoder layer on top of LoRA.

    peft 0.21's `DoraLinearLayer.forward` returns `(m / ‖W + ΔW‖ - 1) · base + m / ‖W + ΔW‖ · lora · scaling`: each
    product keeps its tensor factor for the magnitude's gradient, the base layer's output and `lora_B`'s, both
    (tokens, out) in the compute dtype (the float32 factors are (1, out) per module). So 2 x out elements per
    token and DoRA layer; traced exact on a Llama layer (d 1024, i 2816, all-linear: 36,864 bytes per token
    more in bf16, 73,728 in float32; tests/test_plan_activations.py). The weight norm is detached and the
    LoRA product it is computed from leaves the graph: see `dora_transient_bytes`."""
    return 2 * shape.dora_outputs * _compute_bytes(recipe)


def dora_transient_bytes(recipe: Recipe, shape: ModelShape) -> int:
    """The largest weight-sized transient of one DoRA layer's forward, freed before the next layer runs.

    Each forward computes ΔW as `lora_B(lora_A(eye))` from an (in, in) identity in the LoRA weights' float32
    (4·in² bytes), which autocast copies into 16 bits for the matmul (2·in² more), giving an (in, out) product in
    the compute dtype; then `W + scaling · ΔW` for the norm, two more (in, out) while the identity's 16-bit copy
    is still held by ΔW's graph (and, on a quantized base, W dequantized). In float32 the identity itself is what
    the graph holds. The larger of the two
    moments, for the widest DoRA layer (the down projection's in is the MLP's width: 1.2 GiB on Llama 3.1 8B in
    bf16)."""
    compute = _compute_bytes(recipe)
    eye_copy = compute if compute != 4 else 0  # the 16-bit copy autocast makes of the float32 identity
    dequantized = 1 if recipe.model.quantization != "none" else 0  # W, dequantized for the norm
    largest = 0
    for n_in, n_out in shape.dora_linears:
        building = (4 + eye_copy) * n_in * n_in + compute * n_in * n_out
        norming = (eye_copy or 4) * n_in * n_in + (3 + dequantized) * compute * n_in * n_out
        largest = max(largest, building, norming)
    return largest


def _dense_bytes_per_token(
    recipe: Recipe, d: int, i: int, device: Literal["cpu", "cuda"], *, compiled: bool, quantized: bool
) -> tuple[float, float]:
    """(hidden-width share, MLP share) of a Llama-style dense layer's bytes per token: the coefficients of
    `layer_activation_bytes_per_token`'s docstring."""
    dropout = recipe.lora.dropout > 0 and not compiled
    lean_norms = 0 if compiled else 1
    lean_mlp = 0 if compiled or quantized else 1  # the lean gated MLP needs plain weights
    per_token: float
    mlp: float
    if _compute_bytes(recipe) == 4:
        dropped = ((36 * d, 4 * i) if device == "cuda" else (22 * d, i)) if dropout else (0, 0)
        per_token, mlp = 33 * d + dropped[0], (16 - 4 * lean_mlp) * i + dropped[1]
    else:
        autocast = recipe.train.precision != "fp32"
        per_token, mlp = (25.7 * d, 8.2 * i) if autocast else (37 * d, 10 * i)
        if autocast and not compiled:  # no float32 round trip of each LoRA input (`finetune.model._UnlessAutocast`)
            per_token -= 6 * d
        per_token, mlp = per_token - 6 * d * lean_norms, mlp - 2 * i * lean_mlp
        if dropout:
            extra = 8 * d if autocast else 0  # each LoRA layer's dropped copy, which the round trip made before
            per_token, mlp = (
                (per_token + 24 * d + extra, mlp + 4 * i) if device == "cuda" else (per_token + 6 * d + extra, mlp + i)
            )
    return per_token, mlp


def expert_activation_bytes_per_token(recipe: Recipe, shape: ModelShape) -> float:
    """Bytes a mixture-of-experts block saves for backward per token (the folded W + ΔW apart).

    Traced as the dense layer was (saved_tensors_hooks, weights and the folded expert tensors excluded) on
    Qwen3-MoE and gpt-oss blocks with LoRA on the experts, transformers' grouped_mm experts path, at several
    d, i, experts and k. Per token and each of its k experts: its gathered input and its down projection's
    output (8·d in float32), the gate/up output, the gated and the activation (16·i; 28·i for gpt-oss's
    clamped gate), and the routing indices (36); the router keeps its probabilities (4·E). In 16 bits:
    4.25·d, 8·i (14.5·i), 36 and 18·E. A dense shared expert counts as a dense MLP of its width.
    """
    d, i, k, experts = shape.hidden_size, shape.expert_intermediate_size, shape.experts_per_token, shape.num_experts
    per_pair: float
    if _compute_bytes(recipe) == 4:
        per_pair = 8 * d + (28 if shape.own_expert_gate else 16) * i + 36
        router, shared = 4 * experts, 16 * shape.shared_intermediate_size
    else:
        per_pair = 4.25 * d + (14.5 if shape.own_expert_gate else 8) * i + 36
        router, shared = 18 * experts, 10 * shape.shared_intermediate_size
    return k * per_pair + router + shared


def activation_bytes(
    recipe: Recipe, shape: ModelShape, impl: Implementation, device: Literal["cpu", "cuda"] = "cuda"
) -> tuple[int, str]:
    """Saved activations of the decoder layers at the peak, at `micro_batch_size` x `max_seq_len` tokens (twice
    that for preference pairs: both completions go through one forward).

    Without checkpointing every layer's activations are live when the loss's backward starts, on top of
    the logits. With gradient checkpointing each layer keeps only its input (the residual stream, in the
    embedding's dtype); one layer at a time is recomputed with all its activations, but only after the
    logits and their gradients are freed, so the recomputed layer adds only what it exceeds the logits by.
    """
    seq_len = recipe.data.max_seq_len
    tokens = micro_batch_tokens(recipe)
    one_layer = layer_activation_bytes_per_token(recipe, shape, seq_len, device) * tokens
    layers = shape.num_layers
    checkpointed = recipe.train.checkpointed_layers(layers)
    if not checkpointed:
        return int(one_layer * layers), f"{layers} layers x {tokens} tokens"
    quantized = recipe.model.quantization != "none"
    upcast = quantized and recipe.model.dtype in impl.upcast_unquantized
    residual_bytes = 4 if upcast else DTYPE_BYTES[recipe.model.dtype]
    kept = tokens * shape.hidden_size * residual_bytes * checkpointed
    # The first layers are the checkpointed ones: their backward comes last, once the others' activations are freed.
    whole = (layers - checkpointed) * one_layer
    excess = max(whole, one_layer - logits_bytes(recipe, shape, impl))
    inputs = f"{checkpointed} layer inputs" if checkpointed == layers else f"{checkpointed} of {layers} layers' inputs"
    kept_whole = f" + {layers - checkpointed} layers whole" if whole else ""
    note = f"checkpointed: {inputs}{kept_whole}; 1 layer recomputed later ({one_layer / GiB:.2f} GiB)"
    return int(kept + excess), note


def dora_transient_part(
    recipe: Recipe, shape: ModelShape, impl: Implementation, device: Literal["cpu", "cuda"]
) -> Part | None:
    """DoRA's weight-sized transient (`dora_transient_bytes`) where it rises above the step's peak as the other parts
    count it: in the forward, beside every uncheckpointed layer's activations but before the logits; and, with
    checkpointing, in the recomputed layer's forward beside the activations it rebuilds (the logits are freed by
    then). None without DoRA, 0 bytes where the logits or the recomputed layer's activations are the larger."""
    transient = dora_transient_bytes(recipe, shape)
    if not transient:
        return None
    one_layer = layer_activation_bytes_per_token(recipe, shape, recipe.data.max_seq_len, device) * micro_batch_tokens(
        recipe
    )
    checkpointed = recipe.train.checkpointed_layers(shape.num_layers)
    whole = (shape.num_layers - checkpointed) * one_layer
    logits = logits_bytes(recipe, shape, impl)
    planned = max(whole, one_layer - logits) + logits if checkpointed else whole + logits  # activations + logits
    forward = whole + transient  # the last layer's forward, its own activations about to be kept
    recomputed = one_layer + transient if checkpointed else 0
    over = int(max(0, forward - planned, recomputed - planned))
    return Part("dora", over, "device", f"DoRA's (in, in) identity and ΔW per layer: {transient / GiB:.2f} GiB at once"
                + ("" if over else ", under the peak"))  # fmt: skip


def folded_experts_part(recipe: Recipe, shape: ModelShape) -> Part:
    """W + ΔW of the targeted expert tensors, which peft's `ParamWrapper` computes in each forward and the
    experts' matmuls keep for backward: every layer's without checkpointing, one layer's with it."""
    per_element = DTYPE_BYTES[recipe.model.dtype]
    folded = shape.folded_expert_params * per_element
    layers = shape.moe_layers or shape.num_layers  # DeepSeek-style models have dense layers too
    checkpointed = recipe.train.checkpointed_layers(shape.num_layers)
    if checkpointed == shape.num_layers:
        return Part("folded experts", folded // layers, "device", "W + ΔW of 1 layer's experts, recomputed")
    kept = min(layers, shape.num_layers - checkpointed)  # the dense layers come first, as checkpointed ones do
    which = f"{kept} layers'" if kept > 1 else "1 layer's"
    return Part("folded experts", folded * kept // layers, "device", f"W + ΔW of {which} experts, kept for backward")


def logits_rows(recipe: Recipe, shape: ModelShape, impl: Implementation) -> int:
    """Positions whose logits are alive at once at the peak of the loss: the micro-batch's, or one chunk's."""
    tokens = micro_batch_tokens(recipe)
    if not impl.chunk_logits:
        return tokens
    return min(tokens, max(1, impl.chunk_logits // shape.vocab_size))


def logits_bytes(recipe: Recipe, shape: ModelShape, impl: Implementation) -> int:
    """The logits and their cross-entropy at the peak of the loss (see `Implementation.logits_bytes`); with a
    chunked loss, also the (B·T, H) gradient of the hidden states it computes in the forward, and its scaled copy
    in the backward."""
    logits = logits_rows(recipe, shape, impl) * shape.vocab_size * impl.logits_bytes
    hidden_gradient = (
        2 * micro_batch_tokens(recipe) * shape.hidden_size * _compute_bytes(recipe) if impl.chunk_logits else 0
    )
    return int(logits + hidden_gradient)


@dataclass(frozen=True)
class _Sharding:
    """How one rank holds the model state under a strategy: shares of each part, extras, and what is offloaded."""

    weights_share: float = 1.0
    state_share: float = 1.0
    """LoRA parameters, gradients and optimizer states."""
    gathered_layers: int = 0
    """Decoder layers gathered whole at a time (the one computing and the one prefetched)."""
    gathered_all: bool = False
    """All weights stay gathered from forward to backward (FSDP grad_op)."""
    grad_share: float | None = None
    """Gradients sharded differently from the rest (ZeRO-2 replicates parameters, shards gradients)."""
    offload: frozenset[str] = frozenset()


def sharding(recipe: Recipe, nproc: int) -> _Sharding:
    """Per-rank shares under `distributed` with `nproc` processes (one process: everything, no sharding)."""
    dist = recipe.distributed
    if nproc <= 1 or dist.strategy == "ddp":
        return _Sharding()
    share = 1 / nproc
    if dist.strategy == "fsdp":
        offload = frozenset({"weights", "lora", "gradients", "optimizer"}) if dist.fsdp.cpu_offload else frozenset()
        grad_op = dist.fsdp.sharding == "grad_op"
        return _Sharding(share, share, 0 if grad_op else 2, grad_op, None, offload)
    stage = dist.deepspeed.stage
    moved = {"optimizer"} if dist.deepspeed.offload_optimizer else set()
    if dist.deepspeed.offload_params:
        moved |= {"weights", "lora"}
    if stage == 2:
        return _Sharding(1.0, 1.0, 0, False, share, frozenset(moved))
    return _Sharding(share, share, 2, False, None, frozenset(moved))


def _state_parts(recipe: Recipe, shape: ModelShape, impl: Implementation, how: _Sharding) -> list[Part]:
    """Weights, LoRA parameters, gradients and optimizer states of one rank, each on device or host."""
    weights = weight_bytes(recipe, shape, impl)

    def where(name: str) -> Literal["device", "host"]:
        return "host" if name in how.offload else "device"

    lora_share = how.state_share
    grad_share = how.grad_share if how.grad_share is not None else how.state_share  # optimizer state goes with it
    optimizer = shape.lora_params * optimizer_bytes_per_param(recipe, impl) * grad_share
    method = {"none": recipe.model.dtype, "4bit": f"4-bit {recipe.model.bnb_4bit_quant_type}", "8bit": "8-bit"}
    parts = [
        Part("weights", int(weights * how.weights_share), where("weights"), f"{shape.base_params:,} frozen, "
             f"{method[recipe.model.quantization]}" + (f", 1/{round(1 / how.weights_share)} per rank" if how.weights_share < 1 else "")),
        Part("lora", int(shape.lora_params * impl.lora_bytes * lora_share), where("lora"),
             f"{shape.lora_params:,} trainable, {8 * impl.lora_bytes}-bit"),
        Part("gradients", int(shape.lora_params * impl.lora_bytes * grad_share), where("gradients"), "of the LoRA weights"),
        Part("optimizer", int(optimizer), where("optimizer"), recipe.train.optimizer),
    ]  # fmt: skip
    layer_bytes = weights / max(shape.base_params, 1) * shape.layer_params
    if how.gathered_all:
        parts.append(Part("gathered weights", int(weights), "device", "kept gathered forward to backward (grad_op)"))
    elif how.gathered_layers:
        parts.append(Part("gathered layers", int(layer_bytes * how.gathered_layers), "device",
                          f"{how.gathered_layers} decoder layers unsharded at a time"))  # fmt: skip
    return parts


def estimate(
    recipe: Recipe,
    shape: ModelShape,
    *,
    device: Literal["cpu", "cuda"],
    nproc: int = 1,
    impl: Implementation = FINETUNE,
    device_bytes: int | None = None,
) -> MemoryPlan:
    """The peak memory of one rank of `recipe`'s run on `nproc` processes of `device` (of `device_bytes` each,
    where known; `train.gradient_checkpointing: auto` is resolved against it: `MemoryPlan.checkpointed_layers`)."""

    def plan_of(candidate: Recipe) -> MemoryPlan:
        return _estimate(candidate, shape, device=device, nproc=nproc, impl=impl, device_bytes=device_bytes)

    recipe = recipe.for_device(device)
    if recipe.train.gradient_checkpointing == "auto":
        recipe = _fewest_checkpointed_layers(recipe, shape.num_layers, plan_of, device_bytes)
    return plan_of(recipe)


def describe_checkpointing(setting: bool | int | str, checkpointed: int, num_layers: int) -> str:
    """`gradient checkpointing on` / `off` / `on for 12 of 32 layers`, with `(auto)` where the device chose."""
    if checkpointed == num_layers:
        text = "on"
    elif checkpointed == 0:
        text = "off"
    else:
        text = f"on for {checkpointed} of {num_layers} layers"
    return f"gradient checkpointing {text}" + (" (auto)" if setting == "auto" else "")


AUTO_CHECKPOINTING_SHARE = 0.9
"""`gradient_checkpointing: auto` keeps the planned peak under this share of the memory it plans against
(`device_bytes`: `finetune plan --device-memory`, or what a run can have of its device): the plan came
within 1% of the measured peak on an H100 and an H200 (README, "On a GPU"), and the allocator's cache and
fragmentation need some room above what is allocated."""


def _fewest_checkpointed_layers(
    recipe: Recipe, num_layers: int, plan_of: Callable[[Recipe], MemoryPlan], device_bytes: int | None
) -> Recipe:
    """`recipe` with `gradient_checkpointing: auto` replaced by the fewest decoder layers to checkpoint for the
    plan's peak to fit `AUTO_CHECKPOINTING_SHARE` of `device_bytes` (every layer where none fits, or where
    `device_bytes` is unknown). Each count is planned as it would run: none checkpointed may compile the layers."""

    def checkpointing(layers: int) -> Recipe:
        return recipe.model_copy(update={"train": recipe.train.model_copy(update={"gradient_checkpointing": layers})})

    if device_bytes is not None:
        for layers in range(num_layers + 1):
            candidate = checkpointing(layers)
            if plan_of(candidate).peak_bytes <= AUTO_CHECKPOINTING_SHARE * device_bytes:
                return candidate
    return checkpointing(num_layers)


def _estimate(
    recipe: Recipe,
    shape: ModelShape,
    *,
    device: Literal["cpu", "cuda"],
    nproc: int,
    impl: Implementation,
    device_bytes: int | None,
) -> MemoryPlan:
    """`estimate` of a recipe whose `auto` settings are resolved."""
    how = sharding(recipe, nproc)
    strategy = recipe.distributed.strategy if nproc > 1 else "single process"
    plan = MemoryPlan(device=device, nproc=nproc, strategy=strategy, parts=_state_parts(recipe, shape, impl, how))
    plan.checkpointed_layers = recipe.train.checkpointed_layers(shape.num_layers)
    plan.num_layers = shape.num_layers
    if nproc > 1 and recipe.distributed.strategy == "ddp":  # DDP's flat gradient buckets, a copy of the gradients
        plan.parts.append(Part("ddp buckets", shape.lora_params * impl.lora_bytes, "device", "all-reduce buffers"))
    activations, note = activation_bytes(recipe, shape, impl, device)
    if shape.dora_outputs:
        dora_bytes = dora_bytes_per_token(recipe.for_device(device), shape)
        note += f", DoRA's {dora_bytes:,} bytes more per token and layer counted"
    plan.parts.append(Part("activations", activations, "device", note))
    if shape.folded_expert_params:
        plan.parts.append(folded_experts_part(recipe, shape))
    if shape.expert_params:
        plan.moe = {
            "total_params": shape.base_params, "active_params": shape.active_params,
            "active_params_without_input_embedding": shape.active_params - shape.input_embedding_params,
            "expert_params": shape.expert_params, "router_params": shape.router_params,
            "lora_params": shape.lora_params, "expert_lora_params": shape.expert_lora_params,
        }  # fmt: skip
    rows, tokens = logits_rows(recipe, shape, impl), micro_batch_tokens(recipe)
    chunks = f"chunks of {rows} of {tokens} tokens" if rows < tokens else f"{tokens} tokens"
    plan.parts.append(Part("logits", logits_bytes(recipe, shape, impl), "device",
                           f"{chunks} x {shape.vocab_size:,} vocabulary"))  # fmt: skip
    dora = dora_transient_part(recipe, shape, impl, device)
    if dora is not None:
        plan.parts.append(dora)
    sampling = sampling_weights_part(recipe, shape, how, device_bytes)
    for extra in (reference_part(recipe), generation_part(recipe, shape), sampling):
        if extra is not None:
            plan.parts.append(extra)
    runtime = CUDA_CONTEXT_BYTES if device == "cuda" else CPU_RUNTIME_BYTES
    plan.parts.append(Part("runtime", runtime, "device", "CUDA context" if device == "cuda" else "Python + libraries"))
    return plan

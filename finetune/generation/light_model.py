"""`finetune generate` without transformers' model code: a Llama-family model computed from its files by torch.

Why: on 2 CPU cores, importing transformers' model code (it pulls in torch's dynamo, DTensor and scipy) took
longer than reading the embedded base, applying an adapter and generating 40 tokens together: 4.4 s of wall
time for the command, most of it imports (AMD EPYC, 2026-11-27). A one-shot command pays that on every run.

`LightModel.load` reads config.json and the safetensors weights, and the adapter's A and B as
`finetune.adapters.lora` reads them, and computes the forward transformers' Llama, Mistral, Qwen2 and Qwen3
classes compute, op for op in float32: RMSNorm as theirs, each projection as peft's unmerged LoRA
(`base(x) + B(A(x)) * scaling`), rotary embeddings with transformers' inverse frequencies, SDPA attention
(causal over the prompt, then one token at a time over the cache). `light_generate` decodes greedily with
the tokenizer's own `tokenizer.json` (the `tokenizers` library, which transformers' fast tokenizers wrap); an
adapter that carries a tokenizer of its own other than the base's is left to the transformers path.

It declines (returns None, and the command takes the transformers path) for anything it does not
reproduce exactly: sampling and chat prompts (transformers' logits processors and chat-template rendering),
a dtype other than float32, a device other than the CPU, a quantized base or a merged checkpoint, what
`config_declined_because` names (families, sliding windows, activations), scaled rotary embeddings, weights
other than the family's own tensors, LoRA on embeddings or experts or with saved modules, generation settings
that change greedy decoding (a repetition penalty, ...), and tokenizers whose settings transformers applies
on top of `tokenizer.json`. Its logits equal transformers + peft's within float rounding (tests).

Example:
    text = light_generate(base=None, adapter="adapters/quickstart", prompt="...", max_new_tokens=40,
                          dtype="float32", device="auto", force=False)   # None: take the transformers path
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from finetune.adapters.fit import check_fingerprint, check_fits
from finetune.adapters.lora import Adapter, LoraWeights, read_adapter, recorded_quantization
from finetune.adapters.resolved_base import resolve_base
from finetune.adapters.tokenizer_files import carries_tokenizer
from finetune.fingerprint import weight_files
from finetune.generation.lean_decoder import Layer, Norm, _Rotation, config_declined_because
from finetune.prompting import require_tokens, stop_token_ids, with_bos

# generation_config.json keys that leave greedy decoding with an explicit EOS and max_new_tokens unchanged
GREEDY_NEUTRAL = frozenset({
    "_from_model_config", "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version", "use_cache",
    "output_attentions", "output_hidden_states", "do_sample", "temperature", "top_p", "top_k", "max_length",
})  # fmt: skip
# tokenizer classes that are `tokenizer.json` as it is, and settings that would make transformers alter it
PLAIN_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
TOKENIZER_OVERRIDES = ("add_bos_token", "add_eos_token", "add_prefix_space", "clean_up_tokenization_spaces")
# config.json fields a family's transformers config fills in with a default other than the one the light path
# takes when they are left out (Mistral's 8 key/value heads and 4,096-token window, Qwen3's head_dim of 128, ...)
FAMILY_DEFAULTED = {
    "mistral": ("num_key_value_heads", "sliding_window"),
    "qwen2": ("num_key_value_heads",),
    "qwen3": ("num_key_value_heads", "head_dim"),
}
ATTENTION = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj")


class Declined(Exception):
    """The light path does not reproduce this model or request; the message says why."""


@dataclass(frozen=True)
class LoraLinear:
    """A linear layer with its LoRA updates unmerged, computed as peft computes it: x·Wᵀ + b, then for each
    adapter + (x·Aᵀ)·Bᵀ · scale."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    loras: tuple[tuple[torch.Tensor, torch.Tensor, float], ...] = ()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        for A, B, scale in self.loras:
            result = result + F.linear(F.linear(x, A), B) * scale
        return result


@dataclass(frozen=True)
class SideBySide:
    """Several projections of the same input, their outputs concatenated (q, k and v; gate and up)."""

    parts: tuple[LoraLinear, ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class LightModel:
    """A Llama-family causal LM over plain tensors (see the module docstring)."""

    def __init__(self, config: Any, layers: list[Layer], embed: torch.Tensor, final_norm: Norm, head: LoraLinear):
        self.layers, self.embed, self.final_norm, self.head = layers, embed, final_norm, head
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = _head_dim(config)
        theta = _rope_theta(config)
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / self.head_dim
        self.inv_freq = 1.0 / (theta**exponents)  # as transformers' default rotary initialisation computes it

    @classmethod
    def load(cls, model_dir: Path, adapter: Adapter | None) -> LightModel:
        """The model in `model_dir` (config.json, safetensors) with `adapter` unmerged, in float32.

        Raises:
            Declined: the model or adapter is not one the light path reproduces.
            AdapterError: the adapter's updates do not fit the base's projections.
        """
        config = _read_config(model_dir)
        tensors = _read_weights(model_dir, config)
        loras = _adapter_loras(adapter, tensors, model_dir)
        get = lambda name: _linear(tensors, name, loras)
        layers = []
        for index in range(config.num_hidden_layers):
            prefix = f"model.layers.{index}."
            q_norm = tensors.get(prefix + "self_attn.q_norm.weight")
            k_norm = tensors.get(prefix + "self_attn.k_norm.weight")
            layers.append(Layer(
                input_norm=Norm(tensors[prefix + "input_layernorm.weight"], _eps(config)),
                qkv=SideBySide(tuple(get(prefix + "self_attn." + name) for name in ATTENTION)),
                q_norm=None if q_norm is None else Norm(q_norm, _eps(config)),
                k_norm=None if k_norm is None else Norm(k_norm, _eps(config)),
                out=get(prefix + "self_attn.o_proj"),
                post_norm=Norm(tensors[prefix + "post_attention_layernorm.weight"], _eps(config)),
                gate_up=SideBySide(tuple(get(prefix + "mlp." + name) for name in MLP)),
                down=get(prefix + "mlp.down_proj"),
                scaling=_head_dim(config) ** -0.5,
            ))  # fmt: skip
        final_norm = Norm(tensors["model.norm.weight"], _eps(config))
        return cls(config, layers, tensors["model.embed_tokens.weight"], final_norm, get("lm_head"))

    def rotation(self, positions: torch.Tensor) -> _Rotation:
        """cos and sin at `positions` as transformers' rotary embedding computes them (a float32 outer product
        of the inverse frequencies and the positions, concatenated with itself), shaped (1, 1, T, d)."""
        freqs = (self.inv_freq[None, :, None] @ positions[None, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return _Rotation(emb.cos()[:, None], emb.sin()[:, None])  # attention_scaling is 1.0 unscaled

    def forward(self, token_ids: list[int], cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Feed `token_ids` after the `cache`'s positions (extended in place): the last position's logits (V,).
        The first call (empty cache) attends causally over its tokens; later calls feed one token each."""
        start, length = (cache[0][0].shape[2] if cache else 0), len(token_ids)
        assert not (start and length > 1), "after the prompt, one token per call (SDPA's causal mask is top-left)"
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        hidden = F.embedding(torch.tensor([token_ids]), self.embed)  # (1, T, H)
        rotation = self.rotation(torch.arange(start, start + length))
        q_size, kv_size = heads * dim, kv_heads * dim
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(layer.input_norm(hidden))
            q = qkv[..., :q_size].view(1, length, heads, dim)
            k = qkv[..., q_size : q_size + kv_size].view(1, length, kv_heads, dim)
            v = qkv[..., q_size + kv_size :].view(1, length, kv_heads, dim).transpose(1, 2)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = rotation(q.transpose(1, 2)), rotation(k.transpose(1, 2))
            if len(cache) > index:
                k, v = torch.cat([cache[index][0], k], dim=2), torch.cat([cache[index][1], v], dim=2)
                cache[index] = (k, v)
            else:
                cache.append((k, v))
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=length > 1, scale=layer.scaling,
                                                      enable_gqa=heads != kv_heads)  # fmt: skip
            hidden = hidden + layer.out(attended.transpose(1, 2).reshape(1, length, q_size))
            gate, up = layer.gate_up(layer.post_norm(hidden)).chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        return self.head(self.final_norm(hidden[0, -1]))

    def greedy(self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int]) -> list[int]:
        """The greedy continuation of `prompt`, through the first of `stop_ids` (kept, as transformers keeps it)."""
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        generated: list[int] = []
        with torch.no_grad():
            logits = self.forward(prompt, cache)
            while len(generated) < max_new_tokens:
                token = int(torch.argmax(logits))
                generated.append(token)
                if token in stop_ids or len(generated) == max_new_tokens:
                    break
                logits = self.forward([token], cache)
        return generated


def light_generate(
    *, base: str | None, adapter: str | None, prompt: str, max_new_tokens: int, dtype: str, device: str, force: bool
) -> str | None:
    """The text `finetune generate` prints for a greedy, plain-text request, or None where the light path
    declines (the caller then loads the model through transformers). Errors in the inputs (an unreadable
    adapter, one trained on another base) are raised as the transformers path raises them."""
    if dtype != "float32":
        return None
    lead = read_adapter(adapter) if adapter is not None else None
    if lead is not None and lead.unmergeable is not None:
        return None  # DoRA: peft's layers compute it (the transformers path)
    if base is None:
        if lead is None or lead.base_path is None:
            return None  # the transformers path says what is missing
        base = lead.base_path
    try:
        model_dir = _model_dir(base, device, lead, force)
        tokenizer, bos_id, eos_id = _tokenizer_for(model_dir, lead)
        model = LightModel.load(model_dir, lead)
    except Declined:
        return None
    ids = require_tokens(with_bos(bos_id, tokenizer.encode(prompt, add_special_tokens=False).ids))  # as prompt_ids
    stops = stop_token_ids(eos_id, _generation_config(model_dir).get("eos_token_id"))  # as the transformers path
    return tokenizer.decode(model.greedy(ids, max_new_tokens, stops), skip_special_tokens=True)


def _generation_config(model_dir: Path) -> dict[str, Any]:
    """The base's generation_config.json ({} without one)."""
    generation = model_dir / "generation_config.json"
    return json.loads(generation.read_text(encoding="utf-8")) if generation.is_file() else {}


def _model_dir(base: str, device: str, adapter: Adapter | None, force: bool) -> Path:
    """The base's local directory, after the checks `finetune.load_model` makes (the adapter's fingerprint)."""
    recorded = recorded_quantization([adapter]) if adapter is not None else None
    if recorded is not None and recorded.method != "none":
        raise Declined("the adapter was trained on a quantized base, which the transformers path quantizes")
    resolved = resolve_base(base, device=device)
    if resolved.quantization.method != "none" or resolved.device.type != "cpu":
        raise Declined("a quantized base, or a GPU")
    if resolved.weights_dir is None or resolved.ledger.entries:
        raise Declined("a hub id not in the local cache, or a merged checkpoint")
    if resolved.fingerprint is None:
        raise Declined("no safetensors fingerprint")
    if adapter is not None:
        check_fingerprint(adapter, resolved.fingerprint, str(resolved.pristine_dir or resolved.source), force=force)
    return resolved.weights_dir


def _read_config(model_dir: Path) -> Any:
    fields = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    left_out = [name for name in FAMILY_DEFAULTED.get(fields.get("model_type"), ()) if name not in fields]
    if left_out:
        raise Declined(f"config.json leaves {', '.join(left_out)} to the family's default")
    config = SimpleNamespace(**fields)
    reason = config_declined_because(config)
    if reason is not None or getattr(config, "quantization_config", None) is not None:
        raise Declined(reason or "a quantized base")
    if getattr(config, "pretraining_tp", 1) != 1:
        raise Declined("tensor-parallel slicing")
    _rope_theta(config)  # raises for scaled rotary embeddings
    if set(_generation_config(model_dir)) - GREEDY_NEUTRAL:
        raise Declined("generation settings that change greedy decoding")
    return config


def _rope_theta(config: Any) -> float:
    """The rotary base of an unscaled rotary embedding (transformers 5's `rope_parameters` or the older fields).
    A scaling's kind is `rope_type`, or `type` in older config.json files (`{"type": "linear", "factor": 4}`),
    which transformers still reads as the `rope_type`: either one that is not "default" declines."""
    parameters = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    if any(fields.get("rope_type", fields.get("type", "default")) != "default" for fields in (parameters, scaling)):
        raise Declined("a scaled rotary embedding")
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _eps(config: Any) -> float:
    return getattr(config, "rms_norm_eps", 1e-6)  # the families' default


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _read_weights(model_dir: Path, config: Any) -> dict[str, torch.Tensor]:
    """Every tensor of the base in float32, the head tied to the embeddings where the config says so; exactly
    the family's own tensor names, or Declined."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(model_dir):
        tensors.update(load_file(file))
    if not tensors or any(not t.is_floating_point() for t in tensors.values()):
        raise Declined("no weights, or quantized ones")
    tensors = {name: tensor.float() for name, tensor in tensors.items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    if set(tensors) != _expected_names(config, tensors):
        raise Declined("tensors other than the family's own")
    return tensors


def _expected_names(config: Any, tensors: dict[str, torch.Tensor]) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for index in range(config.num_hidden_layers):
        prefix = f"model.layers.{index}."
        names |= {prefix + n + ".weight" for n in ("input_layernorm", "post_attention_layernorm")}
        names |= {f"{prefix}self_attn.{n}.weight" for n in (*ATTENTION, "o_proj")}
        names |= {f"{prefix}mlp.{n}.weight" for n in (*MLP, "down_proj")}
        optional = [f"{prefix}self_attn.{n}.bias" for n in (*ATTENTION, "o_proj")]  # Qwen2's, attention_bias
        optional += [f"{prefix}mlp.{n}.bias" for n in (*MLP, "down_proj")]  # mlp_bias
        optional += [f"{prefix}self_attn.{n}.weight" for n in ("q_norm", "k_norm")]  # Qwen3's head norms
        names |= {name for name in optional if name in tensors}
    return names


def _adapter_loras(
    adapter: Adapter | None, tensors: dict[str, torch.Tensor], model_dir: Path
) -> dict[str, LoraWeights]:
    """The adapter's LoRA pairs by module, if every one is a plain LoRA on a projection of the base.

    Raises:
        AdapterError: an update's shape is not its projection's (an adapter of another base size, which a
            missing manifest let through), as `finetune.load_model` refuses it, instead of a failed product.
    """
    if adapter is None:
        return {}
    if adapter.config.get("modules_to_save") or adapter.base_copies:
        raise Declined("the adapter saves whole modules")
    for module, lora in adapter.modules.items():
        if lora.embedding or lora.num_experts > 1 or lora.fan_in_fan_out or module + ".weight" not in tensors:
            raise Declined(f"the adapter's {module} is not a plain LoRA on a projection")
    check_fits(adapter, lambda module: tuple(tensors[module + ".weight"].shape), base=str(model_dir))
    return adapter.modules


def _linear(tensors: dict[str, torch.Tensor], module: str, loras: dict[str, LoraWeights]) -> LoraLinear:
    lora = loras.get(module)
    updates = () if lora is None else ((lora.A.float(), lora.B.float(), lora.scale),)
    return LoraLinear(tensors[module + ".weight"], tensors.get(module + ".bias"), updates)


def _tokenizer(model_dir: Path) -> tuple[Any, int | None, int | None]:
    """`tokenizer.json` through the `tokenizers` library, and the BOS and EOS ids, where transformers would use that
    file as it is (else Declined)."""
    from tokenizers import Tokenizer

    config_file, tokenizer_file = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if not (config_file.is_file() and tokenizer_file.is_file()):
        raise Declined("no tokenizer.json")
    settings = json.loads(config_file.read_text(encoding="utf-8"))
    if settings.get("tokenizer_class") not in PLAIN_TOKENIZERS or any(settings.get(k) for k in TOKENIZER_OVERRIDES):
        raise Declined("tokenizer settings transformers applies on top of tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    bos_id, eos_id = (_token_id(tokenizer, settings.get(key)) for key in ("bos_token", "eos_token"))
    return tokenizer, bos_id, eos_id


def _tokenizer_for(model_dir: Path, adapter: Adapter | None) -> tuple[Any, int | None, int | None]:
    """`_tokenizer` of the base, which an adapter's own tokenizer (saved by its run) must encode as: where the
    adapter carries one that differs (another `tokenizer.json`, BOS or EOS), the transformers path loads it, with
    `finetune.model`'s check that its vocabulary is the base's (Declined)."""
    base = _tokenizer(model_dir)
    if adapter is None or not carries_tokenizer(adapter.path):
        return base
    own = _tokenizer(adapter.path)
    if own[0].to_str() != base[0].to_str() or own[1:] != base[1:]:
        raise Declined("the adapter carries a tokenizer other than the base's")
    return base


def _token_id(tokenizer: Any, token: str | dict[str, Any] | None) -> int | None:
    """The id of a special token as tokenizer_config.json names it (a string, or a dict with its content)."""
    content = token.get("content") if isinstance(token, dict) else token
    return None if content is None else tokenizer.token_to_id(content)

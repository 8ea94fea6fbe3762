"""Load a base causal LM and its tokenizer, and wrap it with LoRA adapters from a recipe.

The base comes from a local directory or a hub id through the real `from_pretrained` (offline here,
so a hub id works only when it is already in the local cache), or from `embedded:tiny-llama`, which is
built locally on first use. Loading mistakes become `ModelError`s that say what to do.

Example:
    model, tokenizer, base_path = load_base("embedded:tiny-llama", dtype="float32")
    peft_model = wrap_with_lora(model, LoraConfig(r=8))
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from finetune.adapters.experts import (
    ExpertTensor,
    expert_tensors,
    peft_rewritten_names,
    peft_target_rewrite_off,
    routers,
    unwrapped,
)
from finetune.adapters.quantized import keep_float_kernels
from finetune.adapters.tokenizer_files import carries_tokenizer
from finetune.embedded.cache import resolve_base_id
from finetune.errors import ModelError
from finetune.paths import local_model_dir
from finetune.peft_import import bitsandbytes_hidden, import_peft
from finetune.quantization import NO_QUANTIZATION, Quantization
from finetune.recipe import LoraConfig, ModelConfig
from finetune.tensorfile import check_safetensors

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve(base: str, *, what: str = "model") -> str:
    """Map `embedded:*` ids to their local directory; check that a local path holds a model (or a tokenizer)."""
    resolved = resolve_base_id(base)
    path = Path(resolved).expanduser()
    looks_local = path.exists() or resolved.startswith((".", "/", "~")) or resolved.count("/") > 1
    if not looks_local:
        return resolved
    key = "model.base" if what == "model" else "model.tokenizer"
    if not path.exists():
        raise ModelError(f"{key} {base!r}: no such directory; give a local directory or a hub id")
    marker = "config.json" if what == "model" else "tokenizer_config.json"
    if not path.is_dir() or not (path / marker).is_file():
        raise ModelError(
            f"{key} {base!r} is not a {what} directory (no {marker}); point {key} at a directory written by "
            "save_pretrained"
        )
    for shard in sorted(path.glob("*.safetensors")) if what == "model" else ():
        check_safetensors(shard, ModelError, "re-download or re-save the base model")
    return str(path)


def _quantization_config(config: ModelConfig, compute_dtype: torch.dtype):
    """transformers' `BitsAndBytesConfig` for the recipe's quantization (None: not quantized)."""
    quantization = Quantization.of(config)
    if quantization.method != "none" and importlib.util.find_spec("bitsandbytes") is None:
        raise ModelError(
            f"model.quantization={config.quantization} needs bitsandbytes; pip install 'finetune[quantization]'"
        )
    return quantization.bnb_config(compute_dtype)


def load_tokenizer(
    source: str, *, revision: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer at `source`, with a pad token guaranteed.

    A tokenizer without a pad token gets EOS as pad. That is safe here because labels are built before
    padding (padding positions get label -100 from the attention mask, never by comparing ids with the
    pad id), so EOS stays a trained label.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelError(
            f"cannot load a tokenizer from {source!r}: {first}{_not_cached_hint(source, revision)}"
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _not_cached_hint(source: str, revision: str | None) -> str:
    """What to do when `source` is a hub id that is not in the local cache ('' for a local directory)."""
    if Path(source).is_dir() or local_model_dir(source, revision) is not None:
        return ""
    return f" (not in the local hub cache: run `hf download {source}` where there is network)"


def load_base(
    base: str,
    *,
    dtype: str = "float32",
    revision: str | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    quantization: Quantization = NO_QUANTIZATION,
    tokenizer: str | None = None,
    device: torch.device | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Load base model and tokenizer.

    Returns:
        (model in eval mode, tokenizer, resolved source: the local directory or hub id that was loaded).
    """
    chosen = {"attn_implementation": attn_implementation} if attn_implementation is not None else {}
    # the 4-bit settings only for a 4-bit base, which alone reads them (a recipe refuses them otherwise; a manifest
    # written before it did may still carry them beside 8bit)
    four_bit = quantization.as_record() if quantization.method == "4bit" else {"quantization": quantization.method}
    config = ModelConfig(
        base=base,
        dtype=dtype,
        revision=revision,
        **chosen,
        trust_remote_code=trust_remote_code,
        **four_bit,
        tokenizer=tokenizer,
    )
    return load_base_from_config(config, device=device)


def load_base_from_config(
    config: ModelConfig, tokenizer: PreTrainedTokenizerBase | None = None, *, device: torch.device | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """`load_base` for a recipe's `model` section; `tokenizer`, when the caller already has it from
    `load_tokenizer_for(config)`, is checked and returned instead of being loaded again.

    `device`: where the weights are loaded (a CUDA device: straight onto it, quantized there by
    bitsandbytes, no host copy first); None or the CPU: host memory, as `from_pretrained` does by default.
    """
    source = _resolve(config.base)
    if config.trust_remote_code:
        print(f"warning: model.trust_remote_code is on: Python code shipped with {source} will run", file=sys.stderr)
    dtype = DTYPES[config.dtype]
    files = files_to_load(source, config)
    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        revision=config.revision,
        attn_implementation=attention_for(config, files),
        trust_remote_code=config.trust_remote_code,
    )
    quantization = _quantization_config(config, dtype)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    if device is not None and device.type != "cpu":
        kwargs["device_map"] = {"": device}  # every module there: one GPU per process, never "auto" sharding
    from huggingface_hub.errors import StrictDataclassError  # a config.json field of another type: no ValueError

    try:
        model = AutoModelForCausalLM.from_pretrained(files, **kwargs)
    except (OSError, ValueError, StrictDataclassError) as exc:
        first = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ModelError(
            f"cannot load base model {config.base!r}: {first}{_not_cached_hint(source, config.revision)}"
        ) from None
    _check_quantized_as_asked(model, config)
    # Adapters record the hub id, not this machine's cache path: the model card reads the config's name, and peft's
    # `get_peft_model` the model's own `name_or_path` (adapter_config.json's `base_model_name_or_path`, which
    # `AutoPeftModelForCausalLM` and other tools load the base from).
    model.config._name_or_path = model.name_or_path = source
    keep_float_kernels(model)  # a 4-bit base computes with the same weights in every mode (see there)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer_for(config)
    _check_vocabulary_fits(model, tokenizer, config.tokenizer or config.base)
    return model.eval(), tokenizer, source


def _check_quantized_as_asked(model: PreTrainedModel, config: ModelConfig) -> None:
    """A checkpoint saved quantized (`adapters merge --requantize`, a hub `-bnb-4bit` model) loads with its own
    bitsandbytes settings whatever was asked: asked for 8-bit, a 4-bit one loaded 4-bit while the run, its
    manifest and every later merge took it for 8-bit (a merge would round-trip the wrong way). Asked for none
    (`generate`/`serve` of a requantized merge), it loads as saved, as before."""
    if config.quantization == "none":
        return
    bnb = sys.modules.get("bitsandbytes")
    kinds = {"none"}
    if bnb is not None:
        kinds = {
            "4bit" if isinstance(m, bnb.nn.Linear4bit) else "8bit"
            for m in model.modules()
            if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
        } or {"none"}
    loaded = next(iter(kinds)) if len(kinds) == 1 else "mixed"
    if loaded != config.quantization:
        raise ModelError(
            f"base model {config.base!r} is a checkpoint saved {loaded}-quantized but model.quantization (quantization=) "
            f"is {config.quantization}; set it to {loaded} (or none), or use the 16/32-bit checkpoint it was quantized from"
        )


def sdpa_refused(model_type: str | None) -> bool:
    """Whether transformers refuses sdpa for the causal LM class of `model_type` (`_supports_sdpa = False`):
    gpt-oss (attention sinks), Gemma 2 (attention logit soft-capping), and any family it marks so later."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type or "")
    if not isinstance(class_name, str):
        return False
    import transformers

    try:
        model_class = getattr(transformers, class_name)
    except (AttributeError, ImportError):  # a class this install cannot import: its load says why
        return False
    return getattr(model_class, "_supports_sdpa", True) is False


def attention_for(config: ModelConfig, files: str) -> str:
    """The attention implementation to load with: the recipe's, except that a recipe which does not choose one
    gets `eager` for a family transformers runs no sdpa for (`sdpa_refused`), instead of a load that fails.
    `eval`, `generate` and `serve` choose none: a Gemma 2 adapter could be trained (its recipe says eager) but
    never evaluated, sampled or served."""
    chosen = "attn_implementation" in config.model_fields_set
    config_file = Path(files) / "config.json"
    if chosen or config.attn_implementation != "sdpa" or not config_file.is_file():
        return config.attn_implementation
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except ValueError:
        return config.attn_implementation
    return "eager" if sdpa_refused(model_type) else config.attn_implementation


def load_tokenizer_for(config: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer a recipe's `model` section trains with (`model.tokenizer`, else the base's), no model loaded."""
    source = _resolve(config.tokenizer, what="tokenizer") if config.tokenizer else _resolve(config.base)
    return load_tokenizer(
        files_to_load(source, config), revision=config.revision, trust_remote_code=config.trust_remote_code
    )


def load_adapter_tokenizer(
    adapter_dir: Path, base_tokenizer: PreTrainedTokenizerBase, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase | None:
    """The tokenizer a training run saved beside its adapter (with the chat template it trained with), or None
    where the adapter carries none (the base's then serves it, as before adapters carried one).

    Raises:
        ModelError: it cannot be loaded, or its vocabulary is not the base's (`check_same_vocabulary`).
    """
    if not carries_tokenizer(adapter_dir):
        return None
    tokenizer = load_tokenizer(str(adapter_dir), trust_remote_code=trust_remote_code)
    check_same_vocabulary(tokenizer, base_tokenizer, adapter_dir)
    return tokenizer


def check_same_vocabulary(
    tokenizer: PreTrainedTokenizerBase, base_tokenizer: PreTrainedTokenizerBase, adapter_dir: Path
) -> None:
    """Refuse an adapter's tokenizer whose token ids mean other tokens than the base's: another size, or a
    special token (BOS, EOS, a turn marker...) at another id. The base's model was trained on the base's ids,
    and one server batches, pads and stops every model with them. A tokenizer that differs in its chat template
    or in which token it calls EOS (a base's and its instruct variant's, both holding `<|eot_id|>` at one id) agrees."""
    where = f"adapter {adapter_dir}'s tokenizer"
    fix = f"delete the tokenizer files from {adapter_dir} to use the base's, or load it on the base it was trained on"
    if len(tokenizer) != len(base_tokenizer):
        raise ModelError(f"{where} has {len(tokenizer):,} tokens but the base's has {len(base_tokenizer):,}; {fix}")
    specials = sorted(set(tokenizer.all_special_tokens) | set(base_tokenizer.all_special_tokens))
    for token in specials:
        ids = tokenizer.convert_tokens_to_ids(token), base_tokenizer.convert_tokens_to_ids(token)
        if ids[0] != ids[1]:
            raise ModelError(f"{where} has special token {token!r} at id {ids[0]} but the base's at {ids[1]}; {fix}")


def _check_vocabulary_fits(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tokenizer_source: str) -> None:
    """Refuse a tokenizer whose ids the model has no embedding rows for (an index error mid-forward otherwise)."""
    weight = cast(torch.Tensor, model.get_input_embeddings().weight)  # torch: Tensor | Module
    rows = getattr(weight, "ds_shape", weight.shape)[0]  # loaded under ZeRO-3, a rank holds a partition
    if len(tokenizer) > rows:
        raise ModelError(
            f"tokenizer {tokenizer_source} has {len(tokenizer):,} tokens but the base model's embedding has only "
            f"{rows:,} rows; use the tokenizer that belongs to this model (model.tokenizer)"
        )


def files_to_load(source: str, config: ModelConfig) -> str:
    """What to hand `from_pretrained` for `source`: its snapshot directory when it is a cached hub id.

    Clusters without internet are common, and there even a cached hub model is first checked online,
    which costs minutes of retries (measured: 2 min 47 s for a 1M-parameter model with the hub
    unreachable, 10 s with `HF_HUB_OFFLINE=1`). Loading the cached snapshot directory touches no network.
    `model.check_updates` asks the hub for a newer revision instead.
    """
    if config.check_updates or Path(source).is_dir():
        return source
    return str(local_model_dir(source, config.revision) or source)


def linear_module_names(model: torch.nn.Module, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Distinct last name parts of the model's linear layers (what `target_modules` can name); a name only
    the modules in `skip` (full names) have is left out."""
    names: set[str] = set()
    for name, module in model.named_modules():
        linear = isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Linear8bitLt", "Linear4bit")
        if linear and name not in skip:
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


_PEFT_LAYERS = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
               torch.nn.MultiheadAttention)  # fmt: skip
"""The layer types peft's LoRA wraps (bitsandbytes' quantized linear layers subclass `nn.Linear`), and
transformers' `Conv1D` (GPT-2's layers), checked by name."""


def _check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Refuse target names that match no module as peft matches a list (a module's full name or its last parts,
    never a regex), or that match a module peft cannot put LoRA on (a norm, a whole block): peft raised a
    traceback for both (`NoMatchingPeftModuleError`, `ValueError: Target module ... is not supported`)."""
    modules = list(model.named_modules())
    matched = {t: [(n, m) for n, m in modules if n == t or n.endswith("." + t)] for t in targets}
    missing = [t for t, found in matched.items() if not found]
    if missing:
        raise ModelError(
            f"lora.target_modules {missing} match no module of the base model (each is a module name or its last "
            f"parts, not a regex); linear layers that exist: {', '.join(linear_module_names(model))} (or use "
            "target_modules: all-linear)"
        )
    for target, found in matched.items():
        other = [(n, m) for n, m in found if not isinstance(m, _PEFT_LAYERS) and type(m).__name__ != "Conv1D"]
        if other:
            name, module = other[0]
            raise ModelError(
                f"lora.target_modules {target!r} names {name}, a {type(module).__name__}, which LoRA cannot adapt "
                f"(it takes linear, embedding and convolution layers); linear layers that exist: "
                f"{', '.join(linear_module_names(model))} (or use target_modules: all-linear)"
            )


def embedding_module_names(model: PreTrainedModel) -> tuple[str, str]:
    """(input embeddings, output head) module names of `model`, e.g. ('model.embed_tokens', 'lm_head')."""
    names = {id(module): name for name, module in model.named_modules()}
    return names[id(model.get_input_embeddings())], names[id(model.get_output_embeddings())]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules whose class the model names in `_no_split_modules` (every
    transformers causal LM declares it; [] for one that does not). FSDP shards by them, `finetune plan`
    counts them."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def _lora_targets(config: LoraConfig, model: PreTrainedModel, moe: _MoeTargets) -> str | list[str]:
    """peft's `target_modules`: the recipe's, plus the embeddings/head that `train_*` switches on.

    On a mixture of experts `all-linear` is spelled out as the linear layers' names without the routers
    (unless `train_router`), since peft's `all-linear` would put LoRA on a router that is an `nn.Linear`.
    """
    embed_tokens, lm_head = embedding_module_names(model)
    extra = [
        name for name, wanted in ((lm_head, config.train_lm_head), (embed_tokens, config.train_embed_tokens)) if wanted
    ]
    if not extra and not moe.experts and not moe.linear_routers:
        return config.target_modules
    if config.target_modules == "all-linear":  # peft's `all-linear` leaves the head out and takes no additions
        head = lm_head.rsplit(".", 1)[-1]
        left_out = {head, *moe.moved_by_peft}
        blocks = [name for name in linear_module_names(model, skip=moe.skipped_linear) if name not in left_out]
    else:
        blocks = list(config.target_modules) + [
            name for name in moe.linear_routers if name not in config.target_modules
        ]
    if not extra:
        return blocks
    # One regex (peft full-matches a string against each module name): the blocks' layers by their last name
    # part, the additions by their full name, so `lm_head` cannot match anything inside the blocks.
    suffixes = "|".join(re.escape(name) for name in blocks)
    return "|".join([rf"(?:.*\.)?(?:{suffixes})"] + [re.escape(name) for name in extra])


class _MoeTargets:
    """What `all-linear` adds on a mixture of experts: its expert tensors and, with `train_router`, its routers."""

    def __init__(self, config: LoraConfig, model: torch.nn.Module):
        every_expert = expert_tensors(model)
        self.experts: list[ExpertTensor] = every_expert if config.target_modules == "all-linear" else []
        # `train_router` trains the routers beside a list of target modules too (not only beside `all-linear`).
        router_names = routers(model, every_expert)
        linear = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        # Phi-MoE's and Llama 4's routers subclass nn.Linear but return a tuple (logits, weights, experts):
        # peft's LoRA linear layer adds its update to that output and fails, so they are no linear target.
        wrappable = {name for name in linear if _returns_its_product(model.get_submodule(name))}
        self.frozen_routers = set(router_names) if self.experts and not config.train_router else set()
        # Routers that are nn.Linear are excluded by full name too, in case another layer shares their last name.
        self.excluded_routers = sorted(self.frozen_routers & linear)
        # A router that is no plain nn.Linear (a module holding a weight) is reached as a parameter, like the experts.
        self.router_parameters = [n for n in router_names if n not in wrappable] if config.train_router else []
        # A router that is a plain nn.Linear (JetMoE's `router.layer`, HunYuan-MoE's `gate.wg`) takes linear LoRA:
        # `all-linear` reaches it by name; beside a list of target modules it is added by its full name.
        self.linear_routers = [n for n in router_names if n in wrappable] if config.train_router else []
        self.skipped_linear = self.frozen_routers | set(self.router_parameters)
        """Linear layers `all-linear` leaves out (full names): the frozen routers and those reached as parameters."""
        # Dense layers (shared experts, dense MLPs) named as plain peft renames onto the experts when it loads an
        # adapter of this family: left out of `all-linear`, so the adapter loads in plain peft as trained.
        self.moved_by_peft = peft_rewritten_names(model) if self.experts else frozenset()

    @property
    def target_parameters(self) -> list[str]:
        """Suffixes peft matches parameter names against (`experts.down_proj`, `gate.weight`)."""
        experts = {f"{e.owner.rsplit('.', 1)[-1]}.{e.parameter}" for e in self.experts}
        router_weights = {f"{name.rsplit('.', 1)[-1]}.weight" for name in self.router_parameters}
        return sorted(experts | router_weights)


def _returns_its_product(linear: torch.nn.Module) -> bool:
    """Whether a linear layer's forward is nn.Linear's (or a quantized linear layer's): it returns x·Wᵀ (+ b), to
    which peft's LoRA layer adds its update."""
    return type(linear).forward is torch.nn.Linear.forward or type(linear).__name__ in ("Linear8bitLt", "Linear4bit")


def _check_tied_head_init(config: LoraConfig, model: PreTrainedModel) -> None:
    """Refuse PiSSA/OLoRA on an output head tied to the input embeddings.

    Those inits take the adapter's start out of the weight of each layer they adapt (W_res = W - s·B₀A₀); a tied
    head's weight is the embeddings' too, so the run trained (and evaluated) on rewritten embeddings, which the
    written adapter, an update of the head alone (`finetune.training.mutated_start`), does not carry: re-evaluated,
    an OLoRA run's adapter measured loss 14.3 where the run had 10.0, without a word.
    """
    if config.init not in ("pissa", "olora"):
        return
    embed_tokens, lm_head = embedding_module_names(model)
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embeddings is None or head.weight is not embeddings.weight:
        return
    targets = config.target_modules if isinstance(config.target_modules, list) else []
    if config.train_lm_head or any(lm_head == t or lm_head.endswith("." + t) for t in targets):
        raise ModelError(
            f"lora.init {config.init} rewrites the weight of every layer it adapts, and this base's output head "
            f"({lm_head}) shares its weight with the input embeddings ({embed_tokens}), which training would then "
            "change too; leave the head out (lora.train_lm_head: false), or use lora.init: default or gaussian"
        )


def peft_lora_config(config: LoraConfig, model: PreTrainedModel) -> PeftLoraConfig:
    """Translate the recipe's `lora` section into a `peft.LoraConfig` for `model`."""
    import_peft()  # peft's first import hides bitsandbytes
    from peft import LoraConfig as PeftLoraConfig

    if isinstance(config.target_modules, list):
        _check_targets(model, config.target_modules)
    inits: dict[str, bool | Literal["gaussian", "pissa", "olora"]] = {
        "default": True,
        "gaussian": "gaussian",
        "pissa": "pissa",
        "olora": "olora",
    }
    init = inits[config.init]
    _check_tied_head_init(config, model)
    moe = _MoeTargets(config, model)
    target_parameters = moe.target_parameters
    if config.use_dora and target_parameters:  # peft raised a traceback once the base (and the data) had loaded
        what = "fused expert tensors" if moe.experts else "routers, reached as parameters"
        raise ModelError(
            f"lora.use_dora: this mixture of experts' {what} ({', '.join(target_parameters)}) take LoRA as parameters, "
            "which peft has no DoRA for; set lora.use_dora=false, or give lora.target_modules a list of linear layers "
            "(attention, dense MLPs) without lora.train_router"
        )
    return PeftLoraConfig(
        task_type="CAUSAL_LM",
        r=config.r,
        lora_alpha=config.alpha,  # type: ignore[arg-type]  # peft annotates int; it computes alpha / r, floats work
        # peft refuses dropout on parameter targets; `wrap_with_lora` gives the linear layers theirs back.
        lora_dropout=0.0 if target_parameters else config.dropout,
        target_modules=_lora_targets(config, model, moe),
        target_parameters=target_parameters or None,
        exclude_modules=[*config.exclude_modules, *moe.excluded_routers] or None,
        use_rslora=config.use_rslora,
        use_dora=config.use_dora,
        init_lora_weights=init,
        bias=config.bias,
    )


def wrap_with_lora(model: PreTrainedModel, config: LoraConfig):
    """Freeze `model` and add trainable LoRA adapters (a `peft.PeftModel`, adapter name `default`)."""
    peft = import_peft()
    lora_config = peft_lora_config(config, model)
    if _upcasts_unquantized(model):
        with _experts_kept_in_their_dtype(model):
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    peft_model = _injected(peft, model, lora_config, config)
    use_uniform_dropout(peft_model, config.dropout)
    cast_lora_inputs_unless_autocast(peft_model)
    # LoRA weights train in float32 even on a 16-bit base: Adam updates are too small for bf16.
    for parameter in peft_model.parameters():
        if parameter.requires_grad and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()
    return peft_model


def _injected(peft: Any, model: PreTrainedModel, lora_config: PeftLoraConfig, config: LoraConfig):
    """peft's `get_peft_model`, its `NoMatchingPeftModuleError` said in one line.

    The recipe's target names are checked to exist before (`_check_targets`), so what matches nothing here is
    `lora.exclude_modules` taking out every targeted module (`target_modules: [q_proj]` with `exclude_modules:
    [q_proj]`): peft raised it as a traceback, after the base had loaded.
    """
    try:
        # bitsandbytes hidden: a no-op on a quantized base, which loaded it already
        with bitsandbytes_hidden(), peft_target_rewrite_off():
            return peft.get_peft_model(model, lora_config)
    except ValueError as exc:
        if type(exc).__name__ != "NoMatchingPeftModuleError":
            raise
        targets = config.target_modules if isinstance(config.target_modules, str) else list(config.target_modules)
        excluded = (
            f"lora.exclude_modules {config.exclude_modules} takes out every module of "
            if config.exclude_modules
            else ""
        )
        raise ModelError(
            f"{excluded}lora.target_modules {targets}: no module is left to put LoRA on; exclude fewer modules or "
            "target others"
        ) from None


def _upcasts_unquantized(model: PreTrainedModel) -> bool:
    """Whether a quantized base's unquantized weights (embeddings, output head, norms) go to float32 through
    peft's `prepare_model_for_kbit_training`, as the QLoRA recipe does: only on a float16 base, whose
    activations and logits can overflow float16's range. bfloat16 has float32's range, and the upcast would
    double those weights and carry the whole residual stream in float32 (a 4-bit Llama-3.1-8B: 2.1 GB more
    weights, 1.1 GB more checkpointed layer inputs at 2 x 2048 tokens, and attention handed float32); a bf16
    base then trains as a bf16 LoRA base does, its linear layers 4-bit. (peft's function also freezes the
    base, which `get_peft_model` does too.)"""
    quantized = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    return quantized and model.get_input_embeddings().weight.dtype == torch.float16


@contextmanager
def _experts_kept_in_their_dtype(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, peft's `prepare_model_for_kbit_training` leaves the fused expert tensors as they are.

    It casts every 16-bit parameter bitsandbytes did not quantize to float32; bitsandbytes quantizes only
    `nn.Linear`, so on a mixture of experts that would double the experts, the model's bulk (Qwen3-30B-A3B:
    57 GB of bf16 experts). The experts' storage is set aside while it runs (an empty stand-in is what it casts).
    """
    parameters = [unwrapped(model.get_submodule(e.owner))._parameters[e.parameter] for e in expert_tensors(model)]
    kept = [(p, p.data) for p in parameters if p is not None]
    for parameter, _ in kept:
        parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
    try:
        yield
    finally:
        for parameter, data in kept:
            parameter.data = data


class _UnlessAutocast:
    """peft's `cast_input_dtype_enabled` of one LoRA layer, true only while autocast is off on the device of
    the layer's LoRA weights.

    peft casts each LoRA layer's input to the LoRA weights' dtype, float32, before dropout and `lora_A`. Under
    autocast that is two copies for nothing: autocast casts the float32 copy back to bf16 for the matmul, and
    `lora_A` keeps that bf16 copy for its backward (one per targeted layer; q, k and v would share their input
    otherwise). Without them the forward and the gradients are bit for bit the same (bf16 to float32 and back
    is exact, and dropout rounds once either way), a bf16 Llama layer without LoRA dropout keeps 8·d bytes per
    token less (traced), and each LoRA layer runs two elementwise kernels fewer forward and backward. Outside
    autocast (a 16-bit base trained in float32, inference) peft casts as before: bf16 inputs cannot meet float32
    weights.
    """

    def __init__(self, lora_a: torch.nn.ModuleDict) -> None:
        self.lora_a = lora_a  # where the layer lives when it runs (the model may move after wrapping)

    def __bool__(self) -> bool:
        weight = next(iter(self.lora_a.values())).weight
        return not torch.is_autocast_enabled(cast(torch.Tensor, weight).device.type)


def cast_lora_inputs_unless_autocast(peft_model: torch.nn.Module) -> None:
    """Give every LoRA layer of `peft_model` an `_UnlessAutocast` switch of its input cast."""
    for module in peft_model.modules():
        lora_a = getattr(module, "lora_A", None)
        if isinstance(lora_a, torch.nn.ModuleDict) and lora_a and hasattr(module, "cast_input_dtype_enabled"):
            setattr(module, "cast_input_dtype_enabled", _UnlessAutocast(lora_a))  # noqa: B010 (not a tensor/module)


class UniformDropout(torch.nn.Dropout):
    """Dropout whose mask comes from 16 random bits per element: keep with probability 1-p (p rounded to
    a multiple of 1/65536), scale by 1/(1-p), as `nn.Dropout` does. About twice as fast on CPU.

    peft draws a mask the size of each LoRA layer's input, 7 per decoder layer with all-linear targets;
    torch's CPU dropout draws one float per element through `bernoulli_`, which was 11-13% of a training
    step on an 8M-parameter Llama (torch.profiler, one thread). Drawing 64-bit integers and reading each
    as four 16-bit ones needs a quarter of the generator calls. The random stream differs from
    `nn.Dropout`'s: runs are reproducible with this class, not bit-identical to plain peft with dropout.

    On a GPU, and inside `torch.compile` (whose tracer does not take the in-place `random_`), torch's own
    dropout is used instead: one fused kernel there, where these bits would be five.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return input
        if input.device.type != "cpu" or torch.compiler.is_compiling():
            return torch.nn.functional.dropout(input, self.p, training=True)
        count = input.numel()
        bits = torch.empty((count + 3) // 4, dtype=torch.int64, device=input.device).random_(-(2**63), 2**63 - 1)
        uniform16 = bits.view(torch.int16)[:count].view(input.shape)  # each in [-32768, 32767], uniform
        keep = uniform16 >= round(self.p * 65536) - 32768
        return torch.where(keep, input * (1.0 / (1.0 - self.p)), 0.0)


def use_uniform_dropout(peft_model: torch.nn.Module, dropout: float | None = None) -> None:
    """Replace every LoRA layer's `nn.Dropout` by a `UniformDropout` of the same p, in place.

    `dropout`: give the linear LoRA layers this p where peft left none (its config carries 0 when it also
    targets expert tensors, whose `ParamWrapper` refuses dropout); the expert tensors stay without.
    """
    for module in peft_model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, torch.nn.ModuleDict):
            continue
        for name, layer in dropouts.items():
            if type(layer) is torch.nn.Dropout:
                dropouts[name] = UniformDropout(layer.p)
            elif dropout and isinstance(layer, torch.nn.Identity) and type(module).__name__ != "ParamWrapper":
                dropouts[name] = UniformDropout(dropout)


def describe_targets(peft_model: torch.nn.Module) -> list[str]:
    """Log lines: what LoRA reached ('LoRA on 12 linear modules and 8 expert tensors'), and a warning when a
    mixture of experts' expert tensors carry none."""
    linear = expert = 0
    for module in peft_model.modules():
        if not isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict):
            continue
        if type(module).__name__ == "ParamWrapper" and getattr(module, "num_experts", 1) > 1:
            expert += 1
        elif type(module).__name__ != "ParamWrapper":
            linear += 1
    total = len(expert_tensors(peft_model))
    lines = [f"LoRA on {linear} linear modules" + (f" and {expert} of {total} expert tensors" if total else "")]
    moved = peft_rewritten_names(peft_model) if total else frozenset()
    dense = _dense_layers_named(peft_model, moved)
    family = getattr(peft_model.config, "model_type", "this")
    with_lora = sorted({name.rsplit(".", 1)[-1] for name, has_lora in dense.items() if has_lora})
    without = sorted({name.rsplit(".", 1)[-1] for name, has_lora in dense.items() if not has_lora})
    if with_lora:
        lines.append(
            f"warning: LoRA on dense layers named {', '.join(with_lora)}: plain peft moves LoRA with those names onto the "
            f"experts when it loads a {family} adapter, so only finetune loads this one"
        )
    elif without:
        lines.append(
            f"left out {len(dense)} dense linear layers named {', '.join(without)} (shared experts, dense MLPs): plain "
            f"peft moves LoRA with those names onto the experts when it loads a {family} adapter; name them in "
            "lora.target_modules to train them anyway (then only finetune loads the adapter)"
        )
    if total > expert:
        lines.append(
            f"warning: {total - expert} of the base's {total} fused expert tensors carry no LoRA (the model's bulk); "
            "use lora.target_modules: all-linear to train the experts"
        )
    return lines


def _dense_layers_named(peft_model: torch.nn.Module, names: frozenset[str]) -> dict[str, bool]:
    """Linear layers (not routers) whose last name part is in `names` -> whether they carry LoRA."""
    if not names:
        return {}
    model = getattr(peft_model, "get_base_model", lambda: peft_model)()  # peft wraps its layers in place
    router_names = set(routers(model, expert_tensors(model)))
    found = {}
    for name, module in model.named_modules():
        layer = unwrapped(module)
        if "lora_" in name or name.endswith(".base_layer") or not isinstance(layer, torch.nn.Linear):
            continue
        if name.rsplit(".", 1)[-1] in names and name not in router_names:
            found[name] = isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict)
    return found


def describe_trainable(model: torch.nn.Module) -> str:
    """'trainable 65,536 of 1,300,000 parameters (5.04%)' for the log."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(_weights_held(p) for p in model.parameters())
    return f"trainable {trainable:,} of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%)"


def _weights_held(parameter: torch.nn.Parameter) -> int:
    """How many weights a parameter holds: a bitsandbytes 4-bit weight packs two in each byte of its storage, whose
    `numel` is the bytes (a QLoRA run's log counted the tiny Llama's 1,144,960 parameters as 743,552); the shape
    it unpacks to is in its quantization state."""
    state = getattr(parameter, "quant_state", None)
    shape = getattr(state, "shape", None)
    return math.prod(shape) if shape is not None else parameter.numel()

"""`LoadedModel`: a base model with named LoRA adapters that can be merged, subtracted and swapped exactly.

State is the ledger (adapter name -> weight). Every operation computes the new ledger, then rewrites
only the tensors whose terms changed, each as round(W_base + Σ wᵢ·ΔWᵢ) from the pristine base
(`arithmetic.merged_weight`), in place (the `nn.Parameter` objects stay the same). Hence, in any dtype:
subtracting everything gives the base bit for bit, and `swap(a, b)` equals merging `b` into a fresh base.
If any tensor would hold NaN/Inf, the tensors already rewritten are recomputed from the old ledger and
the operation raises: a failed operation leaves the model as it was.

`use(name)` switches an *unmerged* adapter on for every forward (peft's multi-adapter mode, loaded on
first use); `use(None)` switches it off. `attach(name)` loads one without switching it on, and
`use_per_row()` lets each row of a batch name its own attached adapter (how `finetune serve` batches).
On a mixture of experts, unmerged LoRA on the fused expert tensors (and on a router peft reaches as a raw
parameter) is applied by `expert_rows` in both modes: each row's experts compute with the tensors a merge
of its adapter writes (bit for bit).
Rules: an adapter cannot be both merged and in use (that would count it twice), so `use` refuses a
merged adapter and `merge`/`swap` refuse the adapter in use; other adapters may be merged underneath
the one in use (its LoRA adds on top of the merged weights). On a quantized base, `use` and merges
exclude each other (peft's quantized LoRA layers need the quantized layer underneath).

Example:
    m = finetune.load_model("models/tiny", adapters={"legal": "adapters/legal", "med": "adapters/med"})
    m.merge("legal"); m.swap("legal", "med"); m.subtract("med")      # back to the base, bit for bit
    m.use("legal"); m.model.generate(...); m.use(None)
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from finetune.adapters import quantized
from finetune.adapters.arithmetic import Term, changed_modules, merged_weight, module_terms
from finetune.adapters.expert_rows import ExpertRows
from finetune.adapters.experts import bind_experts, expert_tensors, peft_target_rewrite_off, routers, unwrapped
from finetune.adapters.fit import bind_layouts, check_fits
from finetune.adapters.ledger import Ledger
from finetune.adapters.lora import Adapter
from finetune.adapters.model_dir import (
    copy_side_files,
    shard_file_name,
    staging_dir,
    write_config,
    write_index,
    write_shard,
)
from finetune.adapters.pristine import PristineWeights
from finetune.adapters.resolved_base import ResolvedBase
from finetune.adapters.result import ArithmeticResult
from finetune.adapters.tied import TIE_KEY, tied_parameter_names
from finetune.adapters.tokenizer_files import copy_tokenizer, shared_tokenizer_dir
from finetune.errors import AdapterError, AdapterWarning
from finetune.fingerprint import base_state_items
from finetune.peft_import import bitsandbytes_hidden, import_peft

if TYPE_CHECKING:
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class LoadedModel:
    """A transformers model + tokenizer, its named adapters, and the ledger of what is merged.

    Attributes:
        model: the transformers model (usable with `generate`); merges change its weights in place.
        tokenizer: the tokenizer of the adapter in `use` where it carries one (saved by its training run, with the
            chat template it trained with), else the base's (`base_tokenizer`); `tokenizer_for(name)` for any.
        adapters: name -> `Adapter` (fp32 A/B per module).
        base: the resolved base (`resolve_base`): its source, pristine directory, ledger, quantization,
            dtype (that of merged tensors; the compute dtype for quantized layers) and device.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        base: ResolvedBase,
        *,
        requantize: bool = False,
    ):
        self.model = model
        self.base_tokenizer = tokenizer
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {}  # adapter -> the tokenizer it carries
        self.base = base
        self.requantize = requantize
        self.adapters: dict[str, Adapter] = {}
        self._ledger = base.ledger
        # A model loaded from a merged checkpoint already holds its ledger's merges: its tensors are not the base's.
        self._tied = tied_parameter_names(model)
        self._pristine = PristineWeights.of(
            base.pristine_dir, base.device, model, verify=not self._ledger.entries, aliases=self._tied
        )
        self._untied: dict[str, torch.nn.Parameter] = {}  # module -> the shared weight it held before a merge
        self._ties_on_load = bool(getattr(model.config, TIE_KEY, False))
        self._quantized_originals: dict[str, torch.nn.Module] = {}
        self._requantization_errors: dict[str, float] = {}
        self._peft: PeftModel | None = None
        self._active: str | None = None
        self._per_row = False  # use_per_row() is on: adapter layers enabled for calls with adapter_names
        self._expert_rows = ExpertRows(self._row_tensor)
        self._routers = set(routers(model, expert_tensors(model)))  # LoRA on them is a plain update of their weight

    def __repr__(self) -> str:
        """What a notebook wants to see of it: the base, where and in what dtype, the adapters and their state."""
        return (
            f"LoadedModel(base={self.base_source!r}, device={str(self.device)!r}, dtype={self.dtype}, "
            f"adapters={sorted(self.adapters)}, active={self._active!r}, merged={self.merged})"
        )

    @property
    def base_source(self) -> str:
        """The directory or hub id the model was loaded from."""
        return self.base.source

    @property
    def base_dir(self) -> Path | None:
        """The pristine base's directory (for a merged checkpoint: the base its ledger records)."""
        return self.base.pristine_dir

    @property
    def dtype(self) -> torch.dtype:
        """The dtype merged tensors are written in."""
        assert self.base.dtype is not None, "a loaded model has a dtype"
        return self.base.dtype

    @property
    def device(self) -> torch.device:
        """Where the model's weights are, where inputs go, and where every merge is computed."""
        return self.base.device

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer of the adapter in `use` (its own where it carries one), else the base's."""
        return self.tokenizer_for(self._active)

    def tokenizer_for(self, name: str | None) -> PreTrainedTokenizerBase:
        """The tokenizer adapter `name` was trained with where it carries one, else the base's (None: the base)."""
        return self._tokenizers.get(name, self.base_tokenizer) if name is not None else self.base_tokenizer

    # ---- state -------------------------------------------------------------------------------------
    @property
    def merged(self) -> dict[str, float]:
        """The ledger: adapter name -> merged weight, sorted by name (a copy)."""
        return self._ledger.weights

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    @property
    def active(self) -> str | None:
        """The adapter switched on by `use`, or None."""
        return self._active

    @property
    def pristine_copy_bytes(self) -> int:
        """Bytes of base tensors kept in memory because they could not be read back from the base files."""
        return self._pristine.copied_bytes

    @property
    def requantization_errors(self) -> dict[str, float]:
        """module -> relative Frobenius error added by requantizing its merged weight (requantize=True)."""
        return dict(self._requantization_errors)

    # ---- adapters ----------------------------------------------------------------------------------
    def add_adapter(self, adapter: Adapter, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """Make `adapter` available under `adapter.name`, after checking that it fits this base; `tokenizer`: the
        one it carries (`finetune.model.load_adapter_tokenizer`, checked against the base's), None: the base's."""
        if adapter.name in self.adapters:
            raise AdapterError(f"an adapter named {adapter.name!r} is already loaded; give the new one another name")
        adapter = bind_layouts(bind_experts(adapter, self.model), self.model)
        self._check_fits(adapter)
        self.adapters[adapter.name] = adapter
        if tokenizer is not None:
            self._tokenizers[adapter.name] = tokenizer

    def _check_fits(self, adapter: Adapter) -> None:
        check_fits(adapter, self._weight_shape, base=self.base_source)
        for module in sorted(adapter.base_copies):
            adapter.check_base_copy(module, self._base_weight(module, self._layer(module)[2]))

    def _weight_shape(self, module: str) -> tuple[int, ...] | str:
        """The shape an update of `module` must have (see `fit.check_fits`)."""
        expert = self._expert_parameter(module)
        if expert is not None:
            return tuple(expert.shape)
        try:
            layer = self._layer(module)[2]
        except AttributeError:
            raise KeyError(module) from None
        if module in self._routers:  # a module holding a (experts, hidden) weight, reached as a raw parameter
            rows, columns = _weight(layer).shape
            return (rows, columns)
        return _weight_shape(layer) or type(layer).__name__

    def _expert_parameter(self, name: str) -> torch.nn.Parameter | None:
        """The fused 3D expert tensor called `name` (`...mlp.experts.down_proj`), looking through peft's wrappers."""
        owner_name, _, attribute = name.rpartition(".")
        try:
            owner = unwrapped(self.model.get_submodule(owner_name))
        except AttributeError:
            return None
        parameter = owner._parameters.get(attribute)
        return parameter if parameter is not None and parameter.dim() == 3 else None

    def _base_weight(self, module: str, layer: torch.nn.Module) -> torch.Tensor:
        """The base's value of `module`'s weight: pristine if something is merged into it, else the current one."""
        if any(module in adapter.modules for adapter in (self.adapters[n] for n in self._ledger.entries)):
            return self._pristine.get(module + ".weight", _weight(layer).dtype)
        return _weight(layer).detach()

    def _adapter(self, name: str) -> Adapter:
        if name not in self.adapters:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise AdapterError(
                f"no adapter named {name!r} is loaded (loaded: {loaded}); pass it to load_model(adapters=...)"
            )
        return self.adapters[name]

    # ---- arithmetic --------------------------------------------------------------------------------
    def merge(self, name: str, weight: float = 1.0) -> ArithmeticResult:
        """Add `weight`·ΔW of adapter `name` into the weights (adds to its weight if already merged)."""
        self._adapter(name)
        return self._apply(self._ledger.plus(name, weight, self.adapters[name]), f"merge {name}:{weight:g}")

    def subtract(self, name: str, weight: float | None = None, *, negate: bool = False) -> ArithmeticResult:
        """Take `weight` of adapter `name` back out (default: all of it), exactly: tensors come from the base.

        Subtracting an adapter that is not merged (or more of it than is merged) is task negation: it
        subtracts an update the model never had, and needs `negate=True`.
        """
        self._adapter(name)
        ledger = self._ledger.minus(name, weight, self.adapters[name], negate=negate)
        weight = self._ledger.weights.get(name, 0.0) - ledger.weights.get(name, 0.0)
        return self._apply(ledger, f"subtract {name}:{weight:g}")

    def swap(self, old: str, new: str, weight: float = 1.0) -> ArithmeticResult:
        """Take `old` out entirely and merge `new` with `weight`: equal to merging `new` into a fresh base."""
        self._adapter(old), self._adapter(new)
        if old not in self._ledger.entries:
            raise AdapterError(f"cannot swap out {old!r}: it is not merged (merged: {self.merged or 'nothing'})")
        ledger = self._ledger.minus(old, None, negate=False).plus(new, weight, self.adapters[new])
        return self._apply(ledger, f"swap {old} -> {new}:{weight:g}")

    def _apply(self, ledger: Ledger, operation: str) -> ArithmeticResult:
        started = time.perf_counter()
        if self._active is not None and self._active in ledger.entries:
            raise AdapterError(f"adapter {self._active!r} is in use unmerged; call use(None) before merging it")
        both = self._merged_and_attached(ledger) if self._per_row else None
        if both is not None:
            raise AdapterError(
                f"adapter {both!r} is attached for per-row use; merge it after use(None) and remove_adapter"
            )
        if self._peft is not None and self._active is not None and self._quantized_base():
            raise AdapterError(
                "on a quantized base an adapter in use() and merges exclude each other; call use(None) first"
            )
        modules = changed_modules(self._ledger, ledger, self.adapters)
        old_terms = module_terms(self._ledger.weights, self.adapters)
        new_terms = module_terms(ledger.weights, self.adapters)
        rewritten: list[str] = []
        try:
            for module in modules:
                self._write(module, new_terms.get(module, []))
                rewritten.append(module)
        except AdapterError:
            for module in rewritten:  # back to the old ledger's tensors, exactly
                self._write(module, old_terms.get(module, []))
            raise
        self._ledger = ledger
        notes = []
        if self._requantization_errors and self.requantize:
            worst = max(self._requantization_errors.items(), key=lambda kv: kv[1])
            notes.append(f"requantized merged layers: largest relative error added {worst[1]:.3e} ({worst[0]})")
        return ArithmeticResult(operation, self.merged, len(rewritten), time.perf_counter() - started, notes)

    def _layer(self, module: str) -> tuple[torch.nn.Module, str, torch.nn.Module]:
        """(parent, attribute, layer) holding the base weight of `module`, looking through peft's LoRA wrapper."""
        parent_name, _, attribute = module.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        layer = getattr(parent, attribute)
        if not isinstance(layer, torch.nn.Module):
            raise AttributeError(module)
        if hasattr(layer, "base_layer"):  # peft LoraLayer after use()
            parent, attribute, layer = layer, "base_layer", layer.base_layer
        return parent, attribute, layer

    def _quantized_base(self) -> bool:
        return bool(self._quantized_originals) or any(quantized.is_quantized_linear(m) for m in self.model.modules())

    def _write(self, module: str, terms: list[Term]) -> None:
        expert = self._expert_parameter(module)
        if expert is not None:  # a fused expert tensor: its name is the tensor's, it has no layer of its own
            self._pristine.remember(module, expert.data)
            new = merged_weight(self._pristine.get(module, expert.dtype), terms, expert.dtype, module=module)
            with torch.no_grad():
                expert.data.copy_(new)
            return
        parent, attribute, layer = self._layer(module)
        if module not in self._quantized_originals and quantized.is_quantized_linear(layer):
            self._quantized_originals[module] = layer
            self._pristine.remember_quantized(module + ".weight", layer)
        original = self._quantized_originals.get(module)
        if original is not None:
            self._write_quantized(module, parent, attribute, original, terms)
            return
        name = module + ".weight"
        self._pristine.remember(name, _weight(layer).data)
        if not terms and module in self._untied:  # pristine again: share the tied weight once more
            layer.weight = self._untied.pop(module)
            self._set_tie_flag()
            return
        if terms and name in self._tied and module not in self._untied:
            self._untie(module, layer)
        parameter = _weight(layer)
        new = merged_weight(self._pristine.get(name, parameter.dtype), terms, parameter.dtype, module=module)
        with torch.no_grad():
            parameter.data.copy_(new)

    def _untie(self, module: str, layer: torch.nn.Module) -> None:
        """Give `module` a weight of its own (see `finetune.adapters.tied`); the shared one stays untouched."""
        shared = _weight(layer)
        self._untied[module] = shared
        layer.weight = torch.nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
        self._set_tie_flag()

    def _set_tie_flag(self) -> None:
        """The config says tied only while every tied pair is: save_merged writes it, from_pretrained obeys it."""
        if self._ties_on_load:
            setattr(self.model.config, TIE_KEY, not self._untied)

    def _write_quantized(
        self, module: str, parent: torch.nn.Module, attribute: str, original: torch.nn.Module, terms: list[Term]
    ) -> None:
        """Replace a quantized layer by round(deq(W_q) + Σ w·ΔW) (dense, or requantized), or restore it."""
        if not terms:
            setattr(parent, attribute, original)
            self._requantization_errors.pop(module, None)
            return
        base = self._pristine.get(module + ".weight", self.dtype)
        weight = merged_weight(base, terms, self.dtype, module=module)
        if self.requantize:
            layer, relative_error = quantized.requantize(original, weight)
            self._requantization_errors[module] = relative_error
        else:
            layer = quantized.dense_linear_like(original, weight)
        setattr(parent, attribute, layer)

    # ---- unmerged switching ------------------------------------------------------------------------
    def use(self, name: str | None) -> None:
        """Switch adapter `name` on, unmerged, for every forward (peft multi-adapter); None switches it off."""
        self._per_row = False
        if name is None:
            if self._peft is not None:
                _tuner(self._peft).disable_adapter_layers()
            self._active = None
            return
        self.attach(name)
        assert self._peft is not None  # attach() made it
        self._peft.set_adapter(name)
        _tuner(self._peft).enable_adapter_layers()
        self._active = name

    def attach(self, name: str) -> None:
        """Load adapter `name` into peft's LoRA layers, unmerged, without switching it on (see `use_per_row`)."""
        adapter = self._adapter(name)
        if name in self._ledger.entries:
            raise AdapterError(
                f"adapter {name!r} is merged; using it unmerged too would count it twice (subtract it first)"
            )
        self._ledger.check_same_adapter(name, adapter)  # the same weights merged under another name
        if self._ledger.entries and self._quantized_base():
            raise AdapterError("on a quantized base use() needs nothing merged; subtract the merged adapters first")
        peft = import_peft()
        # bitsandbytes hidden: a no-op on a quantized base, which loaded it already. peft initialises the new LoRA
        # layers at random before it loads the saved weights over them: drawn from the caller's global generators,
        # a first use() moved a notebook's seeded RNG (the same seed then sampled differently before and after it)
        rng_kept = torch.random.fork_rng([self.device] if self.device.type == "cuda" else [], device_type="cuda")
        with warnings.catch_warnings(), bitsandbytes_hidden(), peft_target_rewrite_off(), rng_kept:
            warnings.simplefilter("ignore")
            if self._peft is None:
                self._peft = peft.PeftModel.from_pretrained(
                    self.model, str(adapter.path), adapter_name=name, is_trainable=False
                )
                _tuner(self._peft).disable_adapter_layers()  # attached, not in use: forwards stay the base's
                self._per_row = False
            elif name not in self._peft.peft_config:
                try:
                    self._peft.load_adapter(str(adapter.path), adapter_name=name, is_trainable=False)
                except ValueError as exc:
                    if "target_parameters" not in str(exc):
                        raise
                    raise AdapterError(
                        f"adapter {name!r} puts LoRA on other expert tensors or routers than the adapters attached "
                        f"before it ({', '.join(self._peft.peft_config)}), which peft cannot hold side by side "
                        "unmerged; merge it (serve --merge, or merge()), or use it in a process of its own"
                    ) from None
        self._expert_rows.install(self._peft)
        self._check_attached_whole(name, adapter)

    def _check_attached_whole(self, name: str, adapter: Adapter) -> None:
        """AdapterError (and the adapter detached again) unless peft put a LoRA layer of `name` on every module
        its weights hold. peft builds the layers from `target_modules` in adapter_config.json and drops weights
        of modules those do not name (a warning, hidden here): such an adapter was served, generated and `use`d
        as the base on those modules, while merging it (`--merge`, `merge`) applied every update."""
        for module in sorted(adapter.modules):
            if self._expert_parameter(module) is not None or module in self._routers:
                continue  # raw parameters: peft's `target_parameters`, applied by expert_rows
            layer = self.model.get_submodule(module)
            if name in getattr(layer, "lora_A", {}) or name in getattr(layer, "lora_embedding_A", {}):
                continue
            self._detach(name)
            raise AdapterError(
                f"adapter {name!r} ({adapter.path}) holds weights for {module}, which the target_modules of its "
                "adapter_config.json do not name: peft would leave that update out unmerged; fix target_modules "
                "(or re-save the adapter with peft)"
            )

    def _row_tensor(self, name: str, adapters: tuple[str, ...]) -> torch.Tensor:
        """Tensor `name` (an expert tensor or a router's weight) as merging `adapters` (weight 1 each) over
        what is merged would write it.

        The same `merged_weight` over the same terms (sorted by name) as `merge`, so bit for bit the merged
        model's tensor; the model's own tensor when none of `adapters` has LoRA on it (see `expert_rows`).
        """
        key, parameter = self._raw_parameter(name)
        weights = self._ledger.weights
        if not any(key in self.adapters[a].modules for a in adapters):
            return parameter
        for adapter in adapters:
            weights[adapter] = weights.get(adapter, 0.0) + 1.0
        holding = [a for a in sorted(weights) if key in self.adapters[a].modules]
        terms = [(a, weights[a], self.adapters[a].modules[key]) for a in holding]
        merged_here = any(key in self.adapters[a].modules for a in self._ledger.entries)
        base = self._pristine.get(name, parameter.dtype) if merged_here else parameter.detach()
        return merged_weight(base, terms, parameter.dtype, module=key)

    def _raw_parameter(self, name: str) -> tuple[str, torch.nn.Parameter]:
        """(the adapters' key, the parameter) of a tensor peft reaches as a raw parameter: a fused expert
        tensor, keyed by its own name, or a module's weight (a router's `...mlp.gate.weight`), keyed by it."""
        expert = self._expert_parameter(name)
        if expert is not None:
            return name, expert
        if not name.endswith(".weight"):
            raise AdapterError(f"LoRA on the parameter {name} is not supported unmerged; merge the adapter instead")
        module = name.removesuffix(".weight")
        return module, _weight(self._layer(module)[2])

    def _merged_and_attached(self, ledger: Ledger) -> str | None:
        """The first adapter both in `ledger` and attached for per-row use: a row naming it would get it twice,
        merged underneath and applied unmerged."""
        both = sorted(set(ledger.entries) & set(self.attached))
        return both[0] if both else None

    def use_per_row(self) -> torch.nn.Module:
        """Switch every attached adapter on for calls that name one adapter per row of a batch.

        Returns peft's model: call it with `adapter_names=[...]`, one attached adapter per row and
        "__base__" for base rows (peft's mixed-batch inference; DoRA, which peft refuses there, is
        refused by `finetune serve`'s engine; `read_adapter` only marks it unmergeable). Each row then gets what `use(name)` gives it alone; LoRA on
        fused expert tensors, which peft cannot apply per row, goes through `expert_rows`: each row's
        experts compute with the tensors merging its adapter writes. What is merged stays underneath
        every row; an adapter both merged and attached is refused (a row naming it would get it twice). Until `use(...)` ends this mode, a
        call without `adapter_names` applies peft's active adapter: always pass them. Adapters attached
        later take part too.

        Example:
            model = m.use_per_row()
            model(input_ids=ids, attention_mask=mask, adapter_names=["legal", "__base__"])
        """
        if self._peft is None:
            raise AdapterError("no adapter is attached; call attach(name) first")
        merged = self._merged_and_attached(self._ledger)
        if merged is not None:
            raise AdapterError(
                f"adapter {merged!r} is merged and attached: a row naming it would get it twice; subtract it, or "
                "remove_adapter it, before use_per_row"
            )
        if not self._per_row:  # switching costs a walk over every module: once, not per call
            _tuner(self._peft).enable_adapter_layers()
            self._active, self._per_row = None, True
        return self._peft

    @property
    def attached(self) -> list[str]:
        """Adapters loaded into peft's LoRA layers (by `use` or `attach`), sorted."""
        return sorted(self._peft.peft_config) if self._peft is not None else []

    def remove_adapter(self, name: str) -> None:
        """Forget adapter `name` and free its weights in peft; it must be neither merged nor in use."""
        self._adapter(name)
        if name in self._ledger.entries:
            raise AdapterError(f"adapter {name!r} is merged; subtract it before removing it")
        if name == self._active:
            raise AdapterError(f"adapter {name!r} is in use; call use(None) before removing it")
        self._detach(name)
        del self.adapters[name]
        self._tokenizers.pop(name, None)

    def _detach(self, name: str) -> None:
        """Take adapter `name` out of peft's LoRA layers, if it is there (the adapter stays known)."""
        if self._peft is None or name not in self._peft.peft_config:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if len(self._peft.peft_config) == 1:  # peft cannot hold zero adapters: take its layers out
                self._peft.unload()
                self._peft, self._per_row = None, False
            else:
                self._peft.delete_adapter(name)

    # ---- saving ------------------------------------------------------------------------------------
    def merged_state(self) -> dict[str, torch.Tensor]:
        """The model's base weights as `save_pretrained` names them, quantized layers dequantized to `dtype`."""
        state = dict(base_state_items(self.model))
        for module_name, layer in self.model.named_modules():
            if quantized.is_quantized_linear(layer):
                clean = module_name.replace(".base_layer", "")
                for key in [k for k in state if k.startswith(clean + ".") and k != clean + ".bias"]:
                    del state[key]
                state[clean + ".weight"] = quantized.dequantize(layer).to(self.dtype)
        return state

    def save_merged(self, out_dir: str | Path, *, max_shard_mb: float = 5000.0) -> Path:
        """Write the model with what is merged (not an adapter in `use`) as a plain transformers directory.

        The ledger goes into config.json and the safetensors metadata; quantized layers are written
        dequantized in `dtype`. The directory appears at `out_dir` only once complete.
        """
        if self._active is not None:
            warnings.warn(
                f"save_merged writes merged weights only; {self._active!r} is in use unmerged and is not saved",
                AdapterWarning,
                stacklevel=2,
            )
        state = self.merged_state()
        max_shard_bytes = int(max_shard_mb * 2**20)
        shards: list[dict[str, torch.Tensor]] = [{}]
        shard_bytes = 0
        for name, tensor in state.items():
            size = tensor.numel() * tensor.element_size()
            if shards[-1] and shard_bytes + size > max_shard_bytes:
                shards.append({})
                shard_bytes = 0
            shards[-1][name] = tensor
            shard_bytes += size
        with staging_dir(out_dir) as tmp:
            weight_map: dict[str, str] = {}
            for index, shard in enumerate(shards):
                weight_map.update(write_shard(tmp, shard_file_name(index, len(shards)), shard, self._ledger))
            if len(shards) > 1:
                write_index(tmp, weight_map, sum(t.numel() * t.element_size() for t in state.values()))
            if self.base_dir is not None:
                copy_side_files(self.base_dir, tmp)
            self._save_tokenizer(tmp)
            write_config(tmp, self.model.config.to_dict(), self._ledger, self.dtype)
        return Path(out_dir)

    def _save_tokenizer(self, out_dir: Path) -> None:
        """The merged adapters' tokenizer where they carry one (`tokenizer_files.shared_tokenizer_dir`), else the
        base's: a model merged from an adapter trained with `data.chat_template` chats with that template."""
        merged = [self.adapters[name] for name in self._ledger.entries if name in self.adapters]
        source = shared_tokenizer_dir(merged, "the merged model")
        if source is not None:
            copy_tokenizer(source, out_dir)
        elif self.base_tokenizer is not None:
            self.base_tokenizer.save_pretrained(out_dir)


def _tuner(peft: PeftModel) -> BaseTuner:
    """peft's LoRA tuner inside `peft`: peft types `PeftModel.base_model` as a plain Module."""
    return cast("BaseTuner", peft.base_model)


def _weight(layer: torch.nn.Module) -> torch.nn.Parameter:
    """`layer.weight`, typed: torch types a module's attributes as `Tensor | Module`."""
    return cast(torch.nn.Parameter, layer.weight)


def _weight_shape(layer: torch.nn.Module) -> tuple[int, int] | None:
    if quantized.is_quantized_linear(layer):
        return (layer.out_features, layer.in_features)
    weight = getattr(layer, "weight", None)
    # nn.Linear stores (out, in); transformers' Conv1D (GPT-2, fan_in_fan_out adapters) stores (in, out);
    # nn.Embedding (vocab, dim), the shape of an embedding LoRA's update.
    known = isinstance(layer, (torch.nn.Linear, torch.nn.Embedding)) or type(layer).__name__ == "Conv1D"
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and known:
        rows, columns = weight.shape
        return (rows, columns)
    return None

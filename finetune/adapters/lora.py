"""Read a LoRA adapter directory into fp32 (A, B, scale) per targeted module, and compute its updates.

This module owns what an adapter *is* for the arithmetic: for every targeted linear layer the update
ΔW = scale · B · A (transposed for `fan_in_fan_out`), with scale = alpha / r, or alpha / sqrt(r) for
rsLoRA, per-module r and alpha from `rank_pattern` / `alpha_pattern`: the semantics of peft's
`LoraLayer.get_delta_weight`, computed in fp32. LoRA on an embedding (peft's `lora_embedding_A` (r, vocab)
and `lora_embedding_B` (dim, r), whose update is (B·A)ᵀ) is held in the same (A, B) form, transposed, with
`embedding=True` so that writers give it peft's names back. LoRA on a mixture of experts' fused 3D expert
tensor (peft's `target_parameters`, a `ParamWrapper` with one rank-r pair per expert) is held with
`num_experts` > 1 and its update ΔW[e] = scale · B[:, :, e]·A[e] is the same `delta` (the layout of peft's
`ParamWrapper.get_delta_weight`; `experts.bind_experts` names the tensor and its orientation). Merge,
subtract, swap, combine, on-disk streaming and serving all take updates from `delta`. Everything that cannot be written as such a sum
is refused with an `AdapterError` rather than merged approximately: DoRA (its update depends on the norm of
the weight it is merged into, so weighted sums and exact subtraction have no meaning), LoRA biases,
conv LoRA, `modules_to_save` and trainable tokens (full replacement weights, not updates), and adapters saved
unconverted from an initialisation that rewrote the base (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA). Copies of the
base's embedding weights that peft saves beside embedding/head LoRA (`save_embedding_layers`) are kept in
`Adapter.base_copies`, so a base can be checked against them.

It also owns the safety checks that need only the adapter: names (no path separators, nothing peft or
torch reserve), pickle files (`adapter_model.bin` is refused unless `allow_pickle`, then read with
`torch.load(weights_only=True)`), NaN/Inf in A or B (named by adapter and module).

Example:
    adapter = read_adapter("adapters/legal")
    delta = adapter.delta("model.layers.0.self_attn.q_proj", weight=0.5)   # fp32, shape of W
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from finetune.errors import AdapterError
from finetune.manifest import Manifest, read_manifest
from finetune.quantization import Quantization

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."
# peft refuses adapter names contained in its tuner prefix ("lora_"), e.g. "lora" or "a".
PEFT_LORA_PREFIX = "lora_"
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,63}$")
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)\.weight$")
_EMBEDDING_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<which>A|B)$")
_BASE_COPY_KEY = re.compile(r"^(?P<module>.+)\.base_layer\.weight$")
# Config switches whose adapters are not a plain sum of B·A updates; value = why we refuse.
_UNSUPPORTED_CONFIG = {
    "lora_bias": "LoRA biases are not supported by adapter arithmetic",
    "modules_to_save": "modules_to_save replaces whole modules instead of adding an update",
    "trainable_token_indices": "trainable tokens replace embedding rows instead of adding an update",
    "layer_replication": "layer replication changes the model's structure",
    "use_qalora": "QA-LoRA's pooled update is not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "alora_invocation_tokens": "activated LoRA only applies after invocation tokens, it cannot be merged",
}


# peft initialisations that rewrite the base weight when they create the adapter (W_res = W - s·B₀A₀, or LoftQ's
# quantized W): an adapter saved so is an update of that rewritten weight, not of the base on disk, until peft
# converts it (`save_pretrained(path_initial_model_for_weight_conversion=...)`, which sets the init to True).
_BASE_REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


SCALING_CONFIG_KEYS = ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "fan_in_fan_out", "use_dora")
"""The keys of `adapter_config.json` on which an adapter's updates depend besides its weights."""
_DORA_KEY = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector$")
UNMERGEABLE_DORA = (
    "use_dora is set: DoRA's update depends on the norm of the weight it is merged into, so it has no exact "
    "weighted sum; use it unmerged (generate, eval, use())"
)


def validate_adapter_name(name: str) -> str:
    """Return `name` if it can name an adapter in peft and in the ledger, else raise `AdapterError`.

    Refused: path separators and dots (peft uses names as module keys, where "." splits the path),
    names contained in peft's "lora_" prefix (peft raises on them), and attribute names of torch's
    `ModuleDict` (e.g. "training", "keys"), which peft's per-adapter dicts cannot hold.
    """
    if not _NAME_PATTERN.match(name or ""):
        raise AdapterError(
            f"adapter name {name!r} is invalid: use 1-64 letters, digits, '_' or '-', starting with a letter or "
            "digit (no '/', '.', spaces)"
        )
    if _is_reserved(name):
        raise AdapterError(f"adapter name {name!r} is reserved by peft/torch; choose another name")
    return name


def _is_reserved(name: str) -> bool:
    return name in PEFT_LORA_PREFIX or hasattr(torch.nn.ModuleDict(), name)


def derived_adapter_name(raw: str) -> str:
    """A usable name made from a directory or manifest name (`legal.v2` -> `legal_v2`, `a` -> `a_adapter`).

    Characters peft cannot hold become '_'; a name peft or torch reserve gets an `_adapter` suffix. Only
    names the user did not choose are rewritten; an explicit name is validated as given.
    """
    name = re.sub(r"[^A-Za-z0-9_-]", "_", raw).lstrip("_-")[:56] or "adapter"
    return f"{name}_adapter" if _is_reserved(name) else name


@contextmanager
def ieee_fp32_matmuls() -> Iterator[None]:
    """fp32 matmuls in full IEEE fp32 on CUDA inside the block, whatever TF32 setting is in force.

    Users (and libraries) switch TF32 on for speed; an update computed with a 10-bit mantissa would
    break "computed in fp32" and the exactness that rests on it. CPU matmuls are fp32 already.
    """
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
        previous, matmul.fp32_precision = matmul.fp32_precision, "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = previous
        return
    previous_tf32, matmul.allow_tf32 = matmul.allow_tf32, False
    try:
        yield
    finally:
        matmul.allow_tf32 = previous_tf32


@dataclass(frozen=True)
class LoraWeights:
    """One targeted linear layer: A (r, in), B (out, r) in fp32 and the scale applied to B·A."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float
    fan_in_fan_out: bool = False
    embedding: bool = False
    """An embedding's LoRA: A here is peft's `lora_embedding_B`ᵀ (r, dim), B its `lora_embedding_A`ᵀ (vocab, r)."""
    num_experts: int = 1
    """> 1: LoRA on a fused 3D expert tensor (peft's `target_parameters`), one rank-r pair per expert held as
    peft holds it: A (experts·r, in) with row e·r + j, B (out, r·experts) with column j·experts + e."""
    transposed: bool = False
    """The expert tensor is stored (experts, in, out) instead of (experts, out, in) (set by `experts.bind_experts`)."""
    parameter: str | None = None
    """The expert tensor's parameter name once bound to a model (`down_proj`); None: keyed by peft's wrapper."""

    @property
    def rank(self) -> int:
        return self.A.shape[0] // self.num_experts

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """Shape of the base weight this update is added to."""
        out_features, in_features = self.B.shape[0], self.A.shape[1]
        if self.num_experts > 1:
            inner = (in_features, out_features) if self.transposed else (out_features, in_features)
            return (self.num_experts, *inner)
        return (in_features, out_features) if self.fan_in_fan_out else (out_features, in_features)

    def tensor_name(self, module: str) -> str:
        """The base tensor this update is added to: `<module>.weight`, or the expert tensor's own name."""
        return module if self.num_experts > 1 else module + ".weight"

    def peft_tensors(self, module: str) -> dict[str, torch.Tensor]:
        """This update under the names peft saves it with (`base_model.model.<module>.lora_A.weight`, ...)."""
        prefix = PEFT_PREFIX + module
        if self.embedding:
            return {
                f"{prefix}.lora_embedding_A": self.B.T.contiguous(),
                f"{prefix}.lora_embedding_B": self.A.T.contiguous(),
            }
        return {f"{prefix}.lora_A.weight": self.A.contiguous(), f"{prefix}.lora_B.weight": self.B.contiguous()}

    def delta(
        self, weight: float = 1.0, device: torch.device | str | None = None, *, expert: int | None = None
    ) -> torch.Tensor:
        """weight · scale · B·A in fp32 on `device` (default: where A and B are, the CPU), shaped like the base weight
        (`expert`: that expert's slice of a fused expert tensor's update, bit for bit the slice of the whole).

        The product comes first and the scalar after it, as peft's `get_delta_weight` computes it: at weight 1
        the update is peft's bit for bit, whatever alpha/r is (folding the scalar into B first rounds otherwise
        unless it is a power of two). The same call always rounds the same way: the arithmetic in `inmemory`
        and `ondisk` relies on identical results for identical inputs. The update is computed on the device of
        the weight it is added to, in full fp32 there (no TF32, whatever the process chose): the same inputs on
        the same device give the same bits.
        """
        A, B = self.A.to(device), self.B.to(device)
        if self.num_experts > 1:
            if expert is not None:
                return self._expert_delta(A, B, weight, expert)
            update = torch.empty(self.weight_shape, dtype=torch.float32, device=A.device)
            for e in range(self.num_experts):
                update[e] = self._expert_delta(A, B, weight, e)
            return update
        with ieee_fp32_matmuls():
            update = (B @ A) * (weight * self.scale)  # (out, r) @ (r, in) -> (out, in)
        return update.T if self.fan_in_fan_out else update

    def _expert_delta(self, A: torch.Tensor, B: torch.Tensor, weight: float, expert: int) -> torch.Tensor:
        """ΔW[e] = scale · B[:, :, e] · A[e] for expert e, peft's `ParamWrapper.get_delta_weight` layout.

        One matrix product per expert, also for the whole tensor: a merge can then stream a fused expert
        tensor expert by expert (memory of one expert's slice) and write the bits a whole merge writes."""
        rank = self.rank
        A_e = A[expert * rank : (expert + 1) * rank]  # (r, in)
        B_e = B[:, expert :: self.num_experts]  # (out, r): column j·experts + e
        with ieee_fp32_matmuls():
            update = (B_e @ A_e) * (weight * self.scale)  # (out, r) @ (r, in) -> (out, in)
        return update.T if self.transposed else update


@dataclass
class Adapter:
    """A LoRA adapter read from disk: per-module weights keyed by module name (`model.layers.0.self_attn.q_proj`)."""

    name: str
    path: Path
    config: dict
    modules: dict[str, LoraWeights]
    manifest: Manifest | None
    file_sha256: str = field(default="")
    base_copies: dict[str, torch.Tensor] = field(default_factory=dict)
    """module -> the base weight peft saved beside that module's LoRA (embeddings and head only)."""
    unmergeable: str | None = None
    """Why the adapter has no exact arithmetic (DoRA), or None: peft still applies it unmerged."""

    def check_mergeable(self) -> None:
        """AdapterError for an adapter that adapter arithmetic (merge, subtract, swap, combine, export) cannot take."""
        if self.unmergeable is not None:
            raise AdapterError(f"adapter {self.name!r} ({self.path}): {self.unmergeable}")

    @property
    def base_path(self) -> str | None:
        """Where the base lives: the manifest's path, else peft's `base_model_name_or_path`.

        A recorded local path that does not exist here (the adapter moved to another machine) gives way
        to the recorded id (`embedded:tiny-llama`, a hub id), which finds the base again; the fingerprint
        check then confirms it is the same weights.
        """
        if self.manifest is not None:
            base = self.manifest.base
            return base.path if Path(base.path).exists() else base.id
        return self.config.get("base_model_name_or_path") or None

    @property
    def base_fingerprint(self) -> str | None:
        return self.manifest.base.fingerprint if self.manifest is not None else None

    @property
    def trained_quantization(self) -> Quantization | None:
        """How the base was quantized when this adapter was trained (from its manifest; None without one)."""
        if self.manifest is None:
            return None
        recipe_model = (self.manifest.recipe or {}).get("model")
        fields = recipe_model if isinstance(recipe_model, dict) else {}
        recorded = Quantization.from_record({**fields, "quantization": self.manifest.base.quantization})
        loaded_as = self.manifest.base.dtype  # what bitsandbytes quantized from (see Quantization.weight_dtype)
        if recorded.method == "none" or loaded_as not in ("float32", "bfloat16", "float16"):
            return recorded
        return replace(recorded, weight_dtype=loaded_as)

    @property
    def scaling_sha256(self) -> str:
        """sha256 of the settings in `adapter_config.json` that turn the weights file into updates (alpha, rank
        and their patterns, rsLoRA, layout). An edit of the config alone changes every ΔW while the weights file's
        sha256 stays; a ledger keeps both, so subtracting after such an edit is refused. Taken from the config,
        not from the modules: binding expert tensors to a model renames and rescales those (`bind_experts`)."""
        settings = {key: self.config.get(key) for key in SCALING_CONFIG_KEYS}
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()

    @property
    def ranks(self) -> set[int]:
        return {w.rank for w in self.modules.values()}

    def delta(self, module: str, weight: float = 1.0, device: torch.device | str | None = None) -> torch.Tensor:
        return self.modules[module].delta(weight, device)

    def check_base_copy(self, module: str, base_weight: torch.Tensor) -> None:
        """Refuse a base whose `module` weight differs from the copy peft saved beside this adapter's LoRA."""
        copy = self.base_copies.get(module)
        if copy is not None and not torch.equal(copy.to(base_weight.dtype), base_weight.detach().cpu()):
            raise AdapterError(
                f"adapter {self.name!r} ({self.path}) carries its own copy of {module}.weight, which differs from the "
                "base's (a resized vocabulary?); it cannot be applied to this base"
            )


def pattern_key(pattern_keys, module: str) -> str:
    """The first `rank_pattern`/`alpha_pattern` key matching `module`, as peft's `get_pattern_key` does.

    Copied (three lines) rather than imported: importing peft costs seconds and the CLI's on-disk
    merges otherwise never need it. tests/test_adapters_inmemory.py checks the result against peft.
    """
    for key in pattern_keys:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def pattern_rank(config: dict, module: str) -> int:
    """The rank `adapter_config.json` gives `module`: its `rank_pattern` entry, else `r`."""
    rank_pattern = config.get("rank_pattern") or {}
    return rank_pattern.get(pattern_key(rank_pattern.keys(), module), config.get("r", 8))


def lora_scale(config: dict, module: str, rank: int) -> float:
    """The scale of `module`'s update, alpha / rank (alpha / √rank with rsLoRA), patterns looked up under `module`:
    peft's name for it (for an expert tensor the tensor's own, `...mlp.experts.down_proj`)."""
    alpha_pattern = config.get("alpha_pattern") or {}
    expected_rank = pattern_rank(config, module)
    alpha = alpha_pattern.get(pattern_key(alpha_pattern.keys(), module), config.get("lora_alpha", 8))
    if expected_rank != rank:
        raise AdapterError(
            f"adapter module {module}: lora_A has rank {rank} but adapter_config.json says r={expected_rank}"
        )
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _num_experts(path: Path, config: dict, module: str, rows: int) -> int:
    """How many experts a LoRA pair spans: its A's rows over the rank (1 unless peft's `target_parameters` made it)."""
    rank = pattern_rank(config, module)
    if not config.get("target_parameters") or rows == rank or rank <= 0 or rows % rank:
        return 1
    return rows // rank


def lora_module(key: str) -> str | None:
    """The module a saved tensor holds a LoRA A or B of (`base_model.model.x.q_proj.lora_A.weight` -> `x.q_proj`,
    embeddings' `lora_embedding_A` too), None for any other tensor (`finetune adapters list` reads names only)."""
    module_key = key.removeprefix(PEFT_PREFIX)
    match = _LORA_KEY.match(module_key) or _EMBEDDING_LORA_KEY.match(module_key)
    return match["module"] if match else None


def _read_tensors(path: Path, allow_pickle: bool) -> tuple[dict[str, torch.Tensor], str]:
    """The adapter file's tensors and the sha256 of the file."""
    safetensors_file, pickle_file = path / SAFETENSORS_NAME, path / PICKLE_NAME
    if safetensors_file.is_file():
        from safetensors.torch import load

        data = safetensors_file.read_bytes()
        try:
            return load(data), hashlib.sha256(data).hexdigest()
        except Exception as exc:  # safetensors raises SafetensorError, a plain Exception subclass
            raise AdapterError(f"{safetensors_file} is not a readable safetensors file ({exc}); re-save it") from None
    if pickle_file.is_file():
        if not allow_pickle:
            raise AdapterError(
                f"{pickle_file} is a pickle file, which can run code when loaded; convert it to safetensors or pass "
                "--allow-pickle (allow_pickle=True) if you trust it"
            )
        data = pickle_file.read_bytes()
        try:
            tensors = torch.load(pickle_file, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise AdapterError(f"{pickle_file} cannot be read weights-only ({str(exc).splitlines()[0]})") from None
        return tensors, hashlib.sha256(data).hexdigest()
    raise AdapterError(f"{path} has no {SAFETENSORS_NAME}; point at a directory written by peft's save_pretrained")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The keys of adapter_config.json this package reads, and what peft writes there: a check on what each holds
# (a hand-edited or foreign file with `"r": "8"` or a list for `rank_pattern`) says which key is wrong, where the
# arithmetic and the store listing would otherwise stop on an AttributeError or TypeError deep inside.
_CONFIG_TYPES: dict[str, tuple[str, Callable[[object], bool]]] = {
    "peft_type": ("a string", lambda v: isinstance(v, str)),
    "r": ("a whole number of at least 1", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
    "lora_alpha": ("a number", _is_number),
    "rank_pattern": (
        "an object of module name -> whole number",
        lambda v: isinstance(v, dict) and all(isinstance(r, int) and not isinstance(r, bool) for r in v.values()),
    ),
    "alpha_pattern": (
        "an object of module name -> number",
        lambda v: isinstance(v, dict) and all(map(_is_number, v.values())),
    ),
    "target_modules": (
        "a module name or a list of them",
        lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, str) for t in v)),
    ),
    "target_parameters": (
        "a list of parameter names",
        lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v),
    ),
}


_NOT_NULL = ("r", "lora_alpha")
"""Keys that may be left out (peft's defaults) but not given as null."""


def read_adapter_config(config_file: Path) -> dict:
    """`adapter_config.json` as a dict, its keys that finetune reads of the types peft writes (null allowed).

    Raises:
        AdapterError: unreadable, not JSON, not a JSON object, or a key of another type; the message names the key.
    """
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise AdapterError(f"{config_file} is not valid JSON ({exc}); re-save the adapter") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_file} holds a JSON {type(config).__name__}, not an object; re-save the adapter")
    for key, (expected, fits) in _CONFIG_TYPES.items():
        present = config.get(key) is not None or (key in _NOT_NULL and key in config)  # peft fails on a null r
        if present and not fits(config[key]):
            raise AdapterError(
                f"{config_file}: {key} is {config[key]!r}, not {expected}; fix that key or re-save the adapter with peft"
            )
    return config


def check_lora_type(path: Path, config: dict) -> None:
    """Refuse an adapter of another peft method (IA3, LoHa, prefix tuning, ...): every finetune command, the store's
    listing included, reads its config as LoRA's, where its rank, alpha and targets mean something else or nothing.

    Raises:
        AdapterError: `peft_type` is set and is not "LORA" (peft writes it; a config without one is read as LoRA).
    """
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(
            f"{path}: peft_type {config.get('peft_type')!r} is not LoRA; finetune takes LoRA adapters only (load this "
            "one with peft's PeftModel.from_pretrained)"
        )


def nested_adapters_hint(path: Path, otherwise: str) -> str:
    """How to fix a directory that is not an adapter: peft saves an adapter not named "default" in a subdirectory
    of its name (`save_pretrained(out)` of adapter "legal" writes out/legal/), so name the ones it holds."""
    inside = sorted(p for p in path.iterdir() if (p / CONFIG_NAME).is_file()) if path.is_dir() else []
    if not inside:
        return otherwise
    shown = ", ".join(str(p) for p in inside[:5]) + (", ..." if len(inside) > 5 else "")
    return f"it holds adapters in its subdirectories ({shown}): give one of them"


def read_adapter(path: str | Path, name: str | None = None, *, allow_pickle: bool = False) -> Adapter:
    """Read and check an adapter directory.

    Args:
        path: directory with `adapter_config.json` and `adapter_model.safetensors` (+ optional manifest).
        name: how the ledger and peft will call it; default: the manifest's name, else the directory name.
        allow_pickle: accept `adapter_model.bin`, read with `torch.load(weights_only=True)`.

    Raises:
        AdapterError: missing/malformed files, unsupported LoRA variants, NaN/Inf, invalid name.
    """
    path = Path(path)
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise AdapterError(
            f"{path} is not an adapter directory (no {CONFIG_NAME}); {nested_adapters_hint(path, 'give a directory written by peft')}"
        )
    config = read_adapter_config(config_file)
    check_lora_type(path, config)
    for key, why in _UNSUPPORTED_CONFIG.items():
        if config.get(key):
            raise AdapterError(f"{path}: {key} is set: {why}")
    _check_init(path, config.get("init_lora_weights"))
    manifest = read_manifest(path)
    name = validate_adapter_name(
        name or derived_adapter_name(manifest.name if manifest is not None else path.resolve().name)
    )
    tensors, file_sha256 = _read_tensors(path, allow_pickle)

    pairs, base_copies = _split_tensors(path, tensors)
    modules: dict[str, LoraWeights] = {}
    for module in sorted(pairs):
        A, B, embedding = _pair(path, module, pairs[module])
        for which, tensor in (("lora_A", A), ("lora_B", B)):
            if not torch.isfinite(tensor).all():
                raise AdapterError(f"adapter {name!r} ({path}): module {module} {which} holds NaN or Inf; refusing it")
        fan_in_fan_out = bool(config.get("fan_in_fan_out")) and not embedding
        experts = _num_experts(path, config, module, A.shape[0])
        scale = lora_scale(config, module, A.shape[0] // experts)
        modules[module] = LoraWeights(A, B, scale, fan_in_fan_out, embedding, num_experts=experts)
    stray = sorted(set(base_copies) - set(modules))
    if stray:
        raise AdapterError(f"{path}: tensor {stray[0]}.base_layer.weight belongs to no LoRA module of the adapter")
    return Adapter(
        name=name, path=path, config=config, modules=modules, manifest=manifest, file_sha256=file_sha256,
        base_copies=base_copies, unmergeable=UNMERGEABLE_DORA if config.get("use_dora") else None,
    )  # fmt: skip


def _check_init(path: Path, init: object) -> None:
    """Refuse an adapter saved unconverted from an initialisation that rewrote the base weight (PiSSA, OLoRA, ...).

    Its B·A is an update of the rewritten weight: added to the base on disk it keeps the part the init took out
    of the base (s·B₀A₀), so merged it is not the model that was trained. finetune writes its own PiSSA/OLoRA
    runs converted; peft converts PiSSA, CorDA, OLoRA and LoRA-GA ones, LoftQ's has no original-base form.
    """
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise AdapterError(
            f"{path}: init_lora_weights is {init!r}, which rewrote the base weights when the adapter was created, and "
            "the adapter was saved without converting it to an update of the original base; re-save it with peft's "
            "save_pretrained(..., path_initial_model_for_weight_conversion=DIR) (PiSSA, CorDA, OLoRA, LoRA-GA)"
        )


def _split_tensors(
    path: Path, tensors: dict[str, torch.Tensor]
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(module -> {"A"|"B"|"embedding_A"|"embedding_B": tensor}, module -> saved base weight)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    base_copies: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        module_key = key.removeprefix(PEFT_PREFIX)
        if match := _LORA_KEY.match(module_key):
            pairs.setdefault(match["module"], {})[match["which"]] = tensor
        elif match := _EMBEDDING_LORA_KEY.match(module_key):
            pairs.setdefault(match["module"], {})["embedding_" + match["which"]] = tensor
        elif match := _BASE_COPY_KEY.match(module_key):
            base_copies[match["module"]] = tensor
        elif _DORA_KEY.match(module_key):
            continue  # DoRA's magnitudes: peft applies them unmerged; the adapter is marked unmergeable
        elif module_key.endswith(".bias") and ".lora_" not in module_key:  # `lora.bias: all / lora_only`
            raise AdapterError(
                f"{path}: tensor {key} is a trained bias of the base (lora.bias: all or lora_only), which peft writes "
                "into the base layers themselves and does not take out when the adapter is off; finetune's adapter "
                "operations (generate, eval, serve, merge) do not take such adapters: load it with peft "
                "(PeftModel.from_pretrained), or train with lora.bias: none"
            )
        else:
            raise AdapterError(
                f"{path}: tensor {key} is not a LoRA A/B weight of a linear or embedding layer (conv LoRA and saved "
                "full modules are not supported by adapter arithmetic)"
            )
    if not pairs:
        raise AdapterError(f"{path}: the adapter file holds no LoRA weights")
    return pairs, base_copies


def _pair(path: Path, module: str, pair: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(A (r, in), B (out, r), is_embedding) in fp32 for one module, shapes checked."""
    if set(pair) == {"embedding_A", "embedding_B"}:
        embedding_A, embedding_B = pair["embedding_A"].to(torch.float32), pair["embedding_B"].to(torch.float32)
        if embedding_A.dim() != 2 or embedding_B.dim() != 2 or embedding_A.shape[0] != embedding_B.shape[1]:
            raise AdapterError(
                f"{path}: module {module} has lora_embedding_A {tuple(embedding_A.shape)} and lora_embedding_B "
                f"{tuple(embedding_B.shape)}, not (r, vocab) and (dim, r)"
            )
        return embedding_B.T.contiguous(), embedding_A.T.contiguous(), True
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{path}: module {module} has {', '.join(sorted(pair))} but not both LoRA A and B weights")
    A, B = pair["A"].to(torch.float32), pair["B"].to(torch.float32)
    if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
        raise AdapterError(
            f"{path}: module {module} has A {tuple(A.shape)} and B {tuple(B.shape)}, not (r, in) and (out, r)"
        )
    return A, B, False


def recorded_quantization(adapters: Iterable[Adapter], *, strict: bool = True) -> Quantization | None:
    """The quantization the adapters' manifests record for their base; None when none records one.

    A compute dtype they disagree on is dropped (it changes no dequantized weight). Adapters trained on
    differently quantized bases (none/4bit/8bit, nf4/fp4, double quantization or not) have no one base that
    reproduces what each learned against: `AdapterError` when `strict`, else None (the caller chooses). So do
    adapters whose runs loaded a quantized base in different dtypes (`Quantization.weight_dtype`).
    """
    named = [(a.name, a.trained_quantization) for a in adapters]
    recorded = [(name, q) for name, q in named if q is not None]
    if not recorded:
        return None
    kinds = {
        (q.method, q.weight_dtype, q.quant_type, q.double_quant) if q.method == "4bit" else (q.method, q.weight_dtype)
        for _, q in recorded
    }
    if len(kinds) > 1:
        if not strict:
            return None
        listed = ", ".join(f"{name}: {q.describe()}" + (f" from {q.weight_dtype}" if q.weight_dtype else "")
                           for name, q in recorded)  # fmt: skip
        raise AdapterError(
            f"the adapters were trained on differently quantized bases ({listed}); load them separately, or "
            "choose the base's quantization (quantization= / --quantization)"
        )
    first = recorded[0][1]
    return first if len({q.compute_dtype for _, q in recorded}) == 1 else replace(first, compute_dtype=None)

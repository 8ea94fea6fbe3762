"""The recipe: one typed, validated description of a fine-tuning run.

A recipe is YAML on disk plus `key=value` overrides from the command line; both go through the same
pydantic schema, once, at the boundary. Unknown keys are errors (never silently ignored), and every
problem is reported at once with its dotted path and, for a misspelt key, the closest valid one.

Relative paths in a recipe (base model, data files, output directories) are taken relative to the
current working directory, as with any command-line tool.

Example:
    recipe = load_recipe("recipes/quickstart.yaml", ["train.lr=1e-4", "lora.r=16"])
    recipe.lora.r  # 16
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from finetune.catalog import resolve_recipe_path
from finetune.cpu_features import has_bf16_units
from finetune.errors import RecipeError
from finetune.quantization import Method, Quantization, QuantType

EMBEDDED_BASE = "embedded:tiny-llama"
"""Model id of the embedded default base, shipped prebuilt in the package (see `finetune.embedded`)."""

_NAME_PATTERN = re.compile(r"^[A-Za-z0-9](?!.*\.\.)[A-Za-z0-9._-]{0,63}$")
"""An adapter's directory name under `adapters/`: no path separators, no `..`, no leading dot. Where the
name becomes a peft adapter name (a module key, which `.` would split), dots become `_` (`finetune.adapters.lora`)."""


class _Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, values are checked on assignment too, and no number
    is infinite or NaN (YAML's `.inf` passed `gt=0` and failed deep in training)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_truth_values_for_numbers(cls, data: Any) -> Any:
        """`lora.r=true` is not r 1: pydantic takes a bool for an int, and YAML writes yes/no/on/off as bools."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and _numbers_only(field.annotation):
                    raise ValueError(f"{name} must be a number, not {str(value).lower()}")
        return data


def _numbers_only(annotation: Any) -> bool:
    """Whether a field takes numbers (and maybe None) and nothing else."""
    kinds = {kind for kind in (get_args(annotation) or (annotation,)) if kind is not type(None)}
    return bool(kinds) and kinds <= {int, float}


class ModelConfig(_Section):
    """The base model and how to load it."""

    base: str = EMBEDDED_BASE
    """Local directory or hub id of a causal LM, or `embedded:tiny-llama` for the built-in default."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when `base` is a hub id."""
    tokenizer: str | None = None
    """Tokenizer directory or hub id; defaults to `base`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Dtype the frozen base weights are loaded in. LoRA weights are always trained in float32. `auto`
    (`Recipe.for_device`): bfloat16 on a GPU and on a CPU with bf16 units, float32 on other CPUs."""
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flex_attention"] = "sdpa"
    """Attention kernel; packing isolates documents in all of them (position ids restart per document). Left
    unset, a family transformers runs no sdpa for (gpt-oss, Gemma 2) loads with `eager` (`model.attention_for`)."""
    trust_remote_code: bool = False
    """Run modelling code shipped with a hub model. Off by default: it executes arbitrary Python."""
    check_updates: bool = False
    """Ask the hub for a newer revision of a hub model already in the local cache. Off by default: a cached
    model loads without touching the network (on a machine without internet the check costs minutes of
    retries). A model that is not cached is downloaded either way, unless `HF_HUB_OFFLINE=1`."""
    quantization: Method = Quantization.method
    """Load the frozen base with bitsandbytes (QLoRA for `4bit`). Also written as a mapping, as QLoRA users
    expect: `{bits: 4, type: nf4 | fp4, double_quant: true, compute_dtype: bfloat16}` or `{bits: 8}`, which
    sets the `bnb_4bit_*` fields below (`finetune.quantization` holds the defaults)."""
    bnb_4bit_quant_type: QuantType = Quantization.quant_type
    """Data type of a 4-bit base's weights: `nf4` (QLoRA's NormalFloat) or `fp4`."""
    bnb_4bit_use_double_quant: bool = Quantization.double_quant
    """Quantize a 4-bit base's per-block scales too (QLoRA's double quantization: about 0.4 bits a weight less)."""
    bnb_4bit_compute_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype 4-bit layers compute in (dequantized per matmul); default: `dtype`."""

    @model_validator(mode="before")
    @classmethod
    def _quantization_mapping(cls, data: Any) -> Any:
        """Turn `quantization: {bits, type, double_quant, compute_dtype}` into the flat fields."""
        if not isinstance(data, dict) or not isinstance(data.get("quantization"), dict):
            return data
        spec = dict(data["quantization"])
        fields = {"type": "bnb_4bit_quant_type", "double_quant": "bnb_4bit_use_double_quant"}
        fields["compute_dtype"] = "bnb_4bit_compute_dtype"
        unknown = sorted(set(spec) - {"bits", *fields})
        if unknown:
            raise ValueError(f"quantization: unknown key(s) {unknown}; use bits, type, double_quant, compute_dtype")
        if spec.get("bits") not in (4, 8):
            raise ValueError(f"quantization.bits is {spec.get('bits')!r}; use 4 (QLoRA) or 8")
        if spec["bits"] == 8 and len(spec) > 1:
            raise ValueError("quantization: type, double_quant and compute_dtype apply to bits: 4 only")
        for key, field in fields.items():  # both spellings of one setting: neither may quietly win
            if key in spec and field in data and data[field] != spec[key]:
                raise ValueError(
                    f"quantization.{key} is {spec[key]!r} but {field} is {data[field]!r}; give the setting once"
                )
        flat = {**data, "quantization": f"{spec['bits']}bit"}
        flat.update({fields[key]: value for key, value in spec.items() if key in fields})
        return flat

    @model_validator(mode="after")
    def _four_bit_options_need_four_bits(self) -> ModelConfig:
        """The `bnb_4bit_*` settings configure a 4-bit base only: with `8bit` or `none` bitsandbytes never reads
        them, and the run trained on a base other than the one the recipe seems to ask for. Compared with the
        defaults, not with what was given: a dumped recipe gives every field."""
        if self.quantization == "4bit":
            return self
        for name in ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype"):
            if getattr(self, name) != ModelConfig.model_fields[name].default:
                raise ValueError(
                    f"{name} applies to quantization 4bit only, and quantization is {self.quantization}; remove "
                    f"{name} or set model.quantization=4bit"
                )
        return self


_PEFT_SHAPE_KEYS = {"r": "r", "lora_alpha": "alpha", "use_rslora": "use_rslora", "lora_dropout": "dropout"}
"""peft's adapter_config.json key -> the lora section's field, for what an adapter fixes about a run."""


def starting_adapter_shape(adapter: Path) -> dict[str, Any]:
    """The lora fields an adapter directory's peft config fixes: rank, alpha, rsLoRA, dropout, and the target
    modules when they are plain module names (not the head or embeddings, which have switches of their own,
    nor a mixture of experts' fused tensors). {} when there is no readable LoRA config."""
    try:
        config = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        return {}
    shape = {field: config[key] for key, field in _PEFT_SHAPE_KEYS.items() if config.get(key) is not None}
    targets = config.get("target_modules")
    if isinstance(targets, list) and targets and not config.get("target_parameters"):
        if not any(name in ("lm_head", "embed_tokens") or "." in name for name in targets):
            shape["target_modules"] = sorted(targets)
    return shape


class LoraConfig(_Section):
    """The LoRA adapter: W + (alpha / r) · B·A on each targeted linear layer."""

    r: int = Field(8, ge=1, le=4096)
    """Rank of the update."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: the update is multiplied by alpha / r (alpha / sqrt(r) with rsLoRA)."""
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    """Dropout probability on the input of each LoRA update (peft's `lora_dropout`); the base weights see the input
    as it is. 0 for none."""
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """`all-linear` (every linear layer of the blocks, not the output head) or a list of module-name suffixes.
    On a mixture of experts `all-linear` also takes the fused expert tensors (peft's `target_parameters`: one
    rank-r pair per expert, so experts x r in all per tensor), without dropout there (peft has none for them)."""
    train_router: bool = False
    """On a mixture of experts, also put LoRA on the router (the layer that picks experts). Off by default:
    a moving router shifts which experts see which tokens, and the load balance the base was trained for."""
    train_lm_head: bool = False
    """Also put LoRA on the output head (`lm_head`, whatever the family calls it). A small model on a new
    domain gains most from this: on the quickstart it takes held-out perplexity from 9.2 to about 1.5,
    close to full fine-tuning (see the README's learning-quality table). With tied input/output embeddings
    the head's update stays the head's: merging unties the two (`finetune adapters merge`)."""
    train_embed_tokens: bool = False
    """Also put LoRA on the input embeddings (`embed_tokens`), as continued pretraining on a new vocabulary
    mix does. Its learning rate is `train.embedding_lr`."""
    exclude_modules: list[str] = []
    """Module names (or name suffixes) left out of `target_modules`, as peft's `exclude_modules` matches them."""
    use_rslora: bool = False
    """Scale by alpha / sqrt(r) instead of alpha / r (rank-stabilised LoRA)."""
    use_dora: bool = False
    """Weight-decomposed LoRA: learns a magnitude vector beside A and B."""
    init: Literal["default", "gaussian", "pissa", "olora"] = "default"
    """How A and B start: peft's `init_lora_weights` (B = 0 in `default`, so training starts at the base). `pissa`
    and `olora` move the base's principal (QR) components into the adapter; the adapter is written as a plain
    LoRA of rank 2r on the base on disk (`finetune.training.mutated_start`)."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Which of the base's biases train beside LoRA, as peft's `bias`: `none`; `all`, every bias; `lora_only`, the
    biases of the layers LoRA targets. Trained biases are saved with the adapter, which is then peft's to load:
    `generate`, `eval`, `serve` and the adapter operations refuse it (peft leaves the biases in the base)."""
    init_from: str | None = None
    """An adapter directory the LoRA weights start from instead of `init` (e.g. the SFT adapter a preference
    run refines). Its shape is the run's: `r`, `alpha`, `use_rslora`, `dropout` and `target_modules` not
    given in the recipe are read from its `adapter_config.json` (as peft's `PeftModel.from_pretrained` and
    trl take them); given ones must agree with it. The adapter written at the end is whole (the starting
    weights plus what this run learnt), usable like any other. The reference policy of dpo, kto and grpo's
    KL is then that adapter (its weights are kept aside and swapped in for reference passes, or dpo's are
    precomputed)."""

    @model_validator(mode="before")
    @classmethod
    def _shape_of_the_starting_adapter(cls, data: Any) -> Any:
        """Fill the fields the recipe leaves out from `init_from`'s peft config. An unreadable adapter is left
        to the run, which says what is wrong with it (`finetune.training.preference_setup.initial_adapter`)."""
        if not isinstance(data, dict) or not data.get("init_from"):
            return data
        return {**starting_adapter_shape(Path(str(data["init_from"]))), **data}

    @property
    def starts_as_base(self) -> bool:
        """Whether the LoRA model starts as the base (B = 0): not from another adapter, nor from a PiSSA/OLoRA
        initialisation that moves part of the base into the adapter."""
        return self.init_from is None and self.init not in ("pissa", "olora")

    @property
    def disabling_gives_start(self) -> bool:
        """Whether the model with its adapter disabled is the model as the run started, so reference passes may
        disable it: LoRA starts as the base, and trains nothing `disable_adapter()` leaves on (`bias: all` and
        `lora_only` train the base layers' own biases, which stay as trained with the adapter off)."""
        return self.starts_as_base and self.bias == "none"

    @model_validator(mode="after")
    def _one_start(self) -> LoraConfig:
        if self.init_from is not None and self.init in ("pissa", "olora"):
            raise ValueError(
                f"init {self.init} starts a new adapter from the base's own components, and init_from starts from "
                "that adapter: leave init at default with init_from"
            )
        return self

    @field_validator("target_modules", mode="before")
    @classmethod
    def _one_module_as_a_list(cls, value: Any) -> Any:
        """`lora.target_modules=q_proj` means [q_proj] (peft would read a string as a regex over the whole module
        path, which `q_proj` never matches)."""
        if isinstance(value, str) and value.lower().replace("_", "-") == "all-linear":
            return "all-linear"
        if isinstance(value, str) and re.fullmatch(r"[\w.]+", value):
            return [value]
        if isinstance(value, str) and value != "all-linear":
            raise ValueError("give 'all-linear' or a list of module names such as [q_proj, v_proj]")
        return value

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must name at least one module, or be 'all-linear'")
        return value


class SourceConfig(_Section):
    """One data source: a local file or a dataset saved with `save_to_disk`."""

    path: str = Field(min_length=1)
    """A .jsonl/.json/.csv/.parquet/.txt file, a directory written by `datasets.save_to_disk`, or a hub dataset
    id (`org/name`) in the local hub cache. Not empty: "" was read as the current directory."""
    split: str | None = None
    """Split to read from a saved `DatasetDict` or a hub dataset (default: `train`)."""
    subset: str | None = None
    """Configuration (subset) of a hub dataset, e.g. `main` of `openai/gsm8k`."""
    max_records: int | None = Field(None, ge=1)
    """Read at most this many records (after loading, before tokenizing)."""


def _as_sources(value: Any) -> Any:
    """Accept `path`, `[path, ...]` or full mappings, so short recipes stay short; null is no source
    (`data.validation=null` drops a recipe's held-out data)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list):
        return [{"path": item} if isinstance(item, str) else item for item in value]
    return value


class DataConfig(_Section):
    """Where the data comes from and how records become token ids and labels."""

    train: list[SourceConfig] = Field(min_length=1)
    """Training sources; a single path is accepted as shorthand."""
    validation: list[SourceConfig] = []
    """Held-out sources for eval loss and perplexity. Leave empty to split `validation_split` off `train`."""
    validation_split: float = Field(0.0, ge=0.0, lt=1.0)
    """Fraction of the training records held out (seeded by `train.seed`) when `validation` is empty."""
    format: Literal["text", "instruction", "chat", "preference", "unpaired_preference", "prompt"] = "text"
    """`text`: raw documents (continued pretraining); `instruction`: prompt/response pairs;
    `chat`: message lists rendered with the tokenizer's chat template; `preference`: `{prompt, chosen,
    rejected}` pairs (dpo, orpo, simpo); `unpaired_preference`: `{prompt, completion, label}` (kto). In the
    preference formats each of prompt and completions is a string, or a list of chat messages rendered with
    the chat template as `chat` is; only the completions (with their end-of-turn or EOS token) are trained.
    `prompt`: `{prompt, ...}` records for grpo (a string, or chat messages rendered with the chat template
    and its generation prompt); every other field reaches the reward functions as a keyword argument."""
    text_field: str = "text"
    """Text records: the field holding the document (`.txt` sources are read into it)."""
    prompt_field: str = "instruction"
    """Instruction records: the field holding the instruction (the prompt's `{prompt}`)."""
    input_field: str | None = "input"
    """Optional context field of instruction records; used when present and non-empty."""
    response_field: str = "output"
    """Instruction records: the field holding the response (what is trained)."""
    messages_field: str = "messages"
    """Chat records: the field holding the OpenAI-style message list (ShareGPT `conversations` is read without it)."""
    tools_field: str = "tools"
    """Chat and preference records: the field holding the function schemas given to the chat template (a
    list, or that list as JSON text); when a record has it, every tool call must name one of them."""
    reasoning: Literal["template", "every_turn", "none"] = "template"
    """Chat records' reasoning (`reasoning_content`, `thinking`, or inline `<think>`): `template` trains
    what the template renders (Qwen3 and gpt-oss drop earlier turns' reasoning, as the model sees them at
    inference); `every_turn` makes one document per assistant turn, so each turn's reasoning is trained
    where its turn is the last; `none` drops all reasoning and renders with `enable_thinking=false`."""
    prompt_template: str = "### Instruction:\n{prompt}\n\n### Response:\n"
    """Instruction format: how the prompt is rendered; must contain `{prompt}`."""
    prompt_with_input_template: str = "### Instruction:\n{prompt}\n\n### Input:\n{input}\n\n### Response:\n"
    """Instruction format, records with a non-empty input field; must contain `{prompt}` and `{input}`."""
    chat_template: str | None = None
    """Jinja chat template overriding the tokenizer's own (chat format)."""
    completion_only_loss: bool = True
    """Instruction/chat: put the loss on responses (assistant turns) only, EOS included."""
    max_seq_len: int = Field(512, ge=8)
    """Longest document in tokens; longer records go through `overlength`."""
    overlength: Literal["split", "truncate", "truncate_prompt", "error"] | None = None
    """A record longer than max_seq_len: `split` into consecutive pieces of at most max_seq_len tokens, each
    trained as a document of its own (BOS only on the first, EOS only at the true end; the first token of
    each later piece is context, not a target), as pretraining pipelines do; `truncate` keeps the first
    max_seq_len tokens; `error` stops naming the record. The log says how many tokens each choice keeps.
    Default: `split` for `text`, `truncate` for `instruction` and `chat`, where `split` is refused (a piece
    of a conversation without its prompt is not an example of the task). The preference formats also take
    `truncate_prompt`: the prompt loses tokens from its start (after its first) until the longer completion
    fits, as preference trainers' `max_prompt_length` does; with `truncate` a record whose prompt leaves no
    room for a completion token is an error naming how many there are."""
    packing: bool = True
    """Pack each micro-batch's documents into as few rows as fit (each no longer than its longest document;
    documents never attend to each other) instead of one padded row each. It changes speed only, not what
    is learned: a micro-batch is `train.micro_batch_size` documents either way."""
    num_proc: int | None = Field(None, ge=1)
    """Processes that tokenize the data (default: every core this process may use). The rows are the same
    for any number, so it is not part of the data fingerprint; lower it to leave cores to other work."""

    @field_validator("train", "validation", mode="before")
    @classmethod
    def _coerce_sources(cls, value: Any) -> Any:
        return _as_sources(value)

    @model_validator(mode="after")
    def _resolve_overlength(self) -> DataConfig:
        if self.overlength is None:  # resolved here, so the saved recipe says what was done
            object.__setattr__(self, "overlength", "split" if self.format == "text" else "truncate")
        elif self.overlength == "split" and self.format != "text":
            raise ValueError(
                f"data.overlength=split applies to format text only (this is {self.format}): a piece of a record "
                f"without its prompt is not an example of the task; use truncate or error"
            )
        elif self.overlength == "truncate_prompt" and self.format not in PREFERENCE_FORMATS:
            raise ValueError(
                f"data.overlength=truncate_prompt applies to the preference formats only (this is {self.format}); "
                "use truncate or error"
            )
        return self

    @model_validator(mode="after")
    def _templates_have_placeholders(self) -> DataConfig:
        if "{prompt}" not in self.prompt_template:
            raise ValueError("data.prompt_template must contain '{prompt}'")
        if "{prompt}" not in self.prompt_with_input_template or "{input}" not in self.prompt_with_input_template:
            raise ValueError("data.prompt_with_input_template must contain '{prompt}' and '{input}'")
        if self.chat_template is not None and "{%" not in self.chat_template and "{{" not in self.chat_template:
            # a file's path (trl takes one) would render as its own text: every record trained on the path alone
            shown = self.chat_template if len(self.chat_template) <= 60 else self.chat_template[:57] + "..."
            raise ValueError(
                f"data.chat_template must be a Jinja template's text, got {shown!r} (no {{% %}} or {{{{ }}}} in it); "
                "paste the template itself (a YAML block scalar `|`), not the path of a file"
            )
        return self


PREFERENCE_FORMATS = ("preference", "unpaired_preference")

OBJECTIVE_SETTINGS: dict[str, dict[str, Any]] = {
    "sft": {},
    "dpo": {"beta": 0.1, "dpo_loss": "sigmoid", "rpo_alpha": 0.0, "precompute_reference": False},
    "orpo": {"orpo_lambda": 0.1},
    "simpo": {"beta": 2.5, "simpo_gamma": 1.375, "cpo_alpha": 0.0},
    "kto": {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0},
    "grpo": {
        "beta": 0.0,
        "reward_functions": [],
        "reward_weights": [],
        "num_generations": 8,
        "max_completion_length": 256,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "loss_type": "dapo",
        "epsilon": 0.2,
        "epsilon_high": 0.0,
        "num_iterations": 1,
        "scale_rewards": "group",
        "mask_truncated_completions": False,
    },
}
"""The `train` fields each objective reads, with their defaults (filled in when not given, so the saved recipe
says what was used); a field given for an objective that does not read it is an error."""
OBJECTIVE_FORMATS = {
    "dpo": "preference",
    "orpo": "preference",
    "simpo": "preference",
    "kto": "unpaired_preference",
    "grpo": "prompt",
}
OWN_ROW_FORMATS = (*PREFERENCE_FORMATS, "prompt")
"""Formats whose rows are not documents: each objective that reads one has its own columns."""


TRACKER_PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb", "trackio": "trackio"}
"""`train.report_to` name -> the package that must be importable (and pip-installable under that name)."""
TRACKER_DISTRIBUTIONS = {"mlflow": ("mlflow", "mlflow-skinny")}
"""The installed distributions that provide a tracker's package, where not just the package's own name."""


def tracker_installed(name: str) -> bool:
    """Whether `train.report_to`'s `name` is installed as accelerate sees it: its package importable and one of
    its distributions installed. `find_spec` alone takes a directory of the package's name on sys.path (the
    working directory, under `python -m` or in a notebook: a `./wandb/` left by a script run elsewhere, a
    `TRACKIO_DIR` of `./trackio`) for the package; accelerate then dropped the tracker without a word, and the
    run reported to nothing."""
    from importlib.metadata import PackageNotFoundError, distribution  # here: 11 ms of start-up otherwise

    package = TRACKER_PACKAGES[name]
    if importlib.util.find_spec(package) is None:
        return False
    for name_of_distribution in TRACKER_DISTRIBUTIONS.get(name, (package,)):
        try:
            distribution(name_of_distribution)
            return True
        except PackageNotFoundError:
            continue
    return False


def _check_grpo_settings(train: TrainConfig) -> None:
    """What grpo's settings must agree on."""
    if not train.reward_functions:
        raise ValueError(
            "grpo needs train.reward_functions: a list of `path/to/file.py:function` or built-ins (exact_match, "
            "regex, length)"
        )
    weights = train.reward_weights
    if weights and len(weights) != len(train.reward_functions):
        raise ValueError(
            f"train.reward_weights has {len(weights)} values for {len(train.reward_functions)} reward functions; give "
            "one weight per function"
        )
    if weights and not all(abs(weight) <= 1e6 for weight in weights):  # infinite or NaN ones: _Section refuses
        raise ValueError(f"train.reward_weights {weights}: give weights of at most 1e6 in size")
    if not train.epsilon_high:
        object.__setattr__(train, "epsilon_high", train.epsilon)


class TrainConfig(_Section):
    """The optimisation: how long, how fast, how often to evaluate and save."""

    @property
    def reference_passes(self) -> bool:
        """Whether training runs passes of the reference policy: dpo (unless they are precomputed), kto, and grpo
        with a KL term (beta > 0). Where disabling the adapter does not give the starting model, those passes swap
        the starting weights in (`Recipe.reference_swaps_start`)."""
        return {"dpo": not self.precompute_reference, "kto": True, "grpo": bool(self.beta)}.get(self.objective, False)

    def compiles(self, device_type: str, quantized: bool, checkpointing: bool | None = None) -> bool:
        """`compile` resolved: `auto` compiles where it was measured to pay, CUDA with an unquantized base (a 1B
        Llama LoRA on an H100: 52k tokens/s compiled, 29k eager, 40 s of compiling); not on the CPU, where the
        first step compiles for minutes, nor on a bitsandbytes base (its layers compile, equal to eager, on the
        CPU; what that is worth on a GPU is not measured), nor with gradient checkpointing (inductor's
        partitioner failed on a checkpointed 8B Llama layer, torch 2.11 on an H100: "Node add_697 was invalid,
        but is output"), nor for GRPO, whose step is mostly
        sampling (eager) and whose update forwards change shape every step (a bf16 GRPO run on an H100 hit
        torch's recompile limit; `compile: true` still asks for it), nor with `liger_kernels` (Triton kernels
        inside compiled layers: not yet run on a GPU). `checkpointing`: whether any layer is checkpointed, where
        `gradient_checkpointing: auto` has been resolved (else `auto` counts as checkpointing)."""
        if self.compile == "auto":
            if checkpointing is None:
                checkpointing = self.gradient_checkpointing not in (False, 0)
            eager_only = quantized or checkpointing or self.objective == "grpo" or self.liger_kernels
            return device_type == "cuda" and not eager_only
        return bool(self.compile)

    def checkpointed_layers(self, num_layers: int) -> int:
        """How many of `num_layers` decoder layers `gradient_checkpointing` recomputes (`auto` is resolved against
        the device's memory first: `finetune.plan.memory.estimate`)."""
        setting = self.gradient_checkpointing
        if setting == "auto":
            raise ValueError("train.gradient_checkpointing auto: resolve it with the device's memory first")
        if isinstance(setting, bool):
            return num_layers if setting else 0
        if setting > num_layers:
            raise RecipeError(
                f"train.gradient_checkpointing {setting}: the base has {num_layers} decoder layers; give at most "
                f"{num_layers} (or true for all of them)"
            )
        return setting

    @field_validator("gradient_checkpointing")
    @classmethod
    def _layer_count_is_not_negative(cls, value: bool | int | str) -> bool | int | str:
        if not isinstance(value, bool) and isinstance(value, int) and value < 0:
            raise ValueError(f"{value} layers: give true, false, auto or a number of decoder layers (0 or more)")
        return value

    epochs: float | None = Field(1.0, gt=0)
    """Passes over the training data; ignored when `max_steps` is set. Steps run on across epoch boundaries, and
    the last step takes only the micro-batches left (fewer than `grad_accum_steps` where they do not divide), so
    each document is trained `epochs` times, none more."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps to run; overrides `epochs`."""
    micro_batch_size: int = Field(4, ge=1)
    """Documents per forward pass, per process (the Trainer's `per_device_train_batch_size`). With packing
    they are packed into as few rows as fit; without, each is a row padded to the longest. An optimizer
    step takes micro_batch_size x grad_accum_steps x processes documents, packed or not, so packing
    changes speed, never the number of steps or what they learn."""
    grad_accum_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step. The loss is the mean over the label tokens of all of them."""
    lr: float = Field(2e-4, gt=0)
    """Peak learning rate of the LoRA weights, reached at the end of warmup; `schedule` takes it from there."""
    embedding_lr: float | None = Field(None, gt=0)
    """Learning rate of the LoRA weights on `lm_head`/`embed_tokens` (`lora.train_lm_head`,
    `lora.train_embed_tokens`, or a target list naming them); default `lr`. Refused where neither is trained, as it
    would set nothing. unsloth's continued-pretraining docs train them at a rate 10x
    below the blocks' (5e-6 against 5e-5)."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """The learning rate after warmup, as transformers' schedulers: `cosine` and `linear` decay to 0 at the last
    step, `constant` stays at `lr`."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps over which the learning rate rises linearly from 0 to `lr`."""
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    """Warmup as a fraction of the total steps, rounded up (as the HF Trainer's `warmup_ratio`); used when
    `warmup_steps` is 0."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW's decoupled weight decay, on the trained weights except biases and norms (as the HF Trainer leaves
    them out): a base's biases that `lora.bias` trains keep what they learned in pretraining."""
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    """AdamW's decay rate of the gradient's running mean."""
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    """AdamW's decay rate of the squared gradient's running mean."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon, added to the denominator."""
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = "adamw"
    """`adamw`: torch's AdamW (fused where torch has it), 32-bit state. `adamw_8bit`, `paged_adamw_8bit`: bitsandbytes' AdamW with 8-bit
    state (paged: in memory that can move to the host under pressure); they need bitsandbytes."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this; null turns clipping off."""
    nonfinite_skips: int = Field(0, ge=0)
    """Optimizer steps with a NaN/Inf loss or gradient that may be skipped (no update of the weights, Adam's
    state or the schedule) before the run stops with an error naming the step; 0 stops at the first one.
    No adapter is written when the run stops."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "fp32"
    """Autocast precision of the forward pass (mixed precision); trainable weights stay float32. `auto`: bf16
    where `model.dtype: auto` picks bfloat16, else fp32."""
    gradient_checkpointing: bool | int | Literal["auto"] = False
    """Recompute decoder layers' activations in the backward instead of keeping them: `true` every layer (each
    keeps only its input, and runs again in the backward: about a third more matmul work a step), `false` none,
    N the first N layers, `auto` the fewest layers with which `finetune plan`'s peak fits 90% of the memory the run
    can have: the device's free memory plus what the run holds (every layer where that memory is unknown). Where the memory allows, fewer checkpointed layers are
    less work for the same result."""
    varlen_attention: bool | Literal["auto"] = "auto"
    """Attention over packed rows from the documents' boundaries, no mask (`finetune.training.varlen_attention`):
    torch's varlen FlashAttention on CUDA, one SDPA per document elsewhere. `auto`: on with CUDA, a 16-bit
    base and torch >= 2.10, off (the document mask) on the CPU, where the mask path measured faster."""
    compile: bool | Literal["auto"] = "auto"
    """`torch.compile` each decoder layer (`finetune.training.regional_compile`): the first steps of each shape
    compile (about 40 s for a 1B Llama on an H100, 80 s for a tiny model on a loaded 2-core CPU), later ones
    run the compiled layers. `auto` (`compiles`): on for an unquantized base on CUDA where no layer is checkpointed
    (measured on a bf16 one), off on the CPU, for a 4-bit or 8-bit base, with gradient checkpointing, for GRPO and
    with `liger_kernels`."""
    liger_kernels: bool = False
    """On CUDA, Liger Kernel's Triton RMSNorm, RoPE and SwiGLU in the base's layers (`pip install
    'finetune[liger]'`; `finetune.training.liger_kernels`): fewer, fused elementwise kernels per step. Not used
    on the CPU (said in one line)."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seeds LoRA initialisation, dropout, the data order and the validation split (numpy and accelerate take 0 to 2**32 - 1)."""
    log_every_steps: int = Field(10, ge=1)
    """Write a training record to metrics.jsonl and the trackers, and a console line, every N optimizer steps (and
    at the last); a step's figures are read from the device only then."""
    eval_every_steps: int | None = Field(None, ge=1)
    """Evaluate every N optimizer steps (and always at the end when there is validation data)."""
    save_every_steps: int | None = Field(None, ge=1)
    """Write a resumable checkpoint every N optimizer steps (and at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many checkpoints to keep in the run directory."""
    eval_max_batches: int | None = Field(None, ge=1)
    """Evaluate on the first N batches of the validation data only (every evaluation the same ones): quicker, and
    the held-out figures are then those of that subset."""

    @field_validator("eval_every_steps", "save_every_steps", "eval_max_batches", mode="before")
    @classmethod
    def _zero_is_not_none(cls, value: Any) -> Any:
        if value == 0 and not isinstance(value, bool):  # the HF Trainer's users write 0 (or "no") for none
            raise ValueError("0 is no interval or count: give 1 or more, or null for none")
        return value

    report_to: list[Literal["tensorboard", "mlflow", "wandb", "trackio"]] = ["tensorboard"]
    """Experiment trackers that also receive the run's metrics (through accelerate); [] for none.
    mlflow, wandb and trackio need their package (`pip install 'finetune[wandb]'`); offline use:
    `MLFLOW_TRACKING_URI` (a local store), `WANDB_MODE=offline`. See `finetune.training.tracking`."""
    tracker_project: str = "finetune"
    """Project (wandb, trackio) or experiment (mlflow) the run is filed under; the run is `output.name`."""
    objective: Literal["sft", "dpo", "orpo", "simpo", "kto", "grpo"] = "sft"
    """What the run minimises (`finetune.training.objectives`). `sft`: the next-token loss of the labelled
    tokens (text, instruction, chat data). With `data.format: preference`: `dpo` (Rafailov et al. 2023: the
    log-sigmoid of β times the chosen completion's log-probability gain over the reference policy minus the
    rejected one's), `orpo` (Hong et al. 2024: the chosen completion's NLL plus λ times a log odds-ratio
    penalty, no reference), `simpo` (Meng et al. 2024: length-normalised log-probabilities and a margin γ, no
    reference). With `unpaired_preference`: `kto` (Ethayarajh et al. 2024: desirable and undesirable
    completions, each against a KL baseline). A micro-batch is `micro_batch_size` records (pairs, for the
    paired ones) either way. With `data.format: prompt`: `grpo` (Shao et al. 2024, as trl's GRPOTrainer
    defines it): sample `num_generations` completions of each prompt from the model as it is, score them
    with `reward_functions`, and push the policy toward those above their group's mean; a micro-batch is
    `micro_batch_size` prompts, each with its `num_generations` completions."""
    beta: float | None = Field(None, ge=0)
    """dpo, simpo, kto: β, the scale of the implicit reward. dpo/kto: r = β·log(π(y|x) / π_ref(y|x)), default 0.1
    (trl's); simpo: r = β·mean token log π(y|x), default 2.5 (SimPO's Llama-3-8B-Instruct recipe)."""
    dpo_loss: Literal["sigmoid", "ipo", "hinge"] | None = None
    """dpo: `sigmoid` (the DPO paper's -log σ(β·Δ)), `ipo` ((Δ/n − 1/(2β))², Δ per completion token, as trl
    and the IPO authors normalise it), `hinge` (max(0, 1 − β·Δ), SLiC); Δ is the reward-margin log-ratio."""
    rpo_alpha: float | None = Field(None, ge=0)
    """dpo: weight α of an NLL term on the chosen completions beside the DPO loss (RPO, Pang et al. 2024; trl's
    `loss_type=["sigmoid", "sft"]` with `loss_weights=[1, α]`): the mean −log π over the chosen completions'
    tokens. It keeps the chosen completions likely while the margin grows (default 0: DPO alone)."""
    precompute_reference: bool | None = None
    """dpo: compute the reference policy's log-probabilities of every pair the run trains on once before
    training (the model as it starts) and keep them in the run directory, instead of a forward pass of the base
    with the adapter disabled at every step (default: off)."""
    orpo_lambda: float | None = Field(None, gt=0)
    """orpo: λ, the weight of the odds-ratio term beside the chosen completion's NLL (default 0.1, trl's)."""
    simpo_gamma: float | None = Field(None, ge=0)
    """simpo: γ, the target margin of the length-normalised rewards (default 1.375: SimPO's Llama-3-8B-Instruct
    recipe, γ/β = 0.55 at β = 2.5)."""
    cpo_alpha: float | None = Field(None, ge=0)
    """simpo: weight of an NLL term on the chosen completions beside SimPO's (CPO-SimPO; default 0: SimPO alone)."""
    desirable_weight: float | None = Field(None, gt=0)
    """kto: weight of a desirable completion's loss (default 1; KTO suggests weights that balance the two kinds)."""
    undesirable_weight: float | None = Field(None, gt=0)
    """kto: weight of an undesirable completion's loss (default 1)."""
    reward_functions: list[str] | None = None
    """grpo: the rewards, each `path/to/file.py:function` (imported from that file only, called as trl calls
    it: `f(prompts, completions, completion_ids, **columns) -> list[float | None]`) or a built-in
    (`finetune.training.rewards`: `exact_match(column=answer)`, `regex(pattern=...)`, `length(target=64)`).
    The reward of a completion is their weighted sum."""
    reward_weights: list[float] | None = None
    """grpo: one weight per reward function (default: 1 each)."""
    num_generations: int | None = Field(None, ge=2)
    """grpo: completions sampled per prompt (a group; advantages are taken within it). trl's default, 8."""
    max_completion_length: int | None = Field(None, ge=1)
    """grpo: most tokens a completion may have (a completion cut there is truncated). Default 256."""
    temperature: float | None = Field(None, gt=0)
    """grpo: sampling temperature; the loss scores log-probabilities at this temperature, as trl does."""
    top_p: float | None = Field(None, gt=0, le=1)
    """grpo: nucleus sampling's probability mass (1: off)."""
    top_k: int | None = Field(None, ge=0)
    """grpo: sample among the k likeliest tokens (0: off)."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] | None = None
    """grpo: how token losses are averaged, as trl defines them: `grpo` per completion then over completions,
    `bnpo` over the tokens of each micro-batch, `dr_grpo` over completions x max_completion_length, `dapo`
    (trl's default) over every completion token of the step on every process."""
    epsilon: float | None = Field(None, gt=0)
    """grpo: the importance ratio is clipped to [1 - epsilon, 1 + epsilon_high] (default 0.2)."""
    epsilon_high: float | None = Field(None, ge=0)
    """grpo: the upper clip (default: epsilon; DAPO suggests 0.28). 0 means epsilon."""
    num_iterations: int | None = Field(None, ge=1)
    """grpo: optimizer steps per generation (μ): each generated batch is trained on this many times, with
    importance ratios against the policy that sampled it, clipped."""
    scale_rewards: Literal["group", "batch", "none"] | None = None
    """grpo: divide advantages by the reward's standard deviation within each group (`group`, trl's default),
    over the step's whole batch (`batch`), or not at all (`none`, as Dr. GRPO recommends)."""
    mask_truncated_completions: bool | None = None
    """grpo: leave completions cut at max_completion_length out of the loss (DAPO)."""

    @model_validator(mode="after")
    def _objective_settings(self) -> TrainConfig:
        """Refuse a setting the objective does not read; fill in the defaults of those it does."""
        own = OBJECTIVE_SETTINGS[self.objective]
        for name in sorted({key for settings in OBJECTIVE_SETTINGS.values() for key in settings}):
            if name not in own and getattr(self, name) is not None:
                readers = [objective for objective, settings in OBJECTIVE_SETTINGS.items() if name in settings]
                raise ValueError(
                    f"{name} applies to objective {' or '.join(readers)}, not {self.objective}; remove it or set "
                    f"train.objective to {readers[0]}"
                )
        for name, default in own.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if self.objective in ("dpo", "simpo", "kto") and not self.beta:
            raise ValueError(f"beta must be greater than 0 for objective {self.objective}")
        if self.objective == "kto" and self.micro_batch_size < 2:  # trl's KTOTrainer refuses it too
            raise ValueError(
                "micro_batch_size must be at least 2 for objective kto: its KL baseline pairs each prompt with another "
                "example's completion in the micro-batch, and with 1 it would pair an example with itself"
            )
        if self.objective == "grpo":
            _check_grpo_settings(self)
        return self

    @model_validator(mode="after")
    def _a_length(self) -> TrainConfig:
        """A run needs a length: with both null it stopped on an assertion after the base and the data had loaded."""
        if self.epochs is None and self.max_steps is None:
            raise ValueError("epochs and max_steps are both null; give train.epochs or train.max_steps")
        return self

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_rewards_as_trl(cls, value: Any) -> Any:
        """trl also takes `true` (group) and `false` (none)."""
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("report_to", "reward_functions", mode="before")
    @classmethod
    def _one_as_a_list(cls, value: Any, info: Any) -> Any:
        """`train.report_to=wandb` means [wandb] (and `none`, the Trainer's word, means []); one reward function
        may be given alone too, as `lora.target_modules` may."""
        if isinstance(value, str) and info.field_name == "report_to" and value.lower() == "none":
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("report_to")
    @classmethod
    def _trackers_installed(cls, value: list[str]) -> list[str]:
        for name in value:
            package = TRACKER_PACKAGES[name]
            if not tracker_installed(name):
                raise ValueError(f"{name} is not installed; pip install {package} (or pip install 'finetune[{name}]')")
        return value


class OutputConfig(_Section):
    """Where the adapter and the run's logs go."""

    name: str
    """Adapter name: up to 64 letters, digits, '.', '_' and '-' (no path separators, no '..'). It names the
    directory; where peft needs a name without dots (merging, serving) the dots become '_'
    (`adapters.lora.derived_adapter_name`), so `legal.v2` is merged as `legal_v2`."""
    dir: str | None = None
    """Adapter directory; default `adapters/<name>`."""
    run_dir: str | None = None
    """Checkpoints, metrics.jsonl and TensorBoard logs; default `runs/<name>`."""
    overwrite: bool = False
    """Replace an existing adapter directory of the same name (otherwise it is an error)."""
    report: bool = True
    """Write `report.html` (plots of loss, learning rate, held-out perplexity, throughput, and a table of the
    run) and `plots/*.png` into the run directory when training ends; `finetune report` writes them any time."""

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not _NAME_PATTERN.match(value):
            raise ValueError(
                f"{value!r} is not a valid adapter name: use up to 64 letters, digits, '.', '_' and '-', starting "
                "with a letter or digit (no '/', no '..')"
            )
        return value

    @property
    def adapter_dir(self) -> Path:
        return Path(self.dir) if self.dir else Path("adapters") / self.name

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name


class FsdpConfig(_Section):
    """`distributed.strategy: fsdp`: torch's FSDP2 (`fully_shard`), one shard unit per decoder layer plus the root.

    Activation checkpointing is `train.gradient_checkpointing`, which checkpoints per decoder layer, the
    unit FSDP shards by: one setting for every strategy rather than a second one that only FSDP reads."""

    version: int = 2
    """2, torch's `fully_shard` (per-parameter DTensor sharding). FSDP1 is deprecated in torch and not offered."""
    sharding: Literal["full", "grad_op"] = "full"
    """`full`: parameters are gathered for a layer's forward and backward and freed after (ZeRO-3; least
    memory). `grad_op`: kept gathered from forward to backward (ZeRO-2-like; one all-gather less per step)."""
    cpu_offload: bool = False
    """Keep the sharded parameters, their gradients and the optimizer state in CPU memory (GPU runs)."""
    wrap: Literal["decoder_layer"] = "decoder_layer"
    """What one shard unit is: each decoder layer (found from the model's `_no_split_modules`)."""

    @field_validator("version")
    @classmethod
    def _only_fsdp2(cls, value: int) -> int:
        if value != 2:
            raise ValueError(f"version {value} is not offered; use 2 (torch's fully_shard; FSDP1 is deprecated)")
        return value


class DeepSpeedConfig(_Section):
    """`distributed.strategy: deepspeed`: DeepSpeed ZeRO through accelerate's DeepSpeed plugin (GPU only)."""

    stage: Literal[2, 3] = 3
    """ZeRO stage: 2 shards gradients and optimizer state, 3 also the parameters."""
    offload_optimizer: bool = False
    """Keep optimizer state in CPU memory (ZeRO-Offload)."""
    offload_params: bool = False
    """Keep parameters in CPU memory between uses (stage 3 only)."""

    @model_validator(mode="after")
    def _params_offload_needs_stage3(self) -> DeepSpeedConfig:
        if self.offload_params and self.stage != 3:
            raise ValueError("offload_params needs stage: 3 (stage 2 does not shard parameters)")
        return self


EMBEDDING_LR_UNUSED = (
    "train.embedding_lr applies to the LoRA on the output head and input embeddings, and this recipe trains neither; "
    "remove train.embedding_lr or set lora.train_lm_head=true or lora.train_embed_tokens=true"
)
"""A set `train.embedding_lr` with nothing for it to apply to: refused by the recipe, or by the run for a list of
targets that names neither (`finetune.training.run.parameter_groups`)."""

ZERO3_STARTING_REFERENCE = (
    "the reference policy is the model the run starts from (lora.init_from, a pissa/olora init, or the base biases "
    "lora.bias trains), whose starting weights are swapped in for reference passes, and DeepSpeed ZeRO-3 partitions "
    "them away; use distributed.deepspeed.stage 2, strategy fsdp or ddp, or a reference without passes (dpo: "
    "train.precompute_reference=true; grpo: train.beta=0)"
)


class DistributedConfig(_Section):
    """How several processes share the work (`finetune train --nproc N`); no effect in one process."""

    strategy: Literal["ddp", "fsdp", "deepspeed"] = "ddp"
    """`ddp`: every rank holds the whole model, gradients are averaged. `fsdp`: the model is sharded over
    the ranks (a base too large for one device). `deepspeed`: ZeRO stage 2/3 (`pip install 'finetune[deepspeed]'`)."""
    fsdp: FsdpConfig = FsdpConfig()
    """Options of `strategy: fsdp` (set only with it)."""
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    """Options of `strategy: deepspeed` (set only with it)."""

    @field_validator("strategy")
    @classmethod
    def _deepspeed_installed(cls, value: str) -> str:
        import importlib.util

        if value == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            raise ValueError("deepspeed is not installed; pip install 'finetune[deepspeed]' (it needs a GPU)")
        return value

    @model_validator(mode="after")
    def _options_match_strategy(self) -> DistributedConfig:
        # Compared with the defaults, not with what was given: a dumped recipe gives every option.
        for section, defaults in (("fsdp", FsdpConfig()), ("deepspeed", DeepSpeedConfig())):
            if getattr(self, section) != defaults and self.strategy != section:
                raise ValueError(f"{section} options are set but strategy is {self.strategy}; set strategy: {section}")
        return self


class CatalogInfo(_Section):
    """How `finetune recipes list` describes a recipe; no effect on training."""

    gpus: int | None = Field(None, ge=1)
    """GPUs the recipe is written for."""
    memory: str | None = None
    """Peak memory per GPU, with where the figure comes from (published by an anchor tool, or an estimate)."""


class Recipe(_Section):
    """A whole fine-tuning run."""

    description: str = ""
    """What the recipe is for, in a sentence (`finetune recipes list`); no effect on training."""
    catalog: CatalogInfo = CatalogInfo()
    """How the catalog describes the recipe."""
    model: ModelConfig = ModelConfig()
    """The base model."""
    lora: LoraConfig = LoraConfig()
    """The adapter."""
    data: DataConfig
    """The data (required: at least `train`)."""
    train: TrainConfig = TrainConfig()
    """The optimisation and the objective."""
    distributed: DistributedConfig = DistributedConfig()
    """Several processes (`--nproc`)."""
    output: OutputConfig
    """Where the adapter and the logs go (required: at least `name`)."""

    @property
    def reference_swaps_start(self) -> bool:
        """Whether the run's reference passes swap the starting weights in (`StartingWeights`): it runs reference
        passes (`TrainConfig.reference_passes`) and disabling the adapter does not give the model as the run
        started (`LoraConfig.disabling_gives_start`)."""
        return self.train.reference_passes and not self.lora.disabling_gives_start

    @property
    def start_metrics_prefix(self) -> str:
        """The prefix of the held-out metrics taken before training: `base_` where they are the base's (SFT
        evaluates with the adapter disabled; other objectives where LoRA starts as the base), `start_` where a
        preference or GRPO run starts from another adapter (`lora.init_from`) or a PiSSA/OLoRA initialisation:
        then they are that starting model's, and naming them the base's would mislead a reader of the manifest."""
        return "base_" if self.train.objective == "sft" or self.lora.starts_as_base else "start_"

    def for_device(self, device_type: str, bf16_units: bool | None = None) -> Recipe:
        """This recipe with `model.dtype: auto` and `train.precision: auto` resolved for `device_type`: 16-bit
        where it is fast (a GPU, a CPU with bf16 units), 32-bit on a CPU that emulates bf16 (86x slower than
        float32 on an AVX2-only EPYC, `finetune.cpu_features`). `bf16_units`: the CPU's, when already known."""
        if "auto" not in (self.model.dtype, self.train.precision):
            return self
        if device_type == "cpu" and bf16_units is None:
            bf16_units = bool(has_bf16_units())
        fast = device_type != "cpu" or bool(bf16_units)
        model = {"dtype": "bfloat16" if fast else "float32"} if self.model.dtype == "auto" else {}
        train = {"precision": "bf16" if fast else "fp32"} if self.train.precision == "auto" else {}
        return self.model_copy(
            update={"model": self.model.model_copy(update=model), "train": self.train.model_copy(update=train)}
        )

    @model_validator(mode="after")
    def _deepspeed_steps_itself(self) -> Recipe:
        if self.distributed.strategy == "deepspeed" and self.train.nonfinite_skips:
            raise ValueError(
                "train.nonfinite_skips cannot be used with distributed.strategy deepspeed: DeepSpeed takes its step "
                "before the loop sees the gradient norm; set it to 0 or use fsdp"
            )
        zero3 = self.distributed.strategy == "deepspeed" and self.distributed.deepspeed.stage == 3
        if zero3 and self.reference_swaps_start:  # else found on every rank later
            raise ValueError(ZERO3_STARTING_REFERENCE)
        if self.distributed.strategy == "deepspeed" and self.train.optimizer != "adamw":
            raise ValueError(
                f"train.optimizer {self.train.optimizer} cannot be used with distributed.strategy deepspeed: ZeRO "
                "already partitions the optimizer state over the ranks (and checkpoints map only per-weight state "
                "back from its partitions); use optimizer adamw"
            )
        return self

    @model_validator(mode="after")
    def _objective_fits_data(self) -> Recipe:
        objective, data_format = self.train.objective, self.data.format
        wanted = OBJECTIVE_FORMATS.get(objective)
        if wanted is not None and data_format != wanted:
            raise ValueError(
                f"train.objective {objective} trains on data.format {wanted} records, but data.format is {data_format}; "
                f"set data.format={wanted} (see the README's preference formats)"
            )
        if wanted is None and data_format in OWN_ROW_FORMATS:
            used_by = " or ".join(name for name, fmt in OBJECTIVE_FORMATS.items() if fmt == data_format)
            raise ValueError(f"data.format {data_format} needs objective {used_by}; set train.objective to {used_by}")
        return self

    @model_validator(mode="after")
    def _embedding_lr_has_weights(self) -> Recipe:
        """`train.embedding_lr` is the rate of the LoRA on the output head and input embeddings; with neither
        switched on and `all-linear` targets (which never take them) there is no such LoRA, and the run trained
        as if the key were absent, without a word. A list of targets may name the head by the family's own
        name, so that case is checked once the model is loaded (`finetune.training.run.parameter_groups`)."""
        lora = self.lora
        no_embedding_lora = not (lora.train_lm_head or lora.train_embed_tokens) and lora.target_modules == "all-linear"
        if self.train.embedding_lr is not None and no_embedding_lora:
            raise ValueError(EMBEDDING_LR_UNUSED)
        return self

    @model_validator(mode="after")
    def _sharding_needs_dense_base(self) -> Recipe:
        strategy = self.distributed.strategy
        if strategy != "ddp" and self.model.quantization != "none":
            raise ValueError(
                f"distributed.strategy {strategy} with model.quantization {self.model.quantization} is not supported; "
                "a quantized base is small enough for ddp (QLoRA), or shard an unquantized one"
            )
        return self


# ---------------------------------------------------------------------------------------------------
# Loading: YAML + overrides -> Recipe, with errors a user can act on.


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that rejects a key given twice in one mapping instead of keeping the last. Merge keys
    (`<<: *anchor`) still work as in YAML: the mapping's own keys override the merged ones."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        # a merge key has no constructor of its own: `construct_mapping` below merges it (and `<<` twice is a twice)
        merge = key_node.tag == "tag:yaml.org,2002:merge"
        key = "<<" if merge else loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"recipe {path} does not exist; check the path (recipes live in recipes/)") from None
    except IsADirectoryError:
        raise RecipeError(f"recipe {path} is a directory; give the path of a .yaml file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"recipe {path} cannot be read: {exc}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"{where}: YAML syntax error: {problem}; fix the YAML at that line") from None
    if data is None:
        raise RecipeError(f"recipe {path} is empty; it needs at least data.train and output.name")
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path} must be a mapping of sections (model, lora, data, train, output)")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into (['a', 'b', 'c'], value), the value parsed as a YAML scalar or list."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"override {text!r} is not key=value; write e.g. train.lr=1e-4")
    path = key.strip().split(".")
    if any(not part for part in path):
        raise RecipeError(f"override {text!r} has an empty key part; write dotted keys like lora.r=16")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML: take it as the literal string
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `key=value` into the nested mapping `data` (in place) and return it.

    Unknown keys are left for the schema to reject, so overrides and files share one error path.
    """
    for text in overrides:
        path, value = parse_override(text)
        if isinstance(value, (bool, int, float)) and _takes_text_only(path):
            value = text.partition("=")[2].strip()  # `output.name=2024`, `model.revision=007`: the words typed
        node = data
        for depth, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(path[: depth + 1])
                raise RecipeError(f"override {text!r}: {prefix} is a value, not a section; set {prefix}=... instead")
            node = child
        node[path[-1]] = value
    return data


def _takes_text_only(path: list[str]) -> bool:
    """Whether the recipe field at `path` takes a string (or null) and nothing else. YAML reads an override's
    `2024`, `007` (octal 7) or `yes` as a number or a bool, which such a field refuses; the text was meant."""
    section = _section_at(path[:-1])
    field = section.model_fields.get(path[-1]) if section else None
    kinds = set(get_args(field.annotation) or (field.annotation,)) - {type(None)} if field else set()
    return kinds == {str}


def _section_fields(location: tuple[Any, ...]) -> list[str]:
    """The valid keys of the recipe section at `location` (used for 'did you mean')."""
    section = _section_at(location)
    return list(section.model_fields) if section else []


def _section_at(location: Sequence[Any]) -> type[BaseModel] | None:
    """The recipe section class at `location` (keys from the top; list indices skipped), None where it names none."""
    model: type[BaseModel] | None = Recipe
    for part in location:
        if isinstance(part, int):  # an item of a list of sections, e.g. data.train[0]
            continue
        if model is None or part not in model.model_fields:
            return None
        model = _section_type(model.model_fields[part].annotation)
    return model


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The section class inside an annotation such as `X`, `X | None` or `list[X]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in getattr(annotation, "__args__", ()):
        found = _section_type(argument)
        if found is not None:
            return found
    return None


def closest_key(key: str, valid: list[str]) -> str | None:
    """The valid key a typo most likely meant: by spelling, else by shared prefix (`rank` -> `r`)."""
    close = difflib.get_close_matches(key, valid, n=1)
    if close:
        return close[0]
    prefixed = [v for v in valid if key.startswith(v) or v.startswith(key)]
    return max(prefixed, key=len) if prefixed else None


def _format_location(location: tuple[Any, ...]) -> str:
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "recipe"


def format_validation_error(exc: ValidationError, source: str) -> str:
    """Render every pydantic error as `source: dotted.key: problem`, joined on one line."""
    problems = []
    for error in exc.errors():
        location = tuple(p for p in error["loc"] if p not in ("function-after",))
        where = _format_location(location)
        if error["type"] == "extra_forbidden":
            parent, key = location[:-1], location[-1]
            valid = _section_fields(parent)
            close = closest_key(str(key), valid)
            hint = f"did you mean '{close}'? " if close else ""
            problems.append(f"{where}: unknown key; {hint}valid keys here: {', '.join(valid)}")
        elif error["type"] == "missing":
            problems.append(f"{where}: required key is missing")
        else:
            message = error["msg"].removeprefix("Value error, ")
            got = error.get("input")  # a whole section (a model validator's error) is no help to repeat
            problems.append(f"{where}: {message}" + ("" if isinstance(got, dict) else f" (got {got!r})"))
    count = f"{len(problems)} problems" if len(problems) > 1 else "1 problem"
    return f"{source}: {count}: " + "; ".join(problems)


def recipe_from_dict(data: dict[str, Any], source: str = "recipe") -> Recipe:
    """Validate a plain mapping into a `Recipe`, raising `RecipeError` with every problem at once."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(format_validation_error(exc, source)) from None


def load_recipe(path: str | Path | Recipe, overrides: Sequence[str] = ()) -> Recipe:
    """Read a recipe file, apply `key=value` overrides, validate once.

    Args:
        path: a YAML file, a catalog name (`finetune recipes list`), or an already-built `Recipe` (overrides then
            apply to a copy of it).
        overrides: dotted `key=value` strings, e.g. `["train.lr=1e-4", "lora.target_modules=[q_proj,v_proj]"]`.
    """
    if isinstance(overrides, str):  # a sequence of one-letter strings: "override 't' is not key=value"
        raise RecipeError(
            f"overrides must be a list of key=value strings, not the string {overrides!r}; write [{overrides!r}]"
        )
    if isinstance(path, Recipe):
        # unset keys stay unset: a default may depend on the base (`finetune.model.attention_for`)
        data, source = path.model_dump(exclude_unset=True), "recipe"
    else:
        resolved = resolve_recipe_path(str(path))
        data, source = _read_yaml(resolved), str(path)
    return recipe_from_dict(apply_overrides(data, list(overrides)), source)


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The fully resolved recipe (defaults filled in), as saved next to an adapter."""
    return recipe.model_dump(mode="json")

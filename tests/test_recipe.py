"""The recipe schema: defaults, overrides, and every way a recipe can be wrong, each with a useful error."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from finetune.errors import RecipeError
from finetune.recipe import ModelConfig, load_recipe, parse_override

REPO = Path(__file__).resolve().parents[1]

MINIMAL = "data:\n  train: data.jsonl\noutput:\n  name: demo\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_minimal_recipe_fills_defaults(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL))
    assert recipe.model.base == "embedded:tiny-llama"
    assert recipe.model.trust_remote_code is False
    assert recipe.lora.target_modules == "all-linear"
    assert recipe.data.train[0].path == "data.jsonl"
    assert recipe.output.adapter_dir == Path("adapters/demo")
    assert recipe.output.run_path == Path("runs/demo")


@pytest.mark.parametrize(
    ("override", "check"),
    [
        ("train.lr=1e-4", lambda r: r.train.lr == 1e-4),
        ("lora.r=16", lambda r: r.lora.r == 16),
        ("lora.target_modules=[q_proj,v_proj]", lambda r: r.lora.target_modules == ["q_proj", "v_proj"]),
        ("data.packing=false", lambda r: r.data.packing is False),
        ("train.max_grad_norm=null", lambda r: r.train.max_grad_norm is None),
        ("output.name=other", lambda r: r.output.adapter_dir == Path("adapters/other")),
        ("data.train=[a.jsonl,b.csv]", lambda r: [s.path for s in r.data.train] == ["a.jsonl", "b.csv"]),
        ("data.validation=null", lambda r: r.data.validation == []),  # drops a recipe's held-out data
        # one item of a list alone, as lora.target_modules=q_proj is taken (these were "Input should be a valid list")
        ("train.report_to=tensorboard", lambda r: r.train.report_to == ["tensorboard"]),
        ("train.report_to=none", lambda r: r.train.report_to == []),  # the HF Trainer's word for none
        # a text-only field takes the words typed, which YAML read as a number or a bool ("Input should be a valid
        # string (got 2024)"; 007 was octal 7)
        ("output.name=2024", lambda r: r.output.name == "2024"),
        ("output.name=007", lambda r: r.output.name == "007"),
        ("model.revision=20240101", lambda r: r.model.revision == "20240101"),
        ("train.tracker_project=yes", lambda r: r.train.tracker_project == "yes"),
        ("model.revision=null", lambda r: r.model.revision is None),
    ],
)
def test_overrides_apply_through_the_schema(tmp_path, override, check):
    assert check(load_recipe(write(tmp_path, MINIMAL), [override]))


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        # unknown key: dotted path, suggestion, the valid keys at that level
        (
            MINIMAL + "lora:\n  rank: 4\n",
            [],
            ["lora.rank: unknown key", "did you mean 'r'", "valid keys here: r, alpha"],
        ),
        (MINIMAL + "trian:\n  lr: 1\n", [], ["trian: unknown key", "did you mean 'train'"]),
        (
            "data:\n  train:\n    - path: a.jsonl\n      splt: x\noutput:\n  name: d\n",
            [],
            ["data.train[0].splt", "'split'"],
        ),
        # wrong type and out of range, all reported at once
        (
            MINIMAL + "train:\n  lr: fast\n  micro_batch_size: 0\n",
            [],
            ["2 problems", "train.lr", "train.micro_batch_size", "greater than or equal to 1"],
        ),
        (MINIMAL + "lora:\n  dropout: 1.5\n", [], ["lora.dropout", "less than 1"]),
        (MINIMAL + "model:\n  dtype: float8\n", [], ["model.dtype", "'float32', 'bfloat16' or 'float16'"]),
        ("output:\n  name: x\n", [], ["data: required key is missing"]),
        (MINIMAL.replace("demo", "../evil"), [], ["output.name", "not a valid adapter name"]),
        (MINIMAL + "data:\n  format: text\n", [], ["key 'data' is given twice", ":5:"]),
        # YAML syntax error names file and line
        (MINIMAL + "train:\n  lr: [1e-4\n", [], ["YAML syntax error", "recipe.yaml:"]),
        ("- a\n- b\n", [], ["must be a mapping"]),
        ("", [], ["is empty"]),
        # overrides go through the same validation
        (MINIMAL, ["train.lrr=1"], ["train.lrr: unknown key", "did you mean 'lr'"]),
        (MINIMAL, ["train.lr"], ["not key=value"]),
        (MINIMAL, ["=3"], ["not key=value"]),
        (MINIMAL + "train:\n  lr: 0.1\n", ["train.lr.x=3"], ["train.lr is a value, not a section"]),
        (MINIMAL, ["train.lr.x=3"], ["train.lr: Input should be a valid number"]),
        (MINIMAL, ["lora.r=-1"], ["lora.r", "greater than or equal to 1"]),
        (MINIMAL, ["data.prompt_template=no placeholder"], ["must contain '{prompt}'"]),
        # a template file's path was taken for the template: each record rendered as the path's text
        (MINIMAL, ["data.chat_template=templates/qwen3.jinja"], ["data.chat_template must be a Jinja template's text"]),
        # quantization as a mapping
        (MINIMAL + "model:\n  quantization: {bits: 3}\n", [], ["model", "quantization.bits is 3; use 4 (QLoRA) or 8"]),
        (MINIMAL + "model:\n  quantization: {bits: 4, kind: nf4}\n", [], ["unknown key(s) ['kind']"]),
        (MINIMAL + "model:\n  quantization: {bits: 8, type: nf4}\n", [], ["apply to bits: 4 only"]),
        (
            MINIMAL + "model:\n  quantization: {bits: 4, type: int4}\n",
            [],
            ["model.bnb_4bit_quant_type", "'nf4' or 'fp4'"],
        ),
        # 4-bit settings beside an 8-bit or unquantized base were accepted and never read
        (MINIMAL, ["model.quantization=8bit", "model.bnb_4bit_quant_type=fp4"], ["bnb_4bit_quant_type applies to"]),
        (MINIMAL, ["model.bnb_4bit_use_double_quant=false"], ["quantization is none", "model.quantization=4bit"]),
        (MINIMAL, ["model.quantization={bits: 8}", "model.bnb_4bit_compute_dtype=bfloat16"], ["quantization is 8bit"]),
        # the mapping and the flat field disagreeing: the mapping quietly won
        (
            MINIMAL,
            ["model.quantization={bits: 4, type: fp4}", "model.bnb_4bit_quant_type=nf4"],
            ["quantization.type is 'fp4' but bnb_4bit_quant_type is 'nf4'; give the setting once"],
        ),
        # distributed: no strategy quietly becomes another
        (MINIMAL, ["distributed.strategy=zero"], ["distributed.strategy", "'ddp', 'fsdp' or 'deepspeed'"]),
        (MINIMAL, ["distributed.fsdp.version=1"], ["distributed.fsdp.version", "FSDP1 is deprecated"]),
        (MINIMAL, ["distributed.fsdp.sharding=grad_op"], ["fsdp options are set but strategy is ddp"]),
        (MINIMAL, ["distributed.strategy=fsdp", "distributed.deepspeed.stage=2"], ["set strategy: deepspeed"]),
        (MINIMAL, ["distributed.strategy=fsdp", "model.quantization=4bit"], ["fsdp with model.quantization 4bit"]),
        (
            MINIMAL,
            [
                "distributed.strategy=deepspeed",
                "distributed.deepspeed.stage=2",
                "distributed.deepspeed.offload_params=true",
            ],
            ["offload_params needs stage: 3"],
        ),
        (MINIMAL, ["distributed.strategy=deepspeed", "train.nonfinite_skips=2"], ["nonfinite_skips cannot be used"]),
        (MINIMAL, ["distributed.strategy=deepspeed", "train.optimizer=adamw_8bit"], ["adamw_8bit cannot be used"]),
        # a rate for the head and embedding LoRA, with neither trained, set nothing without a word
        (
            MINIMAL,
            ["train.embedding_lr=1e-5"],
            ["train.embedding_lr applies to the LoRA on the output head", "lora.train_lm_head=true"],
        ),
        # no infinite or NaN numbers (.inf passed gt=0, then training failed on it)
        (MINIMAL, ["train.epochs=.inf", "train.max_steps=null"], ["train.epochs: Input should be a finite number"]),
        # a run without a length passed validation and stopped on an assertion once the base and data had loaded
        (MINIMAL, ["train.epochs=null", "train.max_steps=null"], ["train: epochs and max_steps are both null"]),
        (MINIMAL, ["train.lr=.inf"], ["train.lr: Input should be a finite number"]),
        (MINIMAL, ["train.max_grad_norm=.nan"], ["train.max_grad_norm: Input should be a finite number"]),
        # a truth value is not a number (pydantic took true for 1); a module pattern is not a module name
        (MINIMAL, ["lora.r=true"], ["lora: r must be a number, not true"]),
        (MINIMAL, ["train.micro_batch_size=yes"], ["train: micro_batch_size must be a number, not true"]),
        (MINIMAL, ["lora.target_modules=q_proj|v_proj"], ["lora.target_modules: give 'all-linear' or a list"]),
        # numpy's and accelerate's seeds are 0..2**32-1: a negative seed failed after the data was tokenized
        (MINIMAL, ["train.seed=-1"], ["train.seed: Input should be greater than or equal to 0"]),
        (MINIMAL, ["train.seed=4294967296"], ["train.seed: Input should be less than or equal to 4294967295"]),
        # kto's KL baseline pairs each prompt with another example's completion in the micro-batch
        (
            MINIMAL,
            ["train.objective=kto", "data.format=unpaired_preference", "train.micro_batch_size=1"],
            ["micro_batch_size must be at least 2 for objective kto"],
        ),
        # found on every rank after the model had loaded (each printing it; one ended in SIGABRT)
        (
            MINIMAL,
            [
                "train.objective=kto",
                "data.format=unpaired_preference",
                "train.micro_batch_size=2",
                "lora.init_from=adapters/sft",
                "distributed.strategy=deepspeed",
            ],  # fmt: skip
            ["DeepSpeed ZeRO-3 partitions them away"],
        ),
        # the base's biases that lora.bias trains stay trained with the adapter disabled: swapped in, as above
        (
            MINIMAL,
            [
                "train.objective=kto",
                "data.format=unpaired_preference",
                "train.micro_batch_size=2",
                "lora.bias=all",
                "distributed.strategy=deepspeed",
            ],  # fmt: skip
            ["DeepSpeed ZeRO-3 partitions them away"],
        ),
    ],
)
def test_bad_recipes_fail_with_one_line_that_says_where(tmp_path, text, overrides, expected):
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, text), overrides)
    message = str(info.value)
    assert "\n" not in message
    for fragment in expected:
        assert fragment in message, message


@pytest.mark.parametrize(
    "quantization, expected",
    [
        ("4bit", ("4bit", "nf4", True, None)),
        ("{bits: 4, type: fp4, double_quant: false, compute_dtype: bfloat16}", ("4bit", "fp4", False, "bfloat16")),
        ("{bits: 4}", ("4bit", "nf4", True, None)),
        ("{bits: 8}", ("8bit", "nf4", True, None)),
    ],
)
def test_quantization_as_a_string_or_the_mapping_qlora_users_write(tmp_path, quantization, expected):
    model = load_recipe(write(tmp_path, MINIMAL + f"model:\n  quantization: {quantization}\n")).model
    found = (
        model.quantization,
        model.bnb_4bit_quant_type,
        model.bnb_4bit_use_double_quant,
        model.bnb_4bit_compute_dtype,
    )
    assert found == expected


def test_embedding_lr_passes_where_head_or_embedding_lora_may_be_trained(tmp_path):
    """A switch on, or a list of targets (which may name the head by the family's name: checked by the run)."""
    for switch in ("lora.train_lm_head=true", "lora.train_embed_tokens=true", "lora.target_modules=[q_proj,lm_head]"):
        assert load_recipe(write(tmp_path, MINIMAL), ["train.embedding_lr=1e-5", switch]).train.embedding_lr == 1e-5


def test_four_bit_settings_agreeing_with_the_mapping_or_left_at_their_defaults_pass(tmp_path):
    both = ["model.quantization={bits: 4, type: fp4}", "model.bnb_4bit_quant_type=fp4"]
    assert load_recipe(write(tmp_path, MINIMAL), both).model.bnb_4bit_quant_type == "fp4"
    dumped = load_recipe(write(tmp_path, MINIMAL), ["model.quantization=8bit"]).model.model_dump()
    assert ModelConfig.model_validate(dumped).quantization == "8bit"  # a dumped recipe gives every field


def test_a_manifest_s_four_bit_settings_beside_another_method_do_not_stop_loading_its_base():
    """Adapters trained before the recipe refused them may record `bnb_4bit_*` settings beside `none` or `8bit`."""
    from finetune.model import load_base
    from finetune.quantization import Quantization

    model, _, _ = load_base("embedded:tiny-llama", quantization=Quantization("none", quant_type="fp4"))
    assert not getattr(model, "is_quantized", False)


MERGED = """data:
  train:
    - &source {path: a.jsonl, max_records: 50}
  validation:
    - <<: *source
      path: b.jsonl
output:
  name: demo
"""


def test_yaml_merge_keys_merge_and_the_mapping_s_own_keys_override(tmp_path):
    """`<<: *anchor` failed as a YAML syntax error ("could not determine a constructor for the tag ...merge"): the
    duplicate-key check constructed the merge key itself."""
    recipe = load_recipe(write(tmp_path, MERGED))
    assert [(s.path, s.max_records) for s in recipe.data.validation] == [("b.jsonl", 50)]
    with pytest.raises(RecipeError, match=r"recipe.yaml:7:7: YAML syntax error: key 'path' is given twice"):
        load_recipe(write(tmp_path, MERGED.replace("path: b.jsonl", "path: b.jsonl\n      path: c.jsonl")))
    with pytest.raises(RecipeError, match="key '<<' is given twice"):
        load_recipe(write(tmp_path, MERGED.replace("path: b.jsonl", "<<: {split: x}")))


def test_missing_and_unreadable_recipes(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="is a directory"):
        load_recipe(tmp_path)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(RecipeError, match="cannot be read"):
        load_recipe(binary)


def test_one_target_module_may_be_written_without_a_list(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL), ["lora.target_modules=q_proj"])
    assert recipe.lora.target_modules == ["q_proj"]
    assert load_recipe(write(tmp_path, MINIMAL), ["lora.target_modules=all_linear"]).lora.target_modules == "all-linear"


def test_override_values_parse_as_yaml():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=x=y") == (["a"], "x=y")
    assert parse_override("a=") == (["a"], "")


def test_overrides_given_as_one_string_are_refused_saying_to_make_a_list(tmp_path):
    """`train(path, "lora.r=16")`, as a notebook user types it: a string is a sequence of one-letter strings,
    and the error named the override 'l'."""
    from finetune.training.loop import train

    path = write(tmp_path, MINIMAL)
    for call in (lambda: load_recipe(path, "lora.r=16"), lambda: train(path, "lora.r=16")):
        with pytest.raises(RecipeError, match=r"overrides must be a list .* write \['lora.r=16'\]$"):
            call()
    assert load_recipe(path, ("lora.r=16",)).lora.r == 16  # any sequence of strings is taken


def test_recipe_object_with_overrides_is_copied(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL))
    changed = load_recipe(recipe, ["lora.r=32"])
    assert changed.lora.r == 32 and recipe.lora.r == 8


def test_a_recipe_object_reloaded_keeps_what_it_left_unset(tmp_path):
    """`train(recipe)` reloads a `Recipe` object: a key the recipe did not set must stay unset, or a default that
    depends on the base turns into a choice (gpt-oss got sdpa, which transformers refuses, instead of eager)."""
    from finetune.model import attention_for

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    recipe = load_recipe(
        write(tmp_path, f"model: {{base: {tmp_path}}}\ndata: {{train: x.jsonl}}\noutput: {{name: a}}\n")
    )
    for again in (load_recipe(recipe), load_recipe(recipe, ["train.lr=1e-3"])):
        assert again == recipe.model_copy(update={"train": again.train}) and again.train.lr in (recipe.train.lr, 1e-3)
        assert attention_for(again.model, str(tmp_path)) == "eager"
    chosen = load_recipe(recipe, ["model.attn_implementation=sdpa"])
    assert attention_for(chosen.model, str(tmp_path)) == "sdpa"  # chosen: kept, and transformers says why it fails


def _all_recipe_files() -> list[Path]:
    return sorted((REPO / "recipes").rglob("*.yaml")) + sorted((REPO / "recipes").rglob("*.yml"))


def test_recipes_holds_yaml():
    assert _all_recipe_files(), "recipes/ holds no YAML"


@pytest.mark.parametrize("path", _all_recipe_files(), ids=lambda path: str(path.relative_to(REPO / "recipes")))
def test_shipped_recipe_validates_and_names_its_output(path):
    """Each YAML under recipes/ (subfolders too), by name; what each catalog recipe trains: test_catalog.py."""
    recipe = load_recipe(path)
    assert recipe.output.name == path.stem


@pytest.mark.parametrize(
    "options, zero",
    [
        (["distributed.deepspeed.stage=2"], {"stage": 2, "offload_optimizer": "none"}),
        (
            ["distributed.deepspeed.offload_optimizer=true", "distributed.deepspeed.offload_params=true"],
            {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
        ),
    ],
)
def test_the_deepspeed_config_we_build_passes_deepspeeds_own_parser(tmp_path, options, zero):
    from deepspeed.runtime.config import DeepSpeedConfig

    from finetune.training.deepspeed import deepspeed_config

    overrides = ["distributed.strategy=deepspeed", "train.micro_batch_size=2", "train.grad_accum_steps=4", *options]
    recipe = load_recipe(write(tmp_path, MINIMAL), [*overrides, "train.precision=bf16", "train.max_grad_norm=0.5"])
    parsed = DeepSpeedConfig(deepspeed_config(recipe, world_size=1))  # the parser checks it against this process
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu) == (8, 2)
    assert parsed.gradient_accumulation_steps == 4 and parsed.gradient_clipping == 0.5
    assert parsed.bfloat16_config.enabled and not parsed.float16_config.enabled
    assert parsed.zero_config.stage == zero["stage"]
    assert parsed.zero_config.offload_optimizer.device == zero["offload_optimizer"]
    if "offload_param" in zero:
        assert parsed.zero_config.offload_param.device == zero["offload_param"]


@pytest.mark.parametrize(
    ("override", "device", "quantized", "compiles"),
    [
        ([], "cuda", False, True),  # auto: compiled layers where they were measured to pay
        ([], "cuda", True, False),  # a bitsandbytes base does not compile whole
        ([], "cpu", False, False),  # the first step would compile for minutes
        (["train.gradient_checkpointing=true"], "cuda", False, False),  # inductor failed on it (torch 2.11)
        (["train.gradient_checkpointing=3"], "cuda", False, False),
        (["train.gradient_checkpointing=0"], "cuda", False, True),
        (["train.gradient_checkpointing=auto"], "cuda", False, False),  # unresolved: it may checkpoint
        (["train.compile=false"], "cuda", False, False),
        (["train.compile=true"], "cpu", False, True),
        (["train.liger_kernels=true"], "cuda", False, False),  # Triton kernels in compiled layers: not run yet
        (["train.liger_kernels=true", "train.compile=true"], "cuda", False, True),
        (["train.objective=grpo", "data.format=prompt", "train.reward_functions=[r.py:f]"], "cuda", False, False),
        (
            ["train.objective=grpo", "data.format=prompt", "train.reward_functions=[r.py:f]", "train.compile=true"],
            "cuda",
            False,
            True,
        ),  # fmt: skip
    ],
)
def test_train_compile_auto_resolves_by_device_and_base(tmp_path, override, device, quantized, compiles):
    train = load_recipe(write(tmp_path, MINIMAL), override).train
    assert train.compiles(device, quantized) is compiles


def test_auto_checkpointing_resolved_to_no_layer_leaves_the_layers_compiled(tmp_path):
    train = load_recipe(write(tmp_path, MINIMAL), ["train.gradient_checkpointing=auto"]).train
    assert train.compiles("cuda", False, checkpointing=False) and not train.compiles("cuda", False, checkpointing=True)


@pytest.mark.parametrize("name", ["quickstart-dpo", "quickstart-grpo"])
def test_the_shipped_refining_recipes_take_the_shape_of_any_adapter_they_start_from(tmp_path, name):
    """The DPO and GRPO quickstarts refine an adapter: any peft LoRA of the base, not only one of the quickstart's
    rank, so they leave rank, alpha, dropout and targets to it (an adapter peft wrote with r 8 on q/v)."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.05,
        "target_modules": ["v_proj", "q_proj"],
    }
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml", [f"lora.init_from={adapter}"])
    assert (recipe.lora.r, recipe.lora.alpha, recipe.lora.dropout) == (8, 16, 0.05)
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]


def test_one_reward_function_may_be_given_alone(tmp_path):
    recipe = load_recipe(
        write(tmp_path, MINIMAL),
        ["train.objective=grpo", "data.format=prompt", "train.reward_functions=length(target=8)"],
    )
    assert recipe.train.reward_functions == ["length(target=8)"]


def test_every_recipe_field_has_its_docstring():
    """The README sends readers to `finetune/recipe.py` for every key's meaning ("one docstring per field"); 26 fields,
    `lora.dropout`, `train.lr` and `train.optimizer` among them, had none."""
    tree = ast.parse((REPO / "finetune" / "recipe.py").read_text(encoding="utf-8"))
    missing = []
    for section in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        for statement, after in zip(section.body, [*section.body[1:], None]):
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                documented = isinstance(after, ast.Expr) and isinstance(getattr(after.value, "value", None), str)
                if not documented:
                    missing.append(f"{section.name}.{statement.target.id}")
    assert missing == []

"""Every catalog recipe, one named test each: its LoRA on a tiny model of its family, and its plan recounted.

A failing recipe names itself (`test_catalog.py::test_recipe[qwen3-4b-chat]`). For each one:
- the architecture config it plans with (shipped in `finetune/plan/configs/`, or the embedded base's) is
  shrunk to a tiny size, keeping its class and every architectural switch (fused qkv, biases, tied
  embeddings, norms), and a random model is built from it;
- LoRA is put on it as training does (`finetune.model.wrap_with_lora`), and the modules that got A and B
  are compared with what the recipe's `lora` section says, worked out here by walking the model: every
  linear layer of the decoder blocks for `all-linear`, the listed suffixes otherwise, plus the head and
  embeddings when `train_lm_head` / `train_embed_tokens` are on;
- the plan's counts at full size (`finetune plan`'s `model_shape`) are recounted from the config's sizes:
  the linear weights of the blocks, and the LoRA parameters of the targeted modules, r · (in + out) each.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from finetune.commands.recipes import catalog_entries
from finetune.model import decoder_layers, embedding_module_names, wrap_with_lora
from finetune.plan.memory import estimate
from finetune.plan.model_config import find_model_config
from finetune.plan.shape import model_shape
from finetune.recipe import Recipe, load_recipe

MOE_RECIPES = {"qwen3-30b-a3b-chat", "qwen3-30b-a3b-chat-qlora", "gpt-oss-20b-chat"}
"""Mixtures of experts: their expert LoRA, plans and published counts are tested per recipe in tests/test_moe.py."""
ENTRIES = [entry for entry in catalog_entries() if entry.name not in MOE_RECIPES]
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128)  # fmt: skip


def _with(config: Any, **sizes: Any) -> Any:
    """`config`'s class and architectural switches with `sizes` put in (per-layer lists cut to the layers)."""
    values = {k: v for k, v in config.to_dict().items() if k not in ("architectures", "transformers_version")}
    values.update(sizes)
    if isinstance(values.get("layer_types"), list):  # per-layer attention kinds (Gemma, Qwen3): the first ones
        values["layer_types"] = values["layer_types"][: values["num_hidden_layers"]]
    return type(config)(**values)


def _tiny(config: Any) -> Any:
    """The same architecture at a size that builds in milliseconds (no pad id: it would lie past the vocab)."""
    sizes = {key: value for key, value in TINY.items() if key in config.to_dict() or key == "head_dim"}
    if config.model_type == "phi3":  # Phi's long-rope factors are per rotary dimension: none at this size
        sizes["rope_scaling"] = None
    return _with(config, **sizes, pad_token_id=None)


def _expected_targets(recipe: Recipe, model: torch.nn.Module) -> set[str]:
    """The modules the recipe's `lora` section asks for, found by walking the model (not through peft)."""
    lora = recipe.lora
    in_layers = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and id(m) in in_layers]
    if lora.target_modules == "all-linear":
        wanted = set(linears)
    else:
        wanted = {name for name in linears if name.rsplit(".", 1)[-1] in lora.target_modules}
    wanted = {name for name in wanted if not any(name.endswith(x) for x in lora.exclude_modules)}
    embed_tokens, lm_head = embedding_module_names(model)
    return (
        wanted | ({lm_head} if lora.train_lm_head else set()) | ({embed_tokens} if lora.train_embed_tokens else set())
    )


def _linear_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of one decoder block, by its name, from the config's sizes."""
    text = config.get_text_config()
    hidden, intermediate, heads = text.hidden_size, text.intermediate_size, text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    attention_out = {"o_proj": (heads * head_dim, hidden), "down_proj": (intermediate, hidden)}
    if text.model_type == "phi3":  # fused: one qkv projection, one gate-and-up projection
        return {"qkv_proj": (hidden, (heads + 2 * kv_heads) * head_dim), "gate_up_proj": (hidden, 2 * intermediate),
                **attention_out}  # fmt: skip
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "gate_proj": (hidden, intermediate),
            "up_proj": (hidden, intermediate), **attention_out}  # fmt: skip


def test_the_recipes_left_out_here_are_exactly_the_mixtures_of_experts():
    def experts(name: str) -> int:
        config, _ = find_model_config(load_recipe(name).model.base, None)
        text = config.get_text_config()
        return getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0

    assert {entry.name for entry in catalog_entries() if experts(entry.name)} == MOE_RECIPES


@pytest.mark.parametrize("entry", ENTRIES, ids=[entry.name for entry in ENTRIES])
def test_recipe(entry):
    recipe = load_recipe(entry.path)
    assert recipe.output.name == entry.name and entry.path.stem == entry.name
    config, _ = find_model_config(recipe.model.base, recipe.model.revision)

    # Its LoRA on a tiny model of its family.
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny(config))
    expected = _expected_targets(recipe, model)
    peft_model = wrap_with_lora(model, recipe.lora)
    targeted = {
        name.removeprefix("base_model.model.") for name, m in peft_model.named_modules() if hasattr(m, "lora_A")
    }
    assert targeted == expected
    assert {name.rsplit(".", 1)[-1] for name in targeted} >= {"o_proj", "down_proj"}  # attention and MLP both

    # Its plan's counts, recounted from the config's sizes: at the family's real widths and vocabulary, with
    # two decoder layers (a block's count times the layers is the same sum; 80 meta layers take seconds).
    config = _with(config, num_hidden_layers=2)
    shape = model_shape(config, recipe.lora)
    linears = _linear_shapes(config)
    layers = 2
    assert shape.quantizable_params == layers * sum(fan_in * fan_out for fan_in, fan_out in linears.values())
    rank = recipe.lora.r
    suffixes = {name.rsplit(".", 1)[-1] for name in targeted if ".layers." in name}
    lora_params = layers * sum(rank * (linears[s][0] + linears[s][1]) for s in suffixes)
    text = config.get_text_config()
    lora_params += (
        rank * (text.hidden_size + text.vocab_size) * (recipe.lora.train_lm_head + recipe.lora.train_embed_tokens)
    )
    assert shape.lora_params == lora_params
    plan = estimate(recipe, shape, device="cuda", nproc=1)
    assert plan.peak_bytes > shape.base_params * (0.5 if recipe.model.quantization == "4bit" else 2)


def test_recipes_copy_to_a_new_directory_written_with_a_slash_puts_the_recipe_inside_it(tmp_path, monkeypatch, capsys):
    from finetune.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["recipes", "copy", "quickstart", "mine/"]) == 0
    assert (tmp_path / "mine" / "quickstart.yaml").is_file()  # not a file named `mine`
    assert main(["recipes", "copy", "quickstart", "mine.yaml"]) == 0 and (tmp_path / "mine.yaml").is_file()


RECORD_HINTS = {
    "chat": '{"messages": [...]}',
    "instruction": '{"instruction", "input", "output"}',
    "text": '{"text": "..."}',
    "preference": '{"prompt", "chosen", "rejected"}',
}
"""What a recipe's "Point data.train at your data (...)" comment shows, by the `data.format` the recipe reads."""


@pytest.mark.parametrize("entry", catalog_entries(), ids=lambda entry: entry.name)
def test_recipe_comment_shows_records_of_the_format_it_reads(entry):
    """Following the recipe's own usage comment gives data it reads: a continued-pretraining recipe pointed
    at `{"messages"}` records fails on its first record (no field 'text')."""
    recipe = load_recipe(entry.path)
    hints = [line for line in entry.path.read_text().splitlines() if line.startswith("# Point data.train")]
    if not hints:  # the embedded base's recipes ship their data; the GRPO recipe shows a whole record instead
        return
    assert len(hints) == 1 and RECORD_HINTS[recipe.data.format] in hints[0], (recipe.data.format, hints)


PLANNED = [entry for entry in catalog_entries() if entry.memory and "finetune plan" in entry.memory]


@pytest.mark.parametrize("entry", PLANNED, ids=[entry.name for entry in PLANNED])
def test_catalog_memory_line_is_what_finetune_plan_says(entry):
    """A `finetune recipes list` memory figure credited to `finetune plan` is the plan's CUDA peak today, at the
    recipe's own micro-batch and length (the 70B figure had been left at 43.6 GiB when the plan said 43.5)."""
    from finetune.plan.memory import GiB

    recipe = load_recipe(entry.path)
    config, _ = find_model_config(recipe.model.base, recipe.model.revision)
    plan = estimate(recipe, model_shape(config, recipe.lora), device="cuda", nproc=1)
    batch = f"at batch {recipe.train.micro_batch_size}, {recipe.data.max_seq_len} tokens"
    assert entry.memory.startswith(f"{plan.peak_bytes / GiB:.1f} GiB {batch}")


@pytest.mark.parametrize("name", sorted(MOE_RECIPES))
def test_a_moe_recipe_says_whether_training_adds_its_base_s_load_balancing_loss(name):
    """The MoE recipes said the load-balancing loss "is added as the config weighs it", but their bases'
    config.json (gpt-oss-20b's, Qwen3-30B-A3B's) set `output_router_logits` false, and training adds it only where
    that is true (`finetune.scoring.router_aux_coef`): a 2-step run on a tiny gpt-oss with that config logs no
    `router_aux`. A recipe's comments must say what its base does."""
    (entry,) = [entry for entry in catalog_entries() if entry.name == name]
    config, _ = find_model_config(entry.base)
    text = entry.path.read_text().replace("\n# ", " ").lower()
    says_added = re.search(r"(?<!no )load-balancing loss is added", text) is not None
    says_not_added = "no load-balancing loss is added" in text
    assert (says_added, says_not_added) == (config.output_router_logits, not config.output_router_logits), text


def _files_of_at_most_1_kib() -> None:
    """In the child: files may not grow past 1 KiB (a full disk, for a writer), and the limit is an error."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 10, 1 << 10))


def test_recipes_copy_onto_a_full_disk_leaves_no_file_in_the_way(tmp_path):
    """A copy cut short left the part it had written at the destination (on a full disk, an empty mine.yaml):
    `finetune train mine.yaml` read a part of the recipe, and the copy run again refused it as existing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    copy = [sys.executable, "-m", "finetune", "recipes", "copy", "quickstart-grpo", "mine.yaml"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    full = subprocess.run(
        copy, cwd=tmp_path, env=env, capture_output=True, text=True, preexec_fn=_files_of_at_most_1_kib
    )
    assert full.returncode == 2, full.stderr
    assert full.stderr.startswith("error: cannot write mine.yaml: File too large;") and full.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
    again = subprocess.run(copy, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "mine.yaml").read_text() == (
        Path(env["PYTHONPATH"]) / "recipes" / "quickstart-grpo.yaml"
    ).read_text()

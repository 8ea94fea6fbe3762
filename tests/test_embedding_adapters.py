"""Adapters with LoRA on the output head and the input embeddings, on a base whose two are tied.

Every command takes them (issue 6 item 8): unmerged they change only their own layer, so merging unties
the pair and merged logits equal unmerged ones; subtracting gives the base back bit for bit, tied again;
on disk the same holds and equals the in-memory merge; combine writes peft's embedding names back; and
an adapter `finetune train` writes with `lora.train_lm_head`/`train_embed_tokens` goes through generate,
eval, merge and subtract, with its own learning rate for those layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    REORDERED_ULPS,
    ROUNDED_ULPS,
    assert_tensors_equal,
    assert_within_ulps,
    greedy_text,
    instruction_records,
    make_adapter,
    read_tensors,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import finetune
from finetune.adapters.combine import combine_adapters
from finetune.adapters.lora import read_adapter
from finetune.adapters.ondisk import AdapterSpec, merge_checkpoint, subtract_checkpoint
from finetune.cli import main
from finetune.device import model_device
from finetune.errors import AdapterError
from finetune.fingerprint import base_state_items

HEAD_AND_EMBEDDINGS = ("lm_head", "embed_tokens", "q_proj")


@pytest.fixture(scope="module")
def head_adapters(tmp_path_factory, tiny_base_dir) -> dict[str, Path]:
    """Plain peft adapters on the tied head and embeddings (peft also saves the tied weight beside them)."""
    root = tmp_path_factory.mktemp("head")
    return {
        "style": make_adapter(tiny_base_dir, root / "style", seed=21, targets=HEAD_AND_EMBEDDINGS, magnitude=0.1),
        "tone": make_adapter(tiny_base_dir, root / "tone", seed=22, targets=("lm_head", "v_proj"), magnitude=0.1),
    }


def _logits(model, input_ids) -> torch.Tensor:
    """Logits for `input_ids` (built on the host), computed on the model's device, returned on the host."""
    with torch.no_grad():
        return model(input_ids=input_ids.to(model_device(model))).logits.cpu()


def _is_tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_embedding_lora_is_read_in_linear_form_with_peft_names_back(head_adapters):
    adapter = read_adapter(head_adapters["style"])
    embedding = adapter.modules["model.embed_tokens"]
    assert embedding.embedding and not adapter.modules["lm_head"].embedding
    assert set(adapter.base_copies) == {"lm_head", "model.embed_tokens"}  # peft's save_embedding_layers copies
    saved = load_file(head_adapters["style"] / "adapter_model.safetensors")
    for name, tensor in embedding.peft_tensors("model.embed_tokens").items():
        assert torch.equal(tensor, saved[name]), name
    # peft's Embedding update is (B·A)ᵀ · scale: the same as ours
    from peft import PeftModel

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(read_adapter(head_adapters["style"]).base_path),
        str(head_adapters["style"]),
    )
    reference = model.base_model.model.model.embed_tokens.get_delta_weight("default")
    assert_within_ulps(embedding.delta(), reference, ROUNDED_ULPS)  # one (B·A)ᵀ product, scaled


def test_merge_unties_keeps_logits_and_subtract_gives_the_tied_base_back(tiny_base_dir, tiny_tokenizer, head_adapters):
    m = finetune.load_model(str(tiny_base_dir), {k: str(v) for k, v in head_adapters.items()})
    input_ids = tiny_tokenizer(["def add(a, b):\n    return a"], return_tensors="pt").input_ids
    base = {name: tensor.clone() for name, tensor in base_state_items(m.model)}
    base_logits = _logits(m.model, input_ids)
    m.use("style")
    unmerged = _logits(m.model, input_ids)
    m.use(None)
    assert (unmerged - base_logits).abs().max() > 1e-2  # the adapter changes the output

    m.merge("style")
    assert not _is_tied(m.model) and m.model.config.tie_word_embeddings is False
    assert_within_ulps(_logits(m.model, input_ids), unmerged, REORDERED_ULPS)

    m.swap("style", "tone")
    fresh = finetune.load_model(str(tiny_base_dir), {"tone": str(head_adapters["tone"])})
    fresh.merge("tone")
    assert_tensors_equal(dict(base_state_items(fresh.model)), dict(base_state_items(m.model)))

    m.subtract("tone")
    assert _is_tied(m.model) and m.model.config.tie_word_embeddings is True
    assert_tensors_equal(base, dict(base_state_items(m.model)))
    assert torch.equal(_logits(m.model, input_ids), base_logits)


def test_disk_merge_equals_memory_loads_untied_and_subtracts_to_the_base_files(
    tmp_path, tiny_base_dir, tiny_tokenizer, head_adapters
):
    merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(head_adapters["style"]), 0.5)], tmp_path / "disk")
    m = finetune.load_model(str(tiny_base_dir), {"style": str(head_adapters["style"])})
    m.merge("style", 0.5)
    m.save_merged(tmp_path / "memory")
    assert_tensors_equal(read_tensors(tmp_path / "memory"), read_tensors(tmp_path / "disk"))
    assert "lm_head.weight" in read_tensors(tmp_path / "disk")
    assert json.loads((tmp_path / "disk" / "config.json").read_text())["tie_word_embeddings"] is False

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "disk")
    input_ids = tiny_tokenizer(["for i in range"], return_tensors="pt").input_ids
    assert not _is_tied(loaded)
    assert_within_ulps(_logits(loaded, input_ids), _logits(m.model, input_ids), REORDERED_ULPS)

    subtract_checkpoint(str(tmp_path / "disk"), AdapterSpec("style"), tmp_path / "back")
    assert_tensors_equal(read_tensors(tiny_base_dir), read_tensors(tmp_path / "back"))
    assert json.loads((tmp_path / "back" / "config.json").read_text())["tie_word_embeddings"] is True


def test_an_adapter_whose_saved_embedding_differs_from_the_base_is_refused(tmp_path, tiny_base_dir, head_adapters):
    changed = tmp_path / "changed"
    changed.mkdir()
    for path in head_adapters["style"].iterdir():
        (changed / path.name).write_bytes(path.read_bytes())
    tensors = load_file(changed / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.base_layer.weight"] = tensors["base_model.model.lm_head.base_layer.weight"] + 1
    save_file(tensors, changed / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="carries its own copy of lm_head.weight, which differs"):
        finetune.load_model(str(tiny_base_dir), {"changed": str(changed)})
    with pytest.raises(AdapterError, match="carries its own copy of lm_head.weight, which differs"):
        merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(changed))], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_combine_keeps_embedding_lora_and_equals_the_weighted_sum(tmp_path, tiny_base_dir, head_adapters):
    combine_adapters([head_adapters["style"], head_adapters["tone"]], tmp_path / "both", weights=[1.0, -0.5])
    saved = load_file(tmp_path / "both" / "adapter_model.safetensors")
    assert "base_model.model.model.embed_tokens.lora_embedding_A" in saved
    combined = finetune.load_model(str(tiny_base_dir), {"both": str(tmp_path / "both")})
    combined.merge("both")
    both = finetune.load_model(str(tiny_base_dir), {k: str(v) for k, v in head_adapters.items()})
    both.merge("style")
    both.merge("tone", -0.5)
    for (name, expected), (_, actual) in zip(base_state_items(both.model), base_state_items(combined.model)):
        assert_within_ulps(actual, expected, ROUNDED_ULPS, what=name)  # Σ w·ΔW summed in one fp32 order or two


def test_generate_with_head_and_embedding_lora_prints_greedy_decoding(tiny_base_dir, head_adapters, capsys):
    prompt = "What colour is crate 3?"
    printed = []
    for adapter in (head_adapters["style"], None):
        adapter_args = ["--adapter", str(adapter)] if adapter else []
        assert main(["generate", "--base", str(tiny_base_dir), *adapter_args, "--max-new-tokens", "6", prompt]) == 0
        printed.append(capsys.readouterr().out)
        assert printed[-1] == greedy_text(tiny_base_dir, adapter, prompt, 6) + "\n"
    assert printed[0] != printed[1]  # the head and embedding LoRA change the tokens


def _recipe(root: Path, base_dir: Path, embedding_lr: float) -> Path:
    records = instruction_records(40)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:32]))
    (root / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[32:]))
    recipe = root / "recipe.yaml"
    recipe.write_text(f"""
model: {{base: {base_dir}}}
lora: {{r: 4, alpha: 8, train_lm_head: true, train_embed_tokens: true}}
data: {{train: {root}/train.jsonl, validation: {root}/valid.jsonl, format: instruction, max_seq_len: 96}}
train: {{max_steps: 6, micro_batch_size: 4, lr: 5.0e-3, embedding_lr: {embedding_lr}, log_every_steps: 3}}
output: {{name: heads, dir: {root}/adapters/heads, run_dir: {root}/runs/heads}}
""")
    return recipe


def test_a_trained_head_and_embedding_adapter_works_in_every_command(tmp_path, tiny_base_dir, capsys):
    from finetune.training.loop import train
    from finetune.training.run import parameter_groups

    recipe = _recipe(tmp_path, tiny_base_dir, embedding_lr=1e-3)
    adapter_dir, _ = train(recipe, log=lambda message: None, progress=False)
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    assert "base_model.model.lm_head.lora_A.weight" in saved and not any("base_layer" in k for k in saved)
    assert "base_model.model.model.embed_tokens.lora_embedding_B" in saved
    adapter = read_adapter(adapter_dir)
    assert adapter.modules["lm_head"].B.abs().max() > 0  # trained away from B = 0

    from finetune.model import wrap_with_lora
    from finetune.recipe import load_recipe

    loaded = load_recipe(recipe)
    groups = parameter_groups(loaded, wrap_with_lora(AutoModelForCausalLM.from_pretrained(tiny_base_dir), loaded.lora))
    assert [group["lr"] for group in groups] == [5e-3, 1e-3] and len(groups[1]["params"]) == 4  # head A, B; emb A, B

    valid = tmp_path / "valid.jsonl"
    prompt = "What colour is crate 3?"
    assert main(["generate", "--adapter", str(adapter_dir), "--max-new-tokens", "4", prompt]) == 0
    assert capsys.readouterr().out == greedy_text(tiny_base_dir, adapter_dir, prompt, 4) + "\n"
    assert main(["eval", "--adapter", str(adapter_dir), "--data", str(valid), "--format", "instruction"]) == 0
    merged, back = tmp_path / "merged", tmp_path / "back"
    assert (
        main(["adapters", "merge", "--base", str(tiny_base_dir), "--adapter", str(adapter_dir), "--out", str(merged)])
        == 0
    )
    assert (
        main(["adapters", "subtract", "--model", str(merged), "--adapter", str(adapter_dir), "--out", str(back)]) == 0
    )
    assert_tensors_equal(read_tensors(tiny_base_dir), read_tensors(back))
    assert "base + adapter: perplexity" in capsys.readouterr().out

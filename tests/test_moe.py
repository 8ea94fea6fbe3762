"""Mixture of experts: LoRA on the fused 3D expert tensors of tiny random bases of four families, and exact
arithmetic on them (merge equals plain peft's `merge_and_unload`, subtract returns the base bit for bit,
swap equals a fresh merge) in memory and on disk, where most families store one tensor per expert."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import REORDERED_ULPS, assert_tensors_equal, assert_within_ulps, read_tensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moe_helpers import FAMILIES, MOE_SHAPE, MORE_FAMILIES, build_moe, moe_adapter
from transformers import AutoModelForCausalLM

import finetune
from finetune.adapters.combine import combine_adapters
from finetune.adapters.experts import expert_tensors, routers
from finetune.adapters.lora import read_adapter
from finetune.adapters.ondisk import AdapterSpec, merge_checkpoint, subtract_checkpoint, swap_checkpoint
from finetune.errors import AdapterError, ExportError
from finetune.export.gguf_lora import export_lora_gguf
from finetune.model import describe_targets, wrap_with_lora
from finetune.recipe import LoraConfig


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_base(request, tmp_path_factory, tiny_tokenizer) -> tuple[str, Path]:
    family = request.param
    return family, build_moe(family, tmp_path_factory.mktemp(family), tiny_tokenizer)


def expert_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {e.name: model.get_parameter(e.name).detach().clone() for e in expert_tensors(model)}


def peft_merged(base_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    """The reference: plain peft, as a user runs it, loads the adapter and merges it (`merge_and_unload`) in float32."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()


def test_all_linear_reaches_every_expert_tensor_and_leaves_routers_frozen(moe_base):
    family, base_dir = moe_base
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    experts = expert_tensors(model)
    router_names = routers(model, experts)
    assert len(experts) == 2 * 2 and len(router_names) == 2, (experts, router_names)
    peft_model = wrap_with_lora(model, LoraConfig(r=4, dropout=0.1))
    wrapped = {
        (m.get_base_layer().__class__.__name__, m.parameter_name, n.count(".base_layer"))
        for n, m in peft_model.named_modules()
        if type(m).__name__ == "ParamWrapper"
    }
    assert len(wrapped) == 2  # both expert tensors of each layer, the same way in every layer
    assert describe_targets(peft_model) == ["LoRA on 8 linear modules and 4 of 4 expert tensors"]
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert not any(router in n for router in router_names for n in trainable)
    # linear layers keep their dropout although peft's parameter wrappers have none
    assert {type(m.lora_dropout["default"]).__name__ for m in peft_model.modules() if hasattr(m, "lora_dropout")} == {
        "UniformDropout",
        "Identity",
    }
    routed = wrap_with_lora(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), LoraConfig(r=4, train_router=True)
    )
    trainable = [n for n, p in routed.named_parameters() if p.requires_grad]
    assert all(any(router in n for n in trainable) for router in router_names)


def test_merge_equals_peft_and_subtract_returns_the_base_in_memory(moe_base, tmp_path):
    family, base_dir = moe_base
    adapter_dir = moe_adapter(base_dir, tmp_path / "a", seed=1)
    reference = expert_state(peft_merged(base_dir, adapter_dir))
    m = finetune.load_model(str(base_dir), {"alpha": str(adapter_dir)}, dtype="float32")
    base = expert_state(m.model)
    report = m.merge("alpha")
    merged = expert_state(m.model)
    for name, expected in reference.items():
        assert not torch.equal(merged[name], base[name]), f"{name} unchanged by the merge"
        scale = expected.abs().max()
        torch.testing.assert_close(merged[name], expected, rtol=0, atol=float(scale) * 1e-6)
    assert report.tensors_rewritten == 8 + len(reference)
    m.subtract("alpha")
    assert_tensors_equal(base, expert_state(m.model))


@pytest.mark.parametrize("family", sorted(MORE_FAMILIES))
def test_shared_experts_and_linear_attention_families_merge_as_plain_peft_loads_their_adapter(
    family, tmp_path, tiny_tokenizer
):
    """DeepSeek-V3 (a dense layer, shared experts) and Qwen3.5-MoE (linear attention's 3D conv1d): `all-linear`
    trains every expert tensor and nothing plain peft would load elsewhere (it renames dense `gate_proj`,
    `up_proj`, `down_proj` targets onto the experts for these families), so peft loads the adapter as trained:
    the on-disk merge equals its `merge_and_unload`, changes every expert tensor, and subtract gives the base back."""
    base_dir = build_moe(family, tmp_path / "base", tiny_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base, experts = model.state_dict(), expert_tensors(model)
    assert experts and all(e.owner.endswith("mlp.experts") for e in experts)  # qwen3.5's conv1d is no expert tensor
    lines = describe_targets(wrap_with_lora(model, LoraConfig(r=4, alpha=8)))
    assert lines[0].endswith(f"and {len(experts)} of {len(experts)} expert tensors"), lines
    assert ("left out" in " ".join(lines)) == (family == "deepseek_v3"), lines
    adapter_dir = moe_adapter(base_dir, tmp_path / "a", seed=1)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    merge_checkpoint(str(base_dir), [AdapterSpec(str(adapter_dir))], tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    reference = peft_merged(base_dir, adapter_dir).state_dict()
    assert merged.keys() == reference.keys()
    for name, expected in reference.items():
        torch.testing.assert_close(merged[name], expected, rtol=0, atol=float(expected.abs().max()) * 1e-6)
    assert all(not torch.equal(merged[e.name], base[e.name]) for e in experts)
    subtract_checkpoint(str(tmp_path / "merged"), AdapterSpec(str(adapter_dir)), tmp_path / "back")
    assert_tensors_equal(read_tensors(base_dir), read_tensors(tmp_path / "back"))


def test_router_lora_merges_as_peft_does_and_subtracts_exactly(moe_base, tmp_path):
    """`lora.train_router`: no family's router is an nn.Linear, so peft reaches its weight as a raw parameter;
    merged in memory and on disk it equals plain peft's merge, and subtracting returns the base bit for bit."""
    family, base_dir = moe_base
    adapter_dir = moe_adapter(base_dir, tmp_path / "routed", seed=1, train_router=True)
    reference = peft_merged(base_dir, adapter_dir)
    m = finetune.load_model(str(base_dir), {"routed": str(adapter_dir)}, dtype="float32")
    names = routers(m.model, expert_tensors(m.model))
    base = {n: m.model.get_submodule(n).weight.detach().clone() for n in names}
    m.merge("routed")
    for name in names:
        merged, expected = m.model.get_submodule(name).weight, reference.get_submodule(name).weight
        assert not torch.equal(merged, base[name])
        torch.testing.assert_close(merged, expected, rtol=0, atol=float(expected.abs().max()) * 1e-6)
    m.save_merged(tmp_path / "memory")
    merge_checkpoint(str(base_dir), [AdapterSpec(str(adapter_dir))], tmp_path / "disk")
    assert_tensors_equal(read_tensors(tmp_path / "memory"), read_tensors(tmp_path / "disk"))
    m.subtract("routed")
    assert_tensors_equal(base, {n: m.model.get_submodule(n).weight for n in names})


def test_adapters_on_other_expert_targets_are_refused_side_by_side_in_one_line(moe_base, tmp_path):
    """peft holds adapters unmerged side by side only where they target the same expert tensors and routers."""
    family, base_dir = moe_base
    plain = moe_adapter(base_dir, tmp_path / "plain", seed=1)
    routed = moe_adapter(base_dir, tmp_path / "routed", seed=2, train_router=True)
    m = finetune.load_model(str(base_dir), {"plain": str(plain), "routed": str(routed)}, dtype="float32")
    m.use("plain")
    with pytest.raises(AdapterError, match="'routed' puts LoRA on other expert tensors or routers .*merge it"):
        m.use("routed")


def test_on_disk_merge_subtract_and_swap_are_exact(moe_base, tmp_path):
    family, base_dir = moe_base
    a = moe_adapter(base_dir, tmp_path / "one", seed=1)
    b = moe_adapter(base_dir, tmp_path / "two", seed=2)
    merge_checkpoint(str(base_dir), [AdapterSpec(str(a))], tmp_path / "merged_a")
    stored, written = read_tensors(base_dir), read_tensors(tmp_path / "merged_a")
    assert stored.keys() == written.keys()  # per-expert checkpoints stay per expert
    m = finetune.load_model(str(base_dir), {"one": str(a)}, dtype="float32")
    m.merge("one")
    m.save_merged(tmp_path / "memory_a")
    assert_tensors_equal(read_tensors(tmp_path / "memory_a"), written)
    used = finetune.load_model(str(base_dir), {"one": str(a)}, dtype="float32")
    used.use("one")  # peft wraps the experts for the unmerged forward; they stay wrapped after
    used.use(None)
    used.merge("one")
    used.save_merged(tmp_path / "memory_used")
    assert_tensors_equal(read_tensors(tmp_path / "memory_used"), written)  # not `experts.base_layer.*` names
    experts = [name for name in stored if "experts" in name and not name.endswith("bias")]
    assert experts and all(not torch.equal(stored[n], written[n]) for n in experts)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged_a", dtype=torch.float32)
    assert_tensors_equal(expert_state(m.model), expert_state(reloaded))
    subtract_checkpoint(str(tmp_path / "merged_a"), AdapterSpec("one"), tmp_path / "back")
    assert_tensors_equal(stored, read_tensors(tmp_path / "back"))
    # merged in memory (the experts bound to the model), the ledger names the same adapter as on disk
    subtract_checkpoint(str(tmp_path / "memory_a"), AdapterSpec("one"), tmp_path / "back_from_memory")
    assert_tensors_equal(stored, read_tensors(tmp_path / "back_from_memory"))
    swap_checkpoint(str(tmp_path / "merged_a"), AdapterSpec("one"), AdapterSpec(str(b)), tmp_path / "swapped")
    merge_checkpoint(str(base_dir), [AdapterSpec(str(b))], tmp_path / "merged_b")
    assert_tensors_equal(read_tensors(tmp_path / "merged_b"), read_tensors(tmp_path / "swapped"))


def test_stored_experts_are_read_and_split_one_expert_at_a_time(moe_base):
    """Where a family stores one tensor per expert, each lies in one expert's slice of the fused tensor: read
    expert by expert it assembles what transformers loads, and split it gives back the stored tensors."""
    from finetune.adapters.expert_files import ExpertLayout
    from finetune.adapters.tensor_index import TensorIndex

    family, base_dir = moe_base
    index = TensorIndex.of(base_dir)
    loaded = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    layout = ExpertLayout(loaded, index)
    stored = read_tensors(base_dir)
    fused = [tensor.name for tensor in expert_tensors(loaded) if tensor.name in layout.fused]
    assert bool(fused) == (family != "gpt_oss")  # gpt-oss stores its experts fused
    for name in fused:
        assert layout.experts_apart(name)
        whole = loaded.get_parameter(name).detach()
        for expert in range(whole.shape[0]):
            assert torch.equal(layout.read_expert(name, expert, index.read, torch.float32), whole[expert])
        parts = layout.split(name, whole)
        assert parts.keys() == set(layout.parts(name))
        assert all(torch.equal(values, stored[part].float()) for part, values in parts.items())


def test_expert_adapter_reads_with_one_pair_per_expert(moe_base, tmp_path):
    family, base_dir = moe_base
    adapter = read_adapter(moe_adapter(base_dir, tmp_path / "a", seed=1))
    experts = {module: w for module, w in adapter.modules.items() if w.num_experts > 1}
    assert len(experts) == 4 and {w.num_experts for w in experts.values()} == {4}
    assert {w.rank for w in adapter.modules.values()} == {4}
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["lora_dropout"] == 0.0


def test_combine_cat_equals_the_weighted_sum_and_other_methods_are_refused(moe_base, tmp_path):
    family, base_dir = moe_base
    one, two = moe_adapter(base_dir, tmp_path / "one", seed=1), moe_adapter(base_dir, tmp_path / "two", seed=2)
    combine_adapters([one, two], tmp_path / "both", weights=[1.0, -0.5])
    m = finetune.load_model(str(base_dir), {"one": str(one), "two": str(two), "both": str(tmp_path / "both")})
    m.merge("one")
    m.merge("two", -0.5)
    separately = expert_state(m.model)
    m.subtract("one"), m.subtract("two")
    m.merge("both")
    for name, expected in separately.items():
        torch.testing.assert_close(
            expert_state(m.model)[name], expected, rtol=0, atol=float(expected.abs().max()) * 1e-6
        )
    with pytest.raises(AdapterError, match="use --method cat"):
        combine_adapters([one, two], tmp_path / "svd", method="svd")
    with pytest.raises(ExportError, match="dense LlamaForCausalLM and MistralForCausalLM bases only.*finetune serve"):
        export_lora_gguf(one, tmp_path / "one.gguf")
    m.subtract("both")


TRAIN_RECIPE = """
model:
  base: {base}
lora:
  r: 4
  alpha: 8
data:
  train: train.jsonl
  format: instruction
  max_seq_len: 128
train:
  max_steps: 2
  micro_batch_size: 4
  lr: 0.01
  log_every_steps: 1
output:
  name: moe
"""


@pytest.mark.slow
def test_finetune_train_then_cli_merge_equals_plain_peft(tmp_path, monkeypatch, tiny_tokenizer):
    """The issue's check on one family, through the CLI: every layer's experts carry LoRA after training (with
    the load-balancing loss logged), `finetune adapters merge` equals plain peft's merge and changes every
    expert tensor."""
    from helpers import instruction_records

    from finetune.cli import main

    monkeypatch.chdir(tmp_path)
    base_dir = build_moe("qwen3_moe", tmp_path / "base", tiny_tokenizer, output_router_logits=True)
    records = instruction_records(16)
    Path("train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    Path("recipe.yaml").write_text(TRAIN_RECIPE.format(base=base_dir))
    assert main(["train", "recipe.yaml"]) == 0
    logged = [json.loads(line) for line in Path("runs/moe/metrics.jsonl").read_text().splitlines()]
    assert [m["router_aux"] > 0 for m in logged if "loss" in m] == [True, True]  # the config weighs it in
    adapter = read_adapter("adapters/moe")
    experts = [m for m, w in adapter.modules.items() if w.num_experts > 1]
    assert len(experts) == 2 * 2  # both expert tensors of both layers
    assert all(adapter.modules[m].B.abs().max() > 0 for m in experts)  # trained away from B = 0
    assert main(["adapters", "merge", "--base", str(base_dir), "--adapter", "adapters/moe", "--out", "merged"]) == 0
    reference = expert_state(peft_merged(base_dir, Path("adapters/moe")))
    merged = expert_state(AutoModelForCausalLM.from_pretrained("merged", dtype=torch.float32))
    base = expert_state(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32))
    for name, expected in reference.items():
        assert not torch.equal(merged[name], base[name])
        torch.testing.assert_close(merged[name], expected, rtol=0, atol=float(expected.abs().max()) * 1e-6)
    assert main(["plan", "recipe.yaml"]) == 0


def test_plan_runs_on_each_tiny_family(moe_base, tmp_path, capsys):
    from finetune.cli import main

    family, base_dir = moe_base
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(TRAIN_RECIPE.format(base=base_dir))
    assert main(["plan", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "mixture of experts:" in out and "folded experts" in out


PUBLISHED = {
    # (total, active, active without the input embedding): Qwen counts the input embedding in its 3.3B
    # active; OpenAI leaves it out of gpt-oss-20b's 3.61B.
    "Qwen/Qwen3-30B-A3B": (30.53e9, 3.35e9, 3.04e9),
    "openai/gpt-oss-20b": (20.91e9, 4.19e9, 3.61e9),
}


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-chat", "qwen3-30b-a3b-chat-qlora", "gpt-oss-20b-chat"])
def test_moe_catalog_recipe_plans_what_its_catalog_entry_says(name):
    """Each MoE recipe's `memory` line is its `finetune plan` on one GPU; the plan counts total and active
    parameters as published, and a rank-r pair per expert on every expert tensor."""
    from finetune.catalog import resolve_recipe_path
    from finetune.plan.memory import GiB, estimate
    from finetune.plan.model_config import find_model_config
    from finetune.plan.shape import model_shape
    from finetune.recipe import load_recipe

    recipe = load_recipe(resolve_recipe_path(name))
    config, _ = find_model_config(recipe.model.base)
    shape = model_shape(config, recipe.lora)
    plan = estimate(recipe, shape, device="cuda")
    assert recipe.catalog.memory is not None
    assert recipe.catalog.memory.startswith(f"{plan.peak_bytes / GiB:.1f} GiB")
    total, active, active_without_embedding = PUBLISHED[recipe.model.base]
    assert plan.moe["total_params"] == pytest.approx(total, rel=5e-4)
    assert plan.moe["active_params"] == pytest.approx(active, rel=5e-3)
    assert plan.moe["active_params_without_input_embedding"] == pytest.approx(active_without_embedding, rel=5e-3)
    text = config.get_text_config()
    experts = getattr(text, "num_experts", None) or text.num_local_experts
    inner = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    d, r = text.hidden_size, recipe.lora.r
    per_layer = experts * r * ((d + 2 * inner) + (inner + d))  # gate_up (d -> 2i) and down (i -> d)
    assert shape.expert_lora_params == per_layer * text.num_hidden_layers
    assert shape.folded_expert_params == shape.expert_params


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_load_balancing_loss_is_added_as_the_config_weighs_it(family, tiny_tokenizer):
    """With `output_router_logits` on, the SFT loss over a micro-batch equals transformers' own loss
    (mean cross-entropy + router_aux_loss_coef x aux), and `router_aux` is the aux it added."""
    from finetune.training.objectives.base import CollateOptions, Models
    from finetune.training.objectives.sft import SFT

    torch.manual_seed(0)
    config = FAMILIES[family]()
    config.output_router_logits, config.router_aux_loss_coef = True, 0.3
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    input_ids = torch.randint(0, 512, (2, 24))
    labels = input_ids.clone()
    labels[:, :5] = -100
    reference = model(input_ids=input_ids, labels=labels)
    terms = SFT(CollateOptions(pad_token_id=0, packing=False)).terms(
        Models(model, model, None), {"input_ids": input_ids, "labels": labels}, {}
    )
    tokens = int((labels[:, 1:] != -100).sum())
    # a sum divided by the count against transformers' mean: the same sums in another order
    assert_within_ulps(terms.losses["label_tokens"] / tokens, reference.loss, REORDERED_ULPS, what="loss")
    assert_within_ulps(terms.metrics["router_aux"] / tokens, reference.aux_loss, REORDERED_ULPS, what="router aux")
    assert reference.aux_loss > 0
    config.output_router_logits = False  # the config's own default: no load-balancing term, no metric
    terms = SFT(CollateOptions(pad_token_id=0, packing=False)).terms(
        Models(model, model, None), {"input_ids": input_ids, "labels": labels}, {}
    )
    assert "router_aux" not in terms.metrics


@pytest.fixture(scope="module")
def bf16_moe(tmp_path_factory, tiny_tokenizer) -> dict[str, tuple[Path, dict[str, Path]]]:
    """Per family: a tiny base and three seeded expert adapters (one family stores experts fused, one apart)."""
    made = {}
    for family in ("qwen3_moe", "gpt_oss"):
        root = tmp_path_factory.mktemp(f"{family}-bf16")
        base_dir = build_moe(family, root / "base", tiny_tokenizer)
        made[family] = (base_dir, {n: moe_adapter(base_dir, root / n, seed=s) for n, s in (("x1", 1), ("x2", 2))})
    return made


_moe_operation = st.one_of(
    st.tuples(st.just("merge"), st.sampled_from(["x1", "x2"]), st.sampled_from([1.0, 0.5, -1.0, 2.0])),
    st.tuples(st.just("subtract"), st.sampled_from(["x1", "x2"]), st.sampled_from([None, 0.5])),
    st.tuples(st.just("swap"), st.sampled_from(["x1", "x2"]), st.sampled_from(["x1", "x2"])),
)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations=st.lists(_moe_operation, min_size=1, max_size=6))
def test_invariant_holds_on_expert_tensors_in_bf16(bf16_moe, family, operations):
    """Whatever the sequence, each expert tensor is round(W_base + Σ w·ΔW) summed in fp32 in name order,
    read from the base's files (no kept copies, also where they store one tensor per expert)."""
    base_dir, adapters = bf16_moe[family]
    m = finetune.load_model(str(base_dir), {n: str(p) for n, p in adapters.items()}, dtype="bfloat16")
    base = expert_state(m.model)
    for operation, name, argument in operations:
        try:
            getattr(m, operation)(name, argument) if argument is not None else m.subtract(name)
        except AdapterError:
            pass  # refused (e.g. subtracting what is not merged): must leave the state consistent
        expected = {}
        for tensor_name, tensor in base.items():
            accumulator = tensor.to(torch.float32)
            for adapter_name, weight in sorted(m.merged.items()):
                accumulator = accumulator + m.adapters[adapter_name].modules[tensor_name].delta(weight)
            expected[tensor_name] = accumulator.to(torch.bfloat16)
        assert_tensors_equal(expected, expert_state(m.model))
    for name in list(m.merged):
        m.subtract(name, negate=True)
    assert_tensors_equal(base, expert_state(m.model))
    assert m.pristine_copy_bytes == 0


@pytest.mark.parametrize("dtype, unquantized", [("bfloat16", torch.bfloat16), ("float16", torch.float32)])
def test_qlora_keeps_the_experts_in_the_model_dtype(moe_base, dtype, unquantized):
    """bitsandbytes quantizes the linear layers. On a float16 base peft's kbit preparation upcasts what it
    left (embeddings, head, norms) to float32, and would upcast the experts too (twice the model's bulk),
    which wrap_with_lora prevents; a bf16 base keeps everything in bf16 (float32's range already)."""
    pytest.importorskip("bitsandbytes")
    from finetune.model import load_base
    from finetune.quantization import Quantization

    family, base_dir = moe_base
    model, _, _ = load_base(str(base_dir), dtype=dtype, quantization=Quantization("4bit"))
    peft_model = wrap_with_lora(model, LoraConfig(r=4))
    experts = expert_tensors(peft_model)
    assert len(experts) == 4
    assert {unwrapped_parameter(peft_model, e.name).dtype for e in experts} == {getattr(torch, dtype)}
    norms = [p for name, p in peft_model.named_parameters() if "norm" in name]
    assert norms and {p.dtype for p in norms} == {unquantized}
    assert peft_model.get_input_embeddings().weight.dtype == unquantized
    assert any(type(m).__name__ == "Linear4bit" for m in peft_model.modules())
    assert describe_targets(peft_model) == ["LoRA on 8 linear modules and 4 of 4 expert tensors"]


def unwrapped_parameter(peft_model: torch.nn.Module, name: str) -> torch.Tensor:
    from finetune.adapters.experts import unwrapped

    owner, _, parameter = name.rpartition(".")
    return getattr(unwrapped(peft_model.base_model.model.get_submodule(owner)), parameter)


def test_shared_experts_keep_their_linear_lora_beside_the_routed_experts():
    """Qwen2-MoE's shared expert is dense (`gate_proj`/`up_proj`/`down_proj` nn.Linear): peft 0.21 would move
    those names onto the expert tensors for this family; with its rewrite off both carry LoRA."""
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(**MOE_SHAPE, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4)
    peft_model = wrap_with_lora(AutoModelForCausalLM.from_config(config), LoraConfig(r=4))
    assert describe_targets(peft_model) == ["LoRA on 16 linear modules and 4 of 4 expert tensors"]
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    for part in ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"):
        assert f"base_model.model.model.layers.0.mlp.{part}.lora_A.default.weight" in trainable
    assert not any(".mlp.gate." in n for n in trainable)  # the router


def _patterned_adapter(base_dir: Path, out: Path, rank_pattern: dict, alpha_pattern: dict) -> Path:
    """A seeded random LoRA with per-tensor rank/alpha patterns on the expert tensors, saved by plain peft."""
    from helpers import make_adapter

    from finetune.adapters.experts import peft_target_rewrite_off

    with peft_target_rewrite_off():
        return make_adapter(base_dir, out, seed=5, targets=("q_proj",), manifest=False,
                            target_parameters=["experts.down_proj", "experts.gate_up_proj"],
                            rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)  # fmt: skip


@pytest.mark.parametrize(
    "rank_pattern, alpha_pattern",
    [
        ({}, {"down_proj": 32}),
        ({"down_proj": 8}, {}),
        ({"gate_up_proj": 2}, {"gate_up_proj": 3}),
        ({}, {"experts": 32}),
    ],
)
def test_rank_and_alpha_patterns_on_expert_tensors_are_peft_s(moe_base, tmp_path, rank_pattern, alpha_pattern):
    """peft keys a parameter target's pattern by the tensor's name (`...experts.down_proj`), not by the wrapper
    key its LoRA is saved under (`...experts`, `...experts.base_layer`): merged in memory and on disk, such an
    adapter equals plain peft's merge (an alpha pattern on down_proj merged 4x too small, a rank pattern was
    refused as another base's adapter)."""
    from finetune.adapters.experts import peft_target_rewrite_off

    family, base_dir = moe_base
    adapter_dir = _patterned_adapter(base_dir, tmp_path / "patterned", rank_pattern, alpha_pattern)
    with peft_target_rewrite_off():
        reference = peft_merged(base_dir, adapter_dir)
    m = finetune.load_model(str(base_dir), {"patterned": str(adapter_dir)}, dtype="float32")
    m.merge("patterned")
    for name, merged in expert_state(m.model).items():
        expected = reference.get_parameter(name)
        torch.testing.assert_close(merged, expected, rtol=0, atol=float(expected.abs().max()) * 1e-6)
    m.save_merged(tmp_path / "memory")
    merge_checkpoint(str(base_dir), [AdapterSpec(str(adapter_dir))], tmp_path / "disk")
    assert_tensors_equal(read_tensors(tmp_path / "memory"), read_tensors(tmp_path / "disk"))


def test_combined_router_lora_stays_a_parameter_target_and_patterns_on_experts_are_refused(moe_base, tmp_path):
    """combine cat of router LoRA writes the router under target_parameters (as a target module peft refuses
    it: not an nn.Linear, and the combined adapter could not be used unmerged or served); an adapter whose
    rank/alpha pattern may reach an expert tensor is refused (combine cannot tell which one it sets)."""
    from peft import PeftModel

    family, base_dir = moe_base
    routed = moe_adapter(base_dir, tmp_path / "routed", seed=1, train_router=True)
    combine_adapters([routed, routed], tmp_path / "both", weights=[1.0, 0.5])
    config = json.loads((tmp_path / "both" / "adapter_config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    names = routers(model, expert_tensors(model))
    assert not set(names) & set(config["target_modules"])
    PeftModel.from_pretrained(model, str(tmp_path / "both"))  # loads
    m = finetune.load_model(str(base_dir), {"both": str(tmp_path / "both")}, dtype="float32")
    m.use("both")
    patterned = _patterned_adapter(base_dir, tmp_path / "patterned", {}, {"down_proj": 32})
    with pytest.raises(AdapterError, match="rank_pattern/alpha_pattern that may set the rank or alpha of an expert"):
        combine_adapters([patterned, patterned], tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    plain = moe_adapter(base_dir, tmp_path / "plain", seed=2)  # the same modules but the routers
    with pytest.raises(
        AdapterError, match=r"adapters 'routed' and 'plain' adapt different modules \(\d+, e\.g\. .*merge"
    ):
        combine_adapters([routed, plain], tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_routers_that_subclass_linear_but_return_a_tuple_train_as_parameters(tiny_tokenizer, tmp_path):
    """Phi-MoE's router is an nn.Linear subclass whose forward returns (logits, weights, experts): peft's LoRA
    linear layer cannot add its update to that, so `train_router` reaches its weight as a raw parameter. A
    training forward and backward run, and the in-memory merge equals plain peft's attached forward."""
    from transformers import PhimoeConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(PhimoeConfig(**MOE_SHAPE, intermediate_size=32, num_local_experts=4))
    model.save_pretrained(tmp_path / "base")
    tiny_tokenizer.save_pretrained(tmp_path / "base")
    adapter_dir = moe_adapter(tmp_path / "base", tmp_path / "routed", seed=1, train_router=True)
    assert "router.weight" in json.loads((adapter_dir / "adapter_config.json").read_text())["target_parameters"]
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    peft_model = wrap_with_lora(model, LoraConfig(r=4, train_router=True))
    peft_model(input_ids=ids, labels=ids).loss.backward()  # a training step's forward and backward
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with torch.no_grad():
        attached = PeftModel.from_pretrained(base, str(adapter_dir))(input_ids=ids).logits
    m = finetune.load_model(str(tmp_path / "base"), {"routed": str(adapter_dir)}, dtype="float32", device="cpu")
    m.merge("routed")
    with torch.no_grad():
        merged = m.model(input_ids=ids).logits
    torch.testing.assert_close(merged, attached, rtol=0, atol=1e-5)


def test_train_router_beside_a_list_of_target_modules_trains_the_routers(tiny_tokenizer, tmp_path):
    """`lora.train_router` with `target_modules` a list (not `all-linear`) put LoRA on no router, unsaid: the
    routers were looked for beside the experts `all-linear` takes only. Now each router's weight is a parameter
    target, and the in-memory merge of the saved adapter equals plain peft's attached forward."""
    from peft import PeftModel

    base_dir = build_moe("qwen3_moe", tmp_path / "base", tiny_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = wrap_with_lora(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], train_router=True))
    names = routers(model, expert_tensors(model))
    trained = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert all(f"base_model.model.{name}.lora_A.default.weight" in trained for name in names)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.2, generator=torch.Generator().manual_seed(1))
    peft_model.save_pretrained(tmp_path / "routed")
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        attached = PeftModel.from_pretrained(base, str(tmp_path / "routed"))(input_ids=ids).logits
    m = finetune.load_model(str(base_dir), {"routed": str(tmp_path / "routed")}, dtype="float32", device="cpu")
    m.merge("routed")
    with torch.no_grad():
        merged = m.model(input_ids=ids).logits
    torch.testing.assert_close(merged, attached, rtol=0, atol=1e-5)


def test_dora_on_the_expert_tensors_is_one_line_naming_the_fix():
    """peft has no DoRA for parameter targets: `lora.use_dora` with `all-linear` on a mixture of experts (or
    `train_router` where a router is reached as a parameter) was peft's traceback, after the base and the data had
    loaded in `finetune train` and in `finetune plan`. On the linear layers alone DoRA works."""
    from finetune.errors import ModelError

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES["qwen3_moe"]())
    with pytest.raises(ModelError, match=r"lora.use_dora: .*fused expert tensors .*set lora.use_dora=false"):
        wrap_with_lora(model, LoraConfig(use_dora=True))
    peft_model = wrap_with_lora(model, LoraConfig(use_dora=True, target_modules=["q_proj", "v_proj"]))
    assert any("lora_magnitude_vector" in name for name, _ in peft_model.named_parameters())


def test_routers_held_by_a_linear_one_level_down_stay_frozen_unless_train_router():
    """HunYuan-MoE's router is `mlp.gate.wg` and JetMoE's `mlp.router.layer`: a plain nn.Linear inside the module
    beside the experts. It was not recognised as a router, so `all-linear` trained it (README: routers stay frozen
    unless `lora.train_router`), and `train_router` beside a list of target modules trained none."""
    from transformers import HunYuanMoEV1Config

    torch.manual_seed(0)
    config = HunYuanMoEV1Config(**MOE_SHAPE, intermediate_size=32, num_experts=4, head_dim=16, moe_topk=2)
    model = AutoModelForCausalLM.from_config(config)
    assert routers(model, expert_tensors(model)) == ["model.layers.0.mlp.gate.wg", "model.layers.1.mlp.gate.wg"]

    def trained_routers(lora: LoraConfig) -> set[str]:
        peft_model = wrap_with_lora(AutoModelForCausalLM.from_config(config), lora)
        return {n.split(".lora_")[0] for n, p in peft_model.named_parameters() if p.requires_grad and ".gate.wg." in n}

    assert trained_routers(LoraConfig(r=4)) == set()
    every = {"base_model.model.model.layers.0.mlp.gate.wg", "base_model.model.model.layers.1.mlp.gate.wg"}
    assert trained_routers(LoraConfig(r=4, train_router=True)) == every
    assert trained_routers(LoraConfig(r=4, target_modules=["q_proj"], train_router=True)) == every

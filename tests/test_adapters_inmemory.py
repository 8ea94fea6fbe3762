"""In-memory adapter arithmetic: bit-exact subtract and swap in fp32/bf16/fp16, the ledger invariant under
random operation sequences (hypothesis), merged logits vs peft's unmerged ones, and the safety refusals."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    LIBRARY_ULPS,
    REORDERED_ULPS,
    assert_tensors_equal,
    assert_within_ulps,
    base_tensors,
    bnb_weight,
    make_adapter,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import PeftModel
from transformers import AutoModelForCausalLM

import finetune
from finetune.adapters.inmemory import LoadedModel
from finetune.adapters.lora import read_adapter
from finetune.adapters.resolved_base import ResolvedBase
from finetune.device import model_device
from finetune.errors import AdapterError, AdapterWarning

DTYPES = ["float32", "bfloat16", "float16"]
# The exactness guarantees hold wherever the model runs: on CUDA too (`gpu`: skipped without a CUDA device).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _load(tiny_base_dir, adapter_dirs, dtype="float32", device="auto") -> LoadedModel:
    return finetune.load_model(
        str(tiny_base_dir), {name: str(path) for name, path in adapter_dirs.items()}, dtype=dtype, device=device
    )


def _expected(base: dict[str, torch.Tensor], m: LoadedModel) -> dict[str, torch.Tensor]:
    """The invariant, computed independently: round(W_base + Σ w·ΔW) in fp32, adapters in sorted-name order,
    each update computed where the weight lives (the model's device)."""
    expected = dict(base)
    accumulators: dict[str, torch.Tensor] = {}
    for name, weight in sorted(m.merged.items()):
        for module, lora in m.adapters[name].modules.items():
            key = module + ".weight"
            accumulators.setdefault(key, base[key].to(torch.float32).clone())
            accumulators[key] += lora.delta(weight, base[key].device)
    for key, accumulator in accumulators.items():
        expected[key] = accumulator.to(base[key].dtype)
    return expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_subtracting_everything_gives_the_base_bit_for_bit(tiny_base_dir, adapter_dirs, dtype, device):
    m = _load(tiny_base_dir, adapter_dirs, dtype, device)
    assert m.model.model.layers[0].self_attn.q_proj.weight.device.type == device
    base = base_tensors(m.model)
    for _ in range(20):  # peft's merge/unmerge drifts in bf16 over cycles like these; ours must not
        m.merge("legal")
        m.merge("med", 0.7)
        m.merge("code", -1.3)
        m.subtract("med")
        m.swap("legal", "med", 2.0)
        assert m.merged == {"code": -1.3, "med": 2.0}
        assert not torch.equal(
            m.model.model.layers[0].self_attn.q_proj.weight, base["model.layers.0.self_attn.q_proj.weight"]
        )
        m.subtract("med")
        m.subtract("code")
    assert m.merged == {}
    assert_tensors_equal(base, base_tensors(m.model))
    assert m.pristine_copy_bytes == 0  # the pristine source was the memory-mapped files


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_equals_a_fresh_merge_bit_for_bit(tiny_base_dir, adapter_dirs, dtype, device):
    m = _load(tiny_base_dir, adapter_dirs, dtype, device)
    m.merge("legal")
    m.merge("code", 0.5)
    m.swap("legal", "med")
    fresh = _load(tiny_base_dir, adapter_dirs, dtype, device)
    fresh.merge("med")
    fresh.merge("code", 0.5)
    assert m.merged == fresh.merged == {"code": 0.5, "med": 1.0}
    assert_tensors_equal(base_tensors(fresh.model), base_tensors(m.model))


_operation = st.one_of(
    st.tuples(st.just("merge"), st.sampled_from(["legal", "med", "code"]), st.sampled_from([1.0, 0.5, -1.0, 2.0, 0.1])),
    st.tuples(st.just("subtract"), st.sampled_from(["legal", "med", "code"]), st.sampled_from([None, 0.5])),
    st.tuples(st.just("swap"), st.sampled_from(["legal", "med", "code"]), st.sampled_from(["legal", "med", "code"])),
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations=st.lists(_operation, min_size=1, max_size=8))
def test_invariant_holds_for_random_operation_sequences(tiny_base_dir, adapter_dirs, dtype, device, operations):
    # Every example loads its own model from the session's files (tens of milliseconds): no state
    # carries over from one example to the next, so a failure shrinks to the sequence that causes it.
    m = _load(tiny_base_dir, adapter_dirs, dtype, device)
    base = base_tensors(m.model)
    for operation, name, argument in operations:
        try:
            if operation == "merge":
                m.merge(name, argument)
            elif operation == "subtract":
                m.subtract(name, argument)
            else:
                m.swap(name, argument)
        except AdapterError:
            pass  # refused (e.g. subtracting what is not merged): must leave the state consistent
        assert_tensors_equal(_expected(base, m), base_tensors(m.model))
    for name in list(m.merged):
        m.subtract(name, negate=True)
    assert_tensors_equal(base, base_tensors(m.model))


def test_delta_matches_peft_get_delta_weight(tiny_base_dir, adapter_dirs, tmp_path):
    """Bit for bit, also where alpha/r is no power of two (0.75 here, and rsLoRA's alpha/√r)."""
    patterned = make_adapter(
        tiny_base_dir,
        tmp_path / "patterned",
        seed=5,
        targets=("q_proj", "v_proj"),
        rank_pattern={"q_proj": 2},
        alpha_pattern={"layers.1.self_attn.v_proj": 3},
    )
    assert {lora.rank for lora in read_adapter(patterned).modules.values()} == {2, 4}
    for name, path in {**adapter_dirs, "patterned": patterned}.items():
        model = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(model, str(path))
        adapter = read_adapter(path)
        for module, lora in adapter.modules.items():
            reference = peft_model.base_model.model.get_submodule(module).get_delta_weight("default")
            assert torch.equal(lora.delta(), reference), f"{name} {module}"  # B·A, then scaled, as peft does


def _logits(model, input_ids) -> torch.Tensor:
    """Logits for `input_ids` (built on the host), computed on the model's device, returned on the host."""
    with torch.no_grad():
        return model(input_ids=input_ids.to(model_device(model))).logits.cpu()


def test_merged_logits_match_unmerged_peft_logits(tiny_base_dir, adapter_dirs, tiny_tokenizer):
    input_ids = tiny_tokenizer(["the model reads a document and predicts"], return_tensors="pt").input_ids
    m = _load(tiny_base_dir, adapter_dirs)
    base_logits = _logits(m.model, input_ids)
    for name in ("legal", "med", "code"):
        reference = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32), str(adapter_dirs[name])
        )
        expected = _logits(reference, input_ids)
        m.use(name)
        assert_within_ulps(_logits(m.model, input_ids), expected, REORDERED_ULPS, what=name)
        m.use(None)
        assert torch.equal(_logits(m.model, input_ids), base_logits)
        m.merge(name)
        assert_within_ulps(_logits(m.model, input_ids), expected, REORDERED_ULPS, what=f"merged {name}")
        assert (expected - base_logits).abs().max() > 1e-3  # the adapter does change the output
        m.subtract(name)
    assert torch.equal(_logits(m.model, input_ids), base_logits)


def test_use_and_merge_exclude_each_other_for_the_same_adapter(tiny_base_dir, adapter_dirs, tiny_tokenizer):
    input_ids = tiny_tokenizer(["the adapter learns"], return_tensors="pt").input_ids
    m = _load(tiny_base_dir, adapter_dirs)
    m.merge("legal")
    with pytest.raises(AdapterError, match="would count it twice"):
        m.use("legal")
    m.use("med")  # another adapter on top of the merged one is fine
    with pytest.raises(AdapterError, match="in use unmerged"):
        m.merge("med")
    on_top = _logits(m.model, input_ids)
    m.use(None)
    m.merge("med")
    assert_within_ulps(_logits(m.model, input_ids), on_top, REORDERED_ULPS)
    assert m.active is None and m.merged == {"legal": 1.0, "med": 1.0}


def test_per_row_adapters_give_each_row_what_use_gives_it_alone(tiny_base_dir, adapter_dirs, tiny_tokenizer):
    input_ids = tiny_tokenizer(["the adapter learns"], return_tensors="pt").input_ids
    m = _load(tiny_base_dir, adapter_dirs)
    alone = {}
    for name in ("legal", "code", None):
        m.use(name)
        alone[name] = _logits(m.model, input_ids)
    m.use(None)
    m.attach("med")  # attached, not in use: plain forwards stay the base's
    assert torch.equal(_logits(m.model, input_ids), alone[None])
    model = m.use_per_row()
    rows = ["legal", "__base__", "code", "legal"]
    with torch.no_grad():
        logits = model(
            input_ids=input_ids.repeat(len(rows), 1), adapter_names=rows
        ).logits  # legal, code attached by use
    for row, name in enumerate(rows):
        assert_within_ulps(logits[row : row + 1], alone[None if name == "__base__" else name], REORDERED_ULPS)

    # merged and attached, a row naming it would get it twice: refused in either order
    with pytest.raises(AdapterError, match="'med' is attached for per-row use"):
        m.merge("med")
    m.use(None)
    m.merge("med")
    with pytest.raises(AdapterError, match="'med' is merged and attached: a row naming it would get it twice"):
        m.use_per_row()
    with pytest.raises(AdapterError, match="merged; subtract it"):
        m.remove_adapter("med")
    m.use("legal")
    with pytest.raises(AdapterError, match="in use"):
        m.remove_adapter("legal")
    m.use(None)
    m.remove_adapter("code")
    with pytest.raises(AdapterError, match="no adapter named 'code'"):
        m.use("code")
    m.subtract("med")
    m.remove_adapter("med")
    m.remove_adapter("legal")  # the last one attached: peft's layers are taken out
    assert m.attached == [] and m.adapters == {}
    assert torch.equal(_logits(m.model, input_ids), alone[None])
    m.add_adapter(read_adapter(adapter_dirs["legal"], "legal"))
    m.attach("legal")
    with torch.no_grad():
        again = m.use_per_row()(input_ids=input_ids, adapter_names=["legal"]).logits
    assert_within_ulps(again, alone["legal"], REORDERED_ULPS)


def test_subtracting_what_is_not_merged_is_task_negation_and_must_be_asked_for(tiny_base_dir, adapter_dirs):
    m = _load(tiny_base_dir, adapter_dirs)
    with pytest.raises(AdapterError, match="task negation"):
        m.subtract("legal")
    m.merge("legal", 0.5)
    with pytest.raises(AdapterError, match="task negation"):
        m.subtract("legal", 1.0)
    m.subtract("legal", 1.0, negate=True)
    assert m.merged == {"legal": -0.5}


def test_weights_that_cancel_in_decimal_leave_nothing_merged(tiny_base_dir, adapter_dirs):
    m = _load(tiny_base_dir, adapter_dirs, "bfloat16")
    base = base_tensors(m.model)
    m.merge("legal", 0.1)
    m.merge("legal", 0.2)
    m.subtract("legal", 0.3)
    assert m.merged == {}
    assert_tensors_equal(base, base_tensors(m.model))


def test_overflow_is_refused_and_the_model_is_left_unchanged(tiny_base_dir, tmp_path):
    huge = make_adapter(tiny_base_dir, tmp_path / "huge", seed=4, targets=("q_proj", "down_proj"), magnitude=300.0)
    m = finetune.load_model(str(tiny_base_dir), {"huge": str(huge)}, dtype="float16")
    base = base_tensors(m.model)
    m.merge("huge", 1e-6)  # small enough to fit
    merged = base_tensors(m.model)
    with pytest.raises(AdapterError, match="huge into model.layers.0.*NaN/Inf in float16"):
        m.merge("huge", 1.0)
    assert m.merged == {"huge": 1e-6}
    assert_tensors_equal(merged, base_tensors(m.model))
    m.subtract("huge")
    assert_tensors_equal(base, base_tensors(m.model))


def test_base_built_in_memory_keeps_a_copy_of_targeted_tensors_only(tiny_base_dir, adapter_dirs, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.bfloat16)
    m = LoadedModel(model, tiny_tokenizer, ResolvedBase.in_memory(model))
    m.add_adapter(read_adapter(adapter_dirs["legal"]))
    base = base_tensors(m.model)
    with pytest.warns(AdapterWarning, match="keeping an in-memory copy"):
        m.merge("legal")
    targeted = [p for n, p in model.named_parameters() if "q_proj" in n or "v_proj" in n]
    assert m.pristine_copy_bytes == sum(p.numel() * p.element_size() for p in targeted)
    m.subtract("legal")
    assert_tensors_equal(base, base_tensors(m.model))


def _dequantized_reference(m: LoadedModel, tiny_base_dir, updates: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A dense fp32 model holding what the quantized base computes with (every quantized layer dequantized),
    plus `updates` (module -> ΔW): what a merge must equal."""
    from finetune.adapters.quantized import dequantize, is_quantized_linear

    reference = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32).to(m.device)
    for name, layer in m.model.named_modules():
        if is_quantized_linear(layer):
            weight = dequantize(layer) + updates.get(name, 0.0)
            reference.get_submodule(name).weight.data.copy_(weight)
    return reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_quantized_base_merges_dequantized_and_restores_the_quantized_layer(
    tiny_base_dir, tmp_path, tiny_tokenizer, bits, device
):
    pytest.importorskip("bitsandbytes")
    from finetune.adapters.quantized import dequantize, is_quantized_linear, quantized_linear
    from finetune.quantization import Quantization

    adapter = make_adapter(tiny_base_dir, tmp_path / "q", seed=6, targets=("q_proj", "up_proj"), quantization=bits)
    m = finetune.load_model(str(tiny_base_dir), {"q": str(adapter)}, device=device)
    original = m.model.model.layers[0].self_attn.q_proj
    assert is_quantized_linear(original) and original.weight.device.type == device
    updates = {module: m.adapters["q"].delta(module, device=m.device) for module in m.adapters["q"].modules}
    reference = _dequantized_reference(m, tiny_base_dir, updates)
    m.merge("q")
    for module in updates:  # every merged layer: dense, exactly the dequantized weight plus the update
        merged = m.model.get_submodule(module)
        assert isinstance(merged, torch.nn.Linear) and not is_quantized_linear(merged)
        assert torch.equal(merged.weight, reference.get_submodule(module).weight), module
    input_ids = tiny_tokenizer(["the model reads a document and predicts"], return_tensors="pt").input_ids
    if bits == "4bit":  # 4-bit layers dequantize and run a float matmul: the whole model equals the reference
        assert_within_ulps(_logits(m.model, input_ids), _logits(reference, input_ids), LIBRARY_ULPS)
    m.subtract("q")
    assert m.model.model.layers[0].self_attn.q_proj is original  # the quantized layer itself is back
    requantizing = finetune.load_model(str(tiny_base_dir), {"q": str(adapter)}, requantize=True, device=device)
    report = requantizing.merge("q")
    for module in updates:  # requantized: the merged weight quantized as the base was, nothing else
        layer = requantizing.model.get_submodule(module)
        expected = quantized_linear(reference.get_submodule(module).weight.detach(), Quantization(bits))
        assert is_quantized_linear(layer) and torch.equal(dequantize(layer), dequantize(expected)), module
    errors = requantizing.requantization_errors
    assert set(errors) == set(requantizing.adapters["q"].modules)
    for module, error in errors.items():  # recomputed: the requantized layer's weight against the exact merge
        exact = reference.get_submodule(module).weight.detach().float()
        recomputed = (bnb_weight(requantizing.model.get_submodule(module)) - exact).norm() / exact.norm()
        assert_within_ulps(error, recomputed, REORDERED_ULPS, what=module)  # two norms of the same tensors
        assert error > 1e-3  # requantizing does round: the figure is not vacuously 0
    worst = max(errors, key=lambda module: errors[module])
    assert f"largest relative error added {errors[worst]:.3e} ({worst})" in report.summary()


def test_an_adapter_given_again_is_refused_where_it_would_count_twice(tiny_base_dir, adapter_dirs, tmp_path):
    """A merged model's ledger names its adapters: one given under a merged name must be that adapter, and the
    adapter merged under one name cannot be used unmerged under another. A weight must be finite."""
    m = _load(tiny_base_dir, adapter_dirs)
    m.merge("legal")
    m.save_merged(tmp_path / "merged")
    with pytest.raises(AdapterError, match="adapter 'legal' merged here came from .* another adapter of that name"):
        finetune.load_model(str(tmp_path / "merged"), {"legal": str(adapter_dirs["med"])})
    again = finetune.load_model(str(tmp_path / "merged"), {"again": str(adapter_dirs["legal"])})
    with pytest.raises(AdapterError, match="is the adapter merged here as 'legal'; adding it as 'again' too"):
        again.use("again")
    with pytest.raises(AdapterError, match="adapter weight nan is not a finite number"):
        m.merge("med", float("nan"))


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_an_adapter_with_trained_base_biases_is_refused_saying_what_takes_it(tmp_path, bias):
    """`lora.bias: all / lora_only` saves the base's own biases, trained; peft writes them into the base layers and
    leaves them there with the adapter off, so no exact use, merge or subtract exists. The refusal said "not a
    LoRA A/B weight (conv LoRA and saved full modules ...)", which named neither the cause nor a way out."""
    from helpers import tiny_model, with_adapter

    from finetune.adapters.lora import read_adapter
    from finetune.errors import AdapterError

    with_adapter(tiny_model("qwen2"), bias=bias).save_pretrained(tmp_path / "biased")
    with pytest.raises(AdapterError, match=r"is a trained bias of the base \(lora.bias: all or lora_only\).*peft"):
        read_adapter(tmp_path / "biased")

"""`finetune.load_model`: finding the base from an adapter, switching an adapter on unmerged, generating,
and the fingerprint check (error naming both bases, `force=True`, a warning when no check is possible)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import REORDERED_ULPS, assert_within_ulps, greedy_ids, make_adapter

import finetune
from finetune.errors import AdapterError, AdapterWarning


def test_plain_peft_adapter_without_manifest_loads_with_a_warning(tmp_path, tiny_base_dir, tiny_tokenizer):
    plain = make_adapter(tiny_base_dir, tmp_path / "plain", seed=9, manifest=False)
    config = json.loads((plain / "adapter_config.json").read_text())
    (plain / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(tiny_base_dir)}))
    with pytest.warns(AdapterWarning, match="no manifest.json.*cannot be checked"):
        m = finetune.load_model(str(plain))  # the base comes from base_model_name_or_path
    assert m.active == "plain" and m.merged == {}


def test_a_directory_name_that_is_no_adapter_name_is_made_into_one(tmp_path, tiny_base_dir):
    dotted = make_adapter(tiny_base_dir, tmp_path / "legal.v2", seed=3, manifest=False)
    with pytest.warns(AdapterWarning):
        m = finetune.load_model(str(tiny_base_dir), [str(dotted)])
    assert list(m.adapters) == ["legal_v2"]
    m.merge("legal_v2")
    assert m.merged == {"legal_v2": 1.0}
    with pytest.raises(AdapterError, match="is invalid"):  # a name the user chose is not rewritten
        finetune.load_model(str(tiny_base_dir), {"legal.v2": str(dotted)})


def test_load_model_from_an_adapter_finds_its_base_and_uses_it(tiny_base_dir, adapter_dirs, tiny_tokenizer):
    m = finetune.load_model(str(adapter_dirs["legal"]), device="cpu")  # beside plain peft on the CPU
    assert m.base_dir == tiny_base_dir and m.active == "legal"
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_base_dir), str(adapter_dirs["legal"])
    ).eval()
    input_ids = tiny_tokenizer(["the model"], return_tensors="pt").input_ids
    with torch.no_grad():
        assert_within_ulps(m.model(input_ids=input_ids).logits, reference(input_ids=input_ids).logits, REORDERED_ULPS)
    # generate (KV cache, transformers' loop) gives the tokens of greedy decoding by hand on plain peft
    expected = greedy_ids(reference, input_ids[0].tolist(), 8, tiny_tokenizer.eos_token_id)
    assert len(set(expected)) > 2  # not one token repeated: a wrong position or cache row would show
    output = m.model.generate(input_ids, max_new_tokens=8, do_sample=False, eos_token_id=tiny_tokenizer.eos_token_id)
    assert output[0, input_ids.shape[1] :].tolist() == expected
    m.use(None)
    with reference.disable_adapter():
        base_expected = greedy_ids(reference, input_ids[0].tolist(), 8, tiny_tokenizer.eos_token_id)
    assert base_expected != expected  # the comparison tells the adapter's tokens from the base's
    output = m.model.generate(input_ids, max_new_tokens=8, do_sample=False, eos_token_id=tiny_tokenizer.eos_token_id)
    assert output[0, input_ids.shape[1] :].tolist() == base_expected


def test_repr_names_the_base_and_the_adapters_state(tiny_base_dir, adapter_dirs):
    """A notebook shows a LoadedModel by its repr: the base, and which adapters are in use and merged."""
    m = finetune.load_model(str(tiny_base_dir), {"legal": adapter_dirs["legal"], "med": adapter_dirs["med"]})
    m.use("legal")
    m.merge("med", 0.5)
    assert repr(m) == (
        f"LoadedModel(base={str(tiny_base_dir)!r}, device='cpu', dtype=torch.float32, "
        "adapters=['legal', 'med'], active='legal', merged={'med': 0.5})"
    )


def test_a_weight_that_is_no_number_is_an_adapter_error(tiny_base_dir, adapter_dirs):
    """`merge("legal", "0.5")`, as a notebook user may type it, raised a bare TypeError from the ledger's sum."""
    m = finetune.load_model(str(tiny_base_dir), {"legal": adapter_dirs["legal"]})
    for call in (lambda: m.merge("legal", "0.5"), lambda: m.subtract("legal", "1", negate=True)):
        with pytest.raises(AdapterError, match=r"adapter weight '.*' is not a number; give a weight such as 1"):
            call()
    assert m.merged == {} and m.merge("legal", 0.5).merged == {"legal": 0.5}


def test_switching_an_adapter_on_leaves_the_callers_random_generator_alone(tiny_base_dir, adapter_dirs):
    """peft draws the new LoRA layers' initial weights before loading the saved ones over them; a first `use`
    moved the caller's seeded generator, so a notebook's seeded sampling differed before and after it."""
    m = finetune.load_model(str(tiny_base_dir), {"legal": adapter_dirs["legal"], "med": adapter_dirs["med"]})
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    m.use("legal")  # peft made here
    m.attach("med")  # a second adapter loaded into it
    assert torch.equal(torch.rand(4), expected)


def test_fingerprint_mismatch_in_memory_names_both_and_force_overrides(
    tmp_path, tiny_base_dir, tiny_tokenizer, adapter_dirs, capsys
):
    from helpers import TEST_SHAPE

    from finetune.cli import main
    from finetune.embedded.tiny import build_tiny_llama

    other = tmp_path / "other"
    build_tiny_llama(tiny_tokenizer, seed=11, **TEST_SHAPE).save_pretrained(other)
    tiny_tokenizer.save_pretrained(other)
    with pytest.raises(AdapterError, match=f"trained on base {tiny_base_dir} \\(sha256:.*\\) but {other} is sha256:"):
        finetune.load_model(str(other), {"legal": str(adapter_dirs["legal"])})
    with pytest.warns(AdapterWarning, match=r"but .* is sha256:.*; applied anyway \(--force\)"):
        m = finetune.load_model(str(other), {"legal": str(adapter_dirs["legal"])}, force=True)
    m.merge("legal")
    capsys.readouterr()
    assert main(["generate", "--base", str(other), "--adapter", str(adapter_dirs["legal"]), "--force",
                 "--max-new-tokens", "2", "hi"]) == 0  # fmt: skip
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert warning.startswith("warning: adapter 'legal'") and warning.endswith("applied anyway (--force)")


def test_save_merged_after_use_writes_base_names_and_the_ledger(tmp_path, tiny_base_dir, adapter_dirs):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    m = finetune.load_model(str(tiny_base_dir), {k: str(v) for k, v in adapter_dirs.items()})
    m.use("med")  # peft now wraps the layers: names gain .base_layer and lora_ weights
    m.merge("legal", 0.5)
    with pytest.warns(AdapterWarning, match="'med' is in use unmerged and is not saved"):
        m.save_merged(tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert json.loads(handle.metadata()["finetune_merged"])["adapters"]["legal"]["weight"] == 0.5
    base_names = set(AutoModelForCausalLM.from_pretrained(tiny_base_dir).state_dict()) - {"lm_head.weight"}
    assert names == base_names
    from finetune.fingerprint import base_state_items

    reloaded = finetune.load_model(str(tmp_path / "out"))
    assert reloaded.merged == {"legal": 0.5} and reloaded.base_dir == tiny_base_dir  # the ledger is adopted
    saved = dict(base_state_items(m.model))
    for name, tensor in base_state_items(reloaded.model):
        assert torch.equal(tensor, saved[name]), name
    reloaded.subtract("legal")  # exact, from the base the ledger records
    base = AutoModelForCausalLM.from_pretrained(tiny_base_dir).state_dict()
    for name, tensor in reloaded.model.state_dict().items():
        assert torch.equal(tensor, base[name]), name


def test_a_manifest_without_a_real_fingerprint_warns_instead_of_failing(tmp_path, tiny_base_dir, adapter_dirs):
    import shutil

    unknown = tmp_path / "unknown"
    shutil.copytree(adapter_dirs["legal"], unknown)
    manifest = json.loads((unknown / "manifest.json").read_text())
    manifest["base"]["fingerprint"] = "unknown"  # what training writes for a hub base it has no files of
    (unknown / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(AdapterWarning, match="records no base fingerprint"):
        finetune.load_model(str(tiny_base_dir), {"legal": str(unknown)}).merge("legal")


def test_an_adapter_moved_to_another_machine_finds_its_base_by_id(tmp_path, tiny_base_dir, adapter_dirs):
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(adapter_dirs["legal"], moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["base"]["id"], manifest["base"]["path"] = str(tiny_base_dir), "/nonexistent/cache/tiny-llama"
    (moved / "manifest.json").write_text(json.dumps(manifest))
    m = finetune.load_model(str(moved))  # the recorded path is gone; the id finds the base, fingerprints agree
    assert m.base_dir == tiny_base_dir and m.active == "legal"


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16"])
def test_load_model_takes_torch_dtypes_as_transformers_does(tiny_base_dir, adapter_dirs, dtype):
    loaded = finetune.load_model(tiny_base_dir, {"legal": adapter_dirs["legal"]}, dtype=dtype)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


def test_load_model_names_the_dtypes_it_takes():
    with pytest.raises(AdapterError, match="not one of float32, bfloat16, float16"):
        finetune.load_model("unused", dtype=torch.int8)


def test_adapters_trained_on_differently_quantized_bases_are_refused_unless_the_base_is_chosen(tmp_path, tiny_base_dir):
    """No one base reproduces what a 4-bit and an 8-bit (or a dense) adapter each trained against: loading them
    together used to load the base dense without a word, so the quantized adapters merged onto other weights."""
    pytest.importorskip("bitsandbytes")
    from finetune.adapters.ondisk import AdapterSpec, merge_checkpoint

    q4 = make_adapter(tiny_base_dir, tmp_path / "q4", seed=6, targets=("q_proj",), quantization="4bit")
    q8 = make_adapter(tiny_base_dir, tmp_path / "q8", seed=7, targets=("q_proj",), quantization="8bit")
    dense = make_adapter(tiny_base_dir, tmp_path / "dense", seed=8, targets=("q_proj",))
    for other in (q8, dense):
        with pytest.raises(AdapterError, match=r"differently quantized bases \(q4: 4-bit nf4"):
            finetune.load_model(str(tiny_base_dir), {"q4": str(q4), "other": str(other)}, device="cpu")
        with pytest.raises(AdapterError, match="differently quantized bases"):
            merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(q4)), AdapterSpec(str(other))], tmp_path / "out")
    chosen = finetune.load_model(str(tiny_base_dir), {"q4": str(q4), "q8": str(q8)}, quantization="4bit", device="cpu")
    assert chosen.base.quantization.method == "4bit"


def test_load_model_names_the_quantizations_it_takes():
    with pytest.raises(AdapterError, match="quantization '3bit' is not one of none, 4bit, 8bit"):
        finetune.load_model("embedded:tiny-llama", quantization="3bit", device="cpu")

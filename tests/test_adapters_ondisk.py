"""On-disk adapter arithmetic: merges stream shard by shard and equal the in-memory result bit for bit,
subtract/swap from the pristine base equal a fresh merge, the fallback reports a drift bound that holds.
`combine` is tested in tests/test_combine.py."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import PRINTED_3E, assert_tensors_equal, bnb_weight, make_adapter, read_tensors
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import finetune
from finetune.adapters.ledger import LEDGER_KEY
from finetune.adapters.ondisk import AdapterSpec, merge_checkpoint, subtract_checkpoint, swap_checkpoint
from finetune.errors import AdapterError


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_disk_merge_equals_in_memory_merge_bit_for_bit(tmp_path, tiny_base_dir, adapter_dirs, dtype):
    specs = [AdapterSpec(str(adapter_dirs["legal"]), 1.0), AdapterSpec(str(adapter_dirs["med"]), -0.5)]
    report = merge_checkpoint(str(tiny_base_dir), specs, tmp_path / "disk", dtype=dtype)
    assert report.exact and report.merged == {"legal": 1.0, "med": -0.5}
    m = finetune.load_model(str(tiny_base_dir), {k: str(v) for k, v in adapter_dirs.items()}, dtype=dtype)
    m.merge("legal")
    m.merge("med", -0.5)
    m.save_merged(tmp_path / "memory")
    assert_tensors_equal(read_tensors(tmp_path / "memory"), read_tensors(tmp_path / "disk"))
    # and transformers loads it, with the tied embedding re-tied
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "disk", dtype=getattr(torch, dtype))
    merged_q = loaded.model.layers[1].self_attn.q_proj.weight
    assert torch.equal(merged_q, m.model.model.layers[1].self_attn.q_proj.weight)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_ledger_travels_in_config_and_every_shard(tmp_path, tiny_base_dir, adapter_dirs):
    base = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32)
    base.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shutil.copy(tiny_base_dir / "tokenizer.json", tmp_path / "sharded")
    merge_checkpoint(str(tmp_path / "sharded"), [AdapterSpec(str(adapter_dirs["legal"]), 0.5)], tmp_path / "out")
    ledger = json.loads((tmp_path / "out" / "config.json").read_text())[LEDGER_KEY]
    assert ledger["adapters"]["legal"]["weight"] == 0.5
    shards = sorted((tmp_path / "out").glob("*.safetensors"))
    assert len(shards) == len(list((tmp_path / "sharded").glob("*.safetensors"))) > 3
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            assert json.loads(handle.metadata()[LEDGER_KEY]) == ledger
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(read_tensors(tmp_path / "out"))
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    # sharding does not change a single tensor
    merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(adapter_dirs["legal"]), 0.5)], tmp_path / "single")
    assert_tensors_equal(read_tensors(tmp_path / "single"), read_tensors(tmp_path / "out"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_subtract_and_swap_from_the_base_equal_fresh_merges(tmp_path, tiny_base_dir, adapter_dirs, dtype):
    merge_checkpoint(
        str(tiny_base_dir),
        [AdapterSpec(str(adapter_dirs["legal"])), AdapterSpec(str(adapter_dirs["med"]), 0.7)],
        tmp_path / "both",
        dtype=dtype,
    )
    subtract_checkpoint(str(tmp_path / "both"), AdapterSpec("legal"), tmp_path / "med_only")
    swap_checkpoint(
        str(tmp_path / "med_only"), AdapterSpec("med"), AdapterSpec(str(adapter_dirs["code"])), tmp_path / "code"
    )
    subtract_checkpoint(str(tmp_path / "code"), AdapterSpec("code"), tmp_path / "nothing")
    merge_checkpoint(
        str(tiny_base_dir), [AdapterSpec(str(adapter_dirs["med"]), 0.7)], tmp_path / "fresh_med", dtype=dtype
    )
    merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(adapter_dirs["code"]))], tmp_path / "fresh_code", dtype=dtype)
    assert_tensors_equal(read_tensors(tmp_path / "fresh_med"), read_tensors(tmp_path / "med_only"))
    assert_tensors_equal(read_tensors(tmp_path / "fresh_code"), read_tensors(tmp_path / "code"))
    base = {k: v.to(getattr(torch, dtype)) for k, v in read_tensors(tiny_base_dir).items()}
    assert_tensors_equal(base, read_tensors(tmp_path / "nothing"))


def test_without_the_base_subtract_uses_fp32_arithmetic_within_the_reported_bound(
    tmp_path, tiny_base_dir, adapter_dirs
):
    base_copy = tmp_path / "base"
    shutil.copytree(tiny_base_dir, base_copy)
    specs = [AdapterSpec(str(adapter_dirs["legal"])), AdapterSpec(str(adapter_dirs["med"]))]
    merge_checkpoint(str(base_copy), specs, tmp_path / "both", dtype="bfloat16")
    merge_checkpoint(str(base_copy), specs[1:], tmp_path / "exact", dtype="bfloat16")
    shutil.rmtree(base_copy)  # the recorded base is gone
    report = subtract_checkpoint(str(tmp_path / "both"), AdapterSpec("legal"), tmp_path / "approx")
    assert not report.exact and 0 < report.max_drift_bound < 1e-2
    assert "largest possible drift" in report.summary()
    exact, approx = read_tensors(tmp_path / "exact"), read_tensors(tmp_path / "approx")
    worst = max((exact[k].float() - approx[k].float()).abs().max().item() for k in exact)
    assert worst <= report.max_drift_bound
    # giving the base back makes it exact again
    shutil.copytree(tiny_base_dir, base_copy)
    report = subtract_checkpoint(str(tmp_path / "both"), AdapterSpec("legal"), tmp_path / "again", base=str(base_copy))
    assert report.exact
    assert_tensors_equal(exact, read_tensors(tmp_path / "again"))


def test_refusals_name_what_and_write_nothing(tmp_path, tiny_base_dir, adapter_dirs, tiny_tokenizer):
    merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(adapter_dirs["legal"]))], tmp_path / "legal")
    with pytest.raises(AdapterError, match="task negation"):
        subtract_checkpoint(str(tmp_path / "legal"), AdapterSpec(str(adapter_dirs["med"])), tmp_path / "x")
    with pytest.raises(AdapterError, match="already exists"):
        merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(adapter_dirs["med"]))], tmp_path / "legal")
    with pytest.raises(AdapterError, match="cannot swap out 'med'"):
        swap_checkpoint(
            str(tmp_path / "legal"),
            AdapterSpec(str(adapter_dirs["med"])),
            AdapterSpec(str(adapter_dirs["code"])),
            tmp_path / "x",
        )
    other_base = tmp_path / "other_base"
    from helpers import TEST_SHAPE

    from finetune.embedded.tiny import build_tiny_llama

    build_tiny_llama(tiny_tokenizer, seed=5, **TEST_SHAPE).save_pretrained(other_base)
    with pytest.raises(AdapterError, match="was trained on base .*sha256:.* but .*sha256:"):
        merge_checkpoint(str(other_base), [AdapterSpec(str(adapter_dirs["legal"]))], tmp_path / "x")
    assert not (tmp_path / "x").exists()
    report = merge_checkpoint(str(other_base), [AdapterSpec(str(adapter_dirs["legal"]))], tmp_path / "x", force=True)
    assert report.exact
    bigger = tmp_path / "bigger"
    build_tiny_llama(tiny_tokenizer, seed=0, **{**TEST_SHAPE, "hidden_size": 128}).save_pretrained(bigger)
    with pytest.raises(AdapterError, match="model.layers.0.self_attn.q_proj is \\(128, 128\\).*\\(64, 64\\)"):
        merge_checkpoint(str(bigger), [AdapterSpec(str(adapter_dirs["legal"]))], tmp_path / "y", force=True)
    assert not (tmp_path / "y").exists()


def test_overflow_is_refused_before_anything_appears_at_out(tmp_path, tiny_base_dir):
    huge = make_adapter(tiny_base_dir, tmp_path / "huge", seed=4, targets=("down_proj",), magnitude=300.0)
    with pytest.raises(AdapterError, match="huge into model.layers.0.mlp.down_proj gives NaN/Inf in float16"):
        merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(huge))], tmp_path / "out", dtype="float16")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))


def test_merging_an_adapter_trained_on_a_quantized_base(tmp_path, tiny_base_dir):
    pytest.importorskip("bitsandbytes")
    for bits in ("4bit", "8bit"):
        adapter = make_adapter(
            tiny_base_dir, tmp_path / f"q{bits}", seed=6, targets=("q_proj", "up_proj"), quantization=bits
        )
        report = merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(adapter))], tmp_path / f"disk{bits}")
        assert "dequantized the " + bits in report.summary()
        m = finetune.load_model(str(tiny_base_dir), {"q": str(adapter)})  # quantization from the manifest
        assert m.ledger.base_quantization == bits
        m.merge("q")
        m.save_merged(tmp_path / f"memory{bits}")
        assert_tensors_equal(read_tensors(tmp_path / f"memory{bits}"), read_tensors(tmp_path / f"disk{bits}"))
        config = json.loads((tmp_path / f"disk{bits}" / "config.json").read_text())
        assert "quantization_config" not in config
        AutoModelForCausalLM.from_pretrained(tmp_path / f"disk{bits}")


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_a_quantized_base_is_reproduced_from_the_dtype_its_run_loaded(tmp_path, tiny_base_dir, bits):
    """A QLoRA run with `model.dtype: bfloat16` on a float32 checkpoint quantized the bfloat16 weights; the merge
    (written float32, as stored) must dequantize those same weights. Quantized from float32 instead, the base was
    up to 0.2 (4-bit) and 0.01 (8-bit) away from what the adapter learned against."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    adapter = make_adapter(
        tiny_base_dir, tmp_path / "q", seed=6, targets=("q_proj",), quantization=bits, base_dtype="bfloat16"
    )
    merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(adapter))], tmp_path / "out", device="cpu")
    merged = read_tensors(tmp_path / "out")
    config = (  # as training loads it: nf4 with double quantization (transformers' own default is fp4)
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
        if bits == "4bit"
        else BitsAndBytesConfig(load_in_8bit=True)
    )
    trained = AutoModelForCausalLM.from_pretrained(tiny_base_dir, quantization_config=config, dtype=torch.bfloat16)
    checked = 0
    for name, layer in trained.named_modules():
        if isinstance(layer, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) and not name.endswith("q_proj"):
            assert merged[name + ".weight"].dtype == torch.float32
            # untouched: the trained base (8-bit: int8·absmax/127 in another order than bitsandbytes' own, 1 ulp)
            torch.testing.assert_close(merged[name + ".weight"], bnb_weight(layer), rtol=1.2e-7, atol=0)
            checked += 1
    assert checked == 12
    # in memory too: the default dtype of a base quantized as the adapter's run did is the dtype that run loaded
    loaded = finetune.load_model(str(tiny_base_dir), {"q": str(adapter)}, device="cpu")
    assert loaded.model.dtype == torch.bfloat16
    layers = dict(loaded.model.named_modules())
    for name, layer in trained.named_modules():
        if isinstance(layer, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) and not name.endswith("q_proj"):
            torch.testing.assert_close(bnb_weight(layers[name]), bnb_weight(layer), rtol=0, atol=0)


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_requantize_on_request_prints_the_error_it_adds(tmp_path, tiny_base_dir, bits, tiny_tokenizer):
    bnb = pytest.importorskip("bitsandbytes")
    adapter = make_adapter(tiny_base_dir, tmp_path / "q", seed=6, targets=("q_proj", "up_proj"), quantization=bits)
    report = merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(adapter))], tmp_path / "out", requantize=True)
    # The error the report gives, recomputed from the files: each quantized layer written, read back by
    # transformers, against the exact dense merge of the same adapter.
    merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(adapter))], tmp_path / "dense")
    dense, requantized = read_tensors(tmp_path / "dense"), AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    errors = {}
    for name, layer in requantized.named_modules():
        if isinstance(layer, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            exact = dense[name + ".weight"].float()
            errors[name] = ((bnb_weight(layer) - exact).norm() / exact.norm()).item()
    assert len(errors) == 14  # every linear of the 2 blocks; those the adapter changed are rounded anew:
    assert all(error > 1e-3 for name, error in errors.items() if name.endswith(("q_proj", "up_proj"))), errors
    worst = max(errors, key=lambda name: errors[name])
    printed = re.search(
        rf"requantized to {bits}: relative Frobenius error added (\S+) at worst \((\S+)\), (\S+) on average over 14 ",
        report.summary(),
    )
    assert printed, report.summary()
    assert printed[2] == worst
    for figure, recomputed in ((printed[1], errors[worst]), (printed[3], sum(errors.values()) / len(errors))):
        assert float(figure) == pytest.approx(recomputed, rel=PRINTED_3E)
    assert not list(tmp_path.glob(".out.dense-*"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" in config and config[LEDGER_KEY]["adapters"]["q"]["weight"] == 1.0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # loads back quantized
    with torch.no_grad():
        assert torch.isfinite(
            model(input_ids=tiny_tokenizer(["the model"], return_tensors="pt").input_ids).logits
        ).all()
    with pytest.raises(AdapterError, match="is a quantized checkpoint"):
        subtract_checkpoint(str(tmp_path / "out"), AdapterSpec("q"), tmp_path / "x")
    with pytest.raises(AdapterError, match="--requantize needs adapters trained on a 4bit or 8bit base"):
        merge_checkpoint(
            str(tiny_base_dir), [AdapterSpec(str(tmp_path / "q"))], tmp_path / "y", quantization="none", requantize=True
        )


def test_a_requantized_checkpoint_is_not_taken_for_another_quantization(tmp_path, tiny_base_dir):
    """transformers loads a checkpoint saved 4-bit as 4-bit whatever quantization is asked: asked for 8-bit,
    `load_model` loaded it 4-bit and recorded 8-bit. One line now; asked for what it is, it loads."""
    from finetune.errors import ModelError

    pytest.importorskip("bitsandbytes")
    adapter = make_adapter(tiny_base_dir, tmp_path / "q", seed=6, targets=("q_proj",), quantization="4bit")
    merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(adapter))], tmp_path / "nf4", requantize=True)
    with pytest.raises(ModelError, match=r"checkpoint saved 4bit-quantized but model.quantization .* is 8bit; set"):
        finetune.load_model(str(tmp_path / "nf4"), quantization="8bit", device="cpu")
    assert finetune.load_model(str(tmp_path / "nf4"), quantization="4bit", device="cpu").base.quantization.bits == 4


def test_a_shard_written_tensor_by_tensor_reads_back_in_safetensors(tmp_path):
    """Merges write each shard's header first and then one tensor at a time (`write_planned_shard`): safetensors
    reads every dtype back as written, with the ledger in the metadata; a tensor that is not as planned stops it."""
    from finetune.adapters.ledger import LEDGER_KEY, Ledger, LedgerEntry
    from finetune.adapters.model_dir import PlannedTensor, write_planned_shard, write_shard

    generator = torch.Generator().manual_seed(0)
    tensors = {
        "w.f32": torch.randn(3, 5, generator=generator),
        "w.bf16": torch.randn(7, generator=generator).to(torch.bfloat16),
        "w.f16": torch.randn(2, 2, 2, generator=generator).to(torch.float16),
        "ids": torch.arange(5),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(3, dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
        "strided": torch.randn(4, 6, generator=generator).T,
    }
    ledger = Ledger("base", "fp", {"a": LedgerEntry(0.5)})
    assert write_shard(tmp_path, "model.safetensors", tensors, ledger) == dict.fromkeys(tensors, "model.safetensors")
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert json.loads(handle.metadata()[LEDGER_KEY]) == json.loads(ledger.to_json())
        assert_tensors_equal({name: handle.get_tensor(name) for name in handle.keys()}, tensors)
    planned = [PlannedTensor("w", torch.float32, (2, 2))]
    with pytest.raises(ValueError, match="w: computed torch.bfloat16"):
        write_planned_shard(
            tmp_path, "bad.safetensors", planned, lambda _: torch.zeros(2, 2, dtype=torch.bfloat16), ledger
        )


def test_an_adapter_is_merged_once_under_one_name(tmp_path, tiny_base_dir, adapter_dirs, monkeypatch):
    """Two different adapters of one name, or one adapter under two names, would be taken one for the other or
    counted twice: both are refused, naming them, before anything is written. The ledger records each adapter's
    absolute path, so the merged model is read the same from any working directory."""
    other_legal = make_adapter(tiny_base_dir, tmp_path / "copy" / "legal", seed=9, targets=("q_proj", "v_proj"))
    with pytest.raises(AdapterError, match=r"adapter 'legal' merged here came from .* another adapter of that name"):
        merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(adapter_dirs["legal"])), AdapterSpec(str(other_legal))],
                         tmp_path / "clash")  # fmt: skip
    assert not (tmp_path / "clash").exists()
    twin = tmp_path / "twin"
    shutil.copytree(adapter_dirs["legal"], twin)
    (twin / "manifest.json").unlink(missing_ok=True)  # named after its directory, then
    with pytest.raises(AdapterError, match=r"is the adapter merged here as 'legal'; adding it as 'twin' too would"):
        merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(adapter_dirs["legal"])), AdapterSpec(str(twin))],
                         tmp_path / "twice")  # fmt: skip
    assert not (tmp_path / "twice").exists()

    monkeypatch.chdir(adapter_dirs["legal"].parent)
    merge_checkpoint(str(tiny_base_dir), [AdapterSpec("legal"), AdapterSpec("med", 0.5)], tmp_path / "merged")
    ledger = json.loads((tmp_path / "merged" / "config.json").read_text())[LEDGER_KEY]
    assert ledger["adapters"]["med"]["path"] == str(adapter_dirs["med"].resolve())
    monkeypatch.chdir(tmp_path)
    report = subtract_checkpoint(str(tmp_path / "merged"), AdapterSpec("med"), tmp_path / "legal-only")
    assert report.exact and report.merged == {"legal": 1.0}


def test_an_adapter_whose_config_was_edited_after_merging_is_not_taken_for_the_merged_one(
    tmp_path, tiny_base_dir, adapter_dirs
):
    """Doubling `lora_alpha` in adapter_config.json doubles every update while the weights file stays the same:
    subtracting the edited adapter from fp32 arithmetic (the base gone) would take out twice what went in. The
    ledger records the adapter's scaling beside the file's sha256, so that subtract is refused."""
    base_copy, legal = tmp_path / "base", tmp_path / "legal"
    shutil.copytree(tiny_base_dir, base_copy)
    shutil.copytree(adapter_dirs["legal"], legal)
    merge_checkpoint(
        str(base_copy), [AdapterSpec(str(legal)), AdapterSpec(str(adapter_dirs["med"]))], tmp_path / "both"
    )
    shutil.rmtree(base_copy)
    config = json.loads((legal / "adapter_config.json").read_text())
    config["lora_alpha"] *= 2
    (legal / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(
        AdapterError, match=r"adapter .legal. at .* changed since it was merged \(its weights, or the alpha"
    ):
        subtract_checkpoint(str(tmp_path / "both"), AdapterSpec("legal"), tmp_path / "wrong")
    assert not (tmp_path / "wrong").exists()


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_merging_a_quantized_adapter_in_a_fresh_interpreter(tmp_path, tiny_base_dir, bits):
    """`finetune adapters merge` of an adapter trained on a quantized base, as the first thing a process does:
    nothing has imported bitsandbytes yet (no quantized model is loaded on disk), so the round trip must."""
    import subprocess
    import sys

    pytest.importorskip("bitsandbytes")
    adapter = make_adapter(tiny_base_dir, tmp_path / "q", seed=6, targets=("q_proj", "up_proj"), quantization=bits)
    command = [
        "adapters",
        "merge",
        "--base",
        str(tiny_base_dir),
        "--adapter",
        str(adapter),
        "--out",
        str(tmp_path / "o"),
    ]
    completed = subprocess.run(
        [sys.executable, "-m", "finetune", *command],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "dequantized the " + bits in completed.stdout + completed.stderr


def test_a_gpt2_adapter_on_conv1d_and_linear_layers_merges_as_peft_merges_it(tmp_path, tiny_tokenizer):
    """peft transposes the update of a `Conv1D` (GPT-2) and not of an `nn.Linear`, deciding per layer; the
    `fan_in_fan_out` it saves is the last wrapped layer's kind (here `lm_head`'s: false). Merged by that flag, the
    square `attn.c_proj` got its update transposed and `c_attn` was refused as another base size."""
    from peft import PeftModel
    from transformers import GPT2Config, GPT2LMHeadModel

    base = tmp_path / "gpt2"
    config = GPT2Config(  # untied: peft's merge of a tied head is no reference (it changes the embeddings too)
        vocab_size=len(tiny_tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=128, tie_word_embeddings=False
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        GPT2LMHeadModel(config).save_pretrained(base)
    tiny_tokenizer.save_pretrained(base)
    adapter = make_adapter(
        base, tmp_path / "gpt2-lora", seed=6, targets=("c_attn", "attn.c_proj", "lm_head"), fan_in_fan_out=True
    )
    assert json.loads((adapter / "adapter_config.json").read_text())["fan_in_fan_out"] is False
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter))
    expected = peft_model.merge_and_unload().state_dict()

    merge_checkpoint(str(base), [AdapterSpec(str(adapter))], tmp_path / "merged", device="cpu")
    in_memory = finetune.load_model(str(base), adapters={"gpt2_lora": str(adapter)}, device="cpu")
    in_memory.merge("gpt2_lora")
    assert_tensors_equal(read_tensors(tmp_path / "merged"), expected)
    assert_tensors_equal(in_memory.model.state_dict(), expected)


def test_a_merge_into_a_quantized_base_everything_was_subtracted_from_equals_a_fresh_merge(tmp_path, tiny_base_dir):
    """Subtracting every adapter from a merge over a 4-bit base leaves its dequantized weights with an empty ledger
    that records the base. Taken as a base of its own, a merge quantized those weights again (2.4e-4 away from a
    fresh merge) and called itself exact; it must recompute from the recorded base, or say it cannot."""
    pytest.importorskip("bitsandbytes")
    base = tmp_path / "base"
    shutil.copytree(tiny_base_dir, base)
    adapter = make_adapter(
        base, tmp_path / "q", seed=6, targets=("q_proj",), quantization="4bit", base_dtype="bfloat16"
    )
    merge_checkpoint(str(base), [AdapterSpec(str(adapter))], tmp_path / "merged", device="cpu")
    subtract_checkpoint(str(tmp_path / "merged"), AdapterSpec("q"), tmp_path / "none", device="cpu")
    report = merge_checkpoint(str(tmp_path / "none"), [AdapterSpec(str(adapter))], tmp_path / "again", device="cpu")
    merge_checkpoint(str(base), [AdapterSpec(str(adapter))], tmp_path / "fresh", device="cpu")
    assert report.exact
    assert_tensors_equal(read_tensors(tmp_path / "fresh"), read_tensors(tmp_path / "again"))
    shutil.rmtree(base)  # without the recorded base: fp32 arithmetic on the dequantized weights, said so
    report = merge_checkpoint(str(tmp_path / "none"), [AdapterSpec(str(adapter))], tmp_path / "approx", device="cpu")
    assert not report.exact and "is not available" in report.summary()
    fresh, approx = read_tensors(tmp_path / "fresh"), read_tensors(tmp_path / "approx")
    assert max((fresh[k] - approx[k]).abs().max().item() for k in fresh) <= report.max_drift_bound

"""GGUF export checked by llama.cpp itself (llama-cpp-python): tokens, logits, and LoRA adapters applied at load.

The reference is transformers running the same merged model in fp32. Tolerances are absolute, on logits
whose largest magnitude is about 1 here (a random-init tiny Llama with a random LoRA merged in); measured
worst cases are in the comments.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import llama_cpp  # llama-cpp-python, in the test extra: CI builds llama.cpp from source
import numpy as np
import pytest
import torch
from helpers import ALL_LINEAR, LIBRARY_ULPS, REORDERED_ULPS, assert_within_ulps, make_adapter
from safetensors.torch import load_file, save_file

from finetune.cli import main as cli_main
from finetune.errors import ExportError
from finetune.export.gguf_lora import export_lora_gguf
from finetune.export.gguf_model import export_model_gguf

PROMPTS = [
    "the model reads a document and predicts",
    "def add(a, b):\n    return a + b\n",
    "<|user|>\nwhat is the adapter for?</s>\n<|assistant|>\n",
    "update of the frozen weight matrix for the domain in question",
]
# Worst |llama.cpp - transformers| over every position of PROMPTS, measured: f32 4.9e-7, f16 7.7e-4
# (logits up to 0.62 in magnitude; the smallest top-1 margin among the prompts is 7.0e-3).
# Allowed, in ulps of the export's dtype at the largest logit: llama.cpp's kernels against torch's, and f16
# weights rounded once. Seen: f32 8 ulps and f16 1.6 on an Intel Xeon with AMX, 27 and 4.2 on one with
# AVX-512 and no AMX (llama.cpp picks its kernels by CPU).
LOGIT_ULPS = {"f32": (torch.float32, LIBRARY_ULPS), "f16": (torch.float16, 16)}
# Text for the tokenizer comparison: code, prose, numbers, contractions in both cases, runs of spaces,
# tabs and newlines, accents, CJK, emoji (multi-codepoint too), and llama.cpp's own pre-tokenizer probe.
TOKENIZER_TEXTS = [
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "3 33 333 3333 33333 3.3 3..3 3...3 1,000,000 -42 +7e-3",
    "   leading spaces, trailing spaces   \t\ttabs\t \n \n\n \n\n\n  \n   \n",
    "naïve café Ünïcödé — “quotes” …ellipsis… ¿qué? ñ ß ø",
    "我想在apple工作1314151天～ нещо на Български ελληνικά عربى हिन्दी",
    "🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙",
    "------======= '''''' ``````` \"\"\"\" ......!!!!!!?????? <<>> {{}} [[]]",
    "<s>special tokens inside text</s> <|user|>\nhello<|assistant|>\n",
    "class Cache(dict):\n\tdef __missing__(self, key):\n\t\treturn None\r\n",
]


def _llama(gguf_path: Path, **options) -> contextlib.closing:
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=256, n_threads=1, verbose=False, **options)
    return contextlib.closing(llm)


def llama_cpp_logits(gguf_path: Path, ids: list[int], lora: Path | None = None) -> np.ndarray:
    """(len(ids), vocab) logits from llama.cpp, optionally with a GGUF LoRA adapter applied at load.

    The KV cache is f32: llama.cpp's default f16 cache alone moved logits by up to 1.3e-2 on a model whose
    f32 export matched transformers to 4e-6, and would hide what the export itself does.
    """
    options = {"lora_path": str(lora)} if lora is not None else {}
    f32_cache = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32}
    with _llama(gguf_path, logits_all=True, **f32_cache, **options) as llm:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)


def transformers_logits(model_dir: Path, ids_per_prompt: list[list[int]]) -> list[np.ndarray]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].numpy() for ids in ids_per_prompt]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_base_dir, tiny_tokenizer) -> dict:
    """A random LoRA on every linear layer, merged; the merged model exported as f32/f16, the base as f32,
    the adapter alone as a GGUF LoRA; transformers' logits of the merged model on PROMPTS."""
    from finetune.adapters.ondisk import AdapterSpec, merge_checkpoint

    root = tmp_path_factory.mktemp("gguf")
    adapter = make_adapter(
        tiny_base_dir, root / "adapter", seed=5, targets=ALL_LINEAR, r=8, alpha=16, use_rslora=True, magnitude=0.1
    )  # rsLoRA: its alpha / sqrt(r) scale is folded into B for llama.cpp
    merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(adapter), 1.0)], root / "merged")
    files = {
        dtype: export_model_gguf(root / "merged", root / f"merged-{dtype}.gguf", dtype=dtype).out
        for dtype in LOGIT_ULPS
    }
    ids = [tiny_tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    return {
        "root": root,
        "adapter": adapter,
        "merged": files,
        "base": export_model_gguf(tiny_base_dir, root / "base-f32.gguf", dtype="f32").out,
        "lora": export_lora_gguf(adapter, root / "adapter.gguf").out,
        "ids": ids,
        "reference": transformers_logits(root / "merged", ids),
    }


@pytest.mark.parametrize("dtype", list(LOGIT_ULPS))
def test_merged_model_logits_in_llama_cpp_match_transformers(exported, dtype):
    for ids, reference in zip(exported["ids"], exported["reference"]):
        logits = llama_cpp_logits(exported["merged"][dtype], ids)
        assert logits.argmax(-1)[-1] == reference.argmax(-1)[-1], "next-token top-1 differs"
        torch_dtype, ulps = LOGIT_ULPS[dtype]
        assert_within_ulps(logits, reference, ulps, dtype=torch_dtype, what=dtype)


def test_lora_adapter_applied_by_llama_cpp_equals_the_merged_export(exported):
    for ids in exported["ids"]:
        with_lora = llama_cpp_logits(exported["base"], ids, lora=exported["lora"])
        merged = llama_cpp_logits(exported["merged"]["f32"], ids)
        base_alone = llama_cpp_logits(exported["base"], ids)
        # Measured: 3.7e-7 (6 ulps; 16 without AMX); the adapter moves these logits by up to 0.89: it is applied.
        assert_within_ulps(with_lora, merged, REORDERED_ULPS, what="unmerged LoRA")
        assert np.abs(base_alone - merged).max() > 1e-2


def test_quantized_exports_load_and_stay_close(exported, tiny_base_dir):
    """bf16 and q8_0 are lossy: they load, and their logits stay near fp32 (measured 6.7e-3 and 1.9e-2)."""
    root = exported["root"]
    for dtype, tolerance in (("bf16", 0.03), ("q8_0", 0.08)):
        path = export_model_gguf(root / "merged", root / f"merged-{dtype}.gguf", dtype=dtype).out
        logits = llama_cpp_logits(path, exported["ids"][0])
        assert np.abs(logits - exported["reference"][0]).max() <= tolerance


def test_the_embedded_tokenizer_splits_like_llama_cpp_gpt2(tmp_path):
    """The embedded base's tokenizer (trained as its build does) gives the same ids in llama.cpp, named `gpt-2`."""
    import gguf

    from finetune.embedded.build import EMBEDDED_BASES
    from finetune.embedded.corpus import stdlib_corpus
    from finetune.embedded.tiny import build_tiny_llama
    from finetune.embedded.tokenizer import train_tokenizer

    settings = EMBEDDED_BASES["tiny-llama"]
    corpus = stdlib_corpus(settings.corpus_max_bytes, settings.corpus_file_max_bytes)
    tokenizer = train_tokenizer(corpus.documents, vocab_size=settings.vocab_size)
    build_tiny_llama(tokenizer, hidden_size=32, intermediate_size=64, num_hidden_layers=1).save_pretrained(
        tmp_path / "m"
    )
    tokenizer.save_pretrained(tmp_path / "m")
    path = export_model_gguf(tmp_path / "m", tmp_path / "m.gguf", dtype="f32").out
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == "gpt-2"

    samples = TOKENIZER_TEXTS + [document[:600] for document in corpus.documents[::40]]
    with _llama(path, vocab_only=True) as llm:
        for text in samples:
            ours = tokenizer(text)["input_ids"]
            theirs = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
            assert theirs == ours, f"token ids differ on {text[:60]!r}"
            assert llm.detokenize(ours[1:], special=True).decode("utf-8") == text


def _variant_model(root: Path, tokenizer, architecture: str, **shape) -> Path:
    """A tiny model of another Llama-family shape, saved with the tokenizer."""
    from transformers import MistralConfig, MistralForCausalLM

    from finetune.embedded.tiny import build_tiny_llama

    if architecture == "MistralForCausalLM":
        config = MistralConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256, sliding_window=None,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        torch.manual_seed(1)
        model = MistralForCausalLM(config)
    else:
        model = build_tiny_llama(tokenizer, seed=2, **shape)
    directory = root / architecture
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    "architecture, shape",
    [
        ("MistralForCausalLM", {}),
        # untied output head, attention biases, Llama 3.1 RoPE scaling (rope_freqs tensor), head_dim 32
        (
            "LlamaForCausalLM",
            dict(
                hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, tie_word_embeddings=False, attention_bias=True, max_position_embeddings=256,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
            ),
        ),
    ],
    ids=["mistral", "llama3-rope-bias-untied"],
)  # fmt: skip
def test_llama_family_variants_match_transformers(tmp_path, tiny_tokenizer, architecture, shape):
    model_dir = _variant_model(tmp_path, tiny_tokenizer, architecture, **shape)
    path = export_model_gguf(model_dir, tmp_path / "variant.gguf", dtype="f32").out
    ids = [tiny_tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    for prompt_ids, reference in zip(ids, transformers_logits(model_dir, ids)):
        logits = llama_cpp_logits(path, prompt_ids)
        assert_within_ulps(logits, reference, LIBRARY_ULPS, what="f32")


def test_unsupported_architecture_is_a_one_line_error_naming_the_supported(tmp_path, tiny_base_dir, capsys):
    model_dir = tmp_path / "other"
    shutil.copytree(tiny_base_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["Qwen2ForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))

    assert cli_main(["export", "gguf", "--model", str(model_dir), "--out", str(tmp_path / "x.gguf")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0
    assert "Qwen2ForCausalLM" in error and "LlamaForCausalLM, MistralForCausalLM" in error
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written


def test_export_refuses_an_existing_file_and_an_unknown_tokenizer_split(tmp_path, tiny_base_dir):
    existing = tmp_path / "taken.gguf"
    existing.write_bytes(b"keep")
    with pytest.raises(ExportError, match="already exists"):
        export_model_gguf(tiny_base_dir, existing)
    assert existing.read_bytes() == b"keep"

    model_dir = tmp_path / "metaspace"
    shutil.copytree(tiny_base_dir, model_dir)
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    (model_dir / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ExportError, match="matches none llama.cpp knows by name; supported: gpt-2"):
        export_model_gguf(model_dir, tmp_path / "m.gguf")


def test_cli_exports_an_adapter_as_a_gguf_lora(exported, tmp_path):
    out = tmp_path / "cli-adapter.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "finetune", "export", "gguf", "--adapter", str(exported["adapter"]), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}: lora adapter, 28 tensors (f32)" in done.stdout
    assert out.read_bytes() == exported["lora"].read_bytes()


def test_mistral_sliding_window_is_the_declared_context(tmp_path, tiny_tokenizer):
    """llama.cpp runs Mistral as `llama`, with no sliding window: the file declares the window as its context,
    within which llama.cpp gives transformers' logits, and the report says so. The full 256 was declared before,
    and prompts longer than the window (8) differed from transformers by up to 0.25, top-1 changed, silently."""
    import gguf
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=8,
        bos_token_id=tiny_tokenizer.bos_token_id, eos_token_id=tiny_tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(1)
    MistralForCausalLM(config).save_pretrained(tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    report = export_model_gguf(tmp_path / "m", tmp_path / "m.gguf", dtype="f32")
    assert gguf.GGUFReader(report.out).fields["llama.context_length"].contents() == 8
    assert "context length 8: the sliding window" in report.summary()
    ids = tiny_tokenizer(PROMPTS[0])["input_ids"][:8]
    assert_within_ulps(llama_cpp_logits(report.out, ids), transformers_logits(tmp_path / "m", [ids])[0], LIBRARY_ULPS)


def test_an_export_removes_what_killed_exports_left(tmp_path, tiny_base_dir):
    """SIGKILL or SIGTERM (Python's default: no cleanup) leaves the staging file `.<out>.partial-<pid>`; the
    next export to that path deletes it, and keeps the staging of a writer still running."""
    out = tmp_path / "m.gguf"
    with subprocess.Popen(["true"]) as ended:  # waited for: its pid names a writer that is gone
        pass
    dead = tmp_path / f".m.gguf.partial-{ended.pid}"
    with subprocess.Popen(["sleep", "60"]) as running:
        live = tmp_path / f".m.gguf.partial-{running.pid}"
        for stale in (dead, live):
            stale.write_bytes(b"half a model")
        try:
            export_model_gguf(tiny_base_dir, out)
        finally:
            running.kill()
    assert not dead.exists() and live.exists() and out.is_file()


def test_an_adapter_with_lora_alpha_0_is_applied_as_peft_applies_it(exported, tiny_base_dir):
    """lora_alpha 0 (per-module alphas from alpha_pattern here) raised ZeroDivisionError; llama.cpp reads alpha 0
    as scale 1, so B carries each module's whole scale, and the LoRA gives the merged model's logits."""
    from finetune.adapters.ondisk import AdapterSpec, merge_checkpoint

    root = exported["root"]
    adapter = make_adapter(tiny_base_dir, root / "alpha0", seed=6, r=4, alpha=0, alpha_pattern={"q_proj": 8})
    merge_checkpoint(str(tiny_base_dir), [AdapterSpec(str(adapter), 1.0)], root / "alpha0-merged")
    merged = export_model_gguf(root / "alpha0-merged", root / "alpha0-merged.gguf", dtype="f32").out
    lora = export_lora_gguf(adapter, root / "alpha0.gguf").out
    ids = exported["ids"][0]
    with_lora, base_alone = llama_cpp_logits(exported["base"], ids, lora=lora), llama_cpp_logits(exported["base"], ids)
    assert_within_ulps(with_lora, llama_cpp_logits(merged, ids), REORDERED_ULPS, what="alpha 0 LoRA")
    assert np.abs(with_lora - base_alone).max() > 1e-2


def test_an_adapter_for_another_base_shape_is_refused_in_one_line(exported, tmp_path, tiny_tokenizer, capsys):
    """`--base` of another shape was written without a word, and llama.cpp refused the file only at load."""
    from finetune.embedded.tiny import build_tiny_llama

    other = tmp_path / "wider"
    build_tiny_llama(tiny_tokenizer, hidden_size=96, intermediate_size=128, num_hidden_layers=2).save_pretrained(other)
    tiny_tokenizer.save_pretrained(other)
    out = tmp_path / "lora.gguf"
    argv = ["export", "gguf", "--adapter", str(exported["adapter"]), "--base", str(other), "--out", str(out)]
    capsys.readouterr()  # save_pretrained's progress bar
    assert cli_main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "mlp.down_proj updates a (64, 128) weight" in error
    assert error.endswith(f"{other} has shape (96, 128); give the base the adapter was trained on (--base)")
    assert not list(tmp_path.glob("*.gguf*"))


def test_a_base_of_the_same_shapes_but_other_weights_is_refused_unless_forced(
    exported, tmp_path, tiny_base_dir, capsys
):
    """Shapes alone passed a `--base` of other heads (same weight shapes), whose q/k rows the export orders by its
    heads: a wrong file, exit 0. The base is checked against the adapter's recorded fingerprint, as a merge is."""
    other = tmp_path / "other"
    shutil.copytree(tiny_base_dir, other)
    weights = load_file(other / "model.safetensors")
    save_file({name: tensor + 1 if name.endswith("q_proj.weight") else tensor for name, tensor in weights.items()},
              other / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    out = tmp_path / "lora.gguf"
    argv = ["export", "gguf", "--adapter", str(exported["adapter"]), "--base", str(other), "--out", str(out)]
    assert cli_main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"but --base {other} is sha256:" in line and line.endswith("pass --force (force=True)")
    assert not out.exists()
    with pytest.warns(UserWarning, match="applied anyway"):
        assert cli_main([*argv, "--force"]) == 0
    assert out.read_bytes() == exported["lora"].read_bytes()  # same shapes and heads: the same file
    the_base = ["export", "gguf", "--adapter", str(exported["adapter"]), "--base", str(tiny_base_dir)]
    assert cli_main([*the_base, "--out", str(tmp_path / "same.gguf")]) == 0  # the recorded base passes


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--model", "embedded:tiny-llama", "--base", "somewhere"], "--base goes with --adapter"),
     (["--adapter", "adapters/a", "--name", "mine"], "--name goes with --model"),
     (["--adapter", "adapters/a", "--force"], "--force goes with --base")],
    ids=["base-with-model", "name-with-adapter", "force-without-base"],
)  # fmt: skip
def test_an_option_of_the_other_source_is_refused_not_ignored(tmp_path, capsys, argv, message):
    assert cli_main(["export", "gguf", *argv, "--out", str(tmp_path / "x.gguf")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert message in line and not (tmp_path / "x.gguf").exists()


def test_a_qlora_adapter_exported_alone_says_what_llama_cpp_applies_it_to(tmp_path, tiny_base_dir):
    """An adapter trained on a 4-bit base learned against the dequantized weights; llama.cpp applies the exported
    LoRA to the base's GGUF as exported from its 16/32-bit weights (0.015 apart in logits on a real QLoRA run):
    the summary says so, as `adapters merge` uses the dequantized base."""
    qlora = make_adapter(tiny_base_dir, tmp_path / "qlora", seed=7, r=4, alpha=8, quantization="4bit")
    plain = make_adapter(tiny_base_dir, tmp_path / "plain", seed=7, r=4, alpha=8)
    said = export_lora_gguf(qlora, tmp_path / "qlora.gguf").summary()
    assert "trained on a 4-bit nf4" in said and "not to the dequantized weights" in said
    assert "dequantized" not in export_lora_gguf(plain, tmp_path / "plain.gguf").summary()


def test_rope_inverse_frequencies_saved_with_the_weights_are_left_out(tmp_path, tiny_base_dir, tiny_tokenizer):
    """Checkpoints saved by transformers before 4.31 hold `rotary_emb.inv_freq` per layer, which transformers ignores;
    they were exported as `blk.N.attn_rot_embd`, and llama.cpp refused the file (wrong number of tensors)."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "with-inv-freq"
    shutil.copytree(tiny_base_dir, model_dir)
    weights = load_file(model_dir / "model.safetensors")
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    for layer in range(2):
        weights[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = inv_freq.clone()
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    report = export_model_gguf(model_dir, tmp_path / "m.gguf", dtype="f32")
    ids = tiny_tokenizer(PROMPTS[0])["input_ids"]
    reference = transformers_logits(model_dir, [ids])[0]
    assert_within_ulps(llama_cpp_logits(report.out, ids), reference, LIBRARY_ULPS, what="f32")
    assert report.num_tensors == len(weights) - 2


@pytest.mark.parametrize("source", ["model", "adapter-base"])
def test_a_truncated_weight_file_is_a_one_line_error(exported, tmp_path, tiny_base_dir, capsys, source):
    """A shard cut short (a killed copy) was a SafetensorError traceback, exit 1; for `--adapter` too, whose
    `--base` is read for its tensor headers."""
    model_dir = tmp_path / "cut"
    shutil.copytree(tiny_base_dir, model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    out = tmp_path / "x.gguf"
    chosen = (
        ["--model", str(model_dir)]
        if source == "model"
        else ["--adapter", str(exported["adapter"]), "--base", str(model_dir)]
    )
    assert cli_main(["export", "gguf", *chosen, "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{weights}: it has" in line and "truncated or corrupt; re-create, re-download or re-copy that model" in line
    assert not list(tmp_path.glob("*.gguf*"))


@pytest.mark.parametrize("config", ["{", "[1, 2]"], ids=["cut-short", "not-an-object"])
def test_a_config_json_that_is_no_json_object_is_a_one_line_error(tmp_path, tiny_base_dir, capsys, config):
    """A config.json cut short was a JSONDecodeError traceback (exit 1), one that is a list an AttributeError."""
    model_dir = tmp_path / "broken"
    shutil.copytree(tiny_base_dir, model_dir)
    (model_dir / "config.json").write_text(config)
    assert cli_main(["export", "gguf", "--model", str(model_dir), "--out", str(tmp_path / "x.gguf")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{model_dir / 'config.json'} is not" in line and line.endswith("re-save the model with save_pretrained")
    assert not list(tmp_path.glob("*.gguf*"))


def _limit_file_size() -> None:
    """In the child: files may not grow past 64 KiB (a full disk, for writers), and the limit is an error."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


def test_a_full_disk_while_writing_tensors_is_one_line_and_leaves_nothing(tmp_path, tiny_base_dir):
    """numpy's `tofile` reports a short write as "N requested and M written", an OSError without errno: a disk
    filling up while the tensors were written (past the metadata, 64 KiB here) was a traceback with exit 1."""
    out = tmp_path / "m.gguf"
    argv = [sys.executable, "-m", "finetune", "export", "gguf", "--model", str(tiny_base_dir), "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, preexec_fn=_limit_file_size, timeout=300)
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 2 and line.startswith(f"error: cannot write {out}: File too large;"), done.stderr
    assert "nothing was left behind" in line and not list(tmp_path.iterdir())


def test_a_q8_0_lora_says_which_tensors_it_wrote_as_f16(exported):
    """B's rows are rank-long (8 here): q8_0 cannot pack them, so every B is f16. The model export's summary said
    so for its tensors; the adapter's said only "(q8_0)" for a file whose B matrices all were f16."""
    import gguf

    report = export_lora_gguf(exported["adapter"], exported["root"] / "adapter-q8_0.gguf", dtype="q8_0")
    kinds = [t.tensor_type.name for t in gguf.GGUFReader(report.out).tensors]
    assert kinds.count("F16") == 14 and kinds.count("Q8_0") == 14
    assert "14 tensors with rows not a multiple of 32 written as f16" in report.summary()

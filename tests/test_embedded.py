"""The embedded default base (shipped weights, cache, build, determinism) and the quickstart's domain data.

Bases here are built with `MINI` settings (a 30 KB corpus and as many synthetic rows, 4 + 15 pretraining
steps on one thread) into `tmp_path`, so the full pretraining of `embedded:tiny-llama` never runs in the
test-suite; the shipped one is checked against its build record.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import TEST_SHAPE
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from finetune.embedded import build, shipped
from finetune.embedded.build import (
    BUILD_FORMAT_VERSION,
    EMBEDDED_BASES,
    FINGERPRINTED_FILES,
    RECORD_FILE,
    BuildSettings,
    settings_record,
)
from finetune.embedded.cache import embedded_base_dir, ensure_embedded_base, resolve_base_id
from finetune.embedded.pretrain import PretrainSettings
from finetune.embedded.quickstart_data import bulletin_fields, generate_records, write_dataset
from finetune.embedded.shipped import file_sha256, shipped_base_dir
from finetune.errors import ModelError
from finetune.recipe import DataConfig

REPO = Path(__file__).resolve().parents[1]

MINI = BuildSettings(
    corpus_max_bytes=30_000,
    corpus_file_max_bytes=4_000,
    vocab_size=384,
    seq_len=64,
    pretraining=PretrainSettings(steps=15, micro_batch_size=8, lr=1e-2, warmup_steps=3, heldout_rows=4),
    shape=dict(TEST_SHAPE, tie_word_embeddings=True, num_key_value_heads=4),
    synthetic_fraction=0.5,
    copy_curriculum=PretrainSettings(steps=4, micro_batch_size=8, lr=1e-2, warmup_steps=2, heldout_rows=4),
    previous_token_head=True,
    num_threads=1,
)


class Messages(list):
    """A progress callable that keeps every message, to see what a call did."""

    def __call__(self, message: str) -> None:
        self.append(message)

    def count(self, fragment: str) -> int:  # type: ignore[override]
        return sum(fragment in message for message in self)


@pytest.fixture(scope="module")
def mini_base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("home")
    return ensure_embedded_base("tiny-llama", root=root, settings=MINI, progress=Messages())


@pytest.fixture(scope="module")
def mini_base_after_a_killed_build(tmp_path_factory) -> tuple[Path, Path]:
    """A second build of MINI, in a cache where a killed build left its temporary directory behind."""
    root = tmp_path_factory.mktemp("home")
    final_dir = embedded_base_dir("tiny-llama", MINI, root)
    stale = final_dir.parent / f".{final_dir.name}.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half a model")
    return ensure_embedded_base("tiny-llama", root=root, settings=MINI, progress=Messages()), stale


def test_built_base_is_a_normal_model_directory(mini_base):
    names = {path.name for path in mini_base.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", RECORD_FILE} <= names
    model = AutoModelForCausalLM.from_pretrained(mini_base)
    tokenizer = AutoTokenizer.from_pretrained(mini_base)
    assert isinstance(model, LlamaForCausalLM)
    assert tokenizer.pad_token_id not in (None, tokenizer.eos_token_id)
    assert tokenizer.chat_template
    ids = tokenizer("def f(x):\n    return x\n", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tokenizer))


def test_build_record_says_how_it_was_built(mini_base):
    record = json.loads((mini_base / RECORD_FILE).read_text())
    assert record["settings"]["pretraining"]["steps"] == 15
    assert record["corpus"]["source"].startswith("python-stdlib ")
    assert 0 < record["corpus"]["bytes"] <= 30_000 + 4_000
    assert record["seconds"] > 0
    assert 0 < record["synthetic_tokens"] <= record["corpus"]["tokens"]
    assert 0 <= record["copy_score"] <= 1
    assert record["sha256"] == {name: file_sha256(mini_base / name) for name in FINGERPRINTED_FILES}


def test_pretraining_lowers_the_loss(mini_base):
    pretraining = json.loads((mini_base / RECORD_FILE).read_text())["pretraining"]
    assert pretraining["final_loss"] < pretraining["first_loss"] - 0.5
    assert pretraining["heldout_loss_after"] < pretraining["heldout_loss_before"] - 0.5


def test_same_settings_give_identical_weights_and_tokenizer(mini_base, mini_base_after_a_killed_build):
    again, _ = mini_base_after_a_killed_build
    assert again != mini_base
    first, second = load_file(mini_base / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert (mini_base / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_second_call_reuses_the_cache(mini_base):
    weights = mini_base / "model.safetensors"
    mtime_ns = weights.stat().st_mtime_ns
    messages = Messages()
    assert ensure_embedded_base("tiny-llama", root=mini_base.parents[1], settings=MINI, progress=messages) == mini_base
    assert messages == []
    assert weights.stat().st_mtime_ns == mtime_ns


def test_other_settings_get_their_own_directory(tmp_path):
    other = replace(MINI, pretraining=replace(MINI.pretraining, steps=31))
    assert embedded_base_dir("tiny-llama", other, tmp_path) != embedded_base_dir("tiny-llama", MINI, tmp_path)
    assert embedded_base_dir("tiny-llama", MINI, tmp_path).parent == tmp_path / "embedded"


def test_interrupted_build_leaves_no_partial_directory(tmp_path):
    def interrupt(message: str) -> None:
        if "pretraining step" in message:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ensure_embedded_base("tiny-llama", root=tmp_path, settings=MINI, progress=interrupt)
    final_dir = embedded_base_dir("tiny-llama", MINI, tmp_path)
    assert not final_dir.exists()
    assert not list(final_dir.parent.glob(".*tmp-*"))


def test_leftovers_of_a_killed_build_are_removed(mini_base_after_a_killed_build):
    final_dir, stale = mini_base_after_a_killed_build
    assert not stale.exists()
    assert (final_dir / RECORD_FILE).is_file()


def test_concurrent_callers_build_once(tmp_path):
    messages = Messages()
    results: list[Path] = []

    def call() -> None:
        results.append(ensure_embedded_base(root=tmp_path, settings=MINI, progress=messages))

    callers = [threading.Thread(target=call) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert results == [embedded_base_dir("tiny-llama", MINI, tmp_path)] * 2
    assert messages.count("building embedded base") == 1
    assert not list((tmp_path / "embedded").glob(".*tmp-*"))


@pytest.mark.parametrize("base", ["gpt2", "meta-llama/Llama-3.2-1B", "/models/local", "./relative/dir", "embedded"])
def test_resolve_base_id_leaves_other_ids_alone(base):
    assert resolve_base_id(base) == base


def test_unknown_embedded_base_is_an_error_listing_the_known_ones():
    with pytest.raises(ModelError, match="unknown embedded base embedded:tiny-gpt; known: embedded:tiny-llama"):
        resolve_base_id("embedded:tiny-gpt")


def test_default_shape_suits_bitsandbytes_4bit():
    """Every linear layer but the head has out_features divisible by 32 (bitsandbytes' CPU 4-bit forward)."""
    config = LlamaConfig(vocab_size=EMBEDDED_BASES["tiny-llama"].vocab_size, **EMBEDDED_BASES["tiny-llama"].shape)
    model = LlamaForCausalLM(config)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    assert linears
    assert [name for name, m in linears if m.out_features % 32] == []


# ---------------------------------------------------------------------------------------------------
# The shipped base


def test_shipped_base_is_the_registered_build_with_its_recorded_fingerprint():
    shipped = shipped_base_dir("tiny-llama")
    record = json.loads((shipped / RECORD_FILE).read_text())
    assert record["format_version"] == BUILD_FORMAT_VERSION
    assert record["settings"] == json.loads(json.dumps(settings_record(EMBEDDED_BASES["tiny-llama"])))
    assert record["sha256"] == {name: file_sha256(shipped / name) for name in FINGERPRINTED_FILES}
    assert sum(path.stat().st_size for path in shipped.iterdir()) < 40_000_000
    assert resolve_base_id("embedded:tiny-llama") == str(shipped)
    model = AutoModelForCausalLM.from_pretrained(shipped)
    assert sum(p.numel() for p in model.parameters()) == record["parameters"]
    assert model.dtype == torch.float32


def test_a_damaged_shipped_base_is_refused(tmp_path, monkeypatch):
    damaged = shutil.copytree(shipped_base_dir("tiny-llama"), tmp_path / "tiny-llama")
    monkeypatch.setattr(shipped, "SHIPPED_ROOT", tmp_path)
    (damaged / "model.safetensors").write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ModelError, match="shipped embedded base .* is damaged: model.safetensors has sha256"):
        resolve_base_id("embedded:tiny-llama")


def test_build_script_rebuilds_a_shipped_base_bit_for_bit(tmp_path, monkeypatch, capsys):
    """`python -m finetune.embedded.build` writes the shipped directory; `--check` rebuilds and compares."""
    monkeypatch.setattr(shipped, "SHIPPED_ROOT", tmp_path)
    monkeypatch.setitem(build.EMBEDDED_BASES, "mini-llama", MINI)
    assert build.main(["--name", "mini-llama"]) == 0
    shipped_dir = tmp_path / "mini-llama"
    assert resolve_base_id("embedded:mini-llama") == str(shipped_dir)
    assert build.main(["--name", "mini-llama", "--check"]) == 0
    assert "rebuild matches the shipped base" in capsys.readouterr().err
    (shipped_dir / "model.safetensors").write_bytes(b"other weights")
    assert build.main(["--name", "mini-llama", "--check"]) == 1
    assert "is damaged: model.safetensors has sha256" in capsys.readouterr().err
    assert build.main(["--name", "mini-llama"]) == 0  # intact again
    monkeypatch.setitem(build.EMBEDDED_BASES, "mini-llama", replace(MINI, init_seed=1))  # code that builds otherwise
    assert build.main(["--name", "mini-llama", "--check"]) == 1
    assert "DIFFERS FROM" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# Domain data


def test_domain_generator_is_deterministic(tmp_path):
    assert generate_records(50, seed=3) == generate_records(50, seed=3)
    assert generate_records(50, seed=3) != generate_records(50, seed=4)
    write_dataset(tmp_path / "a", 40, 10, seed=1)
    write_dataset(tmp_path / "b", 40, 10, seed=1)
    for name in ("train.jsonl", "valid.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize(
    ("module", "shipped"),
    [("finetune.embedded.quickstart_data", "quickstart"), ("finetune.data.quickstart_pairs", "quickstart-dpo")],
)
def test_shipped_quickstart_data_regenerates_byte_for_byte(tmp_path, module, shipped):
    """The quickstart's bulletins and the DPO quickstart's pairs (made from them) are what their generators write."""
    subprocess.run([sys.executable, "-m", module, "--out", str(tmp_path)], cwd=REPO, check=True, capture_output=True)
    for name in ("train.jsonl", "valid.jsonl"):
        assert (tmp_path / name).read_bytes() == (REPO / "data" / shipped / name).read_bytes(), name


def test_the_dpo_pairs_are_the_quickstart_bulletins_each_against_one_that_contradicts_its_input():
    bulletins = [json.loads(line) for line in (REPO / "data/quickstart/valid.jsonl").read_text().splitlines()]
    pairs = [json.loads(line) for line in (REPO / "data/quickstart-dpo/valid.jsonl").read_text().splitlines()]
    assert [pair["chosen"] for pair in pairs] == [bulletin["output"] for bulletin in bulletins]
    for pair, bulletin in zip(pairs, bulletins):
        assert bulletin["input"] in pair["prompt"]
        right, wrong = bulletin_fields(pair["chosen"]), bulletin_fields(pair["rejected"])
        assert 1 <= sum(right[name] != wrong[name] for name in right) <= 2


def test_quickstart_data_is_small_held_out_and_in_instruction_format():
    shipped = REPO / "data" / "quickstart"
    train = [json.loads(line) for line in (shipped / "train.jsonl").read_text().splitlines()]
    valid = [json.loads(line) for line in (shipped / "valid.jsonl").read_text().splitlines()]
    assert sum(path.stat().st_size for path in shipped.glob("*.jsonl")) < 1_000_000
    assert all(set(record) == {"instruction", "input", "output"} for record in train + valid)
    prompts = {(record["instruction"], record["input"]) for record in train}
    assert not [record for record in valid if (record["instruction"], record["input"]) in prompts]


def test_bulletin_style_rules():
    records = generate_records(400, seed=0)
    for record in records:
        fields = dict(line.split(": ", 1) for line in record["input"].splitlines())
        low, rain = int(fields["Low"].replace("minus ", "-")), int(fields["Rain"].rstrip("%"))
        assert ("Frost is likely overnight." in record["output"]) == (low < 0)
        assert record["output"].endswith("Take an umbrella.") == (rain >= 70)
        assert f"Low: {fields['Low']} degrees." in record["output"]
        assert f"Rain: {rain} percent." in record["output"]
        assert None not in bulletin_fields(record["output"]).values(), record["output"]


def test_bulletin_values_are_the_same_tokens_in_input_and_output():
    """A value the bulletin repeats must be the same tokens in prompt and output, or no model can copy it."""
    tokenizer = AutoTokenizer.from_pretrained(shipped_base_dir("tiny-llama"))
    template = DataConfig.model_fields["prompt_with_input_template"].default
    for record in generate_records(100, seed=0):
        prompt = template.format(prompt=record["instruction"], input=record["input"])
        sides = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (prompt, record["output"])]
        fields = bulletin_fields(record["output"])
        wind_kmh = fields["wind"].split(" km/h")[0]
        for value in (fields["city"], fields["day"], wind_kmh, *fields["figures"].split(" / ")):
            value_ids = tokenizer(" " + value, add_special_tokens=False)["input_ids"]
            for ids in sides:
                assert any(ids[i : i + len(value_ids)] == value_ids for i in range(len(ids))), (value, record)

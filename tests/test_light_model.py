"""`finetune generate` without transformers' model code (`finetune.generation.light_model`): the logits of
transformers + peft for each Llama-family architecture it takes, the text the transformers path prints, and
the transformers path for everything it declines."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REORDERED_ULPS, REPO, assert_within_ulps, greedy_ids, greedy_text, make_adapter, tiny_model
from helpers import with_adapter as with_lora

from finetune.adapters.lora import read_adapter
from finetune.generation.light_model import Declined, LightModel, light_generate

FAMILIES = [("llama", {}), ("llama", {"attention_bias": True, "mlp_bias": True}), ("mistral", {"sliding_window": None}),
            ("qwen2", {}), ("qwen3", {"head_dim": 24}), ("llama", {"tie_word_embeddings": True})]  # fmt: skip
PROMPT = "the cat sat on the mat"


def _saved(tmp_path: Path, family: str, config: dict) -> tuple[Path, Path, torch.nn.Module]:
    """A tiny `family` base and an all-linear LoRA on it, saved as transformers and peft save them; and the
    peft model they came from."""
    model = tiny_model(family, **config)
    model.save_pretrained(tmp_path / "base")
    peft_model = with_lora(model)
    peft_model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "base", tmp_path / "adapter", peft_model


@pytest.mark.parametrize(("family", "config"), FAMILIES,
                         ids=["llama", "llama-biases", "mistral", "qwen2-qkv-bias", "qwen3-qk-norm", "llama-tied"])  # fmt: skip
def test_each_position_gives_the_logits_of_transformers_and_peft(tmp_path, family, config):
    """The prompt's prefill and eight decode steps over the cache: each next-token distribution equals the
    peft model's forward over the whole sequence to within reordered float32 sums, and greedy decoding picks
    the tokens `greedy_ids` picks."""
    base, adapter, peft_model = _saved(tmp_path, family, config)
    light = LightModel.load(base, read_adapter(adapter))
    ids, cache = [1, 17, 42, 5, 9, 63, 2], []
    logits = light.forward(ids, cache)
    for _ in range(8):
        with torch.no_grad():
            expected = peft_model(input_ids=torch.tensor([ids])).logits[0, -1]
        assert_within_ulps(logits, expected, REORDERED_ULPS, what=f"position {len(ids)}")
        ids.append(int(expected.argmax()))
        logits = light.forward(ids[-1:], cache)
    assert light.greedy([1, 17, 42], 12, stop_ids=frozenset()) == greedy_ids(peft_model, [1, 17, 42], 12)


def _generate_recording_modules(*arguments: str) -> tuple[str, set[str]]:
    """What `finetune generate ARGUMENTS` prints, run as the script runs it in a fresh interpreter, and the
    modules loaded by the time it exits."""
    code = (
        "import json, runpy, sys\n"
        f"sys.argv = ['finetune', 'generate', *{list(arguments)!r}]\n"
        "try:\n    runpy.run_module('finetune', run_name='__main__')\n"
        "except SystemExit as exit:\n    assert not exit.code, exit.code\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    completed = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                               capture_output=True, text=True, timeout=300)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    *printed, modules = completed.stdout.splitlines()
    return "\n".join(printed), set(json.loads(modules))


def test_generate_prints_the_transformers_text_without_importing_model_code(tmp_path, tiny_base_dir):
    """`finetune generate` with an adapter (greedy, plain text) prints what transformers + peft generate, having
    imported neither transformers' model code nor peft: the start-up the light path exists for."""
    adapter = make_adapter(tiny_base_dir, tmp_path / "adapter", seed=4, targets=("q_proj", "v_proj", "down_proj"))
    printed, modules = _generate_recording_modules("--adapter", str(adapter), "--max-new-tokens", "24", PROMPT)
    assert printed == greedy_text(tiny_base_dir, adapter, PROMPT, 24)
    assert "tokenizers" in modules and "finetune.generation.light_model" in modules  # it ran the light path
    assert {"transformers.modeling_utils", "peft"} & modules == set()


def _declines(base: Path, adapter: Path, **request) -> bool:
    options = dict(base=str(base), adapter=str(adapter), prompt=PROMPT, max_new_tokens=4, dtype="float32",
                   device="cpu", force=False)  # fmt: skip
    return light_generate(**{**options, **request}) is None


def _edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_what_it_does_not_reproduce_goes_the_transformers_way(tmp_path, tiny_base_dir):
    """Each thing the light path does not compute as transformers would declines it (the command then loads
    the model through transformers): another dtype, a repetition penalty in the base's generation settings, a
    scaled rotary embedding, a tokenizer setting transformers applies on top of tokenizer.json, a family it
    does not know, LoRA on the embeddings. The unchanged base is taken, so each decline is the change's."""
    adapter = make_adapter(tiny_base_dir, tmp_path / "adapter", seed=5, manifest=False)
    assert not _declines(tiny_base_dir, adapter)
    assert _declines(tiny_base_dir, adapter, dtype="bfloat16")
    changes = {
        "generation_config.json": {"repetition_penalty": 1.3},
        "config.json": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        "tokenizer_config.json": {"add_eos_token": True},
    }
    for name, change in [*changes.items(), ("config.json", {"model_type": "gemma"})]:
        base = tmp_path / f"base-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_base_dir, base)
        if not (base / name).exists():
            (base / name).write_text("{}")
        _edit_json(base / name, **change)
        assert _declines(base, adapter), change
    embedding = make_adapter(tiny_base_dir, tmp_path / "embedding", seed=6, targets=("embed_tokens",), manifest=False)
    assert _declines(tiny_base_dir, embedding)


def test_an_older_config_files_rope_scaling_declines_as_transformers_scales_it(tmp_path, tiny_base_dir):
    """Config files written before `rope_type` name a scaling's kind `type` (`{"type": "linear", "factor": 4}`);
    transformers still scales the rotary embedding by it, so the light path, which computes it unscaled,
    declines it as it declines `rope_type`."""
    from transformers import AutoConfig

    adapter = make_adapter(tiny_base_dir, tmp_path / "adapter", seed=5, manifest=False)
    base = tmp_path / "base"
    shutil.copytree(tiny_base_dir, base)
    config = json.loads((base / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["rope_scaling"] = {"type": "linear", "factor": 4.0}
    (base / "config.json").write_text(json.dumps(config))
    assert AutoConfig.from_pretrained(base).rope_parameters["rope_type"] == "linear"  # what transformers computes
    assert _declines(base, adapter)


@pytest.mark.parametrize(("family", "config", "left_out"),
                         [("qwen3", {"head_dim": 128}, "head_dim"),
                          ("mistral", {"sliding_window": None, "num_attention_heads": 16, "num_key_value_heads": 8},
                           "num_key_value_heads")],
                         ids=["qwen3-head-dim", "mistral-kv-heads"])  # fmt: skip
def test_a_field_config_json_leaves_to_the_familys_default_is_read_as_transformers_reads_it(
    tmp_path, family, config, left_out
):
    """A config.json may leave out what the family's config class defaults (Qwen3's head_dim is 128, Mistral's
    key/value heads 8, not hidden_size / heads and the query heads): transformers loads such a model, and the
    light path, which filled in its own defaults (a RuntimeError on the reshape), declines it."""
    base, adapter, _ = _saved(tmp_path, family, config)
    fields = json.loads((base / "config.json").read_text())
    del fields[left_out]
    (base / "config.json").write_text(json.dumps(fields))
    with pytest.raises(Declined):
        LightModel.load(base, read_adapter(adapter))


def test_a_tokenizer_naming_a_bos_it_does_not_add_is_prompted_as_training_documents_start(tmp_path, tiny_base_dir):
    """GPT-2-style tokenizers (GPT-2, Pythia, Phi-2) name a BOS but do not add it. Training documents start with
    it, so prompts do too, on both paths of `finetune generate` (and in `serve`, through `prompt_ids`): before,
    a base with such a tokenizer was prompted without the token its adapters were trained after."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.data.formats import encode_records
    from finetune.prompting import prompt_ids
    from finetune.recipe import recipe_from_dict

    base = tmp_path / "base"
    shutil.copytree(tiny_base_dir, base)
    _edit_json(base / "tokenizer.json", post_processor=None)
    tokenizer = AutoTokenizer.from_pretrained(base)
    assert tokenizer.bos_token_id is not None and tokenizer.bos_token_id not in tokenizer(PROMPT)["input_ids"]
    config = recipe_from_dict({"data": {"train": "x.jsonl", "format": "text"}, "output": {"name": "x"}}).data
    (document,) = encode_records([{"text": PROMPT}], config, tokenizer, locate=str)
    ids = prompt_ids(tokenizer, PROMPT)
    assert ids[0] == tokenizer.bos_token_id and document.input_ids[:-1] == ids  # all but the EOS
    adapter = make_adapter(base, tmp_path / "adapter", seed=4, manifest=False)
    options = dict(base=str(base), adapter=str(adapter), max_new_tokens=12, dtype="float32", device="cpu")
    light = light_generate(prompt=PROMPT, force=False, **options)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(adapter))
    expected = tokenizer.decode(greedy_ids(model.eval(), ids, 12, tokenizer.eos_token_id), skip_special_tokens=True)
    assert light == expected

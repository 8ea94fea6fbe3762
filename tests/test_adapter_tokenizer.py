"""An adapter carries the tokenizer its run trained with, and everything that loads or passes it on uses it.

One chat run on a copy of the tiny base whose tokenizer has no chat template, with `data.chat_template` set (a
base fine-tuned for chat): before adapters carried a tokenizer, `generate --chat`, `serve`'s chat endpoint and
`load_model(...).tokenizer` had no template to render with (or, on a base with one, the base's other template),
and a merged model directory had the base's tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from helpers import greedy_ids, make_adapter
from transformers import AutoTokenizer

from finetune.adapters.combine import combine_adapters
from finetune.adapters.ondisk import AdapterSpec, merge_checkpoint
from finetune.api import load_model
from finetune.cli import main
from finetune.embedded.tokenizer import train_tokenizer
from finetune.errors import AdapterWarning, ModelError
from finetune.prompting import chat_prompt_ids
from finetune.serve.server import ServerThread
from finetune.serve.settings import ServeSettings
from finetune.training.loop import train

TRAINED_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '### ' + message['role'] + ':\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}"
)
USER = [{"role": "user", "content": "the model reads a document"}]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, tiny_base_dir) -> dict[str, Path]:
    """A base without a chat template, and a two-step chat adapter trained on it with `data.chat_template`."""
    root = tmp_path_factory.mktemp("chat-run")
    base = root / "base"
    shutil.copytree(tiny_base_dir, base)
    (base / "chat_template.jinja").unlink()
    assert AutoTokenizer.from_pretrained(base).chat_template is None
    records = [
        {
            "messages": [
                {"role": "user", "content": f"what does crate {i} hold"},
                {"role": "assistant", "content": "the adapter"},
            ]
        }
        for i in range(16)
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    recipe = {
        "model": {"base": str(base)},
        "lora": {"r": 4, "alpha": 8},
        "data": {"train": str(root / "train.jsonl"), "format": "chat", "chat_template": TRAINED_TEMPLATE,
                 "max_seq_len": 64},
        "train": {"max_steps": 2, "micro_batch_size": 4, "lr": 0.01, "warmup_steps": 0},
        "output": {"name": "chat", "dir": str(root / "adapters" / "chat"), "run_dir": str(root / "runs" / "chat")},
    }  # fmt: skip
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    train(root / "recipe.yaml", log=lambda message: None, progress=False)
    return {"root": root, "base": base, "adapter": root / "adapters" / "chat"}


def test_the_adapter_carries_the_tokenizer_with_the_template_it_trained_with(chat_run):
    """As trl saves it: `AutoTokenizer.from_pretrained(adapter)` is the run's tokenizer with `data.chat_template`."""
    adapter = chat_run["adapter"]
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "tokenizer.json").is_file()
    assert (adapter / "chat_template.jinja").read_text() == TRAINED_TEMPLATE
    assert AutoTokenizer.from_pretrained(adapter).chat_template == TRAINED_TEMPLATE


def test_load_model_uses_the_adapters_tokenizer_while_it_is_in_use(chat_run):
    """`load_model(adapter).tokenizer` renders as training did; the base alone keeps the base's (no template)."""
    m = load_model(chat_run["adapter"], device="cpu")
    assert m.tokenizer.chat_template == TRAINED_TEMPLATE
    rendered = AutoTokenizer.from_pretrained(chat_run["base"]).apply_chat_template(
        USER, chat_template=TRAINED_TEMPLATE, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert chat_prompt_ids(m.tokenizer, USER) == rendered
    m.use(None)
    assert m.tokenizer.chat_template is None and m.tokenizer_for("chat").chat_template == TRAINED_TEMPLATE
    named = load_model(chat_run["base"], {"legal": chat_run["adapter"]}, device="cpu")
    assert named.tokenizer.chat_template is None
    named.use("legal")
    assert named.tokenizer.chat_template == TRAINED_TEMPLATE


def _greedy_chat_reply(chat_run: dict[str, Path], max_new_tokens: int) -> str:
    """What peft + the adapter's own tokenizer (`AutoTokenizer.from_pretrained(adapter)`) generate greedily for
    `USER` as a chat prompt: the reference for `generate --chat` and the served chat."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(chat_run["adapter"])
    model = AutoModelForCausalLM.from_pretrained(chat_run["base"], dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(chat_run["adapter"])).eval()
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True, return_dict=True)["input_ids"]
    ids = greedy_ids(model, prompt, max_new_tokens, tokenizer.eos_token_id)
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_generate_chat_renders_with_the_trained_template(chat_run, capsys):
    """`finetune generate --adapter A --chat` failed with "the base's tokenizer has no chat template"."""
    code = main(
        ["generate", "--adapter", str(chat_run["adapter"]), "--chat", "--max-new-tokens", "8", USER[0]["content"]]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert printed.out == _greedy_chat_reply(chat_run, 8) + "\n"
    data = str(chat_run["root"] / "train.jsonl")  # eval renders chat records with it too (for both figures)
    assert main(["eval", "--adapter", str(chat_run["adapter"]), "--data", data, "--format", "chat", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["base"]["eval_tokens"] == figures["adapter"]["eval_tokens"] > 0


def test_serve_renders_each_models_chat_with_its_own_tokenizer(chat_run, tmp_path):
    """The adapter's chat requests render with its template (a 400 "no chat template" before); the base's have
    none and are refused as before; an adapter loaded at runtime with another vocabulary is refused."""
    settings = ServeSettings(base=str(chat_run["base"]), base_name="base", port=0, device="cpu",
                             adapters={"chat": str(chat_run["adapter"])})  # fmt: skip
    server = ServerThread(settings).start()
    try:
        body = {"messages": USER, "max_tokens": 8, "temperature": 0}
        reply = httpx.post(server.url + "/v1/chat/completions", json={**body, "model": "chat"}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == _greedy_chat_reply(chat_run, 8)
        refused = httpx.post(server.url + "/v1/chat/completions", json={**body, "model": "base"}, timeout=60)
        assert refused.status_code == 400 and "has no chat template" in refused.text
        other = tmp_path / "other"
        shutil.copytree(chat_run["adapter"], other)
        train_tokenizer(["another corpus entirely"] * 20, vocab_size=300, max_model_len=512).save_pretrained(other)
        load = {"lora_name": "other", "lora_path": str(other)}
        refused = httpx.post(server.url + "/v1/load_lora_adapter", json=load, timeout=60)
        assert refused.status_code == 400 and "tokens but the base's has" in refused.text
        assert [card["id"] for card in httpx.get(server.url + "/v1/models").json()["data"]] == ["base", "chat"]
    finally:
        server.stop()


def test_merged_and_combined_outputs_carry_the_adapters_tokenizer(chat_run):
    """`adapters merge`, `save_merged` and `adapters combine` pass the adapter's tokenizer on."""
    root, adapter = chat_run["root"], chat_run["adapter"]
    merge_checkpoint(str(chat_run["base"]), [AdapterSpec(str(adapter))], root / "merged", device="cpu")
    assert AutoTokenizer.from_pretrained(root / "merged").chat_template == TRAINED_TEMPLATE
    m = load_model(chat_run["base"], {"chat": adapter}, device="cpu")
    m.merge("chat")
    m.save_merged(root / "merged-in-memory")
    assert AutoTokenizer.from_pretrained(root / "merged-in-memory").chat_template == TRAINED_TEMPLATE
    combine_adapters([adapter, adapter], root / "combined", weights=[0.5, 0.5])
    assert AutoTokenizer.from_pretrained(root / "combined").chat_template == TRAINED_TEMPLATE


def test_a_tokenizer_of_another_vocabulary_is_refused_in_one_line(chat_run, tmp_path, capsys):
    """An adapter directory holding a tokenizer whose ids are not the base's: refused, not generated with."""
    other = tmp_path / "other"
    shutil.copytree(chat_run["adapter"], other)
    train_tokenizer(["another corpus entirely"] * 20, vocab_size=300, max_model_len=512).save_pretrained(other)
    with pytest.raises(ModelError, match="tokens but the base's has"):
        load_model(other, device="cpu")
    for chat in (["--chat"], []):  # plain text: the light path leaves a tokenizer of its own to the check
        assert main(["generate", "--adapter", str(other), *chat, "hello"]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "delete the tokenizer files" in errors[0], errors


def test_an_on_disk_merge_refuses_to_pass_on_a_tokenizer_the_base_has_no_rows_for(tiny_base_dir, tmp_path, capsys):
    """A plain-peft adapter whose directory holds its run's tokenizer with two tokens added (and the base not resized,
    LoRA on q_proj alone): generate and eval refuse that tokenizer, but `adapters merge` gave it to the merged model,
    whose embedding has the base's rows (an index error in transformers on the new tokens). Refused in one line now,
    before anything is written; with the base's own tokenizer the merge passes it on as before."""
    adapter = make_adapter(tiny_base_dir, tmp_path / "added", seed=1, manifest=False)
    tokenizer = AutoTokenizer.from_pretrained(tiny_base_dir)
    tokenizer.save_pretrained(adapter)
    out = tmp_path / "merged"
    assert main(["adapters", "merge", "--base", str(tiny_base_dir), "--adapter", str(adapter), "--out", str(out)]) == 0
    assert len(AutoTokenizer.from_pretrained(out)) == len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>", "<|end_tool|>"]})
    tokenizer.save_pretrained(adapter)
    capsys.readouterr()
    out = tmp_path / "merged-added"
    assert main(["adapters", "merge", "--base", str(tiny_base_dir), "--adapter", str(adapter), "--out", str(out)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"has {len(tokenizer)} tokens but the base's has" in errors[0], errors
    assert not out.exists()


def test_adapters_with_different_tokenizers_pass_none_on(chat_run, tmp_path):
    """Two adapters with different templates have no one tokenizer: their combination carries none (the base's
    then serves it), with a warning."""
    other = tmp_path / "other-template"
    shutil.copytree(chat_run["adapter"], other)
    (other / "chat_template.jinja").write_text(TRAINED_TEMPLATE.replace("###", "##"))
    with pytest.warns(AdapterWarning, match="carry different tokenizers"):
        combine_adapters([chat_run["adapter"], other], tmp_path / "combined")
    assert not (tmp_path / "combined" / "tokenizer_config.json").exists()
    assert load_model(tmp_path / "combined", device="cpu").tokenizer.chat_template is None

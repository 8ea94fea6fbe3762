"""Every catalog family on a tiny local instance: its architecture, its real chat template, its recipe's LoRA.

For each family a tiny model is built from that architecture's transformers config class, with a small
BPE tokenizer carrying the family's special tokens and its real chat template (`tests/chat_templates/`).
The family's catalog recipe is then run for two steps on a multi-turn chat with a system prompt (in the
OpenAI `messages` shape and the ShareGPT `conversations` shape), and the label mask is checked token by
token: exactly the assistant turns, each with the family's end-of-turn token, are trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import transformers
from helpers import REORDERED_ULPS, assert_within_ulps
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from finetune.catalog import resolve_recipe_path
from finetune.commands.recipes import catalog_entries
from finetune.data.pipeline import preview_documents
from finetune.data.preference import preview_records
from finetune.recipe import load_recipe
from finetune.training.loop import train

TEMPLATES = Path(__file__).parent / "chat_templates"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

SYSTEM = "You answer questions about crates."
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What colour is crate 3?"},
    {"role": "assistant", "content": "Crate 3 is red."},
    {"role": "user", "content": "And crate 4?"},
    {"role": "assistant", "content": "Crate 4 is green, on shelf 2."},
]
SHAREGPT = {"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                               "value": m["content"]} for m in CHAT]}  # fmt: skip


@dataclass(frozen=True)
class Family:
    name: str
    config_class: str
    recipe: str
    template: str
    bos: str | None
    eos: str
    end_of_turn: str
    extra_specials: tuple[str, ...] = ()
    config: dict = field(default_factory=dict)
    closing_after_last_turn: str = ""
    """What the template renders right after the last turn's end-of-turn token (Phi-4 mini: EOS): closing
    tokens that follow one another are trained together, as the turn's end."""


FAMILIES = [
    Family("llama-3.1", "LlamaConfig", "llama-3.1-8b-instruct-chat", "llama-3.1.jinja", "<|begin_of_text|>",
           "<|eot_id|>", "<|eot_id|>", ("<|start_header_id|>", "<|end_header_id|>")),
    Family("llama-3.2", "LlamaConfig", "llama-3.2-1b-instruct-chat", "llama-3.1.jinja", "<|begin_of_text|>",
           "<|eot_id|>", "<|eot_id|>", ("<|start_header_id|>", "<|end_header_id|>")),
    Family("qwen2.5", "Qwen2Config", "qwen2.5-0.5b-instruct-chat", "qwen2.5.jinja", None, "<|im_end|>",
           "<|im_end|>", ("<|im_start|>", "<|endoftext|>")),
    Family("qwen3", "Qwen3Config", "qwen3-0.6b-chat", "qwen2.5.jinja", None, "<|im_end|>", "<|im_end|>",
           ("<|im_start|>", "<|endoftext|>"), {"head_dim": 16}),
    Family("mistral", "MistralConfig", "mistral-7b-instruct-v0.3-chat", "mistral-v0.3.jinja", "<s>", "</s>", "</s>",
           ("[INST]", "[/INST]")),
    Family("gemma-2", "Gemma2Config", "gemma-2-2b-it-chat", "gemma-2.jinja", "<bos>", "<eos>", "<end_of_turn>",
           ("<start_of_turn>",), {"head_dim": 16}),
    Family("gemma-3", "Gemma3TextConfig", "gemma-3-1b-it-chat", "gemma-3.jinja", "<bos>", "<eos>", "<end_of_turn>",
           ("<start_of_turn>",), {"head_dim": 16}),
    Family("phi-3.5", "Phi3Config", "phi-3.5-mini-instruct-chat", "phi-3.5.jinja", "<s>", "<|endoftext|>", "<|end|>",
           ("<|system|>", "<|user|>", "<|assistant|>"), {"pad_token_id": None}),
    Family("phi-4", "Phi3Config", "phi-4-chat-qlora", "phi-4.jinja", None, "<|endoftext|>", "<|im_end|>",
           ("<|im_start|>", "<|im_sep|>"), {"pad_token_id": None}),
    Family("phi-4-mini", "Phi3Config", "phi-4-mini-instruct-chat", "phi-4-mini.jinja", None, "<|endoftext|>",
           "<|end|>", ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|/tool|>"), {"pad_token_id": None},
           closing_after_last_turn="<|endoftext|>"),
]  # fmt: skip


def build_family(family: Family, out: Path) -> Path:
    """A tiny model of the family's architecture and a BPE tokenizer with its special tokens and template."""
    specials = [t for t in (family.bos, family.eos, family.end_of_turn, *family.extra_specials) if t]
    specials = list(dict.fromkeys(specials))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [m["content"] for m in CHAT] * 20 + ["system user assistant model crates shelf colour"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    backend.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=family.bos, eos_token=family.eos,
                                        additional_special_tokens=specials)  # fmt: skip
    tokenizer.chat_template = (TEMPLATES / family.template).read_text()
    config_class = getattr(transformers, family.config_class)
    config = config_class(vocab_size=len(tokenizer), max_position_embeddings=256, **TINY, **family.config)
    model_class = transformers.AutoModelForCausalLM.from_config(config)
    model_class.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_every_catalog_recipe_is_valid_and_names_its_family_and_base():
    entries = catalog_entries()
    assert len(entries) >= 20
    for entry in entries:
        assert entry.name == entry.name.lower() and entry.path.stem == entry.name
        assert load_recipe(entry.path).output.name == entry.name
        assert entry.base == "embedded:tiny-llama" or "/" in entry.base  # a hub id
    families = {"llama-3.1", "llama-3.2", "qwen2.5", "qwen3", "mistral", "gemma-2", "gemma-3", "phi-3", "phi-4"}
    assert all(any(entry.name.startswith(f) for entry in entries) for f in families)
    assert {"lora", "qlora"} <= {entry.method for entry in entries}


def trained_runs(input_ids: list[int], labels: list[int], tokenizer) -> list[str]:
    """The decoded text of each maximal run of trained tokens."""
    runs, current = [], []
    for token, label in zip(input_ids, labels):
        if label != -100:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_family_recipe_trains_and_masks_exactly_the_assistant_turns(family, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = build_family(family, tmp_path / "base")
    (tmp_path / "messages.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    (tmp_path / "sharegpt.jsonl").write_text(json.dumps(SHAREGPT) + "\n")
    overrides = [f"model.base={base}", "model.dtype=float32", "train.precision=fp32", "data.max_seq_len=256",
                 "data.validation_split=0", "train.gradient_checkpointing=false",
                 "model.quantization=none"]  # a QLoRA recipe's masks and LoRA on a float32 tiny base  # fmt: skip
    recipe_path = resolve_recipe_path(family.recipe)

    from finetune.model import load_tokenizer_for

    tokenizer = load_tokenizer_for(load_recipe(recipe_path, overrides).model)
    expected = [f"{m['content']}{family.end_of_turn}" for m in CHAT if m["role"] == "assistant"]
    expected[-1] += family.closing_after_last_turn
    for shape in ("messages", "sharegpt"):
        recipe = load_recipe(recipe_path, [*overrides, f"data.train={shape}.jsonl"])
        (document,) = preview_documents(recipe.data, tokenizer, limit=1)
        runs = [run.strip() for run in trained_runs(document.input_ids, document.labels, tokenizer)]
        assert runs == expected, (shape, tokenizer.decode(document.input_ids))
        assert SYSTEM in tokenizer.decode(document.input_ids)  # the system prompt is rendered, untrained
    # A conversational preference pair: the same template, loss on the completion's turn only (not on the
    # prompt's earlier assistant turn), each side ending with the family's end-of-turn token.
    pair = {"prompt": CHAT[:4], "chosen": CHAT[4:], "rejected": "Crate 4 is red."}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(pair) + "\n")
    pair_recipe = load_recipe(recipe_path, [*overrides, "data.train=pairs.jsonl", "data.format=preference",
                                            "train.objective=dpo"])  # fmt: skip
    ((_, row),) = preview_records(pair_recipe.data, tokenizer, limit=1)
    for side, content in (("chosen", CHAT[4]["content"]), ("rejected", "Crate 4 is red.")):
        runs = [run.strip() for run in trained_runs(row[f"{side}_input_ids"], row[f"{side}_labels"], tokenizer)]
        assert runs == [f"{content}{family.end_of_turn}{family.closing_after_last_turn}"], (
            side, tokenizer.decode(row[f"{side}_input_ids"]))  # fmt: skip
    assert row["chosen_input_ids"] == document.input_ids  # the conversation as SFT chat renders it, token for token

    (tmp_path / "chats.jsonl").write_text((json.dumps({"messages": CHAT}) + "\n") * 8)
    losses: list[float] = []
    train_overrides = [*overrides, "data.train=chats.jsonl", "train.max_steps=2", "train.lr=1e-2",
                       "train.warmup_steps=0", "train.warmup_ratio=0", "train.micro_batch_size=4", "train.grad_accum_steps=1",
                       "train.eval_every_steps=null", "train.save_every_steps=null", "output.name=tiny"]  # fmt: skip
    train(recipe_path, train_overrides, log=lambda message: None, on_step=lambda s, m: losses.append(m["loss"]))
    assert len(losses) == 2 and all(loss == loss and loss < 1e4 for loss in losses)
    assert losses[1] < losses[0]


@pytest.mark.parametrize("separator", [" ", "\n"], ids=["space", "newline"])
def test_whitespace_between_the_reply_and_the_end_of_turn_token_is_trained_with_it(separator, tmp_path, monkeypatch):
    """Qwen2.5's template with a space or a newline put before `<|im_end|>`: what the model writes to end
    its turn is that whitespace and the token, so both are trained (the token was left at -100, and a
    model tuned on such data never learnt to stop)."""
    monkeypatch.chdir(tmp_path)
    family = next(f for f in FAMILIES if f.name == "qwen2.5")
    base = build_family(family, tmp_path / "base")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(base)
    reply_then_end = "message.content + '<|im_end|>'"
    assert reply_then_end in tokenizer.chat_template
    tokenizer.chat_template = tokenizer.chat_template.replace(
        reply_then_end, f"message.content + {separator!r} + '<|im_end|>'"
    )
    (tmp_path / "messages.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    recipe = load_recipe(resolve_recipe_path(family.recipe), [f"model.base={base}", "data.train=messages.jsonl"])

    (document,) = preview_documents(recipe.data, tokenizer, limit=1)
    assert f"red.{separator}<|im_end|>" in tokenizer.decode(document.input_ids)  # the template's whitespace
    runs = trained_runs(document.input_ids, document.labels, tokenizer)
    assert runs == [f"{m['content']}{separator}<|im_end|>" for m in CHAT if m["role"] == "assistant"]


HEAD_FAMILIES = [f for f in FAMILIES if f.name in ("llama-3.1", "gemma-2", "phi-3.5")]  # plain; softcapped; fused qkv


@pytest.mark.parametrize("family", HEAD_FAMILIES, ids=[f.name for f in HEAD_FAMILIES])
def test_the_head_on_labelled_positions_only_gives_the_full_logits_loss_and_gradients(family, tmp_path):
    # forward_loss runs the output layer only where a label is (a hook on the head); Gemma's logit
    # softcapping, a LoRA-wrapped head and packed rows must give the loss of all logits, and its gradients.
    import torch
    from peft import LoraConfig, get_peft_model

    from finetune.data.collate import collate_batch
    from finetune.scoring import forward_loss, token_loss_sum

    base = build_family(family, tmp_path / "base")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    model = get_peft_model(model, lora)
    vocab = model.config.vocab_size
    documents = []
    for length in (9, 5, 4):  # the second half of each document is trained: its labels are its inputs
        input_ids = [(7 * i + 3) % vocab for i in range(length)]
        documents.append({"input_ids": input_ids, "labels": [-100] * (length // 2) + input_ids[length // 2 :]})
    batch = collate_batch(documents, pad_token_id=0, packing=True)

    def loss_and_grads(loss_fn):
        model.zero_grad()
        loss, tokens = loss_fn()
        loss.backward()
        return loss.detach(), int(tokens), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    full = loss_and_grads(lambda: token_loss_sum(model(**inputs, use_cache=False).logits, batch["labels"]))
    selected = loss_and_grads(lambda: forward_loss(model, batch))
    assert selected[1] == full[1] == 10  # 5 + 3 + 2 trained tokens
    # The head on fewer rows (another matmul shape, so other kernels and summation orders).
    assert_within_ulps(selected[0], full[0], REORDERED_ULPS, what="loss")
    for got, expected in zip(selected[2], full[2]):
        assert_within_ulps(got, expected, REORDERED_ULPS, what="gradient")
    assert model(**inputs, use_cache=False).logits.shape[:2] == batch["input_ids"].shape  # the hook is gone


@pytest.mark.parametrize("name", ["gemma-2"])
def test_a_base_transformers_runs_no_sdpa_for_loads_eager_in_eval_and_generate(name, tmp_path, capsys):
    """Gemma 2's class refuses sdpa (`_supports_sdpa = False`: attention logit soft-capping). Its catalog recipe
    sets `attn_implementation: eager`, but `eval`, `generate` and `serve` choose none, so they loaded with the
    default sdpa and failed: the adapter trained could never be evaluated or sampled."""
    from finetune.cli import main

    family = next(f for f in FAMILIES if f.name == name)
    base = build_family(family, tmp_path / "base")
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    assert main(["eval", "--base", str(base), "--data", str(tmp_path / "chats.jsonl"), "--format", "chat"]) == 0
    assert "base: perplexity" in capsys.readouterr().out
    assert main(["generate", "--base", str(base), "--chat", "Crate 3?", "--max-new-tokens", "2"]) == 0

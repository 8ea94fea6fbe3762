"""Packed, padding-free batches train exactly as their documents would one by one.

The property behind `data.packing`: the documents of a micro-batch packed into rows (or into one
(1, total_len) sequence) with restarting position ids and no attention mask give the same token losses
and the same LoRA gradients as running each document alone, under eager and sdpa attention, with the KV
cache off. Padded batches (packing=False) must agree too. And a packed run learns what an unpacked one
does: the same steps over the same documents reach the same held-out loss.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import REORDERED_ULPS, assert_tensors_within_ulps, assert_within_ulps
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from finetune.data.collate import collate_batch
from finetune.data.labels import IGNORE_INDEX
from finetune.data.pipeline import build_datasets
from finetune.recipe import DataConfig
from finetune.scoring import token_loss_sum

WORDS = "the model reads a document and predicts the next token while the adapter learns".split()
# Uneven on purpose: a 1-word document, long ones, short ones, so rows mix lengths and some rows
# hold one document only.
DOCUMENT_WORDS = [1, 37, 5, 60, 2, 14, 23, 3, 48, 9]
MAX_SEQ_LEN = 96


def _documents_file(tmp_path) -> str:
    path = tmp_path / "docs.jsonl"
    lines = [
        json.dumps({"text": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))})
        for i, n in enumerate(DOCUMENT_WORDS)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_tokenizer):
    """The documents, one per row (as training samples them)."""
    tmp_path = tmp_path_factory.mktemp("packing")
    source = _documents_file(tmp_path)
    config = DataConfig(train=[source], max_seq_len=MAX_SEQ_LEN)
    bundle = build_datasets(config, tiny_tokenizer, cache_dir=tmp_path / "cache")
    assert bundle.stats["num_rows"] == len(DOCUMENT_WORDS)
    return bundle


def _packed(single, tokenizer, layout: str = "rows") -> dict[str, torch.Tensor]:
    """All the documents as one packed micro-batch."""
    batch = collate_batch(list(single.train), tokenizer.pad_token_id, packing=True, layout=layout)
    rows = batch["input_ids"].shape[0]
    assert 1 < rows < len(DOCUMENT_WORDS) or layout == "one_sequence"
    assert (batch["position_ids"] == 0).sum(dim=1).gt(1).any(), "no row holds two documents"
    return batch


def _lora_model(base_dir, attn_implementation: str):
    """The tiny base with LoRA on every linear layer; B is random (not zero) so every LoRA weight has a gradient."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation=attn_implementation)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(0)
    return get_peft_model(base, config).train()


def _token_losses(model, batch: dict[str, torch.Tensor], use_cache: bool = False) -> torch.Tensor:
    """Per-token losses at the labelled positions, in order; (N,) float32, with the graph kept."""
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    logits = model(**inputs, use_cache=use_cache).logits  # (B, T, V)
    labels = batch["labels"][:, 1:]
    losses = F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none"
    )
    return losses[labels != IGNORE_INDEX]


def _lora_grads(model) -> dict[str, torch.Tensor]:
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters() if param.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def _separate(model, single_rows, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Token losses of each document run alone, in document order, and the gradient of their mean."""
    losses = torch.cat([_token_losses(model, collate_batch([row], pad_token_id, packing=False)) for row in single_rows])
    num_label_tokens = sum(sum(label != IGNORE_INDEX for label in row["labels"]) for row in single_rows)
    assert losses.numel() == num_label_tokens
    (losses.sum() / num_label_tokens).backward()
    return losses.detach(), torch.tensor(num_label_tokens), _lora_grads(model)


def _by_document(batch: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
    """The trained documents of a packed batch as token tuples (split where position ids restart)."""
    documents = []
    for ids, labels, positions in zip(*(batch[key].tolist() for key in ("input_ids", "labels", "position_ids"))):
        for token, label, position in zip(ids, labels, positions):
            if position == 0:
                documents.append(([], False))
            documents[-1][0].append(token)
            documents[-1] = (documents[-1][0], documents[-1][1] or label != IGNORE_INDEX)
    return [tuple(tokens) for tokens, trained in documents if trained]  # a row's padded tail trains nothing


@pytest.mark.parametrize("layout", ["rows", "one_sequence"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_packed_batch_matches_documents_one_by_one(single, tiny_base_dir, tiny_tokenizer, attn_implementation, layout):
    model = _lora_model(tiny_base_dir, attn_implementation)
    single_rows = list(single.train)
    separate_losses, num_label_tokens, separate_grads = _separate(model, single_rows, tiny_tokenizer.pad_token_id)

    batch = _packed(single, tiny_tokenizer, layout)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    if layout == "rows":
        assert (batch["input_ids"] == tiny_tokenizer.pad_token_id).any(), "no row has a padded tail to isolate"
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    loss_sum, packed_label_tokens = token_loss_sum(model(**inputs, use_cache=False).logits, batch["labels"])
    assert packed_label_tokens.item() == num_label_tokens.item() == single.stats["num_label_tokens"]
    (loss_sum / packed_label_tokens).backward()
    packed_grads = _lora_grads(model)

    assert_within_ulps(loss_sum.item() / packed_label_tokens.item(), separate_losses.mean().item(), REORDERED_ULPS)
    # Token by token too: reorder the separate losses into the packed document order.
    packed_losses = _token_losses(model, batch).detach()
    separate_by_doc = dict(
        zip(
            [tuple(row["input_ids"]) for row in single_rows],
            torch.split(
                separate_losses, [sum(label != IGNORE_INDEX for label in row["labels"]) for row in single_rows]
            ),
        )
    )
    reordered = torch.cat([separate_by_doc[document] for document in _by_document(batch)])
    assert_within_ulps(packed_losses, reordered, REORDERED_ULPS, what="token losses")
    assert_tensors_within_ulps(packed_grads, separate_grads, REORDERED_ULPS, what="LoRA gradient")


def test_padded_batch_matches_documents_one_by_one(single, tiny_base_dir, tiny_tokenizer):
    model = _lora_model(tiny_base_dir, "sdpa")
    single_rows = list(single.train)
    separate_losses, _, separate_grads = _separate(model, single_rows, tiny_tokenizer.pad_token_id)

    batch = collate_batch(single_rows, pad_token_id=tiny_tokenizer.pad_token_id, packing=False)
    assert batch["input_ids"].shape == (len(single_rows), max(len(row["input_ids"]) for row in single_rows))
    padded_losses = _token_losses(model, batch)
    (padded_losses.sum() / padded_losses.numel()).backward()
    assert_within_ulps(padded_losses.detach(), separate_losses, REORDERED_ULPS, what="token losses")
    assert_tensors_within_ulps(_lora_grads(model), separate_grads, REORDERED_ULPS, what="LoRA gradient")


def test_packing_leaks_across_documents_when_the_kv_cache_is_on(single, tiny_base_dir, tiny_tokenizer):
    """Why the training loop must pass use_cache=False: with a cache, position ids no longer isolate documents.

    If this starts failing, transformers changed how it detects packed sequences; revisit the facts in
    ARCHITECTURE.md and the comment in finetune/data/collate.py.
    """
    model = _lora_model(tiny_base_dir, "sdpa")
    with torch.no_grad():
        separate = torch.cat(
            [
                _token_losses(model, collate_batch([row], tiny_tokenizer.pad_token_id, packing=False))
                for row in single.train
            ]
        )
        batch = _packed(single, tiny_tokenizer)
        cached = _token_losses(model, batch, use_cache=True)
    assert abs(cached.mean().item() - separate.mean().item()) > 1e-4


def test_packing_changes_speed_not_learning(workdir):
    """One epoch of a small recipe, packed and unpacked: the same optimizer steps over the same documents,
    and the same held-out loss. Dropout is off so the runs differ only by float rounding in attention
    layouts; relative tolerance 2e-5 on the loss (measured difference ~1e-6), where the old row-based batches (4-5
    documents per packed row) took a third of the steps and ended far apart."""
    from finetune.training.loop import train

    common = ["train.max_steps=null", "train.epochs=1", "lora.dropout=0", "data.max_seq_len=512"]
    losses, steps = {}, {}
    for packing in (True, False):
        lines: list[str] = []
        _, metrics = train(
            "recipe.yaml", [*common, f"data.packing={packing}", f"output.name=p{packing}"], log=lines.append
        )
        losses[packing], steps[packing] = metrics["eval_loss"], metrics["step"]
        layout = next(line for line in lines if line.startswith("batches: "))
        assert ("packed into" in layout) is packing, layout
    assert steps[True] == steps[False] == 40 // (4 * 2), steps  # 40 documents, 4 per micro-batch, 2 per step
    # relative: 8 optimizer steps each rounding differently drift apart by more than one computation does
    assert losses[True] == pytest.approx(losses[False], rel=2e-5), losses
    assert losses[True] < metrics["base_eval_loss"] - 0.02  # both learned something: the comparison is not vacuous

"""Preference objectives: the same loss and gradients as trl, packed pairs as unpacked ones, exact
normalisation across micro-batches, and a DPO run that resumes after SIGKILL bit for bit and whose
adapter plain peft reads as training reported.

trl is the reference only (never imported by finetune): for the same LoRA weights and the same token
ids, each objective's loss and LoRA gradients must equal those of trl's trainer within 1e-5. The token
ids are trl's own tokenization, turned into our rows, so the comparison is of the losses alone (that
our tokenization of the same records equals trl's is checked separately).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from helpers import LIBRARY_ULPS, REORDERED_ULPS, REPO, SUM_ULPS, assert_within_ulps, preference_records
from safetensors.torch import load_file

from finetune.adapters.store import summarize
from finetune.recipe import recipe_from_dict
from finetune.training.loop import SLOW_STEP_ENV, accumulate_gradients, train
from finetune.training.objectives.base import CollateOptions
from finetune.training.objectives.dpo import DPO
from finetune.training.objectives.kto import KTO
from finetune.training.objectives.orpo import ORPO
from finetune.training.objectives.simpo import SimPO


def _logps_scale(metrics: dict[str, float]) -> float:
    """The magnitude the objectives round at: the largest summed log-probability of a completion (losses and
    rewards are differences of such sums: -131 here for DPO's), at least 1."""
    return max([1.0] + [abs(value) for key, value in metrics.items() if "logps" in key])


def unpaired_records(count: int) -> list[dict]:
    """KTO examples from the pairs, desirable and undesirable alternating, one more desirable than not."""
    records = []
    for pair in preference_records(count):
        records.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        records.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    records[3]["label"] = True
    return records


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _randomise(model) -> dict[str, torch.Tensor]:
    """Seeded random LoRA weights (B ≠ 0, so the policy is not the base); returns them."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


def _ours(base_dir: Path, objective, rows: list[dict]) -> tuple[float, dict, dict[str, torch.Tensor]]:
    """Our loss, metrics and LoRA gradients for `rows` in one micro-batch, on the same random LoRA weights."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), _lora())
    _randomise(model)
    result = accumulate_gradients(model, [objective.collate(rows)], Accelerator(cpu=True), objective=objective)
    return result.loss, result.metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def _assert_equal(ours: tuple[float, dict, dict], loss: float, gradients: dict[str, torch.Tensor]) -> None:
    """Our loss and LoRA gradients are trl's: the same maths in another library's order of operations."""
    our_loss, metrics, our_gradients = ours
    assert_within_ulps(our_loss, loss, SUM_ULPS, scale=_logps_scale(metrics), what="loss")
    assert our_gradients.keys() == gradients.keys()
    largest = max(g.abs().max().item() for g in gradients.values())
    for name in gradients:
        assert_within_ulps(our_gradients[name], gradients[name], LIBRARY_ULPS, scale=largest, what=name)
    assert largest > 1e-3  # the comparison is not vacuous


def _trl_args(config_class, **settings):
    return config_class(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, bf16=False,
                        gradient_checkpointing=False, **settings)  # fmt: skip


def _rows_of_parts(tokenized: list[dict]) -> list[dict]:
    """Our rows from trl's DPO tokenization: a prompt and two completions each."""
    rows = []
    for t in tokenized:
        prompt, chosen, rejected = t["prompt_ids"], t["chosen_ids"], t["rejected_ids"]
        rows.append({"chosen_input_ids": prompt + chosen, "chosen_labels": [-100] * len(prompt) + chosen,
                     "rejected_input_ids": prompt + rejected, "rejected_labels": [-100] * len(prompt) + rejected})  # fmt: skip
    return rows


def _rows_of_sequences(tokenized: list[dict]) -> list[dict]:
    """Our rows from trl's ORPO/CPO tokenization: whole sequences with their labels (prompt -100)."""
    keys = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
    return [{key: t[key] for key in keys} for t in tokenized]


@pytest.fixture(scope="module")
def trl_dpo(tiny_base_dir, tiny_tokenizer):
    """trl's DPOTrainer on a fresh LoRA (its reference: the adapter disabled) with random LoRA weights, its
    tokenized pairs, and our rows of the same token ids."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    records = preference_records(6)
    trainer = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32),
        args=_trl_args(DPOConfig, beta=0.1, max_length=None, per_device_train_batch_size=6),
        train_dataset=Dataset.from_list(records),
        processing_class=tiny_tokenizer,
        peft_config=_lora(),
    )
    _randomise(trainer.model)
    tokenized = [trainer.train_dataset[i] for i in range(len(records))]
    return trainer, records, tokenized, _rows_of_parts(tokenized)


@pytest.mark.parametrize(
    "loss_type, rpo_alpha", [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("sigmoid", 0.5)], ids=str
)
def test_dpo_equals_trl(trl_dpo, tiny_base_dir, tiny_tokenizer, loss_type, rpo_alpha):
    trainer, _, tokenized, rows = trl_dpo
    # trl reads its loss types at every call; `sft` with weight α is RPO's NLL term.
    trainer.loss_types = [loss_type] + (["sft"] if rpo_alpha else [])
    trainer.loss_weights = [1.0] + ([rpo_alpha] if rpo_alpha else [])
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(tokenized))
    loss.backward()
    objective = DPO(CollateOptions(tiny_tokenizer.pad_token_id, True), beta=0.1, loss_type=loss_type,
                    precomputed=False, rpo_alpha=rpo_alpha)  # fmt: skip
    ours = _ours(tiny_base_dir, objective, rows)
    _assert_equal(ours, loss.item(), _gradients(trainer.model))
    logged = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    for key, trl_key in (("reward_accuracy", "rewards/accuracies"), ("reward_margin", "rewards/margins"),
                         ("rewards_chosen", "rewards/chosen"), ("logps_rejected", "logps/rejected")):  # fmt: skip
        assert_within_ulps(ours[1][key], logged[trl_key], SUM_ULPS, scale=_logps_scale(ours[1]), what=key)


def test_our_tokenization_of_pairs_is_trls(trl_dpo, tiny_tokenizer):
    from finetune.data.preference import encode_preference_records

    _, records, _, rows = trl_dpo
    config = recipe_from_dict({"data": {"train": "x", "format": "preference"}, "train": {"objective": "dpo"},
                               "output": {"name": "x"}}).data  # fmt: skip
    encoded = encode_preference_records(records, config, tiny_tokenizer, locate=str)
    assert [e.row for e in encoded] == rows


def test_orpo_equals_the_paper_with_trls_odds_ratio(tiny_base_dir, tiny_tokenizer):
    """ORPO: trl's odds-ratio term exactly; the NLL term as the paper defines it (the chosen response's mean
    token NLL, per pair), which trl replaces by a token mean over prompt and response (see objectives/orpo.py)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    trainer = ORPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32),
        args=_trl_args(ORPOConfig, beta=0.1, max_length=512, per_device_train_batch_size=6),
        train_dataset=Dataset.from_list(preference_records(6)),
        processing_class=tiny_tokenizer,
        peft_config=_lora(),
    )
    _randomise(trainer.model)
    tokenized = [trainer.train_dataset[i] for i in range(6)]
    chosen_mean, rejected_mean, _, _, trl_nll = trainer.concatenated_forward(
        trainer.model, trainer.data_collator(tokenized)
    )[:5]
    odds_ratio_terms = trainer.odds_ratio_loss(chosen_mean, rejected_mean)[0]  # λ · log σ(log odds ratio)
    paper_loss = (-chosen_mean - odds_ratio_terms).mean()
    paper_loss.backward()
    objective = ORPO(CollateOptions(tiny_tokenizer.pad_token_id, True), orpo_lambda=0.1)
    ours = _ours(tiny_base_dir, objective, _rows_of_sequences(tokenized))
    _assert_equal(ours, paper_loss.item(), _gradients(trainer.model))
    assert abs(trl_nll.item() - (-chosen_mean).mean().item()) > 1e-6  # trl's own NLL term differs, as documented


@pytest.mark.parametrize("cpo_alpha", [0.0, 1.0], ids=["simpo", "cpo-simpo"])
def test_simpo_equals_trls_cpo_trainer(tiny_base_dir, tiny_tokenizer, cpo_alpha):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    settings = dict(loss_type="simpo", beta=2.5, simpo_gamma=1.375, cpo_alpha=cpo_alpha)
    trainer = CPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32),
        args=_trl_args(CPOConfig, max_length=512, per_device_train_batch_size=6, **settings),
        train_dataset=Dataset.from_list(preference_records(6)),
        processing_class=tiny_tokenizer,
        peft_config=_lora(),
    )
    _randomise(trainer.model)
    tokenized = [trainer.train_dataset[i] for i in range(6)]
    loss, _ = trainer.get_batch_loss_metrics(trainer.model, trainer.data_collator(tokenized))
    loss.backward()
    objective = SimPO(CollateOptions(tiny_tokenizer.pad_token_id, True), beta=2.5, gamma=1.375, cpo_alpha=cpo_alpha)
    _assert_equal(
        _ours(tiny_base_dir, objective, _rows_of_sequences(tokenized)), loss.item(), _gradients(trainer.model)
    )


def test_kto_equals_trl(tiny_base_dir, tiny_tokenizer):
    """Unbalanced labels, unequal weights; the KL baseline from each prompt with the previous completion."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer

    records = unpaired_records(4)
    settings = dict(beta=0.1, desirable_weight=1.0, undesirable_weight=1.3)
    trainer = KTOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32),
        args=_trl_args(KTOConfig, max_length=None, per_device_train_batch_size=len(records), **settings),
        train_dataset=Dataset.from_list(records),
        processing_class=tiny_tokenizer,
        peft_config=_lora(),
    )
    _randomise(trainer.model)
    tokenized = [trainer.train_dataset[i] for i in range(len(records))]
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(tokenized))
    loss.backward()
    rows = [{"input_ids": t["prompt_ids"] + t["completion_ids"], "labels": [-100] * len(t["prompt_ids"]) +
             t["completion_ids"], "prompt_length": len(t["prompt_ids"]), "desirable": t["label"]} for t in tokenized]  # fmt: skip
    objective = KTO(CollateOptions(tiny_tokenizer.pad_token_id, True), **settings)
    ours = _ours(tiny_base_dir, objective, rows)
    _assert_equal(ours, loss.item(), _gradients(trainer.model))
    kl = trainer._metrics["train"]["kl"][-1]
    assert_within_ulps(ours[1]["kl"], kl, SUM_ULPS, scale=_logps_scale(ours[1]), what="kl")


def test_a_lone_kto_example_is_not_its_own_kl_baseline(tiny_base_dir, tiny_tokenizer):
    """A micro-batch of one example (the last of an epoch of 5 examples at micro_batch_size 2) has no other
    completion: rotated, its KL pair was its own prompt and completion, so z0 was its own log-ratio and its loss
    exactly 1 - sigmoid(0) = 0.5 whatever it learnt. It now counts for nothing in the step's z0, and a step with
    no mismatched pair takes z0 = 0."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.data.preference import encode_preference_records
    from finetune.training.objectives.base import Models

    config = recipe_from_dict({"data": {"train": "x", "format": "unpaired_preference"}, "output": {"name": "x"},
                               "train": {"objective": "kto"}}).data  # fmt: skip
    rows = [e.row for e in encode_preference_records(unpaired_records(2)[:3], config, tiny_tokenizer, locate=str)]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32), _lora())
    _randomise(model)
    models = Models(model, model, Accelerator(cpu=True))
    objective = KTO(CollateOptions(tiny_tokenizer.pad_token_id, True), beta=0.1, desirable_weight=1.0,
                    undesirable_weight=1.0)  # fmt: skip
    both, lone = objective.collate(rows[:2]), objective.collate(rows[2:])
    z0 = objective.prepare(models, [both], reduce=False)[0]["z0"]
    assert z0.item() > 0  # the baseline of the mismatched pairs is not the floor: the comparison is not vacuous
    assert objective.prepare(models, [both, lone], reduce=False)[0]["z0"].item() == z0.item()
    prepared = objective.prepare(models, [lone], reduce=False)[0]
    assert prepared["z0"].item() == 0.0
    with torch.no_grad():
        assert objective.terms(models, lone, prepared).losses["examples"].item() < 0.49  # not 0.5: ρ > 0


def test_packed_pairs_equal_unpacked_and_micro_batches_one_batch(trl_dpo, tiny_base_dir, tiny_tokenizer):
    """The same pairs packed in rows, packed in one sequence, padded one per row, and split unevenly into two
    micro-batches: one loss, one gradient (DPO with RPO's token-normalised term: both units at once)."""
    _, _, _, rows = trl_dpo
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    results = []
    for packing, layout, split in ((True, "rows", (6,)), (True, "one_sequence", (6,)), (False, "rows", (6,)),
                                   (True, "rows", (2, 4))):  # fmt: skip
        options = CollateOptions(tiny_tokenizer.pad_token_id, packing, layout)  # type: ignore[arg-type]
        objective = DPO(options, beta=0.1, loss_type="sigmoid", precomputed=False, rpo_alpha=0.5)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base_dir), _lora())
        _randomise(model)
        batches = [objective.collate(rows[: split[0]])] + (
            [objective.collate(rows[split[0] :])] if split[0] < 6 else []
        )
        result = accumulate_gradients(model, batches, Accelerator(cpu=True), objective=objective)
        results.append((result, _gradients(model)))
    (reference, reference_gradients), *others = results
    scale = _logps_scale(reference.metrics)  # -131: one float32 ulp there is 1.5e-5
    largest = max(g.abs().max().item() for g in reference_gradients.values())
    for result, gradients in others:  # the same sums in other orders (layouts, micro-batches, CPU kernels)
        assert_within_ulps(result.loss, reference.loss, SUM_ULPS, scale=scale, what="loss")
        for key, value in reference.metrics.items():
            assert_within_ulps(result.metrics[key], value, SUM_ULPS, scale=scale, what=key)
        for name in gradients:
            assert_within_ulps(gradients[name], reference_gradients[name], REORDERED_ULPS, scale=largest, what=name)


PREFERENCE_RECIPE = """
model: {{base: {base}}}
lora: {{r: 4, alpha: 8, dropout: 0.1}}
data: {{train: pairs.jsonl, validation: held-out.jsonl, format: preference, max_seq_len: 128}}
train: {{objective: dpo, beta: 0.5, precompute_reference: true, max_steps: 6, micro_batch_size: 4, grad_accum_steps: 2,
        lr: 0.01, warmup_steps: 1, log_every_steps: 1, eval_every_steps: 3, save_every_steps: 1, keep_checkpoints: 6,
        report_to: [tensorboard]}}
output: {{name: dpo}}
"""


@pytest.fixture()
def preference_workdir(workdir, tiny_base_dir) -> Path:
    records = preference_records(48)
    (workdir / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:40]))
    (workdir / "held-out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[40:]))
    (workdir / "pref.yaml").write_text(PREFERENCE_RECIPE.format(base=tiny_base_dir))
    return workdir


def _implicit_rewards(base_dir: Path, adapter_dir: Path, rows: list[dict], beta: float) -> torch.Tensor:
    """β·(log π − log π_base)(chosen) − the same for rejected, per pair, with plain peft and plain torch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(adapter_dir)).eval()

    def logp(ids: list[int], labels: list[int]) -> torch.Tensor:
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].float()
        targets = torch.tensor(labels[1:])
        picked = torch.log_softmax(logits, -1).gather(1, targets.clamp(min=0)[:, None])[:, 0]
        return picked[targets != -100].sum()

    margins = []
    with torch.no_grad():
        for row in rows:
            sides = []
            for side in ("chosen", "rejected"):
                ids, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
                policy = logp(ids, labels)
                with model.disable_adapter():
                    sides.append(beta * (policy - logp(ids, labels)))
            margins.append(sides[0] - sides[1])
    return torch.stack(margins)


@pytest.mark.slow
def test_dpo_resumes_after_sigkill_bit_for_bit_and_plain_peft_reads_its_rewards(
    preference_workdir, tiny_base_dir, capsys
):
    work = preference_workdir
    whole, metrics = train("pref.yaml", ["output.name=whole"], log=lambda line: None)
    environment = {**os.environ, "PYTHONPATH": str(REPO), SLOW_STEP_ENV: "0.5"}
    process = subprocess.Popen([sys.executable, "-m", "finetune", "train", "pref.yaml"], cwd=work, env=environment,
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)  # fmt: skip
    lines = []
    while not any(line.startswith("step 3/") for line in lines[-1:]):
        lines.append(process.stderr.readline())
        assert lines[-1] or process.poll() is None, "".join(lines)
    process.send_signal(signal.SIGKILL)  # mid-run: checkpoint 2 or 3 written, the adapter not
    process.wait()
    assert "reference: scoring 40 of 40 training pairs" in "".join(lines)  # 6 steps of 8 pairs: all 40
    resumed_log: list[str] = []
    resumed, _ = train("pref.yaml", resume=True, log=resumed_log.append)
    assert any(line.startswith("resumed from") for line in resumed_log)
    assert not any("reference: scoring" in line for line in resumed_log)  # read back from the run directory
    expected, actual = load_file(whole / "adapter_model.safetensors"), load_file(resumed / "adapter_model.safetensors")
    assert expected.keys() == actual.keys() and all(torch.equal(expected[k], actual[k]) for k in expected)

    # The manifest's held-out rewards, recomputed with nothing but peft and torch (the reference: the base).
    from finetune.data.pipeline import build_datasets
    from finetune.recipe import load_recipe

    recipe = load_recipe("pref.yaml")
    from transformers import AutoTokenizer

    data = build_datasets(recipe.data, AutoTokenizer.from_pretrained(tiny_base_dir), seed=0)
    margins = _implicit_rewards(tiny_base_dir, whole, [data.validation[i] for i in range(len(data.validation))], 0.5)
    scale = _logps_scale({k: v for k, v in metrics.items() if k.startswith("eval_")})
    assert_within_ulps(metrics["eval_reward_margin"], margins.mean().item(), SUM_ULPS, scale=scale)
    assert metrics["eval_reward_accuracy"] == pytest.approx((margins > 0).float().mean().item())
    records = [json.loads(line) for line in (work / "runs" / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert {"reward_accuracy", "reward_margin", "rewards_chosen", "logps_rejected"} <= records[0].keys()
    assert sum("eval_reward_accuracy" in record for record in records) == 2
    assert (work / "runs" / "whole" / "plots" / "rewards.png").is_file()

    # An adapter like any other: merged and subtracted exactly, and `generate` uses it.
    from helpers import greedy_text

    import finetune
    from finetune.cli import main

    loaded = finetune.load_model(whole)
    (name,) = loaded.adapters
    loaded.use(None)
    before = {k: v.clone() for k, v in loaded.model.state_dict().items() if "lora_" not in k}
    loaded.merge(name)
    assert any(not torch.equal(before[k], v) for k, v in loaded.model.state_dict().items() if k in before)
    loaded.subtract(name)
    assert all(torch.equal(before[k], v) for k, v in loaded.model.state_dict().items() if k in before)
    prompt = preference_records(1)[0]["prompt"]
    assert main(["generate", "--adapter", str(whole), "--max-new-tokens", "8", prompt]) == 0
    assert capsys.readouterr().out[:-1] == greedy_text(tiny_base_dir, whole, prompt, 8)  # print adds one newline


def test_a_precomputed_reference_scores_the_pairs_the_run_trains_on_and_a_longer_resume_the_rest(
    preference_workdir,
):
    """Two steps of 8 pairs score those 16 of the 40 (the others are NaN in the file, and a step that read one
    would stop the run on its non-finite loss); resumed to four steps, the run scores the 16 pairs it has not
    scored yet, and the file then holds what a four-step run scores, to float rounding (other batches)."""
    quiet = ["lora.dropout=0.0", "train.report_to=[]", "train.eval_every_steps=null"]
    log: list[str] = []
    train("pref.yaml", [*quiet, "train.max_steps=2", "output.name=grown"], log=log.append)
    assert any("reference: scoring 16 of 40 training pairs" in line for line in log), log
    stored = load_file(preference_workdir / "runs" / "grown" / "reference-logps.safetensors")
    assert stored["train"].isnan().any(dim=1).sum() == 24 and not stored["validation"].isnan().any()

    log.clear()
    lengthened = [*quiet, "train.max_steps=4", "output.name=grown", "output.overwrite=true"]
    train("pref.yaml", lengthened, resume=True, log=log.append)
    assert any("reference: scoring 16 of 40 training pairs" in line for line in log), log
    grown = load_file(preference_workdir / "runs" / "grown" / "reference-logps.safetensors")
    assert torch.equal(grown["train"][~stored["train"].isnan()], stored["train"][~stored["train"].isnan()])
    train("pref.yaml", [*quiet, "train.max_steps=4", "output.name=fresh"], log=lambda line: None)
    fresh = load_file(preference_workdir / "runs" / "fresh" / "reference-logps.safetensors")
    assert torch.equal(fresh["train"].isnan(), grown["train"].isnan()) and grown["train"].isnan().any()
    scored = ~fresh["train"].isnan()
    assert_within_ulps(grown["train"][scored], fresh["train"][scored], SUM_ULPS, what="reference log-probabilities")


KTO_RECIPE = """
model: {{base: {base}}}
lora: {{r: 4, alpha: 8, dropout: 0.0, init_from: {start}}}
data: {{train: examples.jsonl, validation: examples.jsonl, format: unpaired_preference, max_seq_len: 128}}
train: {{objective: kto, beta: 0.5, max_steps: 2, micro_batch_size: 4, lr: 0.01, log_every_steps: 1,
        report_to: []}}
output: {{name: kto, report: false}}
"""


@pytest.mark.slow
def test_from_an_adapter_the_reference_is_that_adapter_swapped_in_as_precomputed(preference_workdir, tiny_base_dir):
    """Refining an adapter (`lora.init_from`), the reference policy is that adapter. DPO scoring it per step,
    with its weights swapped into the trained parameters, trains the adapter that precomputing it trains;
    with either, and with KTO (whose reference cannot be precomputed), the policy at the start is its
    reference: every held-out implicit reward is 0 before the first step."""
    quiet = {"log": lambda line: None}
    start, from_base = train("pref.yaml", ["lora.dropout=0.0", "train.max_steps=2", "output.name=start"], **quiet)
    assert "base_eval_ppl" in from_base and "start_eval_ppl" not in from_base, from_base
    refine = [f"lora.init_from={start}", "lora.dropout=0.0", "train.max_steps=3", "train.report_to=[]"]
    precomputed, before = train("pref.yaml", [*refine, "output.name=precomputed"], **quiet)
    swapped, after = train("pref.yaml", [*refine, "train.precompute_reference=false", "output.name=swapped"], **quiet)
    for metrics in (before, after):  # every reward 0: no margin, and DPO's loss -log sigmoid(0)
        assert metrics["start_eval_reward_margin"] == 0.0, metrics
        assert_within_ulps(metrics["start_eval_loss"], math.log(2), SUM_ULPS, what="DPO loss at margin 0")
        assert not any(key.startswith("base_") for key in metrics), metrics  # the starting adapter's, not the base's
    assert "start_eval_ppl=" in summarize(precomputed).metrics
    expected, actual = (
        load_file(precomputed / "adapter_model.safetensors"),
        load_file(swapped / "adapter_model.safetensors"),
    )
    moved = max((expected[k] - load_file(start / "adapter_model.safetensors")[k]).abs().max().item() for k in expected)
    largest = max((expected[k] - actual[k]).abs().max().item() for k in expected)
    # within a thousandth of how far training moved them: float rounding of batches laid out otherwise, which
    # Adam may magnify (none seen: 0.0 apart on an AMD EPYC); and it trained
    assert largest <= 1e-3 * moved and moved > 1e-3, (largest, moved)

    (preference_workdir / "examples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in unpaired_records(12)))
    (preference_workdir / "kto.yaml").write_text(KTO_RECIPE.format(base=tiny_base_dir, start=start))
    _, kto = train("kto.yaml", [], **quiet)
    assert kto["start_eval_reward_margin"] == 0.0 and kto["start_eval_loss"] == 0.5, kto  # 1 - sigmoid(0)


def test_a_step_without_desirable_examples_logs_no_chosen_metrics(workdir, tiny_base_dir):
    """A metric with no example in a step (kto's chosen side in a step of undesirable examples) is left out of
    that step's record: it was carried over from the step before, as if measured again."""
    records = unpaired_records(4)
    for index, record in enumerate(records):
        record["label"] = index == 0  # one desirable example of 8: in one step of 4 an epoch
    (workdir / "examples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    recipe = KTO_RECIPE.replace("init_from: {start}", "init_from: null").replace("validation: examples.jsonl, ", "")
    (workdir / "kto.yaml").write_text(recipe.format(base=tiny_base_dir))
    train("kto.yaml", ["train.micro_batch_size=2", "train.max_steps=8", "train.eval_every_steps=null"],
          log=lambda line: None)  # fmt: skip
    steps = [json.loads(line) for line in (workdir / "runs" / "kto" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 8 and all("rewards_rejected" in step for step in steps)
    assert sum("rewards_chosen" in step for step in steps) == 2, steps  # the two steps holding the desirable one


@pytest.mark.parametrize("data_format", ["preference", "unpaired_preference"])
def test_an_empty_prompt_without_bos_leaves_each_sequence_first_label_untrained(tiny_tokenizer, data_format):
    """Packed, a sequence's first label is predicted from the sequence before it (chosen's EOS would score
    rejected's first token, counted as chosen's): with no BOS and an empty prompt it must still be -100."""
    import copy

    from finetune.data.labels import IGNORE_INDEX
    from finetune.data.preference import encode_preference_records
    from finetune.training.objectives.logprobs import collate_sequences

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.bos_token = None
    assert tokenizer.bos_token_id is None
    paired = data_format == "preference"
    record = {"prompt": "", "chosen": "Sunny.", "rejected": "Rain all day."} if paired else {
        "prompt": "", "completion": "Sunny.", "label": True}  # fmt: skip
    config = recipe_from_dict({"data": {"train": "x.jsonl", "format": data_format}, "output": {"name": "x"},
                               "train": {"objective": "dpo" if paired else "kto", "micro_batch_size": 2}}).data  # fmt: skip
    (encoded,) = encode_preference_records([record], config, tokenizer, lambda i: "record 1")
    sides = ("chosen_", "rejected_") if paired else ("",)
    sequences = [{"input_ids": encoded.row[f"{s}input_ids"], "labels": encoded.row[f"{s}labels"]} for s in sides]
    assert all(sequence["labels"][0] == IGNORE_INDEX for sequence in sequences)
    if paired:  # each side scores its own tokens only: all but its first
        batch = collate_sequences(sequences, tokenizer.pad_token_id, packing=True)
        assert batch["sequence_tokens"].tolist() == [len(s["input_ids"]) - 1 for s in sequences]
    else:  # so do KTO's KL sequences: the empty prompt with another example's completion, packed after another
        from finetune.training.objectives.kto import mismatched

        other = {"prompt": "Weather?", "completion": "Rain all day.", "label": False}
        (second,) = encode_preference_records([other], config, tokenizer, lambda i: "record 2")
        kl = mismatched([second.row, encoded.row], max_seq_len=512)  # the empty prompt's is packed second
        batch = collate_sequences(kl, tokenizer.pad_token_id, packing=True)
        labelled = [sum(label != IGNORE_INDEX for label in sequence["labels"]) for sequence in kl]
        assert kl[1]["labels"][0] == IGNORE_INDEX and batch["sequence_tokens"].tolist() == labelled


def test_bos_and_eos_already_in_a_pairs_text_are_not_added_again(tiny_tokenizer):
    """As in `text` and `instruction` records: a prompt written with its BOS and completions ending with EOS
    get no second one (a doubled BOS is input the model never saw; a doubled EOS trains stopping twice). So do
    GRPO's string prompts."""
    from finetune.data.preference import encode_preference_records
    from finetune.data.prompts import prompt_token_ids

    bos, eos = tiny_tokenizer.bos_token, tiny_tokenizer.eos_token
    config = recipe_from_dict({"data": {"train": "x.jsonl", "format": "preference"}, "output": {"name": "x"},
                               "train": {"objective": "dpo"}}).data  # fmt: skip
    plain = {"prompt": "Weather?", "chosen": "Sunny.", "rejected": "Rain all day."}
    written = {"prompt": bos + "Weather?", "chosen": "Sunny." + eos, "rejected": "Rain all day." + eos}
    (ours, theirs) = (encode_preference_records([r], config, tiny_tokenizer, str)[0].row for r in (plain, written))
    for side in ("chosen_", "rejected_"):
        assert theirs[f"{side}input_ids"] == ours[f"{side}input_ids"]
        assert theirs[f"{side}input_ids"].count(tiny_tokenizer.bos_token_id) == 1
        assert theirs[f"{side}input_ids"].count(tiny_tokenizer.eos_token_id) == 1
    assert prompt_token_ids(bos + "Weather?", config, tiny_tokenizer, "x") == prompt_token_ids(
        "Weather?", config, tiny_tokenizer, "x"
    )


@pytest.mark.parametrize("overlength", ["truncate", "truncate_prompt"])
def test_a_pair_the_length_limit_makes_the_same_is_refused(tiny_tokenizer, overlength):
    """Completions that differ only beyond data.max_seq_len are the same once cut: a pair with no preference in
    it (loss log 2 whatever the model, gradient 0, never counted accurate) is refused as chosen == rejected is,
    naming the record; one whose difference survives the cut is kept."""
    from finetune.data.preference import encode_preference_records
    from finetune.errors import DataError

    config = recipe_from_dict({"data": {"train": "x.jsonl", "format": "preference", "max_seq_len": 64,
                                        "overlength": overlength}, "output": {"name": "x"},
                               "train": {"objective": "dpo"}}).data  # fmt: skip
    shared = "the model reads a document " * 14  # 71 tokens
    record = {"prompt": "Weather?", "chosen": shared + "Sunny.", "rejected": shared + "Rain all day."}
    with pytest.raises(DataError, match=r"^record 3: chosen and rejected differ only from token \d+ on .*max_seq_len"):
        encode_preference_records([record], config, tiny_tokenizer, lambda i: "record 3")
    kept = {"prompt": "Weather?", "chosen": "Sunny.", "rejected": shared}
    (encoded,) = encode_preference_records([kept], config, tiny_tokenizer, lambda i: "record 4")
    assert encoded.too_long and encoded.row["chosen_input_ids"] != encoded.row["rejected_input_ids"]


def test_kto_labels_read_from_a_csv_file_are_booleans(tmp_path, tiny_tokenizer):
    """A .csv file holds strings only: its `true`/`false` labels are the booleans KTO reads."""
    from finetune.data.preference import preview_records

    (tmp_path / "kto.csv").write_text("prompt,completion,label\nHi,Hello there,true\nHi,Go away,False\n")
    config = recipe_from_dict({"data": {"train": str(tmp_path / "kto.csv"), "format": "unpaired_preference"},
                               "train": {"objective": "kto", "micro_batch_size": 2}, "output": {"name": "x"}}).data  # fmt: skip
    assert [row["desirable"] for _, row in preview_records(config, tiny_tokenizer, 2)] == [True, False]


@pytest.mark.parametrize("starting_adapter", [True, False], ids=["init_from", "base"])
def test_the_reference_pass_is_the_starting_policy_without_dropout(tiny_base_dir, tiny_tokenizer, starting_adapter):
    """With dropout (LoRA's on a starting adapter, the base's attention dropout), a training step's reference pass
    (the model in train mode) scores the starting policy itself, every time alike and as precomputing it does
    (eval mode), not a fresh dropout draw of it; the model's modes are left as they were."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.data.preference import encode_preference_records
    from finetune.training.objectives.base import Models
    from finetune.training.objectives.reference import StartingWeights, score_rows

    config = recipe_from_dict({"data": {"train": "x", "format": "preference"}, "train": {"objective": "dpo"},
                               "output": {"name": "x"}}).data  # fmt: skip
    rows = [e.row for e in encode_preference_records(preference_records(4), config, tiny_tokenizer, locate=str)]
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.5)
    base = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32, attention_dropout=0.5)
    model = get_peft_model(base, lora)
    _randomise(model)
    objective = DPO(CollateOptions(tiny_tokenizer.pad_token_id, True), beta=0.1, loss_type="sigmoid",
                    precomputed=False)  # fmt: skip
    if starting_adapter:
        objective.starting_weights = StartingWeights(model)
    models = Models(model, model, Accelerator(cpu=True))
    batch = objective.collate(rows)
    model.train()
    first, second = (objective.prepare(models, [batch], reduce=True)[0]["reference"] for _ in range(2))
    assert torch.equal(first, second)
    assert all(module.training for module in model.modules())
    if starting_adapter:  # what `train.precompute_reference` stores for the same pairs
        assert_within_ulps(first, score_rows(objective, models, rows, 4).reshape(-1), SUM_ULPS, what="reference")


def test_with_trained_base_biases_the_reference_is_still_the_start(preference_workdir, tiny_tokenizer):
    """`lora.bias: all` trains the base layers' own biases, which stay as trained with the adapter disabled: the
    per-step reference must still be the model as the run started, so it trains the adapter (biases included)
    that precomputing the reference trains, and reports the same held-out rewards."""
    from helpers import TEST_SHAPE

    from finetune.embedded.tiny import build_tiny_llama

    base = preference_workdir / "biased-base"
    build_tiny_llama(tiny_tokenizer, seed=0, attention_bias=True, **TEST_SHAPE).save_pretrained(base)
    tiny_tokenizer.save_pretrained(base)
    common = [f"model.base={base}", "lora.bias=all", "lora.dropout=0.0", "train.max_steps=3", "train.report_to=[]",
              "train.save_every_steps=null", "train.eval_every_steps=null"]  # fmt: skip
    runs = {}
    for precompute in ("true", "false"):
        name = f"precompute-{precompute}"
        runs[precompute] = train("pref.yaml", [*common, f"train.precompute_reference={precompute}",
                                               f"output.name={name}"], log=lambda line: None)  # fmt: skip
    (precomputed, before), (swapped, after) = runs["true"], runs["false"]
    expected, actual = (
        load_file(precomputed / "adapter_model.safetensors"),
        load_file(swapped / "adapter_model.safetensors"),
    )
    assert any("bias" in key for key in expected)
    largest = max((expected[k] - actual[k]).abs().max().item() for k in expected)
    assert largest <= 1e-5 * max(v.abs().max().item() for v in expected.values()), largest
    scale = _logps_scale({k: v for k, v in before.items() if k.startswith("eval_")})
    assert_within_ulps(after["eval_reward_margin"], before["eval_reward_margin"], SUM_ULPS, scale=scale)


def test_a_first_step_from_the_reference_logs_rewards_of_exactly_zero(preference_workdir):
    """The policy's first forward is its reference's: the training step's log-probabilities (through the chunked
    loss with a gradient) and the reference pass's (without one) must agree bit for bit. They were computed by two
    formulas, and the first step logged rewards of 1e-5 and a reward accuracy of 0.125 before any update."""
    seen: list[dict] = []
    overrides = ["train.precompute_reference=false", "train.max_steps=1", "train.eval_every_steps=null",
                 "train.report_to=[]", "lora.dropout=0.0"]  # fmt: skip
    train("pref.yaml", overrides, log=lambda line: None, on_step=lambda step, metrics: seen.append(metrics))
    (first,) = seen
    assert first["rewards_chosen"] == first["rewards_rejected"] == first["reward_accuracy"] == 0.0, first

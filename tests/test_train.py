"""The training loop: exact gradient accumulation, exact resume, and adapters plain peft can load."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from helpers import REORDERED_ULPS, ROUNDED_ULPS, assert_within_ulps, tiny_model
from safetensors.torch import load_file

from finetune.errors import CheckpointError, FinetuneError, ModelError, RecipeError
from finetune.recipe import LoraConfig
from finetune.training.loop import accumulate_gradients, train


def _lora_model(base_dir: Path):
    from transformers import AutoModelForCausalLM

    from finetune.model import wrap_with_lora

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    torch.manual_seed(0)  # the same LoRA initialisation every time
    peft_model = wrap_with_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0, init="gaussian"))
    return peft_model.train()


def test_uneven_micro_batches_accumulate_to_the_one_batch_gradient(tiny_base_dir):
    """Two micro-batches of 7 and 13 tokens give the gradients of one padded batch holding both."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # accelerate keeps one process-wide state: an earlier in-process bf16 run left its autocast behind (gradients
    # 26,624 ulps apart after `test_training_variants_learn[train.precision=bf16]` in the same worker), so the
    # state is cleared as training's own `_make_accelerator` clears it
    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(mixed_precision="no")  # the machine's device, as training's own: CUDA where there is one
    generator = torch.Generator().manual_seed(0)
    lengths = (7, 13)
    rows = [torch.randint(10, 200, (n,), generator=generator) for n in lengths]
    labels = [r.clone() for r in rows]
    labels[0][:3] = -100  # some positions carry no loss, as with prompts

    def single(i):
        return {
            "input_ids": rows[i][None],
            "labels": labels[i][None],
            "attention_mask": torch.ones(1, lengths[i], dtype=torch.long),
        }

    width = max(lengths)
    padded = {
        "input_ids": torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=2) for r in rows]),
        "labels": torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=-100) for r in labels]),
        "attention_mask": torch.stack([(torch.arange(width) < n).long() for n in lengths]),
    }

    gradients = []
    losses = []
    for micro_batches in ([single(0), single(1)], [padded]):
        model = _lora_model(tiny_base_dir).to(accelerator.device)
        losses.append(accumulate_gradients(model, micro_batches, accelerator).loss)
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    # Two attention layouts (two rows alone, one padded batch): the same sums in another order.
    assert_within_ulps(losses[0], losses[1], REORDERED_ULPS, what="loss")
    largest = max(g.abs().max() for g in gradients[1].values())
    for name, grad in gradients[0].items():
        assert_within_ulps(grad, gradients[1][name], REORDERED_ULPS, scale=largest, what=name)
    assert any(g.abs().max() > 1e-4 for g in gradients[0].values())  # the comparison is not vacuous


@pytest.mark.parametrize(("ratio", "steps"), [(0.03, 50), (0.03, 20), (0.1, 25), (0.1, 30), (0.5, 7)])
def test_warmup_ratio_gives_the_hf_trainers_warmup_steps(tmp_path, ratio, steps):
    """`train.warmup_ratio` rounds up as the Trainer does; it was rounded down (0.03 of 20 steps: no warmup at all,
    where the Trainer warms up for 1; 0.03 of 50: 1 step against the Trainer's 2)."""
    from transformers import TrainingArguments

    from finetune.data.sampler import MicroBatchStream
    from finetune.recipe import load_recipe
    from finetune.training.run import run_length

    recipe = load_recipe(
        "quickstart", [f"train.max_steps={steps}", f"train.warmup_ratio={ratio}", "train.warmup_steps=0"]
    )
    length = run_length(recipe, MicroBatchStream(num_rows=40, micro_batch_size=4, seed=0))
    expected = TrainingArguments(output_dir=str(tmp_path), warmup_steps=ratio).get_warmup_steps(steps)
    assert length.warmup_steps == expected


@pytest.mark.parametrize(("schedule", "trainer_schedule"), [("linear", "linear"), ("constant", "constant_with_warmup")])
def test_a_warmup_longer_than_the_run_rises_as_the_hf_trainers_does(tmp_path, schedule, trainer_schedule):
    """`warmup_steps: 10` in a run of 6 steps: the rate rises by lr/10 a step, as the Trainer's. The warmup was cut
    to the run's length, so it rose by lr/6 (0, 1/6, ..., 5/6 of lr against the Trainer's 0, 1/10, ..., 5/10)."""
    from transformers import TrainingArguments, get_scheduler

    from finetune.data.sampler import MicroBatchStream
    from finetune.recipe import load_recipe
    from finetune.training.run import make_scheduler, run_length

    recipe = load_recipe("quickstart", ["train.max_steps=6", "train.warmup_steps=10", f"train.schedule={schedule}"])
    length = run_length(recipe, MicroBatchStream(num_rows=40, micro_batch_size=4, seed=0))
    rates = []
    for make in (
        lambda optimizer: make_scheduler(recipe, optimizer, length),
        lambda optimizer: get_scheduler(
            trainer_schedule,
            optimizer,
            num_warmup_steps=TrainingArguments(output_dir=str(tmp_path), warmup_steps=10).get_warmup_steps(6),
            num_training_steps=6,
        ),
    ):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=recipe.train.lr)
        scheduler = make(optimizer)
        rates.append([scheduler.lr_lambdas[0](step) * recipe.train.lr for step in range(6)])
    assert rates[0] == rates[1] and rates[0][1] == pytest.approx(recipe.train.lr / 10)


def test_evaluating_every_few_steps_without_held_out_data_says_it_evaluates_nothing(workdir):
    """`train.eval_every_steps` beside no held-out data (every catalog recipe sets it; `data.validation=null` drops
    the data) did nothing without a word: the log's first lines say so."""
    logged: list[str] = []
    overrides = ["train.max_steps=1", "train.eval_every_steps=1", "data.validation=null"]
    train("recipe.yaml", overrides, log=logged.append)
    assert "no held-out data (data.validation, data.validation_split): train.eval_every_steps=1 evaluates nothing" in (
        logged
    )


def test_weight_decay_leaves_trained_biases_and_norms_alone_as_the_hf_trainer_does():
    """`lora.bias: all` trains the base's pretrained biases: weight decay, which pulls weights towards 0, must leave
    them alone (the Trainer's `get_decay_parameter_names`). With zero gradients an AdamW step is weight decay alone:
    LoRA's weights shrink, the biases stay as they were."""
    from finetune.model import wrap_with_lora
    from finetune.recipe import recipe_from_dict
    from finetune.training.run import make_optimizer, parameter_groups

    recipe = recipe_from_dict({"data": {"train": "x.jsonl"}, "output": {"name": "x"},
                               "lora": {"r": 4, "bias": "all"},
                               "train": {"weight_decay": 0.5, "lr": 0.1}})  # fmt: skip
    peft_model = wrap_with_lora(tiny_model("qwen2"), recipe.lora)  # Qwen2: biases on q, k and v
    trained = {name: p for name, p in peft_model.named_parameters() if p.requires_grad}
    exempt = [name for name in trained if name.endswith(".bias")]
    with torch.no_grad():
        for name in exempt:
            trained[name].normal_()  # a pretrained bias (these are initialised to 0, which decay leaves as it is)
    before = {name: p.detach().clone() for name, p in trained.items()}
    optimizer = make_optimizer(recipe, parameter_groups(recipe, peft_model))
    for parameter in trained.values():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for name, parameter in trained.items():
        if name in exempt:
            assert torch.equal(parameter, before[name]), name
        elif "lora_A" in name:
            assert torch.allclose(parameter, before[name] * (1 - 0.1 * 0.5)), name


def test_embedding_lr_with_targets_that_name_no_head_or_embedding_is_refused():
    """`train.embedding_lr` beside a list of targets without the head or embeddings applied to nothing: refused
    once the model says which modules those are; with `lm_head` in the list its LoRA trains at that rate."""
    from finetune.model import wrap_with_lora
    from finetune.recipe import recipe_from_dict
    from finetune.training.run import parameter_groups

    def groups(targets: list[str]) -> list[dict]:
        recipe = recipe_from_dict({"data": {"train": "x.jsonl"}, "output": {"name": "x"},
                                   "lora": {"r": 4, "target_modules": targets},
                                   "train": {"lr": 0.1, "embedding_lr": 0.01}})  # fmt: skip
        return parameter_groups(recipe, wrap_with_lora(tiny_model("llama"), recipe.lora))

    with pytest.raises(RecipeError, match="train.embedding_lr applies to the LoRA on the output head"):
        groups(["q_proj", "v_proj"])
    assert [group["lr"] for group in groups(["q_proj", "lm_head"])] == [0.1, 0.01]


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])  # the rate on the device, and read on the host
def test_the_logged_lr_is_the_rate_the_step_trained_at(workdir, optimizer):
    """4 steps, linear, 2 of warmup: steps train at lr x 0, 1/2, 1, 1/2 (the HF Trainer logs these). The log
    said 1/2, 1, 1/2, 0: the next step's rate, read after the schedule advanced. Step 1's weights do not move."""
    import finetune.training.loop as loop

    runs, moved = [], []
    start_run = loop.start_run

    def keep(*args, **kwargs):
        runs.append(start_run(*args, **kwargs))
        runs.append({n: p.detach().clone() for n, p in runs[0].peft_model.named_parameters() if p.requires_grad})
        return runs[0]

    def on_step(step: int, metrics: dict) -> None:
        trained = {n: p for n, p in runs[0].peft_model.named_parameters() if p.requires_grad}
        moved.append(any(not torch.equal(trained[n], runs[1][n]) for n in trained))

    overrides = ["train.max_steps=4", "train.warmup_steps=2", "train.schedule=linear", "train.log_every_steps=1",
                 f"train.optimizer={optimizer}", "data.validation=null"]  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "start_run", keep)
        train("recipe.yaml", overrides, log=lambda line: None, on_step=on_step)
    lines = [json.loads(line) for line in Path("runs/crates/metrics.jsonl").read_text().splitlines()]
    assert [line["lr"] for line in lines if "loss" in line] == pytest.approx([0.0, 0.0025, 0.005, 0.0025])
    assert moved[0] is False and moved[1] is True  # trained at 0: step 1 left the weights as they were


def test_a_run_set_by_epochs_trains_each_document_that_many_times(workdir):
    """40 documents, 4 per micro-batch, 4 micro-batches per step: 1.5 epochs are 15 micro-batches, steps of 4, 4, 4
    and 3 (the last takes those left, as the HF Trainer's last accumulation does). Every step took 4 before, the
    last one a micro-batch more than 1.5 epochs hold: epoch 1.6, four documents trained once too often."""
    seen: list[dict] = []
    overrides = ["train.max_steps=null", "train.epochs=1.5", "train.grad_accum_steps=4", "data.validation=null"]
    train("recipe.yaml", overrides, log=lambda line: None, on_step=lambda step, metrics: seen.append(metrics))
    assert [metrics["epoch"] for metrics in seen] == [0.4, 0.8, 1.2, 1.5]


def test_epochs_count_micro_batches_without_float_error():
    """0.3 epochs of 10 micro-batches are 3 micro-batches (3.0000000000000004 in floats: 4 if taken as it is)."""
    from finetune.data.sampler import MicroBatchStream
    from finetune.recipe import load_recipe
    from finetune.training.run import run_length

    recipe = load_recipe("quickstart", ["train.max_steps=null", "train.epochs=0.3", "train.micro_batch_size=4"])
    length = run_length(recipe, MicroBatchStream(num_rows=40, micro_batch_size=4, seed=0))
    assert length.total_steps == 3  # 4 before: a fourth step of the next micro-batch
    assert length.total_micro_batches == 3


def test_train_writes_a_complete_adapter_that_plain_peft_loads(workdir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir, metrics = train("recipe.yaml")
    assert adapter_dir == Path("adapters/crates")
    files = sorted(p.name for p in adapter_dir.iterdir())
    assert files == [
        "README.md", "adapter_config.json", "adapter_model.safetensors", "chat_template.jinja", "manifest.json",
        "recipe.yaml", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip  # the run's tokenizer with its chat template, as trl saves it
    assert not [p for p in Path("adapters").iterdir() if p.name.startswith(".")]  # no temp leftovers

    manifest = json.loads((adapter_dir / "manifest.json").read_text())
    assert manifest["base"]["fingerprint"].startswith("sha256:")
    assert manifest["recipe"]["lora"]["r"] == 4
    assert manifest["data"]["fingerprint"]
    assert manifest["metrics"]["step"] == 6
    assert set(manifest["versions"]) >= {"torch", "transformers", "peft", "accelerate", "finetune"}

    # Plain peft, from nothing but the adapter directory, reproduces the eval loss training reported.
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    # in one order whatever the process's string hashing (peft writes its set's): equal runs, equal files
    assert len(config["target_modules"]) > 2 and config["target_modules"] == sorted(config["target_modules"])
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    from transformers import AutoTokenizer

    from finetune.data.collate import collate_batch
    from finetune.data.pipeline import build_datasets
    from finetune.recipe import load_recipe
    from finetune.scoring import token_loss_sum

    recipe = load_recipe("recipe.yaml")
    tokenizer = AutoTokenizer.from_pretrained(config["base_model_name_or_path"])
    data = build_datasets(recipe.data, tokenizer, seed=0, log=lambda m: None)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(data.validation), 4):
            batch = collate_batch(
                [data.validation[i] for i in range(start, min(start + 4, len(data.validation)))],
                pad_token_id=tokenizer.pad_token_id,
                packing=True,
            )
            labels = batch.pop("labels")
            loss_sum, n = token_loss_sum(model(**batch, use_cache=False).logits, labels)
            total, count = total + loss_sum.item(), count + int(n)
    assert_within_ulps(total / count, metrics["eval_loss"], REORDERED_ULPS, what="eval loss")  # 0 ulps measured
    assert metrics["eval_loss"] < metrics["base_eval_loss"]

    run_dir = Path("runs/crates")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "loss" in m] == [2, 4, 6]
    assert any("eval_loss" in m for m in lines)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_train_gives_the_caller_its_random_generators_back(workdir):
    """A notebook seeds its own generators; a run seeds them with `train.seed` and draws from them while it trains,
    and must leave the caller's where they were (it reset all three to the same state after every run)."""
    import random

    import numpy as np

    def draws() -> tuple[list[float], float, list[float]]:
        return torch.rand(3).tolist(), random.random(), np.random.rand(3).tolist()

    torch.manual_seed(1234), random.seed(1234), np.random.seed(1234)
    expected = draws()
    torch.manual_seed(1234), random.seed(1234), np.random.seed(1234)
    train("recipe.yaml", ["train.max_steps=2"], log=lambda message: None)
    assert draws() == expected


def test_resume_ends_with_the_same_adapter_bit_for_bit(workdir):
    overrides = ["train.save_every_steps=3", "train.keep_checkpoints=5"]
    uninterrupted, _ = train("recipe.yaml", overrides)
    # Start a second run whose only history is the step-3 checkpoint of the first: as if killed after it.
    shutil.copytree("runs/crates/checkpoint-000003", "runs/resumed/checkpoint-000003")
    resumed, metrics = train("recipe.yaml", [*overrides, "output.name=resumed"], resume=True)
    assert metrics["step"] == 6
    expected = load_file(uninterrupted / "adapter_model.safetensors")
    actual = load_file(resumed / "adapter_model.safetensors")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_a_fresh_run_never_mixes_with_an_earlier_runs_checkpoints_and_metrics(workdir):
    """Killed after step 3 and started again without --resume: refused, since a later --resume would continue the
    older run; with output.overwrite the old checkpoints and metrics go, and the new run's --resume resumes it. A
    resumed run's metrics.jsonl holds each step once, whatever the killed run wrote after its last checkpoint."""
    overrides = ["train.save_every_steps=3", "train.keep_checkpoints=5", "train.log_every_steps=1"]
    train("recipe.yaml", overrides)
    shutil.rmtree("adapters/crates")  # as if killed before the adapter was written
    with pytest.raises(FinetuneError, match="earlier run's checkpoints.*--resume.*output.overwrite"):
        train("recipe.yaml", overrides)
    Path("runs/crates/checkpoint-000006/marker").write_text("the older run's")
    train("recipe.yaml", [*overrides, "output.overwrite=true"])
    assert not Path("runs/crates/checkpoint-000006/marker").exists()
    lines = [json.loads(line) for line in Path("runs/crates/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "loss" in m] == [1, 2, 3, 4, 5, 6]
    # As if killed after logging step 6 and half a line more, before its checkpoint: resume from step 3.
    shutil.rmtree("runs/crates/checkpoint-000006")
    shutil.rmtree("adapters/crates")
    with open("runs/crates/metrics.jsonl", "a") as log:
        log.write('{"step": 7, "lo')
    _, metrics = train("recipe.yaml", overrides, resume=True)
    assert metrics["step"] == 6
    lines = [json.loads(line) for line in Path("runs/crates/metrics.jsonl").read_text().splitlines()]
    trained = [m["step"] for m in lines if "loss" in m]
    assert trained == [1, 2, 3, 4, 5, 6], trained


def test_resume_refuses_a_checkpoint_of_another_recipe_naming_the_setting(workdir):
    train("recipe.yaml", ["train.max_steps=2", "train.save_every_steps=1"])
    with pytest.raises(CheckpointError, match="different recipe") as caught:
        train("recipe.yaml", ["train.max_steps=4", "lora.r=8"], resume=True)
    assert "lora.r is 4 in the checkpoint but 8 now" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_resume_refuses_changed_data_and_a_run_shorter_than_the_checkpoint(workdir):
    """The checkpoint's place in its data means nothing in other data; a run that ends before the checkpoint's
    step cannot continue it (it ended in an IndexError)."""
    train("recipe.yaml", ["train.max_steps=3", "train.save_every_steps=1"])
    shutil.rmtree("adapters/crates")
    with pytest.raises(CheckpointError, match=r"checkpoint-000003 is at step 3, past this run's 2 steps; resume"):
        train("recipe.yaml", ["train.max_steps=2"], resume=True)
    with open("train.jsonl", "a") as handle:
        handle.write(json.dumps({"instruction": "one more", "output": "record"}) + "\n")
    with pytest.raises(CheckpointError, match=r"was written for other data \(sha256:.*the data files changed since"):
        train("recipe.yaml", ["train.max_steps=4"], resume=True)


def test_resume_beside_an_adapter_it_could_not_replace_is_refused_before_training(workdir):
    """A finished run's adapter in the way of a longer one resumed from its checkpoint: without output.overwrite the
    resumed run trained every step left and was then refused its adapter. It is refused at once, saying how."""
    train("recipe.yaml", ["train.max_steps=2", "train.save_every_steps=1"])
    lines_before = Path("runs/crates/metrics.jsonl").read_text()
    with pytest.raises(
        RecipeError, match="adapters/crates already exists and is not this run's adapter.*overwrite=true"
    ):
        train("recipe.yaml", ["train.max_steps=4"], resume=True)
    assert Path("runs/crates/metrics.jsonl").read_text() == lines_before  # no step was trained
    _, metrics = train("recipe.yaml", ["train.max_steps=4", "output.overwrite=true"], resume=True)
    assert metrics["step"] == 4


def test_resume_drops_damaged_metrics_lines_instead_of_failing_on_them(workdir):
    """A metrics.jsonl line that is not UTF-8 or holds a step of Infinity is dropped on resume, as a torn line is;
    it was a UnicodeDecodeError or OverflowError traceback."""
    train("recipe.yaml", ["train.max_steps=2", "train.save_every_steps=1", "train.log_every_steps=1"])
    metrics = Path("runs/crates/metrics.jsonl")
    with metrics.open("ab") as handle:
        handle.write(b'\xff\xfe not text\n{"step": Infinity, "loss": 1.0}\n')
    train("recipe.yaml", ["train.max_steps=3", "output.overwrite=true"], resume=True)
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps[-1] == 3 and steps == sorted(steps)


def test_a_checkpoint_of_an_earlier_version_resumes_unless_a_setting_added_since_differs(workdir):
    """An upgrade that adds recipe settings (with defaults) must not lose a run: a checkpoint without them
    was written by a run that behaved as their defaults do, so it resumes; a recipe that sets one of them
    to something else would change the run, and is refused in one line naming it."""
    train("recipe.yaml", ["train.max_steps=2", "train.save_every_steps=1"])
    state_file = Path("runs/crates/checkpoint-000002/trainer_state.json")
    state = json.loads(state_file.read_text())
    for section, key in (("model", "check_updates"), ("lora", "use_dora"), ("lora", "init_from"),
                         ("data", "validation_split"), ("train", "nonfinite_skips")):  # fmt: skip
        del state["recipe_digest"][section][key]  # as an earlier finetune, without these settings, wrote it
    state_file.write_text(json.dumps(state))
    lines: list[str] = []
    _, metrics = train("recipe.yaml", ["train.max_steps=3", "output.overwrite=true"], resume=True, log=lines.append)
    assert "resumed from runs/crates/checkpoint-000002 at step 2" in lines and metrics["step"] == 3

    shutil.rmtree("runs/crates/checkpoint-000003")
    overrides = ["train.max_steps=4", "lora.use_dora=true"]
    with pytest.raises(CheckpointError, match="lora.use_dora is False in the checkpoint but True now"):
        train("recipe.yaml", overrides, resume=True)


def test_resume_compares_settings_one_by_one_after_filling_those_added_since():
    from finetune.recipe import load_recipe
    from finetune.training.recipe_digest import recipe_digest, resume_mismatch

    recipe = load_recipe("quickstart")
    recorded = recipe_digest(recipe)
    del recorded["lora"]["use_dora"], recorded["train"]["seed"]  # added since: their defaults are the run's
    assert resume_mismatch(recorded, recipe) is None
    assert resume_mismatch(recorded, load_recipe("quickstart", ["train.seed=5"])) == (
        "train.seed is 0 in the checkpoint but 5 now"
    )
    assert resume_mismatch(recorded, load_recipe("quickstart", ["train.epochs=9", "train.eval_every_steps=7"])) is None
    recorded["data"]["max_seq_len"] = 64
    assert (
        resume_mismatch(recorded, recipe)
        == f"data.max_seq_len is 64 in the checkpoint but {recipe.data.max_seq_len} now"
    )
    recorded["lora"]["since_removed"] = 3
    assert resume_mismatch(recorded, recipe) == "lora.since_removed is 3 in the checkpoint but unset now"


def test_a_checkpoint_with_an_embedding_lr_that_applied_to_nothing_resumes_without_it():
    """Before the recipe refused `train.embedding_lr` beside no head or embedding LoRA, such a run trained as if it
    were absent; the recipe that resumes it must leave the rate out, and computes the same steps."""
    from finetune.recipe import load_recipe
    from finetune.training.recipe_digest import recipe_digest, resume_mismatch

    recipe = load_recipe("quickstart")
    assert not recipe.lora.train_lm_head and not recipe.lora.train_embed_tokens
    recorded = recipe_digest(recipe)
    recorded["train"]["embedding_lr"] = 1e-3
    assert resume_mismatch(recorded, recipe) is None
    recorded["lora"]["train_lm_head"] = True  # then the rate trained the head: a recipe without it differs
    assert resume_mismatch(recorded, recipe) == "lora.train_lm_head is True in the checkpoint but False now"
    with_head = load_recipe("quickstart", ["lora.train_lm_head=true"])
    assert resume_mismatch(recorded, with_head) == "train.embedding_lr is 0.001 in the checkpoint but None now"


def test_resume_without_a_checkpoint_is_an_error(workdir):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train("recipe.yaml", resume=True)


@pytest.mark.parametrize(
    ("overrides", "error", "fragments"),
    [
        (["lora.target_modules=[qkv_proj]"], ModelError, ["qkv_proj", "q_proj", "all-linear"]),
        (["model.base=./no-such-model"], ModelError, ["no such directory"]),
        (["model.base=."], ModelError, ["not a model directory"]),
        (["data.train=missing.jsonl"], FinetuneError, ["missing.jsonl"]),
    ],
)
def test_bad_input_fails_before_writing_anything(workdir, overrides, error, fragments):
    with pytest.raises(error) as info:
        train("recipe.yaml", overrides)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert not Path("adapters").exists() or not any(Path("adapters").iterdir())


def test_existing_adapter_is_not_overwritten_unless_asked(workdir):
    Path("adapters/crates").mkdir(parents=True)
    (Path("adapters/crates") / "keep.txt").write_text("mine")
    with pytest.raises(RecipeError, match="already exists"):
        train("recipe.yaml")
    assert (Path("adapters/crates") / "keep.txt").read_text() == "mine"
    with pytest.raises(RecipeError, match="no adapter_config.json; output.overwrite replaces adapters only"):
        train("recipe.yaml", ["output.overwrite=true", "train.max_steps=1"])  # not an adapter: never deleted
    assert (Path("adapters/crates") / "keep.txt").read_text() == "mine"
    (Path("adapters/crates") / "keep.txt").unlink()
    train("recipe.yaml", ["output.overwrite=true", "train.max_steps=1"])  # an empty directory may be replaced
    (Path("adapters/crates") / "keep.txt").write_text("beside an adapter")
    train("recipe.yaml", ["output.overwrite=true", "train.max_steps=1"])  # an adapter is replaced whole
    assert (Path("adapters/crates") / "adapter_model.safetensors").exists()
    assert not (Path("adapters/crates") / "keep.txt").exists()


def test_written_files_get_the_umask_s_permissions(workdir):
    """safetensors writes 0600: the adapter and checkpoint weights were unreadable to the other users of a shared
    machine (a server under another user, a team's adapter store) while the files beside them were not."""
    previous = os.umask(0o022)
    try:
        train("recipe.yaml", ["train.max_steps=1", "train.save_every_steps=1"])
    finally:
        os.umask(previous)
    written = [*Path("adapters/crates").iterdir(), *Path("runs/crates").glob("checkpoint-*/*")]
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in written if path.is_file()}
    assert "adapter_model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.precision=bf16"],
        ["model.dtype=bfloat16"],
        ["model.quantization=8bit"],
        ["model.quantization=4bit"],  # QLoRA: nf4 base, float32 LoRA weights
        ["train.optimizer=adamw_8bit"],
        ["train.gradient_checkpointing=true"],
        ["train.gradient_checkpointing=1"],  # the first of the 2 layers
        ["lora.use_dora=true"],
        ["lora.use_rslora=true", "lora.target_modules=[q_proj,v_proj]"],
        ["data.packing=false"],
    ],
    ids=lambda o: ",".join(o),
)
def test_training_variants_learn(workdir, overrides):
    """Every precision, quantization and LoRA variant a recipe can ask for trains on CPU and lowers eval loss."""
    _, metrics = train("recipe.yaml", [*overrides, "train.max_steps=4"])
    assert metrics["eval_loss"] < metrics["base_eval_loss"] - 0.02


def test_8_bit_adam_state_is_checkpointed_and_resumed(workdir):
    """bitsandbytes keeps 8-bit state for tensors of 4,096 elements and more, with one quantization map shared by
    every parameter's state: safetensors refused the shared tensors, and the run ended without its adapter."""
    overrides = ["train.optimizer=adamw_8bit", "lora.r=64", "lora.target_modules=[q_proj]", "train.save_every_steps=2"]
    train("recipe.yaml", [*overrides, "train.max_steps=2"])
    assert Path("runs/crates/checkpoint-000002/trainable.safetensors").exists()
    _, metrics = train("recipe.yaml", [*overrides, "train.max_steps=3", "output.overwrite=true"], resume=True)
    assert metrics["step"] == 3


@pytest.mark.parametrize("p", [0.05, 0.1, 0.3])
def test_lora_dropout_keeps_1_minus_p_and_preserves_the_mean(p):
    from finetune.model import UniformDropout

    dropout = UniformDropout(p)
    x = torch.ones(4_000_000)
    torch.manual_seed(0)
    y = dropout(x)
    kept = (y != 0).float().mean().item()
    assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / x.numel()) ** 0.5 + 1 / 65536, kept  # 5 sigma, p to 1/65536
    assert torch.all((y == 0) | (y == torch.tensor(1.0) * (1.0 / (1.0 - p))))  # the kept are scaled, exactly
    assert abs(y.mean().item() - 1.0) < 0.01  # E[dropout(x)] = x
    torch.manual_seed(0)
    assert torch.equal(dropout(x), y)  # drawn from torch's generator: seeded runs and resumes repeat
    assert dropout.eval()(x) is x


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_lora_dropout_gradient_is_the_upstream_gradient_times_mask_over_1_minus_p(p):
    """`UniformDropout` replaces peft's `nn.Dropout` on every LoRA input (`use_uniform_dropout`): its backward
    must be nn.Dropout's, dy · mask / (1 − p), alone and inside a LoRA layer, where A's and B's gradients
    are those of the dropped input x · mask / (1 − p)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from finetune.model import UniformDropout, use_uniform_dropout

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=generator, requires_grad=True)  # no exact zeros: y == 0 marks dropped
    upstream = torch.randn(16, 32, generator=generator)
    torch.manual_seed(0)
    y = UniformDropout(p)(x)
    y.backward(upstream)
    mask = (y != 0).float()
    assert 0 < mask.mean() < 1
    assert_within_ulps(y, x.detach() * mask / (1 - p), ROUNDED_ULPS, what="forward")  # x·(1/(1-p)) vs x/(1-p)
    assert_within_ulps(x.grad, upstream * mask / (1 - p), ROUNDED_ULPS, what="backward")

    layer = torch.nn.Sequential(torch.nn.Linear(32, 24))
    config = PeftLoraConfig(r=4, lora_alpha=8, target_modules=["0"], lora_dropout=p, init_lora_weights=False)
    peft_model = get_peft_model(layer, config).train()
    use_uniform_dropout(peft_model)
    lora = peft_model.base_model.model[0]
    assert isinstance(lora.lora_dropout["default"], UniformDropout)
    torch.manual_seed(0)
    inputs = x.detach()
    out_upstream = torch.randn(16, 24, generator=generator)
    peft_model(inputs).backward(out_upstream)
    torch.manual_seed(0)  # the same draw: the layer's only random numbers are its dropout mask
    dropped = inputs * ((UniformDropout(p)(torch.ones_like(inputs)) != 0).float() / (1 - p))  # (16, 32)
    A, B, scale = lora.lora_A["default"].weight, lora.lora_B["default"].weight, lora.scaling["default"]
    hidden = dropped @ A.detach().T  # (16, r)
    grad_B = scale * out_upstream.T @ hidden  # (24, r)
    grad_A = scale * (out_upstream @ B.detach()).T @ dropped  # (r, 32)
    assert_within_ulps(B.grad, grad_B, REORDERED_ULPS, what="lora_B")
    assert_within_ulps(A.grad, grad_A, REORDERED_ULPS, what="lora_A")


def test_wrapped_models_use_the_uniform_dropout(tiny_base_dir):
    from transformers import AutoModelForCausalLM

    from finetune.model import UniformDropout, wrap_with_lora

    model = wrap_with_lora(AutoModelForCausalLM.from_pretrained(tiny_base_dir), LoraConfig(r=4, dropout=0.1))
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p == 0.1]
    assert dropouts and all(type(m) is UniformDropout for m in dropouts)


def test_an_adapter_to_start_from_gives_the_run_its_shape_unless_the_recipe_says_otherwise(workdir, tiny_base_dir):
    """`lora.init_from` with a recipe silent about LoRA trains the adapter's own shape (its rank, alpha, dropout
    and target modules, as `PeftModel.from_pretrained` in trl takes them); a rank the recipe does give and the
    adapter does not have is one error naming both."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = PeftLoraConfig(r=2, lora_alpha=6, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                            init_lora_weights="gaussian")  # fmt: skip
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base_dir), config).save_pretrained(workdir / "start")
    text = (workdir / "recipe.yaml").read_text()
    silent = text[: text.index("lora:")] + text[text.index("data:") :]
    (workdir / "silent.yaml").write_text(silent)
    adapter, _ = train("silent.yaml", ["lora.init_from=start", "train.max_steps=1", "train.report_to=[]"],
                       log=lambda line: None)  # fmt: skip
    written = json.loads((adapter / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], sorted(written["target_modules"])) == (2, 6, ["q_proj", "v_proj"])
    start = load_file(workdir / "start" / "adapter_model.safetensors")
    assert load_file(adapter / "adapter_model.safetensors").keys() == start.keys()

    with pytest.raises(ModelError, match=r"lora.init_from start: its LoRA \(.*r=2.*\) is not this recipe's"):
        train("silent.yaml", ["lora.init_from=start", "lora.r=4", "output.name=r4"], log=lambda line: None)


def test_an_adapter_to_start_from_with_a_per_module_alpha_is_refused_not_rescaled(workdir, tiny_base_dir):
    """peft's `alpha_pattern` gives a module its own alpha; the recipe has one. Copied under the run's scale,
    q_proj's weights started at a quarter of their update, and the adapter written at the end was another model
    than the one it started from (logits 6.6 apart after a step at lr 1e-9), without a word."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    config = PeftLoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                            alpha_pattern={"q_proj": 32}, init_lora_weights="gaussian")  # fmt: skip
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base_dir), config).save_pretrained(workdir / "start")
    with pytest.raises(ModelError, match=r"lora.init_from start: module .*q_proj is scaled 8 in the adapter .* but 2"):
        train("recipe.yaml", ["lora.init_from=start", "train.max_steps=1", "train.report_to=[]"], log=lambda line: None)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_a_pissa_or_olora_adapter_is_written_as_an_update_of_the_base_on_disk(workdir, capsys, init):
    """PiSSA/OLoRA take the adapter's start out of the base the run trains on: written as the trained factors
    alone, the adapter was another model for finetune's merge and generate (only peft's loader redid the SVD), and
    the "base" perplexity was the residual's. Now it is a plain LoRA of rank 2r on the base on disk: `eval` of it
    gives the run's own held-out loss, from the base's."""
    import re

    from finetune.cli import main

    _, metrics = train("recipe.yaml", [f"lora.init={init}", "lora.dropout=0", "train.max_steps=3"])
    config = json.loads(Path("adapters/crates/adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["init_lora_weights"]) == (8, 16, True)
    assert main(["eval", "--adapter", "adapters/crates", "--data", "valid.jsonl", "--format", "instruction",
                 "--max-seq-len", "128"]) == 0  # fmt: skip
    base_line, tuned_line = capsys.readouterr().out.strip().splitlines()[-2:]
    base_loss = float(re.search(r"loss ([\d.]+)", base_line)[1])
    tuned_loss = float(re.search(r"loss ([\d.]+)", tuned_line)[1])
    assert abs(base_loss - metrics["base_eval_loss"]) < 2e-3, (base_line, metrics["base_eval_loss"])
    assert abs(tuned_loss - metrics["eval_loss"]) < 2e-3, (tuned_line, metrics["eval_loss"])
    assert tuned_loss < base_loss - 0.02


def test_a_pissa_adapter_with_lora_on_the_input_embeddings_is_one_rank_2r_adapter(workdir, capsys):
    """The input embeddings' LoRA is no PiSSA factor (peft starts it at A = 0 and leaves the embedding's base as it
    is), so the conversion to rank 2r passed it by: the written adapter said r=8 and held an embedding LoRA of rank 4,
    refused by every reader ("lora_A has rank 4 but adapter_config.json says r=8") and by peft's loader. Now it is
    padded to 2r with zeros, and the adapter read back gives the run's held-out loss."""
    from finetune.adapters.lora import read_adapter
    from finetune.cli import main

    overrides = ["lora.init=pissa", "lora.train_embed_tokens=true", "lora.target_modules=[q_proj]", "lora.dropout=0"]
    _, metrics = train("recipe.yaml", [*overrides, "train.max_steps=2", "train.report_to=[]"], log=lambda line: None)
    adapter = read_adapter("adapters/crates")
    assert {lora.rank for lora in adapter.modules.values()} == {8} and "model.embed_tokens" in adapter.modules
    assert main(["eval", "--adapter", "adapters/crates", "--data", "valid.jsonl", "--format", "instruction",
                 "--max-seq-len", "128", "--json"]) == 0  # fmt: skip
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["adapter"]["eval_loss"] == pytest.approx(metrics["eval_loss"], abs=2e-3)


def test_resume_at_the_last_step_never_takes_an_earlier_runs_adapter_for_its_own(workdir, monkeypatch):
    """Killed between its last checkpoint and its adapter (in the final evaluation, say), an `output.overwrite` run
    whose adapter directory still holds an earlier run's adapter: --resume must write this run's adapter (it used
    to say "the run had finished" and hand back the earlier one), with the last step's metrics in its manifest."""
    from finetune.manifest import read_manifest
    from finetune.training import loop

    overrides = ["train.max_steps=3", "train.save_every_steps=3", "output.overwrite=true"]
    train("recipe.yaml", overrides)  # the earlier run, at lr 0.005
    earlier = load_file("adapters/crates/adapter_model.safetensors")
    expected_run, expected_metrics = train("recipe.yaml", [*overrides, "train.lr=0.001", "output.name=whole"])

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as if killed after the step-3 checkpoint, before the adapter was renamed in

    with monkeypatch.context() as patched:
        patched.setattr(loop, "finish_run", killed)
        with pytest.raises(KeyboardInterrupt):
            train("recipe.yaml", [*overrides, "train.lr=0.001"])
    _, metrics = train("recipe.yaml", [*overrides, "train.lr=0.001"], resume=True)
    actual = load_file("adapters/crates/adapter_model.safetensors")
    assert any(not torch.equal(earlier[name], actual[name]) for name in earlier)
    expected = load_file(expected_run / "adapter_model.safetensors")
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    assert read_manifest(Path("adapters/crates")).recipe["train"]["lr"] == 0.001
    for key in ("loss", "lr", "grad_norm", "epoch", "tokens_seen"):
        assert metrics[key] == expected_metrics[key], key
    # and once it is written, --resume again says so and hands back that very adapter
    again, _ = train("recipe.yaml", [*overrides, "train.lr=0.001"], resume=True)
    assert torch.equal(load_file(again / "adapter_model.safetensors")[name], actual[name])


def test_a_resumed_runs_first_throughput_counts_only_the_tokens_it_trained(tmp_path):
    """metrics.jsonl's tokens_per_s after --resume: the first write used to divide every token seen since step 0
    (the checkpoint's tokens_seen) by the seconds since the resume."""
    from finetune.training.progress import TrainingLog

    log = TrainingLog(tmp_path, total_steps=6, first_step=4, first_tokens_seen=4000, log_every_steps=1,
                      say=lambda line: None, show_bar=False)  # fmt: skip
    log(5, {"loss": 1.0, "lr": 0.1, "epoch": 0.1, "tokens_seen": 5000, "grad_norm": 1.0, "elapsed_s": 2.0})
    log.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["tokens_per_s"] == pytest.approx(500.0)


def test_throughput_leaves_out_evaluations_and_checkpoints(workdir, monkeypatch):
    """Each evaluation and checkpoint moves the loop's clock on by 1000 s; the steps' clock (step_s, and
    tokens_per_s with it) must not count them. It did: with an evaluation every logged step, every logged
    throughput counted one. (A clock moved on rather than a sleep: the real steps take 0.1-5 s on a loaded machine.)"""
    from finetune.training import loop
    from finetune.training.run import TrainingRun

    class Clock:
        offset = 0.0

        def perf_counter(self) -> float:
            return time.perf_counter() + self.offset

        def __getattr__(self, name: str):
            return getattr(time, name)

    clock = Clock()
    monkeypatch.setattr(loop, "time", clock)

    def slowed(real):
        def slow(self):
            clock.offset += 1000.0
            return real(self)

        return slow

    for name in ("evaluate", "save_checkpoint"):
        monkeypatch.setattr(TrainingRun, name, slowed(getattr(TrainingRun, name)))
    seen: list[dict] = []
    overrides = ["train.max_steps=4", "train.eval_every_steps=1", "train.save_every_steps=1", "train.log_every_steps=1"]
    train("recipe.yaml", overrides, log=lambda line: None, on_step=lambda step, metrics: seen.append(metrics))
    assert len(seen) == 4 and "eval_loss" in seen[0]  # the evaluations and checkpoints did run
    assert all(metrics["step_s"] < 1000 for metrics in seen), [metrics["step_s"] for metrics in seen]
    records = [json.loads(line) for line in (workdir / "runs" / "crates" / "metrics.jsonl").read_text().splitlines()]
    logged = [record for record in records if "tokens_per_s" in record]
    for before, after in zip(logged, logged[1:]):
        assert after["tokens_per_s"] > (after["tokens_seen"] - before["tokens_seen"]) / 1000, logged


def test_a_run_resumed_at_its_last_step_logs_its_final_evaluation_once(tmp_path):
    """The final evaluation comes after the last checkpoint: a run killed after it (before its adapter was written)
    evaluates again on --resume, and metrics.jsonl kept both records of it."""
    from finetune.training.progress import TrainingLog

    path = tmp_path / "metrics.jsonl"
    records = [{"step": 3, "loss": 1.0}, {"step": 3, "eval_loss": 2.0, "eval_ppl": 7.4}]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    log = TrainingLog(tmp_path, total_steps=3, first_step=3, log_every_steps=1, say=lambda line: None, show_bar=False)
    log.log_eval(3, {"eval_loss": 2.0, "eval_ppl": 7.4})
    log.close()
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert written == records


def test_a_full_disk_under_metrics_jsonl_is_one_output_error(tmp_path):
    """metrics.jsonl is appended to at every logged step, outside any staging directory: a full disk there ended
    `finetune train` with OSError's traceback and exit 1. /dev/full is a real file that is always full."""
    from finetune.errors import OutputError
    from finetune.training.progress import TrainingLog

    log = TrainingLog(tmp_path, total_steps=3, first_step=0, log_every_steps=1, say=lambda line: None, show_bar=False)
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # after the log is open: reading /dev/full never ends
    with pytest.raises(OutputError, match=r"metrics.jsonl: No space left on device; free disk space") as caught:
        log.log_eval(1, {"eval_loss": 2.0, "eval_ppl": 7.4})
    log.close()
    assert "\n" not in str(caught.value)


def test_a_callback_that_changes_its_metrics_changes_nothing_of_the_run(workdir):
    """`on_step` got the loop's own dict, the one kept as the run's last metrics: a callback that cleared it (or
    added its own keys) left an adapter whose manifest, checkpoint and `TrainResult.metrics` had no loss."""
    seen: list[int] = []

    def meddle(step: int, metrics: dict) -> None:
        seen.append(step)
        metrics.clear()
        metrics["mine"] = 1.0

    result = train("recipe.yaml", ["train.max_steps=2", "train.log_every_steps=1"], log=lambda line: None,
                   on_step=meddle)  # fmt: skip
    assert seen == [1, 2]
    records = [json.loads(line) for line in (workdir / "runs" / "crates" / "metrics.jsonl").read_text().splitlines()]
    last_train = [record for record in records if "loss" in record][-1]
    manifest = json.loads((result.adapter_dir / "manifest.json").read_text())
    for metrics in (result.metrics, manifest["metrics"]):
        assert "mine" not in metrics and metrics["loss"] == last_train["loss"]
        assert metrics["grad_norm"] == last_train["grad_norm"]


def test_an_evaluation_line_starts_a_line_of_its_own_under_the_progress_bar(tmp_path, capsys):
    """With the bar drawn (a terminal), the evaluation's line was printed where the bar's text ended, one line
    holding both: `| 2/4 [00:01<00:01, 1.2step/s]step 2: eval loss ...`."""
    import sys

    from finetune.training.progress import TrainingLog

    log = TrainingLog(tmp_path, total_steps=4, first_step=0, log_every_steps=1, show_bar=True,
                      say=lambda line: print(line, file=sys.stderr))  # fmt: skip
    for step in (1, 2):
        metrics = {"loss": 1.0, "lr": 0.1, "epoch": 0.1, "tokens_seen": 100 * step, "grad_norm": 1.0}
        log(step, {**metrics, "elapsed_s": float(step), **({"eval_loss": 2.0, "eval_ppl": 7.4} if step == 2 else {})})
    log.close()
    console = capsys.readouterr().err
    assert "step 2: eval loss 2.0000" in console
    before = console[: console.index("step 2: eval loss")]
    # what precedes it on its line: nothing, or the blanks with which the bar was cleared
    assert before.rstrip("\r").rsplit("\r", 1)[-1].rsplit("\n", 1)[-1].strip() == "", repr(before[-120:])


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_the_log_counts_a_quantized_base_s_parameters_as_the_dense_base_s(tiny_base_dir, bits):
    """A bitsandbytes 4-bit weight packs two weights in each byte its storage counts: the log of a QLoRA run gave
    the base about 60% of its parameters, and the trainable share was inflated accordingly."""
    pytest.importorskip("bitsandbytes")
    from finetune.model import describe_trainable, load_base, wrap_with_lora
    from finetune.quantization import Quantization

    lora = LoraConfig(r=4)
    dense, _, _ = load_base(str(tiny_base_dir))
    quantized, _, _ = load_base(str(tiny_base_dir), quantization=Quantization(bits))  # type: ignore[arg-type]
    assert describe_trainable(wrap_with_lora(quantized, lora)) == describe_trainable(wrap_with_lora(dense, lora))


@pytest.mark.parametrize("lora", [dict(init="olora", train_lm_head=True, target_modules=["q_proj"]),
                                  dict(init="pissa", target_modules=["q_proj", "lm_head"])])  # fmt: skip
def test_pissa_or_olora_on_a_head_tied_to_the_embeddings_is_refused(tiny_base_dir, lora):
    """PiSSA/OLoRA rewrite the weight of each layer they adapt; the tiny base's head is its embeddings' weight, so
    the run trained on rewritten embeddings that the written adapter (an update of the head) does not carry: an
    OLoRA run's adapter, re-evaluated, measured loss 14.3 where the run had reported 10.0. Refused before peft
    rewrites anything."""
    from transformers import AutoModelForCausalLM

    from finetune.model import wrap_with_lora

    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    before = model.lm_head.weight.detach().clone()
    with pytest.raises(ModelError, match=r"lora.init (olora|pissa) rewrites .* shares its weight with the input emb"):
        wrap_with_lora(model, LoraConfig(**lora))
    assert torch.equal(model.lm_head.weight, before)


@pytest.mark.parametrize("lora", [dict(target_modules=["q_proj"], exclude_modules=["q_proj"]),
                                  dict(exclude_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                        "down_proj"])])  # fmt: skip
def test_exclude_modules_that_leave_nothing_to_adapt_is_a_one_line_error(tiny_base_dir, lora):
    """Every targeted module excluded: peft's NoMatchingPeftModuleError came out of `finetune train` as a traceback
    (exit 1) once the base had loaded; now a ModelError naming both keys (one line, exit 2)."""
    from transformers import AutoModelForCausalLM

    from finetune.model import wrap_with_lora

    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir)
    with pytest.raises(ModelError, match=r"lora.exclude_modules \[.*q_proj.*\] takes out every module of lora.target"):
        wrap_with_lora(model, LoraConfig(**lora))

"""GRPO: settings, reward functions as trl calls them, batched sampling, advantages, the loss against trl's
GRPOTrainer, and a short run through the CLI (a reward function that fails stops it with one line).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grpo_helpers import write_grpo_run, write_rewards
from helpers import LIBRARY_ULPS, REORDERED_ULPS, REPO, assert_within_ulps, greedy_ids

from finetune.errors import RecipeError
from finetune.generation.sample import SampleSettings, sample_completions
from finetune.recipe import load_recipe
from finetune.training.objectives.grpo import advantages_of, nanstd
from finetune.training.objectives.grpo_loss import LossScale, LossSettings, loss_sum, per_token_loss
from finetune.training.rewards import RewardError, TrainerState, load_reward_functions, score

GRPO_OVERRIDES = ["train.objective=grpo", "data.format=prompt"]


def _recipe_file(tmp_path: Path, base_dir: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"model:\n  base: {base_dir}\ndata:\n  train: prompts.jsonl\n  format: prompt\noutput:\n  name: grpo-test\n"
    )
    return path


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([], "grpo needs train.reward_functions"),
        (["train.reward_functions=[a.py:f]", "train.reward_weights=[1.0,2.0]"], "2 values for 1 reward functions"),
        (["train.reward_functions=[a.py:f]", "train.num_generations=1"], "num_generations"),
        (["train.objective=sft"], "data.format prompt needs objective grpo"),
        (["train.objective=dpo", "data.format=preference", "train.num_generations=4"], "num_generations applies to"),
        (["train.reward_functions=[a.py:f]", "train.reward_weights=[.nan]"], "should be a finite number"),
        (["train.reward_functions=[a.py:f]", "train.reward_weights=[1.0e+40]"], "give weights of at most 1e6"),
        (["train.reward_functions=[a.py:f]", "train.temperature=.inf"], "should be a finite number"),
    ],
    ids=[
        "no-rewards",
        "weights",
        "one-generation",
        "prompt-with-sft",
        "setting-of-another-objective",
        "nan-weight",
        "huge-weight",
        "infinite-temperature",
    ],
)
def test_recipe_refuses(tmp_path, tiny_base_dir, overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(_recipe_file(tmp_path, tiny_base_dir), [*GRPO_OVERRIDES, *overrides])


def test_recipe_defaults_are_trls(tmp_path, tiny_base_dir):
    train = load_recipe(_recipe_file(tmp_path, tiny_base_dir), [*GRPO_OVERRIDES, "train.reward_functions=[a.py:f]",
                                                               "train.scale_rewards=false"]).train  # fmt: skip
    assert (train.loss_type, train.beta, train.epsilon, train.epsilon_high) == ("dapo", 0.0, 0.2, 0.2)
    assert (train.num_generations, train.num_iterations, train.scale_rewards) == (8, 1, "none")


def _score(entries: list[str]) -> torch.Tensor:
    functions = load_reward_functions(entries)
    completions = ["4", "5"]
    columns = {"answer": ["4", "4"]}
    return score(functions, ["2+2=", "2+2="], completions, [[1], [2]], columns, TrainerState(0, 1, 0.0),
                 ["record 1", "record 1"])  # fmt: skip


def test_reward_functions_called_as_trl_calls_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_rewards(tmp_path)
    scores = _score(["rewards.py:good", "exact_match(column=answer)", "regex(pattern='^4$')", "length(target=2)",
                     "rewards.py:maybe"])  # fmt: skip
    expected = torch.tensor([[1.0, 1.0, 1.0, -0.5, float("nan")], [0.0, 0.0, 0.0, -0.5, float("nan")]])
    torch.testing.assert_close(scores, expected, equal_nan=True)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("rewards.py:raises", r"reward function rewards.py:raises raised ValueError: no answer column \(on a batch"),
        ("rewards.py:short", "returned 1 values for 2 completions"),
        ("rewards.py:scalar", "returned a Tensor for 2 completions"),
        ("rewards.py:exits", r"reward function rewards.py:exits raised SystemExit: 3 \(on a batch"),
        ("rewards.py:words", "returned 'high' for a completion of record 1"),
        ("rewards.py:missing", "defines no function 'missing'"),
        ("nofile.py:f", "no file nofile.py"),
        ("bogus", "neither `path/to/file.py:function` nor a built-in"),
        ("rewards.py:huge", "returned 1e\\+300 .* beyond float32's range"),
        ("regex(pattern='[')", "unterminated character set .*fix the argument"),
        ("exact_match(colum=answer)", "exact_match takes no argument colum; it takes column"),
        ("length(target=0)", "length's target must be a whole number"),
    ],
    ids=[
        "raises",
        "count",
        "scalar-tensor",
        "sys-exit",
        "not-a-number",
        "no-function",
        "no-file",
        "unknown",
        "beyond-float32",
        "bad-pattern",
        "unknown-argument",
        "zero-target",
    ],
)
def test_reward_function_errors_name_it(tmp_path, monkeypatch, entry, message):
    monkeypatch.chdir(tmp_path)
    write_rewards(tmp_path)
    with pytest.raises(RewardError, match=message):
        _score([entry])


def test_a_reward_functions_error_of_several_lines_is_told_in_one(tmp_path, monkeypatch):
    """The CLI prints a RewardError as one `error:` line: an exception message of several lines (numpy's, an
    assertion's) or a file whose import fails so was printed over several, the last of them not the error's."""
    monkeypatch.chdir(tmp_path)
    write_rewards(tmp_path)
    with pytest.raises(RewardError) as raised:
        _score(["rewards.py:lines"])
    assert "\n" not in str(raised.value) and "raised ValueError: shapes differ (on a batch" in str(raised.value)
    (tmp_path / "broken.py").write_text("raise ImportError('no backend\\ninstall one of: a, b')\n")
    with pytest.raises(RewardError) as raised:
        load_reward_functions(["broken.py:f"])
    assert "\n" not in str(raised.value) and str(raised.value).endswith("raised ImportError: no backend")


def test_a_numpy_array_of_rewards_is_taken_as_trl_takes_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_rewards(tmp_path)
    torch.testing.assert_close(_score(["rewards.py:array"]), torch.tensor([[0.0], [0.5]]))


def test_an_async_reward_function_is_awaited_as_trl_awaits_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text(
        "async def good(prompts, completions, answer, **kwargs):\n"
        "    return [float(c == a) for c, a in zip(completions, answer)]\n"
    )
    torch.testing.assert_close(_score(["rewards.py:good"]), torch.tensor([[1.0], [0.0]]))


def test_a_reward_file_imports_the_modules_beside_it(tmp_path, monkeypatch):
    """As when it runs as a script: reward code split into a helper module next to it was ModuleNotFoundError."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "scoring_helpers_x.py").write_text("def half(text):\n    return len(text) / 2\n")
    (tmp_path / "code" / "rw.py").write_text(
        "from scoring_helpers_x import half\n"
        "def score(prompts, completions, **kwargs):\n    return [half(c) for c in completions]\n"
    )
    (function,) = load_reward_functions(["code/rw.py:score"])
    assert function.function(prompts=["p"], completions=["abcd"]) == [2.0]


def test_a_quoted_regex_is_taken_as_written_escapes_included():
    """`\\b` is a word boundary (a Python literal would make it a backspace), and the GSM8K recipe's pattern
    loads without leaning on Python's deprecated invalid escapes (`\\s`, `\\S`)."""
    import warnings

    import yaml

    (boundary,) = load_reward_functions([r'regex(pattern="\bfoo\b")'])
    assert boundary.function(completions=["a foo b", "afoob"]) == [1.0, 0.0]
    recipe = yaml.safe_load((REPO / "recipes" / "qwen3-4b-base-grpo-gsm8k.yaml").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        form, _ = load_reward_functions(recipe["train"]["reward_functions"])
    assert form.function(completions=["<think>4 + 4</think> 8", "8"]) == [1.0, 0.0]


def test_every_column_of_the_steps_records_reaches_the_reward_functions():
    """A record without `answer` first in the batch does not hide the others' (trl's `datasets` table has every
    column, None where a record lacks it)."""
    from finetune.training.objectives.grpo import reward_columns

    records = [{"prompt": "a", "note": 1}, {"prompt": "b", "answer": "3"}]
    assert reward_columns(records, 2) == {"note": [1, 1, None, None], "answer": [None, None, "3", "3"]}


def test_a_bad_reward_function_fails_validate_and_train_before_the_model_loads(
    tmp_path, tiny_base_dir, capsys, monkeypatch
):
    """`finetune validate` loads the recipe's reward functions; `finetune train` does before anything else."""
    from finetune.cli import main

    monkeypatch.chdir(tmp_path)
    recipe = write_grpo_run(tmp_path, tiny_base_dir, "nofile.py:f")
    for variables in ("CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR"):  # --cpu sets them; put back after the test
        monkeypatch.setenv(variables, os.environ.get(variables, ""))
    for command in (["validate"], ["train"], ["train", "--nproc", "2", "--cpu"]):  # the last before any rank starts
        assert main([*command, str(recipe)]) == 2
        assert "no file nofile.py" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_long_prompt_is_cut_from_its_start_keeping_bos_and_what_the_completion_continues_from(tiny_tokenizer):
    """As trl cuts GRPO prompts (from the left): an instruction's end, `### Response:`, stays."""
    from finetune.data.prompts import encode_prompt_records
    from finetune.recipe import DataConfig

    prompt = "amber violet teal ochre " * 12 + "### Response:"
    whole = [tiny_tokenizer.bos_token_id, *tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    config = DataConfig(train="x.jsonl", format="prompt", max_seq_len=12, overlength="truncate")
    (row,) = encode_prompt_records([{"prompt": prompt}], config, tiny_tokenizer, lambda i: f"record {i + 1}")
    assert len(whole) > 12 and row.row["input_ids"] == [whole[0], *whole[-11:]]
    assert tiny_tokenizer.decode(row.row["input_ids"][1:]).endswith("### Response:")


def test_advantages_as_trl_computes_them():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, float("nan"), 2.0])
    advantages, std = advantages_of(rewards, 4, "group")
    first = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-4)
    torch.testing.assert_close(advantages[:4], first)
    torch.testing.assert_close(advantages[4:], torch.zeros(4))  # equal rewards; NaN -> 0
    assert std[0] == pytest.approx(0.5) and std[4] == 0.0
    batch, _ = advantages_of(rewards[:4], 4, "none")
    torch.testing.assert_close(batch, torch.tensor([0.75, -0.25, -0.25, -0.25]))
    assert float(nanstd(rewards)) == pytest.approx(float(rewards[~rewards.isnan()].std()))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_and_zero_std_groups_of_sparse_rewards_are_trls(scale):
    """Groups where no completion, one, some or all were scored (None is NaN): advantages and the share of
    completions whose std is zero (`frac_reward_zero_std`) as trl 1.16 computes them, with trl's own `nanstd`.
    A group with fewer than two scored completions has no std in trl (NaN, not zero); it was counted as zero."""
    from trl.trainer.utils import nanstd as trls_nanstd

    nan = float("nan")
    rewards = torch.tensor([1.0, nan, nan, nan, nan, nan, nan, nan, 1.0, 2.0, 3.0, nan, 5.0, 5.0, 5.0, 5.0])
    groups = rewards.view(-1, 4)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(4)
    if scale == "batch":
        std = trls_nanstd(rewards).expand_as(rewards)
    else:
        std = trls_nanstd(groups, dim=1).repeat_interleave(4)
    expected = rewards - mean if scale == "none" else (rewards - mean) / (std + 1e-4)
    advantages, ours = advantages_of(rewards, 4, scale)
    torch.testing.assert_close(advantages, torch.nan_to_num(expected, nan=0.0))
    assert torch.equal(torch.isclose(ours, torch.zeros_like(ours)), torch.isclose(std, torch.zeros_like(std)))


def test_greedy_sampling_equals_decoding_each_prompt_alone(tiny_base_dir, tiny_tokenizer):
    """All prompts in one left-padded batch with a KV cache (in place, with room), a repeated prompt sharing
    its prefill, rows leaving as they stop: each row's tokens are those of a full forward per token on that
    prompt alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir)
    texts = ["def add(a, b):", "for i in", "x", "for i in"]
    prompts = [tiny_tokenizer(text)["input_ids"] for text in texts]
    model.train()
    alone = SampleSettings(12, temperature=0.0)
    got = sample_completions(model, prompts, alone, stop_ids={tiny_tokenizer.eos_token_id}, pad_token_id=0)
    assert model.training, "the model's mode is restored"
    model.eval()
    assert got == [greedy_ids(model, prompt, 12, tiny_tokenizer.eos_token_id) for prompt in prompts]
    stop = got[1][4]  # a token the second row writes at its fifth step: rows stop at different steps
    cut = [tokens[: tokens.index(stop) + 1] if stop in tokens else tokens for tokens in got]
    assert len({len(tokens) for tokens in cut}) > 1
    assert sample_completions(model, prompts, alone, stop_ids={stop}, pad_token_id=0) == cut


def test_draws_follow_the_filtered_distribution_and_a_seed_repeats_them():
    """One uniform number per row, inverted through the cumulative distribution: token frequencies over
    40,000 rows are the softmax's (within 4 standard errors), top-k and top-p never draw a filtered-out token,
    and the same seed gives the same tokens."""
    from finetune.generation.sample import draw, filtered_scores

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(40_000, 1)
    for settings in (SampleSettings(1, 1.0), SampleSettings(1, 0.7, top_k=3), SampleSettings(1, 1.3, top_p=0.8)):
        expected = filtered_scores(logits[:1], settings).softmax(-1)[0]
        torch.manual_seed(0)
        drawn = draw(logits, settings)
        frequencies = torch.bincount(drawn, minlength=6).double() / len(drawn)
        error = (expected.double() * (1 - expected.double()) / len(drawn)).sqrt()
        assert ((frequencies - expected.double()).abs() <= 4 * error + 1e-12).all(), (settings, frequencies)
        assert (frequencies[expected == 0] == 0).all()
        torch.manual_seed(0)
        assert torch.equal(draw(logits, settings), drawn)


def _trl_loss(loss_type: str, beta: float, iterations: int) -> tuple[float, float]:
    """trl's token-level formulas written out on padded (B, T) tensors (GRPOTrainer._compute_loss)."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    logps = torch.randn(3, 4) * 0.5 - 1
    old = logps + (torch.randn(3, 4) * 0.3 if iterations > 1 else 0)
    ref = logps + torch.randn(3, 4) * 0.2
    advantages = torch.tensor([1.0, -0.5, 0.25])
    coef = torch.exp(logps - old)
    loss = -torch.min(coef * advantages[:, None], coef.clamp(0.8, 1.28) * advantages[:, None])
    if beta:
        loss = loss + beta * (torch.exp(ref - logps) - (ref - logps) - 1) * coef  # use_bias_correction_kl
    if loss_type == "grpo":
        expected = ((loss * mask).sum(-1) / mask.sum(-1)).mean()
    elif loss_type == "bnpo":
        expected = (loss * mask).sum() / mask.sum()
    elif loss_type == "dr_grpo":
        expected = (loss * mask).sum() / (3 * 6)
    else:
        expected = (loss * mask).sum() / mask.sum()
    flat = mask.bool()
    owner = torch.arange(3)[:, None].expand(3, 4)[flat]
    settings = LossSettings(loss_type, 0.2, 0.28, beta, 6)
    tokens, _ = per_token_loss(logps[flat], old[flat], ref[flat], advantages[owner], settings)
    scale = LossScale(3, torch.tensor(3.0), mask.sum())
    ours = loss_sum(tokens, torch.ones_like(tokens), owner, settings, scale) / 3
    return float(ours), float(expected)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize(("beta", "iterations"), [(0.0, 1), (0.04, 1), (0.0, 2), (0.04, 3)])
def test_loss_averages_as_trl_defines_them(loss_type, beta, iterations):
    ours, expected = _trl_loss(loss_type, beta, iterations)
    assert_within_ulps(ours, expected, LIBRARY_ULPS, what=loss_type)  # trl's op order, float32


def test_the_kl_metric_is_trls_importance_weighted_one():
    """trl 1.16 logs `kl` as the masked mean of the per-token KL it adds to the loss, weighted by the importance
    ratio (`use_bias_correction_kl`); after the first step of a `num_iterations` group the ratio is not 1, and the
    unweighted KL was logged instead."""
    torch.manual_seed(0)
    logps = torch.randn(6) * 0.5 - 1
    old, ref = logps + torch.randn(6) * 0.3, logps + torch.randn(6) * 0.2
    _, parts = per_token_loss(logps, old, ref, torch.ones(6), LossSettings("dapo", 0.2, 0.2, 0.04, 6))
    trls = (torch.exp(ref - logps) - (ref - logps) - 1) * torch.exp(logps - old)
    torch.testing.assert_close(parts["kl"], trls)


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    import os

    env.update({k: v for k, v in os.environ.items() if k.startswith(("HF_", "FINETUNE_", "TRANSFORMERS_"))})
    return subprocess.run([sys.executable, "-m", "finetune", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_completions_no_function_rewards_are_said_once_in_a_warning_line(tmp_path, tiny_base_dir, capsys, monkeypatch):
    """A reward that returns None for everything trains nothing (advantage 0, as in trl): `finetune train` says
    so in one `warning:` line, once, and the run still ends as trl's would."""
    from finetune.cli import main

    monkeypatch.chdir(tmp_path)
    recipe = write_grpo_run(tmp_path, tiny_base_dir, "rewards.py:maybe")
    assert main(["train", str(recipe), "train.max_steps=2", "data.validation=null"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "got None from every reward function" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: 8 of 8 completions of a step"), warned


@pytest.mark.slow
def test_a_run_through_the_cli_reports_rewards_and_a_failing_reward_stops_it(tmp_path, tiny_base_dir):
    recipe = write_grpo_run(tmp_path, tiny_base_dir, "lengths.py:short")
    done = _cli(tmp_path, "train", str(recipe))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in (tmp_path / "runs" / "grpo-run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward" in line]
    assert len(steps) >= 3 and all(-1.0 <= line["reward"] <= 0.0 for line in steps)
    assert {"generate_s", "reward_s", "completion_length", "clip_ratio", "entropy"} <= steps[0].keys()
    assert all(0 < line["generate_s"] + line["reward_s"] < line["step_s"] for line in steps)  # seconds of the step
    assert (tmp_path / "adapters" / "grpo-run" / "adapter_model.safetensors").exists()
    _merges_as_plain_peft_and_subtracts_exactly(tiny_base_dir, tmp_path / "adapters" / "grpo-run")

    # Refined from that adapter with β > 0, the reference is the adapter the run starts from (trl's frozen "ref"
    # copy), not the base: the first step's policy is its reference (KL 0 without dropout), and only the updates
    # move it away.
    refined = _cli(tmp_path, "train", str(recipe), "lora.init_from=adapters/grpo-run", "train.beta=0.04",
                   "lora.dropout=0.0", "output.name=grpo-refined")  # fmt: skip
    assert refined.returncode == 0, refined.stderr[-2000:]
    lines = (tmp_path / "runs" / "grpo-refined" / "metrics.jsonl").read_text().splitlines()
    kl = [json.loads(line)["kl"] for line in lines if "kl" in json.loads(line)]
    assert len(kl) == 3 and abs(kl[0]) < 1e-7 and kl[2] > 1e-6, kl

    failing = write_grpo_run(tmp_path, tiny_base_dir, "rewards.py:raises")
    (tmp_path / "grpo-fail.yaml").write_text(failing.read_text().replace("name: grpo-run", "name: grpo-fail"))
    broken = _cli(tmp_path, "train", "grpo-fail.yaml")
    assert broken.returncode == 2, broken.stderr[-2000:]
    last = broken.stderr.strip().splitlines()[-1]
    assert "reward function rewards.py:raises raised ValueError: no answer column" in last
    assert not (tmp_path / "adapters" / "grpo-fail").exists()


def _merges_as_plain_peft_and_subtracts_exactly(base_dir: Path, adapter_dir: Path) -> None:
    """A GRPO adapter is an adapter like any other: merged in memory it computes what plain peft's merge
    computes, and subtracted it leaves the base bit for bit."""
    from helpers import assert_tensors_equal
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import finetune

    m = finetune.load_model(str(base_dir), {"grpo": str(adapter_dir)}, dtype="float32")
    base = {name: tensor.clone() for name, tensor in m.model.state_dict().items()}
    m.merge("grpo")
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(adapter_dir))
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45]])
    with torch.no_grad():
        merged, expected = m.model(input_ids=ids).logits, reference.merge_and_unload()(input_ids=ids).logits
    assert not torch.equal(merged, AutoModelForCausalLM.from_pretrained(base_dir)(input_ids=ids).logits)
    assert_within_ulps(merged, expected, REORDERED_ULPS)  # W + s·B·A merged by peft and by finetune
    m.subtract("grpo")
    assert_tensors_equal(base, m.model.state_dict())


def _lora_model(base_dir: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_the_starting_adapter_as_reference_is_trls_ref_copy_and_the_weights_come_back_bit_for_bit(
    tiny_base_dir, tiny_tokenizer
):
    """β > 0 from `lora.init_from`: π_ref is scored with the starting weights swapped into the trained parameters.
    It equals what trl scores with its frozen "ref" adapter (a peft copy of the starting adapter, made active),
    and afterwards the trained weights are exactly what they were."""
    from finetune.training.objectives.base import CollateOptions, Models
    from finetune.training.objectives.grpo import GRPO, GRPOSettings
    from finetune.training.objectives.reference import StartingWeights

    model = _lora_model(tiny_base_dir)
    settings = GRPOSettings(2, SampleSettings(8), LossSettings("dapo", 0.2, 0.2, 0.04, 8), 1, "group", False, (1.0,))
    objective = GRPO(CollateOptions(tiny_tokenizer.pad_token_id, packing=True), settings, tiny_tokenizer, [])
    objective.starting_weights = StartingWeights(model)
    model.add_adapter("ref", model.peft_config["default"])  # trl's copy, for comparison only
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".ref." in name:
                parameter.copy_(model.get_parameter(name.replace(".ref.", ".default.")))
        for name, parameter in model.named_parameters():  # training moves the adapter
            if ".default." in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if ".default." in name}
    state = objective._sequences([[1, 40, 41], [1, 42]], [[43, 44, 45], [46, 47]], [False, False], torch.device("cpu"))
    model.eval()
    objective._score_policies(Models(model, model, None), [state])
    with torch.no_grad():
        policy = objective.token_logps(model, state)[0]
        model.set_adapter("ref")
        trls = objective.token_logps(model, state)[0]
        model.set_adapter("default")
    assert not torch.allclose(policy, trls, atol=1e-3)  # the start and the trained adapter differ
    assert_within_ulps(state["ref_logps"], trls, REORDERED_ULPS)  # same weights, batched otherwise
    now = {name: p.detach() for name, p in model.named_parameters() if ".default." in name}
    assert all(torch.equal(now[name], trained[name]) for name in trained)


@pytest.mark.parametrize(
    ("loss_type", "beta", "iterations"),
    [("dapo", 0.0, 1), ("grpo", 0.0, 1), ("grpo", 0.04, 1), ("bnpo", 0.0, 2), ("dr_grpo", 0.04, 3), ("dapo", 0.04, 2)],
)
def test_loss_and_gradients_equal_trls(tmp_path, tiny_base_dir, tiny_tokenizer, loss_type, beta, iterations):
    """The same prompts, completions, advantages, π_old and π_ref through trl 1.16's GRPOTrainer._compute_loss
    and through ours: loss and LoRA gradients within LIBRARY_ULPS (clipping active: π_old differs from π)."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from finetune.training.objectives.base import CollateOptions, Models
    from finetune.training.objectives.grpo import GRPO, GRPOSettings

    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    prompts = [tiny_tokenizer(text)["input_ids"][:5] for text in ["def add(a, b):", "for item in range(3):"]]
    assert all(len(p) == 5 for p in prompts), "equal prompt lengths: trl passes no position ids"
    completions = [[40, 41, 42, eos], [43, 44], [45, 46, 47, 48, 49, 50], [51, eos]]
    prompt_of = [0, 0, 1, 1]
    advantages = torch.tensor([0.9, -0.9, 0.5, -0.5])
    width = max(len(c) for c in completions)
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    generator = torch.Generator().manual_seed(1)
    old = torch.randn(4, width, generator=generator) * 0.3 - 4.0
    ref = torch.randn(4, width, generator=generator) * 0.3 - 4.0

    theirs = _lora_model(tiny_base_dir)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, loss_type=loss_type, beta=beta, num_iterations=iterations, epsilon_high=0.28,
        temperature=0.7, report_to=[], use_cpu=True, bf16=False, logging_steps=1,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=theirs, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * 4), processing_class=tiny_tokenizer,
    )  # fmt: skip
    inputs = {
        "prompt_ids": torch.tensor([prompts[i] for i in prompt_of]),
        "prompt_mask": torch.ones(4, 5, dtype=torch.long),
        "completion_ids": torch.tensor([c + [pad] * (width - len(c)) for c in completions]),
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": mask.sum(),
    }
    if iterations > 1:
        inputs["old_per_token_logps"] = old
    if beta:
        inputs["ref_per_token_logps"] = ref
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the Trainer's loop, which this call skips
    expected = trainer._compute_loss(trainer.model, inputs)
    expected.backward()

    ours = _lora_model(tiny_base_dir)
    ours.train()
    settings = GRPOSettings(2, SampleSettings(8, temperature=0.7), LossSettings(loss_type, 0.2, 0.28, beta, 8),
                            iterations, "group", False, (1.0,))  # fmt: skip
    objective = GRPO(CollateOptions(pad, packing=True), settings, tiny_tokenizer, [])
    state = objective._sequences([prompts[i] for i in prompt_of], completions, [False] * 4, torch.device("cpu"))
    owner = state["seq/target_sequence"]
    position = torch.cat([torch.arange(len(c)) for c in completions])  # the packer keeps each sequence's order
    order = torch.argsort(owner, stable=True)
    flat_position = torch.empty_like(owner)
    flat_position[order] = position
    if iterations > 1:
        state["old_logps"] = old[owner, flat_position]
    if beta:
        state["ref_logps"] = ref[owner, flat_position]
    count = torch.tensor(4.0, dtype=torch.float64)
    state.update(advantages=advantages, rewards=torch.zeros(4), scores=torch.zeros(4, 0), std=torch.ones(4),
                 step_tokens=mask.sum().double(), step_completions=count, timing=torch.zeros(2))  # fmt: skip
    terms = objective.terms(Models(ours, ours, None), {}, state)
    loss = terms.losses["completions"] / count
    loss.backward()

    assert_within_ulps(loss, expected, LIBRARY_ULPS, what="loss")  # trl's op order
    theirs_grads, our_grads = _lora_grads(theirs), _lora_grads(ours)
    assert our_grads.keys() == theirs_grads.keys() and our_grads
    for name, grad in our_grads.items():
        assert_within_ulps(grad, theirs_grads[name], LIBRARY_ULPS, what=name)


@pytest.mark.slow
@pytest.mark.parametrize(("iterations", "resumed_at"), [(1, 2), (3, 2), (2, 3)])
def test_resume_from_a_checkpoint_gives_the_same_adapter_bit_for_bit(
    tmp_path, tiny_base_dir, monkeypatch, iterations, resumed_at
):
    """What a SIGKILL after step `resumed_at` leaves (that checkpoint, no adapter, no later checkpoint), resumed:
    the sampling RNG travels in the checkpoint, so the later steps draw the same completions and write the same
    adapter; and in the middle of a `num_iterations` group (3 steps from step 1's completions, or 2), the
    checkpoint carries the group's completions, rewards and π_old, which the resumed steps train on again."""
    import shutil

    from safetensors.torch import load_file

    from finetune.training.checkpoint import CARRIED_FILE
    from finetune.training.loop import train
    from finetune.training.run_files import checkpoint_path

    monkeypatch.chdir(tmp_path)
    recipe = write_grpo_run(tmp_path, tiny_base_dir, "lengths.py:short")
    settings = ["train.max_steps=4", "train.save_every_steps=1", "train.keep_checkpoints=4", "train.report_to=[]",
                f"train.num_iterations={iterations}"]  # fmt: skip
    whole, _ = train(recipe, [*settings, "output.name=whole"], log=lambda line: None)
    expected = load_file(whole / "adapter_model.safetensors")
    shutil.rmtree(whole)
    for step in range(resumed_at + 1, 5):
        shutil.rmtree(checkpoint_path(tmp_path / "runs" / "whole", step))
    carried = checkpoint_path(tmp_path / "runs" / "whole", resumed_at) / CARRIED_FILE
    assert carried.is_file() == (resumed_at % iterations != 0)  # only a group's middle carries its completions
    log: list[str] = []
    resumed, _ = train(recipe, [*settings, "output.name=whole"], resume=True, log=log.append)
    assert any(line.startswith("resumed from") and f"step {resumed_at}" in line for line in log), log
    actual = load_file(resumed / "adapter_model.safetensors")
    assert expected.keys() == actual.keys() and all(torch.equal(expected[k], actual[k]) for k in expected)


def test_lean_lora_layers_give_pefts_outputs_bit_for_bit(tiny_base_dir):
    """While sampling, plain LoRA linear layers skip peft's bookkeeping: the logits are peft's exactly, every
    LoRA layer of the model is replaced, and peft's forward is back afterwards."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.generation.lean_lora import lean_lora

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base_dir), config)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(0, 0.05)  # a trained adapter: B is not zero
    ids = torch.randint(3, 100, (3, 9))
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with lean_lora(model) as replaced:
            got = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    layers = sum(1 for module in model.modules() if type(module).__qualname__ == "Linear" and hasattr(module, "lora_A"))
    assert replaced == layers > 0
    assert torch.equal(got, expected) and torch.equal(again, expected)
    assert not any("forward" in module.__dict__ for module in model.modules())
    model.train()  # dropout on: training-mode layers keep peft's forward
    with lean_lora(model) as replaced:
        assert replaced == 0


def _train_noting(tmp_path, base_dir, monkeypatch, rewards: str, source: str, overrides: list[str]) -> list:
    """Train a GRPO run (`finetune train`, in `tmp_path`) whose reward functions are `source`, written as noted.py,
    which append what they saw to noted.jsonl; return its records."""
    from finetune.cli import main

    monkeypatch.chdir(tmp_path)
    recipe = write_grpo_run(tmp_path, base_dir, rewards)
    (tmp_path / "noted.py").write_text(source)
    assert main(["train", str(recipe), *overrides]) == 0
    return [json.loads(line) for line in (tmp_path / "noted.jsonl").read_text().splitlines()]


ONE_STEP_OF_TWO_MICRO_BATCHES = [
    "train.max_steps=1", "train.micro_batch_size=1", "train.grad_accum_steps=2", "data.validation=null"
]  # fmt: skip


def _logged_steps(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "runs" / "grpo-run" / "metrics.jsonl").read_text().splitlines()]


def test_reward_statistics_are_trls_over_the_whole_step(tmp_path, tiny_base_dir, monkeypatch):
    """trl logs `reward_std` as the standard deviation of all the step's rewards and `rewards/<f>` as the mean over
    the completions f scored (nanmean). They were a mean of per-micro-batch deviations (two micro-batches here) and
    a mean that counted each None as 0. The reward functions write down what they returned, to compare with."""
    source = (
        "import json\n"
        "def _note(name, values):\n"
        "    with open('noted.jsonl', 'a') as f:\n        f.write(json.dumps([name, values]) + '\\n')\n"
        "    return values\n"
        "def lengths(prompts, completions, **kwargs):\n    return _note('lengths', [len(c) / 10 for c in completions])\n"
        "def some(prompts, completions, **kwargs):\n"
        "    return _note('some', [None if i % 3 else 1.0 + len(c) / 7 for i, c in enumerate(completions)])\n"
    )
    noted = _train_noting(
        tmp_path, tiny_base_dir, monkeypatch, "noted.py:lengths, noted.py:some", source, ONE_STEP_OF_TWO_MICRO_BATCHES
    )
    lengths = torch.tensor([v for name, values in noted if name == "lengths" for v in values], dtype=torch.float64)
    some = torch.tensor([math.nan if v is None else v for name, values in noted if name == "some" for v in values],
                        dtype=torch.float64)  # fmt: skip
    assert len(lengths) == 8 and 0 < int(torch.isnan(some).sum()) < 8
    rewards = lengths + torch.nan_to_num(some)  # trl: the weighted nansum over the functions
    (step,) = _logged_steps(tmp_path)
    assert step["reward"] == pytest.approx(rewards.mean().item(), rel=1e-6)
    assert step["reward_std"] == pytest.approx(rewards.std().item(), rel=1e-6)
    assert step["rewards/noted.py:some"] == pytest.approx(some.nanmean().item(), rel=1e-6)
    assert step["rewards/noted.py:lengths"] == pytest.approx(lengths.mean().item(), rel=1e-6)


def test_a_completion_no_function_scored_is_left_out_of_the_reward_statistics(tmp_path, tiny_base_dir, monkeypatch):
    """trl 1.16 makes the reward of a completion every function gave None NaN and logs `reward` and `reward_std` as
    the nanmean and nanstd over the step: such a completion is left out. They were counted as a reward of 0, which
    drew `reward` toward 0 (-0.30 for a step whose scored completions averaged -0.60)."""
    source = (
        "import json\n"
        "def some(prompts, completions, **kwargs):\n"
        "    values = [None if i % 2 else -1.0 - len(c) / 7 for i, c in enumerate(completions)]\n"
        "    with open('noted.jsonl', 'a') as f:\n        f.write(json.dumps(['some', values]) + '\\n')\n"
        "    return values\n"
    )
    noted = _train_noting(tmp_path, tiny_base_dir, monkeypatch, "noted.py:some", source, ONE_STEP_OF_TWO_MICRO_BATCHES)
    some = torch.tensor([math.nan if v is None else v for _, values in noted for v in values], dtype=torch.float64)
    assert len(some) == 8 and int(torch.isnan(some).sum()) == 4
    (step,) = _logged_steps(tmp_path)
    scored = some[~torch.isnan(some)]
    assert step["reward"] == pytest.approx(scored.mean().item(), rel=1e-6)
    assert step["reward_std"] == pytest.approx(scored.std().item(), rel=1e-6)


def test_the_reward_std_of_rewards_with_a_large_offset_is_trls(tmp_path, tiny_base_dir, monkeypatch):
    """`reward_std` is the sample deviation of the step's rewards (trl's nanstd, which subtracts the mean first),
    also when the rewards sit far from 0: taken as E[r²] - E[r]² in float32, 10,000 + k/8 rewards were logged
    with a std ten times theirs (or 0, where the difference came out negative)."""
    source = (
        "import json\n"
        "def offset(prompts, completions, **kwargs):\n"
        "    values = [10000.0 + (len(c) % 5) / 8 for c in completions]\n"
        "    with open('noted.jsonl', 'a') as f:\n        f.write(json.dumps(['offset', values]) + '\\n')\n"
        "    return values\n"
    )
    noted = _train_noting(
        tmp_path, tiny_base_dir, monkeypatch, "noted.py:offset", source, ONE_STEP_OF_TWO_MICRO_BATCHES
    )
    rewards = torch.tensor([v for _, values in noted for v in values], dtype=torch.float64)
    assert len(rewards) == 8 and rewards.std() > 0
    (step,) = _logged_steps(tmp_path)
    assert step["reward"] == pytest.approx(rewards.mean().item(), rel=1e-9)
    assert step["reward_std"] == pytest.approx(rewards.std().item(), rel=1e-5)
    assert step["rewards/noted.py:offset"] == pytest.approx(rewards.mean().item(), rel=1e-9)


@pytest.mark.slow
def test_reward_functions_see_the_runs_length_and_epoch_as_trl_passes_them(tmp_path, tiny_base_dir, monkeypatch):
    """`trainer_state.max_steps` and `.epoch`, which reward functions read to shape rewards by progress: a run set
    by `train.epochs` passed max_steps 0 (a division by zero in a curriculum reward) and epoch 0 throughout."""
    source = (
        "import json\n"
        "def noted(prompts, completions, trainer_state, **kwargs):\n"
        "    with open('noted.jsonl', 'a') as f:\n"
        "        f.write(json.dumps([trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch]) + '\\n')\n"
        "    return [0.0 for _ in completions]\n"
    )
    overrides = ["train.max_steps=null", "train.epochs=1", "data.validation=null"]
    seen = _train_noting(tmp_path, tiny_base_dir, monkeypatch, "noted.py:noted", source, overrides)
    assert seen == [[step, 4, step / 4] for step in range(4)]  # 8 prompts, 2 per step


def test_tokens_seen_counts_every_sequence_a_step_trains_on(tmp_path, tiny_base_dir, tiny_tokenizer, monkeypatch):
    """`tokens_seen` (and so `tokens_per_s` and the report's throughput) counts the prompt + completion tokens of
    every sequence the step trained on, as trl's `num_tokens` counts them: each prompt `num_generations` times, and
    each completion's sampled tokens. It had counted each prompt's tokens once and no completion token (18 tokens
    for a step of 8 sequences of about 20), a throughput 5-10x too low. A `num_iterations` step trains on the same
    sequences again and counts them again (trl counts them once, at generation)."""
    source = (
        "import json\n"
        "def lengths(prompts, completions, completion_ids, **kwargs):\n"
        "    with open('noted.jsonl', 'a') as f:\n"
        "        f.write(json.dumps([prompts, [len(ids) for ids in completion_ids]]) + '\\n')\n"
        "    return [float(len(ids)) for ids in completion_ids]\n"
    )
    overrides = [*ONE_STEP_OF_TWO_MICRO_BATCHES, "train.max_steps=2", "train.num_iterations=2"]
    ((prompts, lengths),) = _train_noting(tmp_path, tiny_base_dir, monkeypatch, "noted.py:lengths", source, overrides)
    assert len(prompts) == len(lengths) == 8  # 2 prompts x 4 completions, generated once for both steps
    prompt_tokens = [1 + len(tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]) for prompt in prompts]
    step_tokens = sum(prompt_tokens) + sum(lengths)
    steps = [line for line in _logged_steps(tmp_path) if "tokens_seen" in line]
    assert [line["tokens_seen"] for line in steps] == [step_tokens, 2 * step_tokens]
    assert all(line["tokens_per_s"] == pytest.approx(step_tokens / line["step_s"], rel=1e-6) for line in steps)


@pytest.mark.parametrize("layout", ["rows", "one_sequence", "bucketed_rows"])
def test_a_steps_trained_tokens_are_its_sequences_counted_without_reading_the_device(tiny_tokenizer, layout):
    """Whatever the padding of the layout (bucketed rows pad to 128), the count is the sequences' own tokens, and
    taking it waits for nothing (the loop reads a step's values once per logging interval)."""
    from finetune.training.host_sync import HostSyncDetector
    from finetune.training.objectives.base import CollateOptions
    from finetune.training.objectives.grpo import GRPO, GRPOSettings

    settings = GRPOSettings(2, SampleSettings(8), LossSettings("dapo", 0.2, 0.2, 0.0, 8), 1, "group", False, (1.0,))
    objective = GRPO(CollateOptions(tiny_tokenizer.pad_token_id, True, layout), settings, tiny_tokenizer, [])
    prompts, completions = [[1, 40, 41], [1, 40, 41], [1, 42]], [[50, 51, 2], [52], [53, 54, 55, 56]]
    states = [objective._sequences(prompts[:2], completions[:2], [False] * 2, torch.device("cpu")),
              objective._sequences(prompts[2:], completions[2:], [True], torch.device("cpu"))]  # fmt: skip
    with HostSyncDetector() as detector:
        tokens = objective.trained_tokens(states)
    assert detector.found == [], detector.describe()
    assert int(tokens) == sum(len(p) + len(c) for p, c in zip(prompts, completions)) == 16


@pytest.mark.parametrize("column", ["completions", "prompts", "trainer_state"])
def test_a_column_named_as_a_reward_functions_argument_is_refused_at_loading(
    tmp_path, tiny_base_dir, capsys, monkeypatch, column
):
    """A column reward functions would get twice (its name is one of their own arguments) is refused when the data
    loads, in one line naming the column and the record. It had failed the first step's scoring with a TypeError
    told as the reward function's (`finetune_reward_<digits>.good() got multiple values for keyword argument`)."""
    from finetune.cli import main

    monkeypatch.chdir(tmp_path)
    recipe = write_grpo_run(tmp_path, tiny_base_dir, "rewards.py:good")
    records = [{"prompt": f"def f{i}(a, b):", "answer": str(i), **({column: "x"} if i == 2 else {})} for i in range(8)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    for command in (["data", "preview"], ["train"]):
        assert main([*command, str(recipe)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"error: prompts.jsonl line 3 (record 3): column '{column}' has the name of an"), err
        assert "rename the column" in err[-1] and "reward function rewards.py" not in err[-1]
    assert not (tmp_path / "adapters").exists()


def test_completions_also_stop_at_the_chat_templates_end_of_turn(tmp_path, tiny_base_dir, tiny_tokenizer, monkeypatch):
    """A base tuned with its own template (a Qwen2.5 or Llama 3.1 base) lists the template's end of turn in neither
    EOS: GRPO's completions of chat prompts ran on to max_completion_length. The objective now stops at it."""
    import copy

    from finetune.training.objectives import objective_for

    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.py").write_text("def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_tokens(["<|im_end|>"], special_tokens=True)
    chatml = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
              "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")  # fmt: skip
    recipe = {"model": {"base": str(tiny_base_dir)}, "data": {"train": "prompts.jsonl", "format": "prompt"},
              "train": {"objective": "grpo", "reward_functions": ["r.py:f"]}, "output": {"name": "grpo-test"}}  # fmt: skip
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    assert objective_for(load_recipe(tmp_path / "recipe.yaml"), tokenizer).turn_closers == {tokenizer.eos_token_id}
    recipe["data"]["chat_template"] = chatml
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    closers = objective_for(load_recipe(tmp_path / "recipe.yaml"), tokenizer).turn_closers
    assert closers == {tokenizer.convert_tokens_to_ids("<|im_end|>")} and tokenizer.eos_token_id not in closers

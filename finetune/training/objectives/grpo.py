"""GRPO (Shao et al. 2024, as trl 1.16's GRPOTrainer defines it): generate, score, push toward the better.

Per optimizer step, in `prepare` (no gradient):
1. every prompt of the step's micro-batches is repeated `num_generations` (G) times and all of them are
   sampled in one batch with a KV cache from the LoRA model as it is now, in eval mode (no dropout), without
   a copy of the weights (`finetune.generation.sample`);
2. the reward functions score each completion (`finetune.training.rewards`); the reward is their weighted
   sum (NaN where every function returned None);
3. advantages: A_i = (R_i − mean of its group) / (std + 1e-4), std over the group (`scale_rewards: group`),
   over the whole step on every process (`batch`), or no division (`none`); NaN becomes 0;
4. prompt + completion become sequences scored padding-free (`logprobs.collate_sequences`), their tokens up
   to and including the first stop token; π_old (when each generation is trained `num_iterations` > 1
   times) and π_ref (β > 0: the adapter disabled, or with `lora.init_from` the adapter the run started
   from, swapped in: `reference.MeasuredAgainstStart`) are scored here.

`terms` then scores the completions with gradient at the sampling temperature and returns the clipped
policy-gradient loss (`grpo_loss`). With `num_iterations` μ > 1, one generation serves μ optimizer steps
(the run holds its data position meanwhile, as trl repeats each batch μ times).

Evaluation (`reduce=False`) samples the held-out prompts the same way, each with draws keyed by its record
(the same at every evaluation), and reports their rewards.

Example:
    objective = GRPO(options, settings, tokenizer, load_reward_functions(["reward.py:score"]))
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from finetune.data.labels import IGNORE_INDEX
from finetune.device import to_device
from finetune.errors import RewardWarning
from finetune.generation.sample import SampleSettings, sample_completions
from finetune.prompting import model_stop_token_ids
from finetune.training.objectives.base import CollateOptions, Models, Terms
from finetune.training.objectives.grpo_loss import LossScale, LossSettings, loss_sum, per_token_loss
from finetune.training.objectives.logprobs import collate_sequences, logits_at
from finetune.training.objectives.reference import MeasuredAgainstStart
from finetune.training.rewards import RewardFunction, TrainerState, score

SEQUENCE_PREFIX = "seq/"


@dataclass(frozen=True)
class GRPOSettings:
    num_generations: int
    sample: SampleSettings
    loss: LossSettings
    num_iterations: int
    scale_rewards: str
    mask_truncated_completions: bool
    reward_weights: tuple[float, ...]
    seed: int = 0
    """Keys the draws (`draw_table`): in training with the step and each prompt's place in the global batch,
    in evaluation with the record."""


def draw_table(keys: list[str], group: int, tokens: int) -> torch.Tensor:
    """(len(keys) x group, tokens) float64 uniform numbers: each prompt's `group` rows of draws come from a
    generator of its own, seeded from its key (`training_keys`, `evaluation_keys`), so what a prompt samples
    depends on its key and the model, not on which process samples it or what shares its batch."""
    tables = []
    for key in keys:
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
        tables.append(torch.rand(group, tokens, dtype=torch.float64, generator=generator))
    return torch.cat(tables)


def training_keys(seed: int, step: int, batches: list[dict[str, Any]], process: int) -> list[str]:
    """A training step's prompt keys: (seed, step, micro-batch k, the prompt's place in micro-batch k of the
    step's global batch, all processes' rows). 2 ranks then sample what one process with their global batch
    samples, and a resumed run what the interrupted one did, from the step alone."""
    size = len(batches[0]["rows"])
    return [
        f"grpo-train {seed} {step} {k} {process * size + i}"
        for k, b in enumerate(batches)
        for i in range(len(b["rows"]))
    ]


def evaluation_keys(seed: int, rows: list[dict[str, Any]]) -> list[str]:
    """Held-out prompts' keys: (seed, the record itself). Every evaluation of a run then samples a prompt
    with the same numbers (common random numbers: the start and the end of a run differ by what the model
    learnt, not by the draws), whatever the process count."""
    return [
        "grpo-eval {} {}".format(seed, hashlib.blake2b(f"{row['input_ids']} {row['columns']}".encode()).hexdigest())
        for row in rows
    ]


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sample standard deviation (n − 1) over the non-NaN values, as trl's `nanstd`: NaN where fewer than two
    are not NaN (it was 0 there, so a group with one scored completion counted in `frac_reward_zero_std`, which
    trl leaves it out of; the advantages are 0 either way)."""
    if dim is None:
        values, dim = values.reshape(-1), 0
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim)
    variance = torch.nansum((values - mean) ** 2, dim=dim) / (count - 1).clamp(min=1)
    return torch.where(count > 1, variance.sqrt(), torch.nan)


def advantages_of(rewards: torch.Tensor, group_size: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) advantages and (n,) the std each was scaled by, from (n,) rewards in groups of `group_size`."""
    groups = rewards.view(-1, group_size)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(group_size)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(groups, dim=1).repeat_interleave(group_size)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), std


def reward_columns(records: list[dict[str, Any]], group: int) -> dict[str, list[Any]]:
    """The dataset columns reward functions get as keyword arguments, one value per completion (`group` per record):
    every column any record of the step has, None where a record lacks it, as trl's `datasets` table of JSON lines
    gives them (a first record without `answer` must not hide the others' answers)."""
    named = dict.fromkeys(key for record in records for key in record)
    keys = [key for key in named if key not in ("prompt", "completion", "completion_ids")]
    return {key: [record.get(key) for record in records for _ in range(group)] for key in keys}


class GRPO(MeasuredAgainstStart):
    name: str = "grpo"
    loss_units: tuple[str, ...] = ("completions",)
    count_units: tuple[str, ...] = ("completions",)

    def __init__(
        self,
        options: CollateOptions,
        settings: GRPOSettings,
        tokenizer: Any,
        reward_functions: list[RewardFunction],
        turn_closers: frozenset[int] = frozenset(),
    ):
        self.options, self.settings, self.tokenizer = options, settings, tokenizer
        self.reward_functions = reward_functions
        self.max_steps, self.steps_per_epoch = 0, 0.0
        """The run's length, for the `trainer_state` reward functions read (`set_run_length`)."""
        self.turn_closers = turn_closers
        """The chat template's end of turn, where a completion also stops: a base tuned with its own template (a
        Qwen2.5 or Llama 3.1 base) lists it in neither EOS, and its completions ran to `max_completion_length`."""
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        names = ["reward", "reward_std", "frac_reward_zero_std", "completion_length", "truncated_share",
                 "clip_ratio", "entropy", "nll", "generate_s", "reward_s"]  # fmt: skip
        names += [f"rewards/{function.name}" for function in reward_functions]
        names += ["reward_sq", "rewarded"]  # see finish_summary
        names += [f"scored/{function.name}" for function in reward_functions]
        if settings.loss.beta:
            names.append("kl")
        self.metric_units: Mapping[str, str] = dict.fromkeys(names, "completions")
        self.steps_prepared = 0
        """Training steps prepared so far: a generation every `num_iterations` of them."""
        self._generated: list[dict] | None = None
        self._warned_unrewarded = False

    def set_run_length(self, total_steps: int, steps_per_epoch: float) -> None:
        """The run's optimizer steps and steps per pass over the prompts, as trl's `TrainerState` gives reward
        functions `max_steps` and a fractional `epoch` (a run set by `train.epochs` had passed them 0)."""
        self.max_steps, self.steps_per_epoch = total_steps, steps_per_epoch

    # ---- rows ---------------------------------------------------------------------------------------
    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The prompts of a micro-batch, kept as rows: the completions are not known before `prepare`."""
        return {"rows": [{"input_ids": list(row["input_ids"]), "columns": row["columns"]} for row in rows]}

    def counts(self, batch: dict[str, Any]) -> dict[str, int]:
        return {"completions": len(batch["rows"]) * self.settings.num_generations}

    # ---- generation and scoring (no gradient) -------------------------------------------------------
    def prepare(self, models: Models, batches: list[dict[str, Any]], *, reduce: bool) -> list[dict]:
        if not reduce:
            return self._generate(models, batches, reduce=False)
        if self._generated is None or self.steps_prepared % self.settings.num_iterations == 0:
            self._generated = self._generate(models, batches, reduce=True)
            states = self._generated
        else:  # the same completions again: nothing generated or scored this step
            states = [{**state, "timing": torch.zeros_like(state["timing"])} for state in self._generated]
        self.steps_prepared += 1
        return states

    def carried_state(self) -> list[dict] | None:
        """The completions a `num_iterations` group is still training on (None at a group's end: the next step
        generates anew)."""
        if self._generated is None or self.steps_prepared % self.settings.num_iterations == 0:
            return None
        return self._generated

    def restore_carried_state(self, states: list[dict], device: torch.device) -> None:
        self._generated = [to_device(state, device) for state in states]

    def _generate(self, models: Models, batches: list[dict[str, Any]], *, reduce: bool) -> list[dict]:
        settings, group = self.settings, self.settings.num_generations
        rows = [row for batch in batches for row in batch["rows"]]
        prompts = [row["input_ids"] for row in rows for _ in range(group)]
        started = time.perf_counter()
        stops = model_stop_token_ids(models.peft, self.tokenizer) | self.turn_closers
        uniforms = None
        if settings.sample.temperature:  # greedy decoding draws nothing
            if reduce:
                keys = training_keys(settings.seed, self.steps_prepared, batches, models.accelerator.process_index)
            else:
                keys = evaluation_keys(settings.seed, rows)
            uniforms = draw_table(keys, group, settings.sample.max_new_tokens)
        completions = sample_completions(models.peft, prompts, settings.sample, stop_ids=stops,
                                         pad_token_id=self.pad_token_id, uniforms=uniforms)  # fmt: skip
        generated = time.perf_counter()
        scores = self._score(rows, completions)  # (n, F) on the host
        self._warn_unrewarded(scores, rows)
        scored = time.perf_counter()
        device = models.accelerator.device
        weights = torch.tensor(settings.reward_weights, dtype=torch.float32)
        rewards = (scores * weights).nansum(dim=1)
        rewards[torch.isnan(scores).all(dim=1)] = torch.nan
        all_rewards = rewards.to(device)
        if reduce and models.accelerator.num_processes > 1:
            all_rewards = models.accelerator.gather(all_rewards)
        advantages, std = advantages_of(all_rewards, group, settings.scale_rewards)
        if reduce and models.accelerator.num_processes > 1:
            first = models.accelerator.process_index * len(rewards)
            advantages, std = advantages[first : first + len(rewards)], std[first : first + len(rewards)]
        truncated = [not completion or completion[-1] not in stops for completion in completions]
        states, start = [], 0
        for batch in batches:
            count = len(batch["rows"]) * group
            part = slice(start, start + count)
            states.append(self._sequences(prompts[part], completions[part], truncated[part], device))
            states[-1].update(advantages=advantages[part], rewards=rewards[part].to(device),
                              scores=scores[part].to(device), std=std[part])  # fmt: skip
            start += count
        self._score_policies(models, states)
        tokens = torch.stack([state["mask"].sum() for state in states]).sum().double()
        totals = torch.stack([tokens, torch.tensor(float(len(completions)), dtype=torch.float64, device=device)])
        if reduce:
            totals = models.accelerator.reduce(totals, reduction="sum")
        timing = torch.tensor([generated - started, scored - generated], dtype=torch.float64, device=device)
        for state in states:
            state.update(step_tokens=totals[0], step_completions=totals[1], timing=timing)
        return states

    def _warn_unrewarded(self, scores: torch.Tensor, rows: list[dict[str, Any]]) -> None:
        """Say once per run that completions got None from every reward function: they train with advantage 0
        (as in trl), so a function that never applies (a misspelt column, say) would otherwise train nothing."""
        unrewarded = torch.isnan(scores).all(dim=1)  # on the host: reading it waits for no device
        if self._warned_unrewarded or not bool(unrewarded.any()):
            return
        self._warned_unrewarded = True
        first = json.loads(rows[int(unrewarded.int().argmax()) // self.settings.num_generations]["columns"])
        warnings.warn(
            f"{int(unrewarded.sum())} of {len(scores)} completions of a step got None from every reward function "
            f"(the first from prompt {_preview(first['prompt'])}); they train with advantage 0. Return a number "
            "from at least one function for each completion (said once per run)",
            RewardWarning,
            stacklevel=2,
        )

    def _score(self, rows: list[dict[str, Any]], completions: list[list[int]]) -> torch.Tensor:
        group = self.settings.num_generations
        records = [json.loads(row["columns"]) for row in rows]
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        prompts = [record["prompt"] for record in records for _ in range(group)]
        chat = isinstance(prompts[0], list)
        shown = [[{"role": "assistant", "content": text}] for text in texts] if chat else texts
        columns = reward_columns(records, group)
        where = [f"prompt {_preview(record['prompt'])}" for record in records for _ in range(group)]
        epoch = self.steps_prepared / self.steps_per_epoch if self.steps_per_epoch else 0.0
        state = TrainerState(self.steps_prepared, self.max_steps, epoch)
        return score(self.reward_functions, prompts, shown, completions, columns, state, where)

    def _sequences(self, prompts, completions, truncated, device) -> dict[str, Any]:
        """Prompt + completion sequences laid out padding-free, the loss mask per completion token."""
        sequences = [
            {"input_ids": prompt + completion, "labels": [IGNORE_INDEX] * len(prompt) + completion}
            for prompt, completion in zip(prompts, completions)
        ]
        batch = collate_sequences(sequences, self.options.pad_token_id, packing=True, layout=self.options.layout)
        keep = torch.tensor([0.0 if cut and self.settings.mask_truncated_completions else 1.0 for cut in truncated])
        batch = {f"{SEQUENCE_PREFIX}{key}": value for key, value in to_device(batch, device).items()}
        owner = batch[f"{SEQUENCE_PREFIX}target_sequence"]
        lengths = torch.tensor([float(len(completion)) for completion in completions], device=device)
        return {**batch, "mask": keep.to(device)[owner], "lengths": lengths,
                "truncated": torch.tensor(truncated, dtype=torch.float32, device=device)}  # fmt: skip

    def _score_policies(self, models: Models, states: list[dict]) -> None:
        """π_old (μ > 1) and π_ref (β > 0) per completion token, without gradient."""
        with torch.no_grad():
            for state in states:
                if self.settings.num_iterations > 1:
                    state["old_logps"] = self.token_logps(models.peft, state)[0]
                if self.settings.loss.beta:
                    with self.reference_policy(models):
                        state["ref_logps"] = self.token_logps(models.peft, state)[0]

    def trained_tokens(self, prepared: list[dict]) -> torch.Tensor:
        """This process's tokens of the step, for `tokens_seen` and `tokens_per_s`: prompt + completion of every
        sequence the step trains on (each prompt `num_generations` times, each completion up to its first stop
        token), as trl's `num_tokens`, and again on a `num_iterations` step that trains on them again. The loop's
        own count, the prompt records' tokens, left the completions out. Counted on the device from the
        sequences' layout (padding is -1), so nothing is read back in the step."""
        laid_out = [state[f"{SEQUENCE_PREFIX}document_index"] >= 0 for state in prepared]
        return torch.stack([positions.sum() for positions in laid_out]).sum()

    # ---- the loss -----------------------------------------------------------------------------------
    def token_logps(self, model: Any, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) log π of each completion token at the sampling temperature, and (N,) the entropy there."""
        batch = {
            key.removeprefix(SEQUENCE_PREFIX): value for key, value in state.items() if key.startswith(SEQUENCE_PREFIX)
        }
        logits = logits_at(model, batch).float() / self.settings.sample.temperature  # (N, V)
        log_probabilities = torch.log_softmax(logits, dim=-1)
        logps = log_probabilities.gather(1, batch["target_ids"][:, None]).squeeze(1)
        entropy = -(log_probabilities.detach().exp() * log_probabilities.detach()).sum(-1)
        return logps, entropy

    def terms(self, models: Models, batch: dict[str, Any], prepared: dict) -> Terms:
        state, settings = prepared, self.settings.loss
        owner = state[f"{SEQUENCE_PREFIX}target_sequence"]
        completions = len(state["lengths"])
        logps, entropy = self.token_logps(models.step, state)
        old = state.get("old_logps", logps.detach())
        token_loss, parts = per_token_loss(logps, old, state.get("ref_logps"), state["advantages"][owner], settings)
        scale = LossScale(completions, state["step_completions"], state["step_tokens"])
        loss = loss_sum(token_loss, state["mask"], owner, settings, scale)
        return Terms({"completions": loss}, self._metrics(state, entropy, logps.detach(), parts, scale))

    def _metrics(self, state, entropy, logps, parts, scale: LossScale) -> dict[str, torch.Tensor]:
        """Each metric as a sum whose division by the step's completions gives its mean (token means are
        weighted by completions / tokens of the step)."""
        mask, owner = state["mask"], state[f"{SEQUENCE_PREFIX}target_sequence"]
        per_token = scale.step_completions / scale.step_tokens.clamp(min=1.0)
        tokens = torch.zeros(scale.completions, device=logps.device).index_add(0, owner, torch.ones_like(logps))
        nll = torch.zeros(scale.completions, device=logps.device).index_add(0, owner, -logps) / tokens.clamp(min=1)
        count = scale.completions * scale.step_completions.new_ones(())
        rewarded = ~torch.isnan(state["rewards"])  # trl 1.16 leaves a completion no function scored out (NaN)
        # float64: `reward_std` comes from Σr and Σr² (finish_summary), and in float32 their difference lost the
        # spread of rewards with a large offset (10,000 ± 0.15 was logged with a std of 1.5, or 0)
        rewards = torch.where(rewarded, state["rewards"].double(), 0.0)
        metrics = {
            "reward": rewards.sum(),
            "reward_sq": (rewards**2).sum(),
            "rewarded": rewarded.sum(),
            "reward_std": count * 0,  # finish_summary: from the sums of the whole step (or evaluation)
            "frac_reward_zero_std": torch.isclose(state["std"], torch.zeros_like(state["std"])).sum(),
            "completion_length": state["lengths"].sum(),
            "truncated_share": state["truncated"].sum(),
            "clip_ratio": (parts["clipped"] * mask).sum() * per_token,
            "entropy": (entropy * mask).sum() * per_token,
            "nll": nll.sum(),
            "generate_s": state["timing"][0] * count,  # / C: this process's seconds (weighted mean over processes)
            "reward_s": state["timing"][1] * count,
        }
        for index, function in enumerate(self.reward_functions):
            scores = state["scores"][:, index]
            metrics[f"rewards/{function.name}"] = torch.nansum(scores.double())
            metrics[f"scored/{function.name}"] = (~torch.isnan(scores)).sum()
        if "kl" in parts:
            metrics["kl"] = (parts["kl"] * mask).sum() * per_token
        return metrics

    def finish_summary(self, result: dict[str, float], counts: Mapping[str, float]) -> None:
        """trl's statistics over all the completions of a step (every micro-batch, every process) or of an
        evaluation, from the means of sums `summarise` took: `reward` and `reward_std` the mean and the sample
        standard deviation of the rewards of the completions some function scored (trl's `nanmean` and `nanstd`
        over the gathered batch, where a completion every function gave None is NaN; they had counted it as a
        reward of 0, and `reward_std` was once a mean of per-micro-batch deviations), NaN where fewer are scored
        than the statistic needs; `rewards/<function>` the mean over the completions the function scored (trl's
        `nanmean`: a None counted as 0 before), NaN where it scored none."""
        n = counts["completions"]
        mean_square, rewarded = result.pop("reward_sq", None), result.pop("rewarded", None)
        if mean_square is not None and rewarded is not None and "reward" in result:
            scored = round(rewarded * n)
            mean = result["reward"] / rewarded if scored > 0 else math.nan
            variance = max(mean_square / rewarded - mean**2, 0.0) * scored / (scored - 1) if scored > 1 else math.nan
            result["reward"], result["reward_std"] = mean, math.sqrt(variance)
        for function in self.reward_functions:
            share = result.pop(f"scored/{function.name}", None)
            if share is not None and f"rewards/{function.name}" in result:
                total = result[f"rewards/{function.name}"]
                result[f"rewards/{function.name}"] = total / share if share > 0 else math.nan


def _preview(prompt: Any) -> str:
    text = json.dumps(prompt, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."

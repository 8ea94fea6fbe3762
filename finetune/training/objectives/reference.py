"""The reference policy π_ref without a second copy of the model: the adapter disabled, or precomputed.

DPO and KTO measure the policy against the model as training starts. With LoRA that model is inside the
trained one: the same base with the adapter switched off (B = 0 at initialisation, so the starting model
is the base). `reference_logps` runs that forward under `torch.no_grad()` with peft's `disable_adapter()`,
in eval mode (no dropout: the reference is one fixed policy, as precomputed values are), on the unwrapped
LoRA model, which holds the very parameters the DDP wrapper, the FSDP2 shards or the DeepSpeed engine
train (a sharded forward gathers as usual; every rank runs it in step).

`train.precompute_reference` instead scores each row the run will train on (and every validation row) once
before the first step, with the model as it starts (the adapter on: also right when LoRA starts from another
adapter, `lora.init_from`, or from a PiSSA/OLoRA initialisation that moves part of the base into the adapter),
in eval mode under the run's autocast, each process a strided share. The values are kept in the run
directory as safetensors (`reference-logps.safetensors`: one (rows, sequences) float32 tensor per split, NaN
for a row not scored) and added to the rows as columns, so the sampler hands them to collation with their
rows; `--resume` loads the file, so a resumed run uses the very values the interrupted one did (and scores
only rows it lacks).

When LoRA does not start as the base (`lora.init_from`, e.g. the SFT adapter a DPO, KTO or GRPO run refines;
or a PiSSA/OLoRA initialisation), the reference passes instead run the model as the run started, as trl's
trainers do with their frozen "ref" copy of a pretrained adapter: `StartingWeights` keeps a copy of the
trainable LoRA weights as the run starts (a few MB at most) and swaps it into the very parameters for a
no-grad pass, then swaps the current weights back, bit for bit. No second adapter is added to the model,
so saving, the optimizer and the sharding wrappers see exactly the parameters they always do.

Example:
    ref = objective.reference_logps(models, batch)    # (S,): the adapter disabled, or the starting weights
    values = load_or_compute(run_dir, ...)            # {"train": (rows, 2), "validation": ...}
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from finetune.atomic import atomic_file
from finetune.device import to_device
from finetune.errors import ModelError
from finetune.recipe import ZERO3_STARTING_REFERENCE
from finetune.training.objectives.base import Models
from finetune.training.objectives.logprobs import sequence_logps
from finetune.training.sharding import lockstep_batches

REFERENCE_FILE = "reference-logps.safetensors"
REFERENCE_COLUMNS = ("reference_chosen_logp", "reference_rejected_logp")
"""Row columns of precomputed reference log-probabilities of a pair's sequences, in sequence order."""


class StartingWeights:
    """The trainable weights as the run starts, to be swapped in for passes of the starting policy."""

    def __init__(self, peft_model: Any):
        """Copies `peft_model`'s trainable parameters as they are now: call it before the first step (and before
        a resumed run loads its checkpoint), after any sharding wrapper has put its parameters in place.

        Raises:
            ModelError: DeepSpeed ZeRO-3 holds the parameters partitioned outside `param.data`.
        """
        self.parameters = [parameter for parameter in peft_model.parameters() if parameter.requires_grad]
        if any(hasattr(parameter, "ds_numel") for parameter in self.parameters):
            raise ModelError(ZERO3_STARTING_REFERENCE)  # the recipe refuses it first; kept for the Python API's models
        with torch.no_grad():
            self.values = [parameter.detach().clone() for parameter in self.parameters]

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The starting weights in the parameters for the block (no gradient); the current ones back after it."""
        with torch.no_grad():
            current = [parameter.detach().clone() for parameter in self.parameters]
            for parameter, value in zip(self.parameters, self.values):
                parameter.copy_(value)
            try:
                yield
            finally:
                for parameter, value in zip(self.parameters, current):
                    parameter.copy_(value)


class MeasuredAgainstStart:
    """What an objective whose reference policy is the model as the run starts (DPO, KTO, GRPO's KL) shares."""

    starting_weights: StartingWeights | None = None
    """The starting LoRA weights, set by the run when LoRA does not start as the base; None: the reference is
    the base, the adapter disabled."""

    def reference_policy(self, models: Models) -> AbstractContextManager:
        """π_ref for the block: the starting weights swapped in, or the base (the adapter disabled), in eval
        mode: the model as it starts is one policy, not a fresh dropout draw of it per pass (LoRA dropout acts
        on the swapped-in weights, the base's own dropout on either), and the precomputed values are scored
        in eval mode too."""
        policy = models.peft.disable_adapter() if self.starting_weights is None else self.starting_weights.swapped_in()
        return _in_eval_mode(models.peft, policy)

    def reference_logps(self, models: Models, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(S,) log π_ref of each sequence, no gradient."""
        with torch.no_grad(), self.reference_policy(models):
            return sequence_logps(models.peft, batch)


@contextmanager
def _in_eval_mode(model: Any, inner: AbstractContextManager) -> Iterator[None]:
    """`inner` with every module of `model` in eval mode; each module's own mode back after it."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with inner:
            yield
    finally:
        for module, training in modes:
            module.training = training


@torch.no_grad()
def score_rows(objective: Any, models: Models, rows: Any, micro_batch_size: int) -> torch.Tensor:
    """(rows, sequences per row) log π of every row's sequences, the model as it is now, in eval mode.

    Each process scores a strided share and the shares are summed over processes (each row is scored by
    exactly one), so every process ends with all values; all run the same forwards (`lockstep_batches`).
    """
    accelerator = models.accelerator
    shares = lockstep_batches(len(rows), micro_batch_size, accelerator.process_index, accelerator.num_processes)
    was_training = models.peft.training
    models.peft.eval()
    values: torch.Tensor | None = None
    for batch_indices, counted in shares:
        batch = to_device(objective.collate([rows[i] for i in batch_indices]), accelerator.device)
        with accelerator.autocast():
            scores = sequence_logps(models.peft, batch).reshape(len(batch_indices), -1)  # (rows, sequences)
        if values is None:
            values = torch.zeros(len(rows), scores.shape[1], dtype=torch.float32, device=accelerator.device)
        if counted:
            values[torch.tensor(batch_indices, device=accelerator.device)] = scores.float()
    models.peft.train(was_training)
    assert values is not None, "no rows to score"
    return accelerator.reduce(values, reduction="sum").cpu()


def load_or_compute(
    run_dir: Path, digest: str, complete: Any, *, resume: bool, is_main: bool, wait: Any
) -> dict[str, torch.Tensor]:
    """The precomputed values of each split, kept in the run directory: `complete(stored)` -> {split: tensor}
    (every process) gives them from those an earlier start of this run stored (None when there are none:
    a new run, or a file written for another `digest`), scoring what they lack. The main process writes
    them back when they changed: a resumed run that trains on rows the interrupted one never reached
    scores those rows and keeps them.

    `digest` names what the values depend on (recipe and data); a file written for another digest is not used.
    """
    path = run_dir / REFERENCE_FILE
    stored = None
    if resume and path.is_file():
        with safe_open(str(path), framework="pt") as handle:
            if (handle.metadata() or {}).get("digest") == digest:
                stored = load_file(str(path))
    values = complete(stored)
    if is_main and _scored_differently(stored, values):
        run_dir.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as staging:
            save_file({k: v.contiguous() for k, v in values.items()}, str(staging), metadata={"digest": digest})
    wait()
    return values


def _scored_differently(stored: dict[str, torch.Tensor] | None, values: dict[str, torch.Tensor]) -> bool:
    """Whether `values` score other rows than `stored` (NaN marks a row not scored)."""
    if stored is None or stored.keys() != values.keys():
        return True
    return any(not torch.equal(values[name].isnan(), stored[name].isnan()) for name in values)


def with_reference_columns(rows: Any, values: torch.Tensor) -> Any:
    """`rows` with one column per sequence of its precomputed reference log-probabilities."""
    for column, number in zip(REFERENCE_COLUMNS, range(values.shape[1])):
        rows = rows.add_column(column, values[:, number].tolist())
    return rows

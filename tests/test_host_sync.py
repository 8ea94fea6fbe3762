"""An optimizer step never makes the host wait for the device, for every objective.

Whole training steps (forward and backward of every micro-batch, the objective's no-grad work, clipping,
fused AdamW and the schedule) run under `HostSyncDetector`, which fails on anything that would synchronise
the host with a GPU (`.item()`, `nonzero`, boolean-mask indexing, `.tolist()`, a device-to-host copy). The
host's own work (collating, counting on host tensors) happens before, as in the loop. The detector itself
is checked to catch each kind of operation, so a silent detector cannot pass these tests.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import instruction_records, preference_records

from finetune.recipe import load_recipe
from finetune.training.device_schedule import DeviceSchedule
from finetune.training.host_sync import HostSyncDetector
from finetune.training.loop import device_schedule, device_step, step_inputs
from finetune.training.run import start_run

RECIPE = """
model: {{base: {base}}}
lora: {{r: 4, alpha: 8, dropout: 0.1}}
data: {{train: data.jsonl, format: {format}, max_seq_len: 128}}
train: {{objective: {objective}, max_steps: 3, micro_batch_size: 2, grad_accum_steps: 2, lr: 0.01, warmup_steps: 1
         {extra}}}
output: {{name: {objective}}}
"""
CASES = {
    "sft": ("instruction", ""),
    "dpo": ("preference", ""),
    "dpo-reference-precomputed": ("preference", ", precompute_reference: true"),
    "orpo": ("preference", ""),
    "simpo": ("preference", ""),
    "kto": ("unpaired_preference", ""),
}


def _records(data_format: str) -> list[dict]:
    if data_format == "instruction":
        return instruction_records(8)
    pairs = preference_records(8)
    if data_format == "preference":
        return pairs
    return [
        {"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
        for pair in pairs
        for side in ("chosen", "rejected")
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_training_step_never_syncs_the_host(case, tmp_path, monkeypatch, tiny_base_dir):
    monkeypatch.chdir(tmp_path)
    data_format, extra = CASES[case]
    objective = case.split("-")[0]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(data_format)))
    (tmp_path / "recipe.yaml").write_text(
        RECIPE.format(base=tiny_base_dir, format=data_format, objective=objective, extra=extra)
    )
    run = start_run(load_recipe("recipe.yaml"), resume=False, say=lambda line: None)
    schedule = device_schedule(run)
    assert isinstance(schedule, DeviceSchedule), "fused AdamW skips on the device: no host check needed"
    before = {name: p.detach().clone() for name, p in run.peft_model.named_parameters() if p.requires_grad}
    for _ in range(2):  # the first step creates Adam's state; the second is a steady one
        inputs = step_inputs(run, run.next_micro_batches())
        with HostSyncDetector() as detector:
            queued = device_step(run, inputs, schedule)
        assert detector.found == [], detector.describe()
    values = dict(zip(queued.names, queued.values.tolist()))
    assert values["skipped"] == 0.0 and values["grad_norm"] > 0
    changed = [
        name for name, p in run.peft_model.named_parameters() if p.requires_grad and not torch.equal(p, before[name])
    ]
    assert changed, "the steps trained nothing"


def test_the_detector_catches_every_kind_of_sync():
    x = torch.arange(6.0)
    mask = x > 2
    catches = {
        "item": lambda: x.sum().item(),
        "float": lambda: float(x.sum()),
        "bool": lambda: bool(x.sum() > 0),
        "nonzero": lambda: x.nonzero(),
        "mask index": lambda: x[mask],
        "mask assign": lambda: x.clone().__setitem__(mask, 0.0),
        "masked_select": lambda: x.masked_select(mask),
        "unique": lambda: x.unique(),
        "tolist": lambda: x.tolist(),
        "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    }
    for name, operation in catches.items():
        with HostSyncDetector() as detector:
            operation()
        assert detector.found, f"{name} was not caught"
    with torch.inference_mode():  # sampling's tensors: their scalar reads dispatch nothing
        total = x.sum()
    reads = {"item": total.item, "int": lambda: int(total), "float": lambda: float(total), "bool": lambda: bool(total)}
    for name, operation in reads.items():
        with torch.inference_mode(), HostSyncDetector() as detector:
            operation()
        assert len(detector.found) == 1, f"{name} of an inference tensor: {detector.found}"
    with HostSyncDetector() as detector:  # what a step does instead
        index = torch.tensor([3, 4, 5])
        x.index_select(0, index).sum()
        x.new_zeros(2).index_add(0, torch.tensor([0, 1, 1]), x[:3])
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)
    assert detector.found == []


def test_a_poisoned_step_changes_nothing_on_the_device_and_the_schedule_does_not_advance():
    from transformers import get_scheduler

    weights = torch.nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(0)))
    optimizer = torch.optim.AdamW([weights], lr=0.1, fused=True)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=1, num_training_steps=6)
    schedule = DeviceSchedule(optimizer, scheduler, total_steps=6, device=torch.device("cpu"))
    weights.grad = torch.ones(5)
    schedule.step(optimizer, torch.tensor(1.0), torch.tensor(1.0))
    before = (weights.detach().clone(), {k: v.clone() for k, v in optimizer.state[weights].items()})
    rate, applied = optimizer.param_groups[0]["lr"].clone(), schedule.applied.clone()
    weights.grad = torch.full((5,), float("nan"))
    with HostSyncDetector() as detector:
        skipped = schedule.step(optimizer, torch.tensor(float("nan")), torch.tensor(float("nan")))
    assert detector.found == [] and skipped.item() == 1.0
    assert torch.equal(weights.detach(), before[0])
    assert all(torch.equal(optimizer.state[weights][k], v) for k, v in before[1].items())
    assert torch.equal(optimizer.param_groups[0]["lr"], rate) and torch.equal(schedule.applied, applied)
    schedule.close()
    assert scheduler.last_epoch == 1 and optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0]
    assert scheduler.get_last_lr()[0] == pytest.approx(0.1 * scheduler.lr_lambdas[0](1))

"""Checkpoint tensors split from their structure and joined back: safetensors for the tensors, JSON for the rest.

The round trip goes through the real formats (a safetensors file, a JSON string) and must give back every
tensor bit for bit with its dtype and shape, and every other value as JSON holds it. Through
`save_checkpoint`/`load_checkpoint`, a real optimizer's state comes back so that the next step is identical.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from finetune.training.checkpoint import _join_tensors, _split_tensors, load_checkpoint, save_checkpoint


def _round_trip(value, tmp_path):
    tensors: dict[str, torch.Tensor] = {}
    structure = _split_tensors(value, "optimizer", tensors)
    save_file(tensors, tmp_path / "tensors.safetensors")
    document = json.loads(json.dumps(structure))  # what STATE_FILE holds
    return _join_tensors(document, load_file(tmp_path / "tensors.safetensors")), tensors


def assert_same(expected, actual, where="value"):
    """Equal as the checkpoint promises: tensors bit for bit (dtype, shape), tuples back as lists, all else ==."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), where
        for key in expected:
            assert_same(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for index, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{where}[{index}]")
    else:
        assert type(actual) is type(expected) and actual == expected, where


def test_nested_tensors_round_trip_bit_for_bit(tmp_path):
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(3, 5, generator=generator)  # stored through its transposed (non-contiguous) view
    value = {
        "state": {
            0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 2, generator=generator)},
            1: {"step": torch.tensor(3.0), "exp_avg": matrix.T, "ints": torch.arange(6, dtype=torch.int64)},
            2: {"half": torch.randn(7, generator=generator).to(torch.bfloat16), "empty": torch.zeros(0, 4)},
        },
        "param_groups": [
            {"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "name": "lora", "foreach": None, "amsgrad": False},
            {"lr": torch.tensor(5e-4), "betas": (0.8, 0.99), "params": [2], "nested": [[1, 2], (torch.ones(2), "x")]},
        ],
        "looks_like_a_reference": {"tensor": "optimizer.state.0.step", "dict": [], "list": 1},
    }
    joined, tensors = _round_trip(value, tmp_path)
    assert_same(value, joined)
    assert len(tensors) == 9  # every tensor stored once, under its own name


@pytest.mark.parametrize("value", [None, 0, 1.5, "text", [], {}, True])
def test_values_without_tensors_round_trip_unchanged(tmp_path, value):
    joined, tensors = _round_trip(value, tmp_path)
    assert tensors == {} and joined == value and type(joined) is type(value)


def _trained_optimizer(seed: int):
    torch.manual_seed(seed)
    weights = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    optimizer = torch.optim.AdamW(
        [{"params": [weights[0]], "lr": 1e-2}, {"params": [weights[1]], "lr": 1e-3, "weight_decay": 0.0}]
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return weights, optimizer, scheduler


def _step(weights, optimizer, scheduler, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    loss = sum((w * torch.randn(w.shape, generator=generator)).sum() ** 2 for w in weights)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def test_optimizer_state_comes_back_and_the_next_step_is_identical(tmp_path):
    weights, optimizer, scheduler = _trained_optimizer(seed=0)
    for seed in range(3):
        _step(weights, optimizer, scheduler, seed)
    trainable = {f"w{i}": w.detach().clone() for i, w in enumerate(weights)}
    path = save_checkpoint(
        tmp_path,
        step=3,
        trainable=trainable,
        optimizer_state=optimizer.state_dict(),
        scheduler=scheduler,
        state={"epoch": 0},
        keep=1,
    )

    restored_weights, restored, restored_scheduler = _trained_optimizer(seed=1)  # other weights, fresh state
    loaded, optimizer_state, state = load_checkpoint(path, scheduler=restored_scheduler)
    restored.load_state_dict(optimizer_state)
    assert state == {"epoch": 0, "step": 3}
    assert_same(trainable, loaded)
    assert_same(optimizer.state_dict()["state"], restored.state_dict()["state"])
    assert restored_scheduler.state_dict() == scheduler.state_dict()
    with torch.no_grad():
        for weight, saved in zip(restored_weights, loaded.values()):
            weight.copy_(saved)
    _step(weights, optimizer, scheduler, seed=3)
    _step(restored_weights, restored, restored_scheduler, seed=3)
    for weight, restored_weight in zip(weights, restored_weights):
        assert torch.equal(weight, restored_weight)

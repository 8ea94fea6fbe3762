"""`train.gradient_checkpointing` as a count of layers: which layers recompute, that the step computes the same,
and how `auto` chooses from the device's memory."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from peft import LoraConfig, get_peft_model

from finetune.errors import RecipeError
from finetune.model import decoder_layers
from finetune.recipe import load_recipe
from finetune.training.checkpointing import checkpointed_layer_count, device_memory_bytes, enable_checkpointing

LAYERS = 4


def _lora_model(dropout: float):
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear"))


def _forwards_per_layer_in_a_step(peft_model, input_ids) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Forward calls of each decoder layer over one forward + backward, and the LoRA gradients it gives. Counted
    at each layer's MLP: the recomputation calls the layer's `forward`, not the hooks of its `__call__`."""
    layers = decoder_layers(peft_model)
    calls = [0] * len(layers)
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
        for index, layer in enumerate(layers)
    ]
    peft_model.train()
    torch.manual_seed(7)  # the dropout masks: a recomputed layer must draw the same ones
    peft_model(input_ids=input_ids, labels=input_ids).loss.backward()
    for hook in hooks:
        hook.remove()
    gradients = {name: p.grad.clone() for name, p in peft_model.named_parameters() if p.grad is not None}
    return calls, gradients


@pytest.mark.parametrize("checkpointed", [0, 1, 3, LAYERS])
def test_the_first_n_layers_recompute_and_the_gradients_are_the_same(checkpointed):
    input_ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(0))  # below the vocabulary
    reference_calls, reference = _forwards_per_layer_in_a_step(_lora_model(dropout=0.1), input_ids)
    assert reference_calls == [1] * LAYERS
    peft_model = _lora_model(dropout=0.1)
    enable_checkpointing(peft_model, checkpointed)
    calls, gradients = _forwards_per_layer_in_a_step(peft_model, input_ids)
    assert calls == [2] * checkpointed + [1] * (LAYERS - checkpointed)  # a checkpointed layer runs again in backward
    assert gradients.keys() == reference.keys()
    for name, gradient in gradients.items():  # the same kernels on the same inputs, the same dropout masks
        assert torch.equal(gradient, reference[name]), name


def test_a_count_is_taken_as_given_and_more_layers_than_the_base_has_is_refused():
    config = tiny_model("llama", num_hidden_layers=LAYERS).config
    for setting, expected in (("true", LAYERS), ("false", 0), ("2", 2)):
        recipe = load_recipe("quickstart", [f"train.gradient_checkpointing={setting}"])
        assert checkpointed_layer_count(recipe, config, torch.device("cpu"), nproc=1) == expected
    too_many = load_recipe("quickstart", [f"train.gradient_checkpointing={LAYERS + 1}"])
    with pytest.raises(RecipeError, match=f"the base has {LAYERS} decoder layers; give at most {LAYERS}"):
        checkpointed_layer_count(too_many, config, torch.device("cpu"), nproc=1)


def test_auto_on_the_cpu_plans_against_the_memory_this_process_can_have():
    """A tiny model fits any host: `auto` checkpoints nothing there. What it plans against is the host's available
    memory plus what this process holds: more than its resident set, less than the host's physical memory (which
    also counts the kernel's and the other processes' memory)."""
    import psutil

    config = tiny_model("llama", num_hidden_layers=LAYERS).config
    recipe = load_recipe("quickstart", ["train.gradient_checkpointing=auto"])
    assert checkpointed_layer_count(recipe, config, torch.device("cpu"), nproc=1) == 0
    assert psutil.Process().memory_info().rss < device_memory_bytes(torch.device("cpu")) < psutil.virtual_memory().total


def test_a_run_checkpointing_one_layer_says_so_and_trains_the_same_adapter(workdir):
    """End to end on the tiny base (2 layers, LoRA dropout 0.1): the log names the count, and the adapter equals
    the one trained with no checkpointing bit for bit."""
    from safetensors.torch import load_file

    from finetune.training.loop import train

    adapters, logs = {}, {}
    for setting in ("1", "false"):
        lines: list[str] = []
        adapter_dir, _ = train(
            "recipe.yaml",
            ["train.max_steps=3", f"train.gradient_checkpointing={setting}", f"output.name=checkpointed-{setting}"],
            log=lines.append,
        )
        adapters[setting], logs[setting] = load_file(adapter_dir / "adapter_model.safetensors"), "\n".join(lines)
    assert "gradient checkpointing on for 1 of 2 layers" in logs["1"]
    assert "gradient checkpointing" not in logs["false"]
    assert adapters["1"].keys() == adapters["false"].keys()
    assert all(torch.equal(adapters["1"][name], adapters["false"][name]) for name in adapters["1"])

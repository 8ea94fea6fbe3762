"""`train.liger_kernels`: Liger Kernel's RMSNorm, RoPE and SwiGLU on CUDA, equal to PyTorch's in values and LoRA
gradients (a `gpu` test); on the CPU a run says in one line that they are not used and trains as without."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from finetune.errors import ModelError
from finetune.recipe import LoraConfig
from finetune.training.liger_kernels import use_liger_kernels
from finetune.training.loop import train

LIGER_INSTALLED = importlib.util.find_spec("liger_kernel") is not None


@pytest.mark.slow
def test_on_the_cpu_a_run_says_they_are_not_used_and_trains(workdir):
    lines: list[str] = []
    adapter, metrics = train("recipe.yaml", ["train.liger_kernels=true", "train.max_steps=2", "train.report_to=[]"],
                             log=lines.append)  # fmt: skip
    said = [line for line in lines if "liger" in line.lower()]
    assert said == ["train.liger_kernels: Liger's kernels are Triton kernels for CUDA; not used on the cpu"], said
    assert (adapter / "adapter_model.safetensors").is_file() and metrics["loss"] > 0


@pytest.mark.skipif(LIGER_INSTALLED, reason="checks the message for a machine without liger-kernel")
def test_asked_for_on_cuda_without_liger_kernel_installed_is_one_line_naming_the_extra(tiny_base_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir)
    with pytest.raises(ModelError, match=r"liger-kernel is not installed; pip install 'finetune\[liger\]'"):
        use_liger_kernels(True, model, torch.device("cuda"), say=print)
    assert not use_liger_kernels(False, model, torch.device("cuda"), say=print)


@pytest.mark.gpu
def test_liger_kernels_equal_pytorchs_values_and_lora_gradients(tiny_base_dir):
    """The same LoRA model (gaussian B, so the adapter is live) with and without Liger's kernels: logits and every
    LoRA gradient agree to float32 reordering (Liger's RMSNorm and RoPE compute in float32, in other orders)."""
    pytest.importorskip("liger_kernel", reason="pip install 'finetune[liger]' to run it")
    from finetune.model import wrap_with_lora

    device = torch.device("cuda")
    plain = AutoModelForCausalLM.from_pretrained(tiny_base_dir).to(device)
    fused = copy.deepcopy(plain)
    messages: list[str] = []
    assert use_liger_kernels(True, fused, device, messages.append), messages
    models = []
    for model in (plain, fused):
        torch.manual_seed(0)
        models.append(wrap_with_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0, init="gaussian")).train())
    ids = torch.randint(3, plain.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0)).to(device)
    outputs = [model(input_ids=ids, labels=ids) for model in models]
    for output in outputs:
        output.loss.backward()
    torch.testing.assert_close(outputs[1].logits, outputs[0].logits, rtol=1e-4, atol=1e-4)
    grads = [{n: p.grad for n, p in model.named_parameters() if p.requires_grad} for model in models]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-3, atol=1e-5, msg=name)

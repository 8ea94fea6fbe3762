"""On a CUDA device: the chunked loss against whole logits (memory, time, values) and a sync-free step.

Loads `finetune/chunked_loss.py` and `finetune/training/host_sync.py` by path (they import torch only), so it
runs on a GPU machine without the project's other dependencies:

1. Llama-3's 128,256-word head at 2 x 2048 tokens in bf16: peak memory above the inputs
   (`torch.cuda.max_memory_allocated`), time of forward + backward, and the losses and hidden-state gradients
   of `token_losses` against `F.cross_entropy(head(hidden).float())`;
2. where liger-kernel is installed, its fused linear cross-entropy measured alike, with per-token losses
   (`reduction="none"`, what every objective here needs: the preference objectives sum them per sequence),
   and whether its forward and backward sync with the host: the evidence for keeping finetune's own loss;
3. under `HostSyncDetector`: that loss, its backward, clipping and fused AdamW skipping a non-finite step
   through `found_inf` with a tensor learning rate find no sync; `.item()` and `.cpu()` are caught.

Example:
    python3 bench/gpu_chunked_loss.py
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent


def load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


chunked_loss = load("chunked_loss", "finetune/chunked_loss.py")
host_sync = load("host_sync", "finetune/training/host_sync.py")


def whole(head, hidden, targets):
    return F.cross_entropy(head(hidden).float(), targets, reduction="none")


def measure(function, head, hidden, targets, weights):
    hidden = hidden.detach().clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start_bytes = torch.cuda.memory_allocated()
    start = time.perf_counter()
    losses = function(head, hidden, targets)
    (losses * weights).sum().backward()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return losses.detach(), hidden.grad, torch.cuda.max_memory_allocated() - start_bytes, seconds


def liger(head, hidden, targets):
    """Liger Kernel's fused linear cross-entropy, per-token losses (it recomputes the logits in the backward
    to fold in the per-token gradient)."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    return LigerFusedLinearCrossEntropyFunction.apply(hidden, head.weight, targets, None, None, -100, 0.0, 0.0, "none")[
        0
    ]


def arms():
    """The losses compared: whole logits, finetune's chunks, and Liger's kernel where it is installed."""
    found = [("whole", whole), ("chunked", chunked_loss.token_losses)]
    if importlib.util.find_spec("liger_kernel") is not None:
        found.append(("liger", liger))
    else:
        print("liger: not measured (liger-kernel is not installed)")
    return found


def main() -> None:
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__)
    tokens, vocab, size = 2 * 2048, 128_256, 4096
    generator = torch.Generator(device=device).manual_seed(0)
    head = torch.nn.Linear(size, vocab, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(False)
    hidden = torch.randn(tokens, size, device=device, dtype=torch.bfloat16, generator=generator)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    weights = torch.rand(tokens, device=device, generator=generator) + 0.5
    functions = dict(arms())
    for _ in range(3):  # warm-up twice (Triton compiles Liger's kernels), then measured
        results = {name: measure(fn, head, hidden, targets, weights) for name, fn in functions.items()}
    for name, (_, _, peak, seconds) in results.items():
        print(f"{name:>8}: loss peak {peak / 2**20:,.0f} MiB, forward+backward {seconds * 1e3:.1f} ms")
    l0, g0, _, _ = results["whole"]
    for name in [name for name in results if name != "whole"]:
        l1, g1, _, _ = results[name]
        print(
            f"{name}: losses' max relative difference to whole logits {((l1 - l0).abs() / l0.abs()).max().item():.2e}, "
            f"hidden gradients' max difference {(g1 - g0).abs().max().item():.2e} of max {g0.abs().max().item():.2e}"
        )
        with host_sync.HostSyncDetector() as detector:
            losses = functions[name](head, hidden.detach().clone().requires_grad_(True), targets)
            (losses * weights).sum().backward()
        print(f"{name}: forward + backward {detector.found or 'make no host sync'}")

    lora = torch.nn.Parameter(torch.zeros(size, 8, device=device))
    optimizer = torch.optim.AdamW([lora], lr=1e-3, fused=True)
    optimizer.param_groups[0]["lr"] = torch.tensor(1e-3, dtype=torch.float32, device=device)  # CUDA: float32 only
    optimizer.found_inf = torch.zeros((), device=device)
    x = hidden[:512].float().requires_grad_(False)
    with host_sync.HostSyncDetector() as detector:
        for _ in range(2):
            h = (x + (x @ lora) @ torch.ones(8, size, device=device)).to(torch.bfloat16)
            loss = chunked_loss.token_losses(head, h, targets[:512]).sum()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_([lora], 1.0)
            optimizer.found_inf.copy_((~(torch.isfinite(loss) & torch.isfinite(norm))).float())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    print(f"sync-free step on CUDA: {detector.found or 'no sync'}")
    with host_sync.HostSyncDetector() as detector:
        loss.item()
        loss.cpu()
    print(f"caught: {detector.found}")


if __name__ == "__main__":
    main()

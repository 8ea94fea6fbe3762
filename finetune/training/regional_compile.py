"""`train.compile`: each decoder layer compiled on its own (regional compilation), the rest left eager.

Compiling the whole model puts the loss, the head hook and every shape of the step inside one graph: a
head that selects the labelled rows (a different count every micro-batch) recompiles, so the whole-model
path had to fall back to the full logits. The decoder layers are where the work and the launches are, and
they are all alike: torch compiles the layer's code once for all of them (torchtune and torchtitan compile
per layer; they report +16-27% tokens/s). `fullgraph=True` makes a graph break an error instead of a silent
slowdown. Measured here on a tiny Llama with LoRA (dropout 0.05) on every linear layer and the document mask
of `finetune.training.document_mask`: no graph break, the first step compiling for about 80 s on a loaded
2-core CPU, then 2.5 s.

With a bitsandbytes (4/8-bit) base the layers hold bitsandbytes' own matmuls. bitsandbytes 0.50 registers its
ops with torch, and on the CPU (torch 2.13) dynamo traced a 4-bit layer whole, with no graph break, its losses and
LoRA gradients those of eager (tests/test_regional_compile.py). Such layers are still compiled without
`fullgraph`, so that a version or device where dynamo does break there runs slower instead of stopping, and the
log says so.

Only forwards that record gradients (the training step's) run compiled; forwards under `no_grad` or
`inference_mode` (evaluation, reference log-probabilities, sampling) run the eager layer. Each of those is
another grad mode and other shapes (every decoding step of GRPO's sampler is one), and torch's limit of 8
compilations per code object is shared by all the layers: on an H100 (torch 2.11) a tiny Llama's base
evaluation and first steps, and GRPO's first sampling, hit it, which under `fullgraph` is an error.

Example:
    compile_layers(peft_model, quantized=False, say=print)   # in place; the model's forward is unchanged
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from finetune.model import decoder_layers


def compile_layers(model: Any, *, quantized: bool, say: Callable[[str], None]) -> int:
    """Compile every decoder layer of `model` in place (`nn.Module.compile`); returns how many."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(fullgraph=not quantized)
        # nn.Module.compile sets `_compiled_call_impl`, which `Module.__call__` runs when it is set.
        compiled = layer._compiled_call_impl
        assert compiled is not None, "nn.Module.compile no longer sets _compiled_call_impl"
        layer._compiled_call_impl = _compiled_while_recording_gradients(compiled, layer._call_impl)
    graphs = "graph breaks allowed around the quantized matmuls" if quantized else "fullgraph"
    say(f"compile: {len(layers)} decoder layers compiled one by one ({graphs}); the first steps of each shape compile")
    return len(layers)


def _compiled_while_recording_gradients(compiled: Callable[..., Any], eager: Callable[..., Any]) -> Callable[..., Any]:
    """A layer's call: `compiled` where autograd records (the training step), `eager` elsewhere."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return (compiled if torch.is_grad_enabled() else eager)(*args, **kwargs)

    return call

"""`train.compile`: each decoder layer compiled on its own (regional compilation), the rest left eager.

Compiling the whole model puts the loss, the head hook and every shape of the step inside one graph: a
head that selects the labelled rows (a different count every micro-batch) recompiles, so the whole-model
path had to fall back to the full logits. The decoder layers are where the work and the launches are, and
they are all alike: torch compiles the layer's code once for all of them (torchtune and torchtitan compile
per layer; they report +16-27% tokens/s). `fullgraph=True` makes a graph break an error instead of a silent
slowdown. Measured here on a tiny Llama with LoRA (dropout 0.05) on every linear layer and the document mask
of `finetune.training.document_mask`: no graph break, the first step compiling for about 80 s on a loaded
2-core CPU, then 2.5 s.

With a bitsandbytes (4/8-bit) base the layers hold bitsandbytes' own matmuls, which dynamo does not trace
whole: they are compiled without `fullgraph` (graph breaks around each quantized matmul), and the log says so.

Example:
    compile_layers(peft_model, quantized=False, say=print)   # in place; the model's forward is unchanged
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from finetune.model import decoder_layers


def compile_layers(model: Any, *, quantized: bool, say: Callable[[str], None]) -> int:
    """Compile every decoder layer of `model` in place (`nn.Module.compile`); returns how many."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(fullgraph=not quantized)
    graphs = "graph breaks allowed around the quantized matmuls" if quantized else "fullgraph"
    say(f"compile: {len(layers)} decoder layers compiled one by one ({graphs}); the first steps of each shape compile")
    return len(layers)

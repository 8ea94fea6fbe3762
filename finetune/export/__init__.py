"""Exports to formats other runtimes load: GGUF for llama.cpp (and Ollama, LM Studio), models and LoRA adapters.

Modules, one job each: `llama_layout` knows the Llama family's GGUF names, hyperparameters and q/k row
order; `gguf_tokenizer` turns a byte-level BPE tokenizer into GGUF metadata; `gguf_file` writes one file,
streamed and atomic; `gguf_model` exports a model directory; `gguf_lora` an adapter alone.

Example:
    from finetune.export.gguf_model import export_model_gguf
    export_model_gguf("merged/legal", "legal.gguf", dtype="q8_0")
"""

"""Adapter arithmetic: exact merge, subtract, swap and combine of LoRA adapters, in memory and on disk.

Modules, one job each: `lora` reads adapters and computes ΔW; `ledger` records what is merged;
`arithmetic` is the one merge formula; `pristine` serves untouched base tensors; `quantized` handles
bitsandbytes layers; `inmemory` is `LoadedModel`; `model_dir` writes model directories atomically;
`ondisk` merges checkpoints shard by shard; `combine` builds one adapter from several; `store` lists them.

Example:
    from finetune.adapters.lora import read_adapter
    read_adapter("adapters/legal").modules["model.layers.0.self_attn.q_proj"].delta()
"""

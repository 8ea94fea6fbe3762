"""Adapter arithmetic: exact merge, subtract, swap and combine of LoRA adapters, in memory and on disk.

Modules, one job each: `resolved_base` is the one value every operation on base weights starts from
(weights, ledger, pristine base, quantization, dtype, device); `lora` reads adapters and computes ΔW;
`fit` checks an adapter against a base; `ledger` records what is merged; `arithmetic` is the one merge
formula; `pristine` serves untouched base tensors on the base's device; `quantized` handles bitsandbytes
layers; `inmemory` is `LoadedModel`; `model_dir` writes model directories atomically; `disk_operation`
prepares an on-disk merge, subtract or swap, `disk_stream` writes it shard by shard and `ondisk` is the
three commands; `requantize` quantizes a merged checkpoint; `combine` builds one adapter from several;
`store` lists them; `result` is what an operation reports; `tied` and `tensor_index` are helpers.

Example:
    from finetune.adapters.lora import read_adapter
    read_adapter("adapters/legal").modules["model.layers.0.self_attn.q_proj"].delta()
"""

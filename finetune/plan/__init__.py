"""`finetune plan`: the peak memory of a run per device, estimated before anything is loaded.

Three steps, one module each: `model_config` finds the base's `config.json` (local directory, hub cache,
or the architecture numbers shipped in `finetune/plan/configs/` for the catalog's bases); `shape` counts
parameters exactly on the meta device (no weights, no memory) with the same peft wrapping training uses;
`memory` turns counts, the recipe and the process layout into parts in bytes, and `suggest` says what
to change when the run does not fit a device.

Example:
    from finetune.plan.memory import estimate
    plan = estimate(load_recipe("llama-3.1-8b-instruct-chat"), device="cuda")
    plan.peak_bytes / 2**30   # GiB on one GPU
"""

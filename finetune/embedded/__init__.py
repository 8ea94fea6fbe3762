"""The embedded default base: a tiny Llama built by this package (shipped prebuilt), and the quickstart's data.

One job per module: `cache` (where a base lives: shipped, or built once under a lock; `embedded:` ids),
`build` (the build recipe; `python -m finetune.embedded.build`), `corpus`, `synthetic` (copying rows),
`tokenizer`, `tiny` (the model config, the wired previous-token head), `pretrain` (the pretraining loop),
`quickstart_data` (the generated domain data).

Nothing is imported here: the quickstart's data generator (`python -m finetune.embedded.quickstart_data`)
needs none of the build stack, which `cache` pulls in (torch, transformers: 10 s of start-up).

Example:
    from finetune.embedded.cache import resolve_base_id
    resolve_base_id("embedded:tiny-llama")   # the shipped model directory (finetune/embedded/base/tiny-llama)
"""

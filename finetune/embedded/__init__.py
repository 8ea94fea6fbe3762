"""The embedded default base: a tiny Llama built locally (no download), and the quickstart's data.

One job per module: `cache` (where a base lives, building it once under a lock, `embedded:` ids),
`build` (the build recipe: corpus, tokenizer, model, pretraining), `corpus`, `tokenizer`, `tiny`
(the model config), `pretrain` (the pretraining loop), `quickstart_data` (the generated domain data).

Example:
    from finetune.embedded import resolve_base_id
    resolve_base_id("embedded:tiny-llama")   # the local model directory, built on first use
"""

from finetune.embedded.cache import EMBEDDED_PREFIX, embedded_base_dir, ensure_embedded_base, resolve_base_id

__all__ = ["EMBEDDED_PREFIX", "embedded_base_dir", "ensure_embedded_base", "resolve_base_id"]

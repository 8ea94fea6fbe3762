"""The embedded default base: a tiny Llama built locally on first use, named `embedded:<name>` in recipes.

One job per module: `cache` (where a base lives, building it once, resolving `embedded:` ids), `build`
(the build steps and registered settings), `tokenizer`, `corpus`, `pretrain`, `tiny` (the model), and
`quickstart_data` (the quickstart's generated data set).

Example:
    path = ensure_embedded_base("tiny-llama")      # builds on first use (about a minute), then cached
    resolve_base_id("embedded:tiny-llama")         # the same path, as a string
"""

from finetune.embedded.cache import EMBEDDED_PREFIX, embedded_base_dir, ensure_embedded_base, resolve_base_id

__all__ = ["EMBEDDED_PREFIX", "embedded_base_dir", "ensure_embedded_base", "resolve_base_id"]

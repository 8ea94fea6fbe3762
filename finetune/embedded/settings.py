"""What every embedded base is built from: the settings, the registry of names, the build format's version.

Plain data, apart from the build code (`finetune.embedded.build`, which imports torch and transformers), so that
resolving `embedded:tiny-llama` to its directory, which every command that loads a model does, and `finetune
plan` import none of the pretraining stack.

Example:
    EMBEDDED_BASES["tiny-llama"].vocab_size     # 2048
    settings_record(EMBEDDED_BASES["tiny-llama"])  # what the cache directory name is hashed from
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

TINY_LLAMA_SHAPE = dict(
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class PretrainSettings:
    """How long and how hard to pretrain."""

    steps: int
    micro_batch_size: int
    lr: float
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at `lr * min_lr_ratio`."""
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    heldout_rows: int = 16
    """Rows kept out of training and scored before and after, to show the model learnt something."""
    bf16_autocast: bool = True
    """Run the forward pass under bfloat16 autocast (about 1.5x faster on CPU); weights stay float32."""
    seed: int = 0


BUILD_FORMAT_VERSION = 2
"""Bump when the build code changes what it produces, so cached bases are rebuilt (new directory name).
2: synthetic copying rows in the pretraining mix; sha256 of the weights and tokenizer in the record."""


@dataclass(frozen=True)
class BuildSettings:
    """Everything an embedded base is built from; its cache directory name is derived from these."""

    corpus_max_bytes: int
    """Standard-library source read for the tokenizer and for pretraining, in UTF-8 bytes."""
    corpus_file_max_bytes: int
    """At most this many bytes from any one source file."""
    vocab_size: int
    seq_len: int
    """Pretraining row length in tokens."""
    pretraining: PretrainSettings
    shape: dict[str, int | bool] = field(default_factory=lambda: dict(TINY_LLAMA_SHAPE))
    """`LlamaConfig` fields; every linear out_features a multiple of 32 (bitsandbytes' CPU 4-bit)."""
    synthetic_fraction: float = 0.0
    """Share of the training rows that are synthetic copying rows (`finetune.embedded.synthetic`); the
    rest are the corpus's. Without them a small model does not learn to copy from its context."""
    copy_curriculum: PretrainSettings | None = None
    """A first pretraining phase on `repeat` rows alone, before the mixed one: with corpus rows in every
    batch from the start, copying had not formed after 1,500 steps; alone, it forms in a few hundred."""
    previous_token_head: bool = False
    """Start from a wired previous-token head (`tiny.wire_previous_token_head`), so that copying from
    the context is learnt within the pretraining budget."""
    init_seed: int = 0
    num_threads: int | None = None
    """torch threads for pretraining; None uses every CPU this process may run on. Part of the settings
    because it changes the weights: a different thread count sums in a different order, and 600 steps
    amplify that (1 vs 2 threads differed by up to 0.34 in a weight). A fixed count builds the same base
    on any machine with the same CPU kernels. The default uses 1: on 2 busy cores a 2-thread build took
    6x longer than a 1-thread one (threads spin-waiting for each other); on idle ones 2 threads would be
    about 1.5x faster."""


EMBEDDED_BASES: dict[str, BuildSettings] = {
    "tiny-llama": BuildSettings(
        corpus_max_bytes=4_000_000,
        corpus_file_max_bytes=16_000,
        vocab_size=2048,
        seq_len=256,
        pretraining=PretrainSettings(steps=1500, micro_batch_size=8, lr=3e-3, warmup_steps=50, heldout_rows=64),
        shape=dict(TINY_LLAMA_SHAPE),
        synthetic_fraction=0.5,
        copy_curriculum=PretrainSettings(
            steps=800, micro_batch_size=8, lr=3e-3, warmup_steps=30, min_lr_ratio=1.0, heldout_rows=64
        ),
        previous_token_head=True,
        num_threads=1,
    ),
}
"""The embedded bases a recipe can name as `embedded:<name>`."""


def settings_record(settings: BuildSettings) -> dict:
    """The settings as plain JSON-able data (also what the cache directory name is hashed from)."""
    return asdict(settings)

"""CLI command groups; each module exposes `register(subparsers)` (see `finetune.cli`)."""

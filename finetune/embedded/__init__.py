"""The embedded default: a tiny Llama-family base and tokenizer that need no download."""

"""The label of a position that carries no loss, shared by every step that builds or reads labels.

Labels follow the Hugging Face convention: aligned with `input_ids`, `IGNORE_INDEX` where no loss is
taken (prompts, padding, a document's first token in a packed row); the loss shifts them by one.

Example:
    labels = [IGNORE_INDEX] * len(prompt_ids) + response_ids
"""

IGNORE_INDEX = -100

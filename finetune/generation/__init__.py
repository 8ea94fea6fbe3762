"""Generation shared by serving and training: the running batch's KV cache (`kvbatch`) and batched sampling
from a model as it is now (`sample`), which GRPO uses to draw its completions from the adapter being trained.

Example:
    completions = sample_completions(peft_model, [[1, 5, 6]] * 4, SampleSettings(max_new_tokens=32), stop_ids={2})
"""

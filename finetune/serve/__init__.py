"""`finetune serve`: an OpenAI-compatible HTTP server for a base and its LoRA adapters, one job per module.

- `settings`: what the server is told (models, host/port, limits).
- `engine`: the model side: served names, prompts to tokens, batched forwards with per-row adapters
  (peft mixed batches; MoE expert LoRA per row through `adapters.expert_rows`) or one adapter merged exactly; adapters loaded, unloaded, swapped at runtime.
- `kvbatch`: the running batch's KV cache, mask and positions, rows joining and leaving between steps.
- `sampling`: the next token per row (greedy or seeded sampling); `textstream`: tokens to text pieces, stops.
- `batcher`: the worker thread that schedules sequences into forwards (iteration-level batching).
- `protocol`: OpenAI request validation and response JSON; `app`: the FastAPI routes.
- `server`: binding, uvicorn, foreground (`serve_forever`) or background (`ServerThread`).

Example:
    finetune serve models/tiny --adapter legal=adapters/legal --adapter med=adapters/med --port 8000
"""

"""Batched sampling with a KV cache from a model as it is now: every row of a batch decoded together.

All prompts (GRPO: every prompt of a step, each repeated `num_generations` times) are decoded in one
left-padded batch (`KVBatch`): a prefill forward, then one token per row per forward. Rows that have
written a stop token leave the batch (`KVBatch.select`, one copy of the cache) once they are a quarter
of it, so late steps run on the rows still writing. Filters are applied as transformers' `generate`
applies them: temperature, then top-k, then top-p (the smallest set of tokens whose probability reaches
`top_p`). Draws use the process's global torch RNG on the model's device, so a checkpoint that holds
the RNG state resumes the same samples; or, given `uniforms`, a table of each row's uniform numbers drawn
beforehand (GRPO keys them by the prompt's place in the step's global batch, or in evaluation by its record,
so a row draws the same tokens whichever process samples it and whatever else is in its batch).

Per token the host does little: the cache writes one column in place (`KVBatch` with `room`), the token
is drawn with one random number per row (`draw`) and written into a device table, and the host reads one
count (how many rows have stopped?). Rows that share a prompt (GRPO's group) share its prefill. The prefill
is the model's own forward with peft's LoRA layers as plain matrix products (`lean_lora`, the same outputs
bit for bit); each decode step, for the Llama-family models it takes, is `LeanDecoder.step`: a few tensor
ops per layer over copies of the weights with the LoRA update merged in, made at the start of each call
and freed at its end (the logits equal the model's within float rounding). Otherwise the model's own forward
decodes too, with no copy of the weights.

The model runs in eval mode (no dropout: the samples come from the policy the loss scores) under
`torch.inference_mode` (`torch.no_grad` on a sharded model); its training mode is restored after.

Example:
    settings = SampleSettings(max_new_tokens=32, temperature=1.0)
    completions = sample_completions(model, [[1, 5, 6], [1, 7]], settings, stop_ids={2}, pad_token_id=0)
    completions[0]     # [token, ..., 2]: up to and including the first stop token
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from finetune.generation.kvbatch import KVBatch
from finetune.generation.lean_decoder import LeanDecoder
from finetune.generation.lean_lora import lean_lora


@dataclass(frozen=True)
class SampleSettings:
    """How tokens are drawn. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def filtered_scores(logits: torch.Tensor, settings: SampleSettings) -> torch.Tensor:
    """(B, V) logits -> scores after temperature, top-k and top-p (filtered-out tokens at -inf)."""
    scores = logits.float() / settings.temperature
    if 0 < settings.top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, settings.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if settings.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probabilities = sorted_scores.softmax(dim=-1)
        mass_before = probabilities.cumsum(dim=-1) - probabilities
        drop = mass_before >= settings.top_p  # the tokens before this one already reach top_p
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    return scores


def draw(logits: torch.Tensor, settings: SampleSettings, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One token id per row of `logits` (B, V), as a (B,) tensor on the logits' device.

    A draw inverts each row's cumulative distribution at one uniform number: B random numbers per step, where
    `torch.multinomial` or the exponential race draw B x V (on a CPU, drawing the randoms of a 2,048-word
    vocabulary for 32 rows cost more than the tiny base's forward). The cumulative sum is float64, so its
    rounding is far below any token's probability; filtered-out tokens (probability 0) add nothing to it
    and are never the first index past the drawn point. `uniform`: (B,) float64 numbers in [0, 1) to use
    instead of drawing them from the global RNG."""
    if settings.temperature == 0.0:
        return logits.argmax(dim=-1)
    cumulative = filtered_scores(logits, settings).softmax(dim=-1).double().cumsum(dim=-1)  # (B, V)
    if uniform is None:
        uniform = torch.rand(len(cumulative), dtype=torch.float64, device=cumulative.device)
    point = uniform[:, None] * cumulative[:, -1:]
    return torch.searchsorted(cumulative, point, right=True).squeeze(-1).clamp_(max=cumulative.shape[-1] - 1)


def sample_completions(
    model: Any,
    prompts: list[list[int]],
    settings: SampleSettings,
    *,
    stop_ids: set[int] | frozenset[int],
    pad_token_id: int,
    uniforms: torch.Tensor | None = None,
) -> list[list[int]]:
    """The completion of each prompt: its sampled tokens, up to and including the first stop token, at most
    `settings.max_new_tokens`. `uniforms`: (prompts, max_new_tokens) float64, row i's draw at token t uses
    `uniforms[i, t]` (default: the global RNG)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with _no_autograd(model):
            decoder = LeanDecoder.of(model)
            with lean_lora(model):
                return _decode(model, decoder, prompts, settings, stop_ids, pad_token_id, device, uniforms)
    finally:
        model.train(was_training)


def _no_autograd(model: Any) -> Any:
    """`torch.inference_mode` (no autograd bookkeeping per op: cheaper than `no_grad`; no tensor of it escapes),
    except where the parameters are sharded across processes: FSDP2 and DeepSpeed ZeRO-3 gather them into
    buffers they update in place after the forward, which tensors made in inference mode refuse."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) or hasattr(p, "ds_numel") for p in model.parameters()):
            return torch.no_grad()
    return torch.inference_mode()


def _decode(model, decoder, prompts, settings, stop_ids, pad_token_id, device, uniforms) -> list[list[int]]:
    """Prefill each distinct prompt once, copy its cache to the rows that share it, then decode (with
    `decoder`'s lean step where it took the model, else the model's forward).

    Tokens stay on the device in an (N, max_new_tokens) table; the host reads one flag per step (did a row
    stop?) and the table once at the end."""
    distinct: dict[tuple[int, ...], int] = {}
    source = [distinct.setdefault(tuple(prompt), len(distinct)) for prompt in prompts]
    batch = KVBatch.from_prompts([list(p) for p in distinct], ["policy"] * len(distinct), pad_token_id, device,
                                 room=settings.max_new_tokens)  # fmt: skip
    logits = model(input_ids=batch.input_ids, logits_to_keep=1, **batch.forward_kwargs()).logits[:, -1]
    batch.advance()
    if len(distinct) < len(prompts):  # each row of the decoding batch from its prompt's prefill
        index = torch.tensor(source, dtype=torch.long, device=device)
        batch.cache.batch_select_indices(index)
        batch.mask, batch.positions, logits = batch.mask[index], batch.positions[index], logits[index]
        batch.models = ["policy"] * len(prompts)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    table = torch.full((len(prompts), settings.max_new_tokens), -1, dtype=torch.long, device=device)
    rows = torch.arange(len(prompts), device=device)  # which prompt each batch row decodes
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)  # per batch row: has written a stop
    if uniforms is not None:
        uniforms = uniforms.to(device)
    for step in range(settings.max_new_tokens):
        chosen = draw(logits, settings, None if uniforms is None else uniforms[rows, step])  # (B_t,)
        table[rows, step] = chosen  # a finished row's later tokens come after its stop: never read
        if step + 1 == settings.max_new_tokens:
            break
        done |= torch.isin(chosen, stops)
        finished = int(done.sum())  # the one host read per step
        if finished == len(done):
            break
        if finished * 4 >= len(done):  # drop finished rows once they are a quarter of the batch (one copy)
            keep = (~done).nonzero().squeeze(-1)
            batch.select(keep.tolist())
            rows, chosen, done = rows[keep], chosen[keep], done[keep]
        logits = decoder.step(chosen, batch) if decoder else _forward_one(model, chosen, batch)
        batch.advance()
    return [_until_stop(row, stop_ids) for row in table.tolist()]


def _forward_one(model: Any, token_ids: torch.Tensor, batch: KVBatch) -> torch.Tensor:
    """The model's own forward of one token per row of an advanced batch: the next-token logits (B, V)."""
    kwargs = batch.forward_kwargs()
    return model(input_ids=token_ids[:, None], logits_to_keep=1, **kwargs).logits[:, -1]


def _until_stop(tokens: list[int], stop_ids: set[int] | frozenset[int]) -> list[int]:
    """A table row's tokens up to and including its first stop token (-1 marks steps it did not decode)."""
    out: list[int] = []
    for token in tokens:
        if token < 0:
            break
        out.append(token)
        if token in stop_ids:
            break
    return out

"""The running batch's tensors: KV cache, attention mask and position ids, row by row, between decode steps.

Rows are left-padded: every row's real tokens end at the same cache index, so one decode step appends
one column for all rows. A padded slot holds zero keys and values and is masked out (mask 0); each
row's position ids count its own real tokens only, so a row sees exactly the positions it would see
alone (RoPE is applied before keys are cached, so padding on the left never moves a cached key).
Rows join (`join`: the shorter cache is padded on the left) and leave (`select`) between steps, which is
what lets a server add requests to a running batch (iteration-level batching); columns that no row
uses any more are dropped (`select` trims them).

The cache is transformers' `DynamicCache` with plain full-attention layers, whose `keys`/`values`
tensors are (B, heads, T, head_dim). With `room` (a batch that knows how many tokens it will decode, as
sampling does), each layer is a `ReservedLayer`: its keys and values are the front of a buffer with that
many spare columns, so a decode step writes one column in place; a `DynamicLayer` concatenates the whole
cache instead (O(T) copied per token, O(T²) per completion).

Example:
    batch = KVBatch.from_prompts([[1, 5, 6], [1, 7]], models=["legal", "base"], pad_token_id=0, device=device)
    batch.input_ids        # (2, 3): [[1, 5, 6], [0, 1, 7]]
    out = model(input_ids=batch.input_ids, **batch.forward_kwargs())
    batch.advance(); ...   # then feed one (B, 1) token per row
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer


class KVBatch:
    """Rows being decoded together: their cache, mask (B, T), last position ids (B, 1) and model names."""

    def __init__(self, cache: DynamicCache, mask: torch.Tensor, positions: torch.Tensor, models: list[str]):
        self.cache = cache
        self.mask = mask  # (B, T) 1 = real token; T = cache length (+ the tokens of the next forward)
        self.positions = positions  # (B, q) position ids of the tokens the next forward feeds
        self.models = models
        self.input_ids: torch.Tensor | None = None  # (B, q) set for a prefill; decode steps pass their own

    @classmethod
    def from_prompts(
        cls, prompts: list[list[int]], models: list[str], pad_token_id: int, device: torch.device, room: int = 0
    ) -> KVBatch:
        """A batch ready for its prefill forward on `device` (the model's): prompts left-padded to the longest,
        empty cache; with `room`, a cache whose layers keep that many columns spare for decoding."""
        length = max(len(prompt) for prompt in prompts)
        ids = torch.tensor([[pad_token_id] * (length - len(p)) + p for p in prompts], dtype=torch.long, device=device)
        mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T): 0 at each row's first real token
        batch = cls(ReservedCache(room) if room else DynamicCache(), mask, positions, list(models))
        batch.input_ids = ids
        return batch

    def __len__(self) -> int:
        return len(self.models)

    def forward_kwargs(self) -> dict:
        """Keyword arguments of the model call for the tokens at `positions`."""
        return dict(attention_mask=self.mask, position_ids=self.positions, past_key_values=self.cache, use_cache=True)

    def advance(self) -> None:
        """After a forward: make room for one more token per row (mask column, next position)."""
        self.input_ids = None
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self), 1)], dim=1)
        self.positions = self.positions[:, -1:] + 1

    def join(self, other: KVBatch) -> None:
        """Append `other`'s rows (both advanced, i.e. waiting for their next token) to this batch."""
        self._pad_left(other.mask.shape[1] - self.mask.shape[1])
        other._pad_left(self.mask.shape[1] - other.mask.shape[1])
        for (mine, keys, values), (_, their_keys, their_values) in zip(
            _filled(self.cache), _filled(other.cache), strict=True
        ):
            mine.keys = torch.cat([keys, their_keys])
            mine.values = torch.cat([values, their_values])
        self.mask = torch.cat([self.mask, other.mask])
        self.positions = torch.cat([self.positions, other.positions])
        self.models += other.models

    def select(self, rows: list[int]) -> None:
        """Keep only `rows` (indices, in order), then drop the leading columns no kept row uses."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask, self.positions = self.mask[index], self.positions[index]
        self.models = [self.models[i] for i in rows]
        used = self.mask[:, :-1].any(dim=0).nonzero()  # the last column is the next token's: always kept
        unused = int(used[0]) if len(used) else self.mask.shape[1] - 1
        if unused:
            for layer, keys, values in _filled(self.cache):
                layer.keys, layer.values = keys[:, :, unused:], values[:, :, unused:]
            self.mask = self.mask[:, unused:]

    def _pad_left(self, columns: int) -> None:
        if columns <= 0:
            return
        for layer, keys, values in _filled(self.cache):
            layer.keys, layer.values = _pad_time(keys, columns), _pad_time(values, columns)
        self.mask = torch.cat([self.mask.new_zeros(len(self), columns), self.mask], dim=1)


class ReservedLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values are the first `length` columns of buffers with
    `room` more: `update` writes the new columns in place (and grows the buffers by `room` only when they
    are full). Whoever assigns `keys`/`values` (joining, trimming) hands over buffers without spare room;
    the next `update` then copies them once into new ones."""

    def __init__(self, room: int):
        self.room = room
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0
        super().__init__()

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._key_buffer is None else self._key_buffer[:, :, : self._length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._key_buffer = value
        self._length = 0 if value is None or value.dim() < 2 else value.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._value_buffer is None else self._value_buffer[:, :, : self._length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._value_buffer = value

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self._length, key_states.shape[-2]
        if self._key_buffer is None or self._value_buffer is None or length + new > self._key_buffer.shape[-2]:
            self._key_buffer = _grown(self._key_buffer, length, key_states, self.room)
            self._value_buffer = _grown(self._value_buffer, length, value_states, self.room)
        self._key_buffer[:, :, length : length + new] = key_states
        self._value_buffer[:, :, length : length + new] = value_states
        self._length = length + new
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` with their spare room (one copy of the buffers)."""
        if self._key_buffer is not None and self._value_buffer is not None:
            self._key_buffer, self._value_buffer = self._key_buffer[indices], self._value_buffer[indices]


class ReservedCache(DynamicCache):
    """A `DynamicCache` whose layers are `ReservedLayer`s with `room` spare columns each."""

    def __init__(self, room: int):
        super().__init__()
        self.layer_class_to_replicate = functools.partial(ReservedLayer, room)  # type: ignore[assignment]


def _grown(buffer: torch.Tensor | None, length: int, states: torch.Tensor, room: int) -> torch.Tensor:
    """A buffer (B, heads, length + new + room, d) holding `buffer`'s first `length` columns."""
    batch, heads, new, dim = states.shape
    grown = states.new_empty(batch, heads, length + new + room, dim)
    if buffer is not None and length:
        grown[:, :, :length] = buffer[:, :, :length]
    return grown


def _filled(cache: DynamicCache) -> list[tuple[CacheLayerMixin, torch.Tensor, torch.Tensor]]:
    """(layer, keys, values) of each cache layer: full-attention layers that a forward has filled."""
    filled = []
    for layer in cache.layers:
        if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
            raise TypeError(f"a batch's cache needs filled full-attention layers, not {type(layer).__name__}")
        filled.append((layer, layer.keys, layer.values))
    return filled


def _pad_time(states: torch.Tensor, columns: int) -> torch.Tensor:
    """(B, heads, T, d) -> (B, heads, columns + T, d) with zeros in front."""
    batch, heads, _, dim = states.shape
    return torch.cat([states.new_zeros(batch, heads, columns, dim), states], dim=2)

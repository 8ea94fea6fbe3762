"""Which documents form which micro-batch on which process: a deterministic, resumable stream.

A row of the training data is one document, so a micro-batch is `micro_batch_size` documents whether
packing is on or off (packing lays them out in fewer rows when they are collated): the steps per epoch
and the documents per step do not depend on packing.

Training consumes one endless stream of micro-batches, epoch after epoch; optimizer step `s` takes
micro-batches `s·G … s·G+G-1` (G = grad_accum_steps). Each epoch's order is a permutation seeded by
(seed, epoch) alone, never by global RNG state, so the position in the data is just a count of
micro-batches consumed: that count is all a checkpoint needs to resume at exactly the same document.

With several processes, each global micro-batch of `micro_batch_size · num_processes` documents is cut
into per-rank slices; an epoch whose size does not divide evenly wraps around to its start so every
rank runs the same number of micro-batches (collective ops must stay in lockstep).

Example:
    stream = MicroBatchStream(num_rows=1000, micro_batch_size=4, seed=0)
    stream.micro_batches_per_epoch  # 250
    stream.indices(position=0)      # row ids of the first micro-batch of this rank
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class MicroBatchStream:
    """The rows (documents) of micro-batch number `position` (0-based, counted across epochs) for one process."""

    num_rows: int
    micro_batch_size: int
    seed: int
    num_processes: int = 1
    process_index: int = 0

    @property
    def global_batch_rows(self) -> int:
        return self.micro_batch_size * self.num_processes

    @property
    def micro_batches_per_epoch(self) -> int:
        return math.ceil(self.num_rows / self.global_batch_rows)

    def epoch_order(self, epoch: int) -> tuple[int, ...]:
        """The row order of `epoch`: a permutation seeded by (seed, epoch), wrapped to whole global batches."""
        padded_rows = self.micro_batches_per_epoch * self.global_batch_rows
        return _epoch_order(self.num_rows, self.seed, epoch, padded_rows if self.num_processes > 1 else self.num_rows)

    def indices(self, position: int) -> list[int]:
        """Row ids of this process's slice of micro-batch `position`."""
        epoch, offset = divmod(position, self.micro_batches_per_epoch)
        order = self.epoch_order(epoch)
        start = offset * self.global_batch_rows + self.process_index * self.micro_batch_size
        return list(order[start : start + self.micro_batch_size])

    def rows_trained_on(self, micro_batches: int) -> list[int]:
        """Row ids, sorted and each once, of every process's slices of micro-batches 0 .. `micro_batches` - 1:
        the rows a run of that many micro-batches trains on (all of them once it reaches an epoch)."""
        if micro_batches >= self.micro_batches_per_epoch:
            return list(range(self.num_rows))
        return sorted(set(self.epoch_order(0)[: micro_batches * self.global_batch_rows]))

    def epoch_of(self, position: int) -> float:
        """Fractional epochs completed after `position` micro-batches."""
        return position / self.micro_batches_per_epoch


@lru_cache(maxsize=2)
def _epoch_order(num_rows: int, seed: int, epoch: int, padded_rows: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(num_rows, generator=generator).tolist()
    return tuple((order * math.ceil(padded_rows / num_rows))[:padded_rows])

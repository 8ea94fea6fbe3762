"""The micro-batch stream on its own: every document once per epoch on one process, the wrap-around that
keeps several ranks in lockstep, and positions that mean the same documents in any new stream (resume)."""

from __future__ import annotations

from collections import Counter

import pytest

from finetune.data.sampler import MicroBatchStream


def _epoch(stream: MicroBatchStream, epoch: int) -> list[list[int]]:
    first = epoch * stream.micro_batches_per_epoch
    return [stream.indices(position) for position in range(first, first + stream.micro_batches_per_epoch)]


def test_one_process_sees_every_document_once_per_epoch_and_a_short_last_batch():
    stream = MicroBatchStream(num_rows=10, micro_batch_size=4, seed=3)
    batches = _epoch(stream, 0)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(i for b in batches for i in b) == list(range(10))
    assert sorted(i for b in _epoch(stream, 1) for i in b) == list(range(10))
    assert _epoch(stream, 0) != _epoch(stream, 1)  # a new permutation each epoch


@pytest.mark.parametrize("num_rows, micro_batch_size, num_processes", [(10, 3, 2), (7, 2, 3), (12, 3, 2), (5, 4, 2)])
def test_ranks_wrap_around_to_the_epoch_start_and_stay_in_lockstep(num_rows, micro_batch_size, num_processes):
    ranks = [MicroBatchStream(num_rows, micro_batch_size, 0, num_processes, rank) for rank in range(num_processes)]
    per_rank = [_epoch(stream, 0) for stream in ranks]
    assert len({len(batches) for batches in per_rank}) == 1  # the same number of micro-batches on every rank
    assert all(len(batch) == micro_batch_size for batches in per_rank for batch in batches)
    seen = Counter(i for batches in per_rank for batch in batches for i in batch)
    assert set(seen) == set(range(num_rows))  # every document
    padded = ranks[0].micro_batches_per_epoch * micro_batch_size * num_processes
    repeats = padded - num_rows
    order = ranks[0].epoch_order(0)
    assert order[num_rows:] == order[:repeats]  # the padding repeats the epoch's first documents
    assert sum(seen.values()) == padded and sum(count - 1 for count in seen.values()) == repeats
    for position in range(ranks[0].micro_batches_per_epoch):  # ranks take disjoint slices of one global batch
        slices = [stream.indices(position) for stream in ranks]
        assert [i for part in slices for i in part] == list(
            order[position * micro_batch_size * num_processes : (position + 1) * micro_batch_size * num_processes]
        )


def test_a_global_batch_across_ranks_is_the_single_process_batch_of_the_same_size():
    ranks = [MicroBatchStream(12, 3, 5, 2, rank) for rank in range(2)]
    single = MicroBatchStream(12, 6, 5)
    for position in range(4):  # two epochs: 12 rows divide evenly, so no padding anywhere
        assert ranks[0].indices(position) + ranks[1].indices(position) == single.indices(position)


def test_a_position_means_the_same_documents_in_a_new_stream():
    before = MicroBatchStream(num_rows=50, micro_batch_size=4, seed=9, num_processes=2, process_index=1)
    after = MicroBatchStream(num_rows=50, micro_batch_size=4, seed=9, num_processes=2, process_index=1)
    assert [before.indices(p) for p in range(40)] == [after.indices(p) for p in range(40)]
    assert after.epoch_of(before.micro_batches_per_epoch * 2) == 2.0
    other_seed = MicroBatchStream(num_rows=50, micro_batch_size=4, seed=10, num_processes=2, process_index=1)
    assert other_seed.indices(0) != before.indices(0)


@pytest.mark.parametrize("num_rows, micro_batch_size, num_processes", [(10, 3, 1), (10, 3, 2), (7, 2, 3)])
def test_the_rows_a_run_trains_on_are_those_its_micro_batches_take(num_rows, micro_batch_size, num_processes):
    ranks = [MicroBatchStream(num_rows, micro_batch_size, 4, num_processes, rank) for rank in range(num_processes)]
    for micro_batches in range(2 * ranks[0].micro_batches_per_epoch + 1):
        taken = {i for stream in ranks for position in range(micro_batches) for i in stream.indices(position)}
        assert ranks[0].rows_trained_on(micro_batches) == sorted(taken), micro_batches
    assert ranks[0].rows_trained_on(1) != list(range(num_rows))

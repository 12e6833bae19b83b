"""The HSTU step's data: jagged batches of user histories with Zipf-distributed item ids, drawn
and collated on the host with numpy.

    loader = ZipfLoader(config, rank, num_batches)   # yields BatchKey(index)
    batch = collate(config, rank, key)               # HostBatch: the host-side preprocessing

The loader yields keys only; collate() is the preprocessing a training job runs in Python on the
host, and the step runs it in its h2d task (an iterator's work would run on the engine caller's
thread between iterations, serial under every thread map). Per user it draws a history length
(log-normal, clipped to [2, max_seq_len]), then ``events_per_token`` raw events per kept token
(Zipf item id, action type, timestamp), sorts all events by (user, time) and keeps each user's
most recent ``length`` events: the amount of host work grows with ``events_per_token``. Most of
it is numpy on large arrays (the random draws, the sort), which releases the GIL. Every batch is
a pure function of (config.seed, rank, index), whatever thread draws it and in whatever order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np

__all__ = ["BatchKey", "HostBatch", "ZipfLoader", "collate"]


class BatchKey(NamedTuple):
    index: int


@dataclass
class HostBatch:
    """One rank's batch on the host: ``lengths`` (batch_size,) int64; ``items`` and ``actions``
    (sum(lengths),) int64, the users' histories back to back (jagged); ``negatives``
    (num_negatives,) int64, the item ids the sampled softmax scores against."""

    lengths: np.ndarray
    items: np.ndarray
    actions: np.ndarray
    negatives: np.ndarray


class ZipfLoader:
    """``num_batches`` keys for one rank; iterate it once per run."""

    def __init__(self, num_batches: int) -> None:
        self.num_batches = num_batches

    def __iter__(self) -> Iterator[BatchKey]:
        return (BatchKey(i) for i in range(self.num_batches))


def _zipf_ids(rng: np.random.Generator, a: float, n: int, num_ids: int) -> np.ndarray:
    return (rng.zipf(a, n) - 1) % num_ids


def collate(config, rank: int, key: BatchKey) -> HostBatch:
    c = config
    rng = np.random.default_rng([c.seed, rank, key.index])
    mean_len = max(2.0, c.max_seq_len / 3)
    lengths = np.clip(rng.lognormal(np.log(mean_len), 0.6, c.batch_size), 2, c.max_seq_len)
    lengths = lengths.astype(np.int64)
    num_events = lengths * c.events_per_token
    user = np.repeat(np.arange(c.batch_size), num_events)
    time = rng.random(user.size)
    items = _zipf_ids(rng, c.zipf_a, user.size, c.num_items)
    actions = rng.integers(0, c.num_actions, user.size)
    order = np.lexsort((time, user))  # by user, then time; user is already sorted
    ends = np.cumsum(num_events)
    kept = order[np.arange(user.size) >= (ends - lengths)[user]]
    negatives = _zipf_ids(rng, c.zipf_a, c.num_negatives, c.num_items)
    return HostBatch(lengths, items[kept], actions[kept], negatives)

"""Grain pipeline: documents -> token ids (+EOS) -> concatenated and split into seq_len rows.

Rows carry `segment_ids` (1..k per row, 0 for padding) and `positions` (restarting at 0 in
each segment), so the model never attends across documents and no document is dropped:
one longer than seq_len continues in the next row. With `block_size` set, a document longer
than that many tokens becomes several documents (blocks) first, each with its own positions. The
order is a seeded global shuffle of documents, then a seeded window shuffle of the packed rows
(consecutive rows of one long document would otherwise fill whole batches); each process reads
`ds[process_index::process_count]`. With `workers`, Grain prefetches in that many processes
(`mp_prefetch`); the iterator's state then restores only into the same worker count.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import grain
import numpy as np
from tokenizers import Tokenizer

from r1jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Split:
    train: list[int]
    eval: list[int]


def split_documents(n: int, eval_fraction: float, seed: int) -> Split:
    """Held-out documents for eval: a seeded random subset, at least one when asked for any."""
    order = np.random.default_rng(seed).permutation(n)
    n_eval = 0 if eval_fraction == 0 else max(1, int(round(n * eval_fraction)))
    if n_eval >= n:
        n_eval = n - 1
    return Split(sorted(order[n_eval:].tolist()), sorted(order[:n_eval].tolist()))


@dataclasses.dataclass(frozen=True)
class _Subset:
    docs: Sequence[str]
    indices: list[int]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> str:
        return self.docs[self.indices[i]]


class _Blocks(grain.experimental.FlatMapTransform):
    """Token ids of one document -> consecutive blocks of at most `size` tokens (nothing dropped)."""
    max_fan_out = 1 << 30  # only bounds MapDataset.flat_map; the IterDataset one takes any fan-out

    def __init__(self, size: int):
        self.size = size

    def flat_map(self, row: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        ids = row["tokens"]
        return [{"tokens": ids[i:i + self.size]} for i in range(0, len(ids), self.size)]


class _Encode(grain.transforms.Map):
    def __init__(self, tokenizer: Tokenizer, eos: int | None):
        self.tok, self.eos = tokenizer, eos

    def map(self, text: str) -> dict[str, np.ndarray]:
        ids = self.tok.encode(text).ids
        if self.eos is not None:
            ids.append(self.eos)
        return {"tokens": np.asarray(ids, np.int32)}


class _OnRestore(grain.IterDataset):
    """Passes elements and state through; `fix(state)` vets or repairs a state before it is restored."""

    def __init__(self, parent: grain.IterDataset, fix: Callable[[dict], dict]):
        super().__init__(parent)
        self.fix = fix

    def __iter__(self) -> grain.DatasetIterator:
        return _OnRestoreIterator(self._parent.__iter__(), self.fix)


class _OnRestoreIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, fix: Callable[[dict], dict]):
        super().__init__(parent)
        self.fix = fix

    def __next__(self):
        return next(self._parent)

    def get_state(self) -> dict:
        return self._parent.get_state()

    def set_state(self, state: dict) -> None:
        self._parent.set_state(self.fix(state))


def _tuple_slices(state: dict) -> dict:
    # grain 0.2.18's ConcatThenSplit tests `slice != (-1, -1)` for "no remainder", but a state that
    # went through JSON (every checkpoint does) holds lists, so the restored packer would emit a
    # document it had already finished again.
    return {**state, "remainder_slices": {k: tuple(v) for k, v in state["remainder_slices"].items()}}


def saved_workers(state: dict) -> int:
    """The data.workers an iterator state was saved with (a ShardsIterator's: its first shard's)."""
    state = state["shards"][0] if "shards" in state else state
    return len(state.get("iterators_in_use_states", ()))  # one state per mp_prefetch worker


def _same_workers(workers: int, state: dict) -> dict:
    saved = saved_workers(state)
    if saved != workers:
        raise ConfigError(f"data.workers={workers}: the data iterator in this checkpoint ran with {saved} "
                          f"workers; resume with data.workers={saved}")
    return state


def _rename(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"ids": row["tokens"], "segment_ids": row["tokens_segment_ids"].astype(np.int32),
            "positions": row["tokens_positions"].astype(np.int32)}


def lm_batches(docs: Sequence[str], indices: Sequence[int], tokenizer: Tokenizer, eos: int | None, *,
               seq_len: int, batch_size: int, seed: int, shard_index: int = 0, shard_count: int = 1,
               epochs: int | None = None, shuffle_rows: int = 512, block_size: int = 0,
               workers: int = 0) -> grain.IterDataset:
    """An IterDataset of {'ids','segment_ids','positions'} int32 [batch_size, seq_len] (per process).

    `docs[indices[k]]` are the documents; `epochs=None` repeats forever (each epoch reshuffled);
    `block_size` > 0 splits documents into blocks of at most that many tokens (data.block_size);
    `workers` > 0 runs the pipeline in that many processes (data.workers)."""
    ds = grain.MapDataset.source(_Subset(docs, list(indices)))
    ds = ds.seed(seed).shuffle().repeat(epochs)[shard_index::shard_count].map(_Encode(tokenizer, eos))
    # Worker processes each run this whole chain; more threads per worker only contend for cores.
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1 if workers else 2, prefetch_buffer_size=16))
    if block_size:
        it = grain.experimental.FlatMapIterDataset(it, _Blocks(block_size))
    it = _OnRestore(grain.experimental.ConcatThenSplitIterDataset(it, length_struct={"tokens": seq_len}),
                    _tuple_slices)
    if shuffle_rows > 1:
        it = grain.experimental.WindowShuffleIterDataset(it, window_size=shuffle_rows, seed=seed)
    it = it.map(_rename).batch(batch_size, drop_remainder=epochs is None)
    if workers:
        from absl import flags
        if not flags.FLAGS.is_parsed():  # mp_prefetch reads absl flags; outside absl.app they are unparsed
            flags.FLAGS.mark_as_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=4))
    return _OnRestore(it, functools.partial(_same_workers, workers))


class ShardsIterator(grain.DatasetIterator):
    """Several data shards read by one process: their batches side by side, in shard order.

    A process that reads shards [a, b) of S places exactly the rows that processes a..b-1 of an
    S-process run would, so runs with different process counts but the same S see the same
    global batches (distributed.data_shards). The state holds one state per shard."""

    def __init__(self, iterators: Sequence[grain.DatasetIterator]):
        super().__init__(list(iterators))
        self._its = list(iterators)

    def __next__(self) -> dict[str, np.ndarray]:
        parts = [next(it) for it in self._its]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def get_state(self) -> dict:
        return {"shards": [it.get_state() for it in self._its]}

    def set_state(self, state: dict) -> None:
        for it, s in zip(self._its, state["shards"], strict=True):
            it.set_state(s)

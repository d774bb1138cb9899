"""Grain pipeline: documents -> token ids (+EOS) -> concatenated and split into seq_len rows.

Rows carry `segment_ids` (1..k per row, 0 for padding) and `positions` (restarting at 0 in
each segment), so the model never attends across documents and no document is dropped:
one longer than seq_len continues in the next row. The order is a seeded global shuffle of
documents, then a seeded window shuffle of the packed rows (consecutive rows of one long
document would otherwise fill whole batches); each process reads
`ds[process_index::process_count]`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import grain
import numpy as np
from tokenizers import Tokenizer


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


class _Encode(grain.transforms.Map):
    def __init__(self, tokenizer: Tokenizer, eos: int | None):
        self.tok, self.eos = tokenizer, eos

    def map(self, text: str) -> dict[str, np.ndarray]:
        ids = self.tok.encode(text).ids
        if self.eos is not None:
            ids.append(self.eos)
        return {"tokens": np.asarray(ids, np.int32)}


def _rename(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"ids": row["tokens"], "segment_ids": row["tokens_segment_ids"].astype(np.int32),
            "positions": row["tokens_positions"].astype(np.int32)}


def lm_batches(docs: Sequence[str], indices: Sequence[int], tokenizer: Tokenizer, eos: int | None, *,
               seq_len: int, batch_size: int, seed: int, shard_index: int = 0, shard_count: int = 1,
               epochs: int | None = None, shuffle_rows: int = 512) -> grain.IterDataset:
    """An IterDataset of {'ids','segment_ids','positions'} int32 [batch_size, seq_len] (per process)."""
    ds = grain.MapDataset.source(_Subset(docs, list(indices)))
    ds = ds.seed(seed).shuffle().repeat(epochs)[shard_index::shard_count].map(_Encode(tokenizer, eos))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=16))
    it = grain.experimental.ConcatThenSplitIterDataset(it, length_struct={"tokens": seq_len})
    if shuffle_rows > 1:
        it = grain.experimental.WindowShuffleIterDataset(it, window_size=shuffle_rows, seed=seed)
    return it.map(_rename).batch(batch_size, drop_remainder=epochs is None)

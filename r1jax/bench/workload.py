"""The benchmark's batches: a learnable synthetic token stream, identical for every framework.

Each row is a first-order Markov chain over the vocabulary: with probability `follow` the next
token is `successor[token]` (a fixed random permutation), otherwise a fresh Zipf-distributed
token. A model can learn the successor table, so the loss falls from ln(V) towards the chain's
entropy and the loss curves of two implementations say whether they train alike; no tokenizer or
corpus is needed, so the bench starts in seconds and both processes read the same array.
"""
from __future__ import annotations

import numpy as np


def batches(vocab: int, batch: int, seq_len: int, n: int, seed: int = 0, follow: float = 0.75,
            zipf: float = 1.1) -> np.ndarray:
    """[n, batch, seq_len] int32 token ids."""
    rng = np.random.default_rng(seed)
    successor = rng.permutation(vocab)
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = ranks ** -zipf
    p /= p.sum()
    order = rng.permutation(vocab)          # which ids are frequent
    rows = n * batch
    out = np.empty((rows, seq_len), np.int64)
    out[:, 0] = order[rng.choice(vocab, rows, p=p)]
    fresh = order[rng.choice(vocab, (rows, seq_len), p=p)]
    keep = rng.random((rows, seq_len)) < follow
    for t in range(1, seq_len):
        out[:, t] = np.where(keep[:, t], successor[out[:, t - 1]], fresh[:, t])
    return out.reshape(n, batch, seq_len).astype(np.int32)

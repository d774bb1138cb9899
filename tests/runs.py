"""Shared by the tests that train tiny.yaml a few steps and compare runs: the same packed batches
(two documents a row) on any mesh."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from r1jax import config as configlib
from r1jax.parallel import mesh as meshlib
from r1jax.train.step import build

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def train_tiny(overrides: list[str], devices: list, steps: int):
    """`steps` train steps of tiny.yaml + `overrides` on `devices`, each on fresh random tokens
    (seed 0) in rows of two packed documents. Returns (cfg, mesh, state, shardings, losses)."""
    cfg = configlib.load(TINY, overrides)
    mesh, _, state, shardings, _, step = build(cfg, meshlib.make_mesh(cfg.mesh, devices))
    rng = np.random.default_rng(0)
    B, T = cfg.train.global_batch_size, cfg.data.seq_len
    seg = np.ones((B, T), np.int32)
    seg[:, T // 2:] = 2
    pos = np.concatenate([np.arange(T // 2), np.arange(T - T // 2)])[None].repeat(B, 0).astype(np.int32)
    losses = []
    for _ in range(steps):
        batch = {"ids": rng.integers(0, cfg.model.vocab_size, (B, T)).astype(np.int32),
                 "segment_ids": seg, "positions": pos}
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return cfg, mesh, state, shardings, losses

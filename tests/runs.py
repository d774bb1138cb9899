"""Shared by the tests that train tiny.yaml a few steps and compare runs: the same packed batches
(two documents a row) on any mesh; with `loss.objective=masked_lm` in the overrides the batches
carry a random loss_mask (about 70% of the tokens are targets)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from r1jax import config as configlib
from r1jax.config import ObjectiveKind
from r1jax.parallel import mesh as meshlib
from r1jax.train.step import build

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def tiny_batches(cfg, steps: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    B, T = cfg.train.global_batch_size, cfg.data.seq_len
    seg = np.ones((B, T), np.int32)
    seg[:, T // 2:] = 2
    pos = np.concatenate([np.arange(T // 2), np.arange(T - T // 2)])[None].repeat(B, 0).astype(np.int32)
    out = []
    for _ in range(steps):
        batch = {"ids": rng.integers(0, cfg.model.vocab_size, (B, T)).astype(np.int32),
                 "segment_ids": seg, "positions": pos}
        if cfg.loss.objective is ObjectiveKind.masked_lm:
            batch["loss_mask"] = (rng.random((B, T)) < 0.7).astype(np.int32)
        out.append(batch)
    return out


def train_tiny(overrides: list[str], devices: list, steps: int, model=None):
    """`steps` train steps of tiny.yaml + `overrides` on `devices`, each on fresh random tokens
    (seed 0) in rows of two packed documents, from `model`'s weights (default: the run's own
    init, born in its shards). Returns (cfg, mesh, state, shardings, losses)."""
    cfg = configlib.load(TINY, overrides)
    setup = build(cfg, meshlib.make_mesh(cfg.mesh, devices), model=model)
    state, losses = setup.state, []
    for batch in tiny_batches(cfg, steps):
        state, m = setup.step(state, batch)
        losses.append(float(m["loss"]))
    return cfg, setup.mesh, state, setup.shardings, losses


def logits_and_grads(overrides: list[str]):
    """tiny.yaml + `overrides` on its mesh, fresh weights: the forward with MTP on a batch of
    random tokens (seed 0) and the gradient of the logits against a fixed random cotangent,
    compiled once. Returns (logits, {param path: gradient}, dropped pairs, the compiled HLO text)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from r1jax import weights
    cfg = configlib.load(TINY, overrides)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (cfg.train.global_batch_size, cfg.data.seq_len)),
                      jnp.int32)
    mesh = meshlib.make_mesh(cfg.mesh)
    graphdef, _ = weights.target(cfg, mesh, None)
    state = weights.fresh(cfg, mesh)
    params = nnx.state(nnx.merge(graphdef, state), nnx.Param)

    def f(params):
        out = nnx.merge(graphdef, nnx.merge_state(state, params))(ids, mtp=True)
        cot = jax.random.normal(jax.random.key(1), out.logits.shape)
        return jnp.sum(out.logits * cot) / out.logits.size, (out.logits, out.aux["dropped"])

    with meshlib.activate(mesh):
        compiled = jax.jit(jax.grad(f, has_aux=True)).lower(params).compile()
        grads, (logits, dropped) = compiled(params)
        hlo = compiled.as_text()
    return (np.asarray(logits), {k: np.asarray(v) for k, v in nnx.to_flat_state(grads)},
            int(np.asarray(dropped).sum()), hlo)

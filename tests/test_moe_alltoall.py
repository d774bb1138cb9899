"""kernels.moe_dispatch=alltoall (r1jax/kernels/expert_parallel.py), on data 2 x expert 4 over 8
fake CPU devices: at the buffer factor that never drops, min(ep, E/k), it equals the all-gather /
reduce-scatter exchange (outputs and gradients within 1e-6); at 1.25 x the balanced load it drops,
and the count it reports equals a NumPy count of the overflow per (source shard, destination)."""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from r1jax import config as configlib
from r1jax import weights
from r1jax.config import ConfigError, MeshConfig, ModelConfig
from r1jax.kernels import expert_parallel
from r1jax.model.moe import route
from r1jax.parallel import mesh as meshlib

ROOT = Path(__file__).resolve().parents[1]

E, D, F, T, K = 8, 32, 24, 128, 2
CFG = ModelConfig(hidden_size=D, n_routed_experts=E, n_group=4, topk_group=2, num_experts_per_tok=K,
                  moe_intermediate_size=F)
DATA, EP = 2, 4


@pytest.fixture(scope="module")
def setup():
    mesh = meshlib.make_mesh(MeshConfig(data=DATA, expert=EP))
    r = np.random.default_rng(0)
    x = r.normal(size=(T, D)).astype(np.float32)
    router = (r.normal(size=(D, E)) * 2 / np.sqrt(D)).astype(np.float32)
    bias = (r.normal(size=(E,)) * 0.3).astype(np.float32)
    experts = [(r.normal(size=s) / np.sqrt(s[1])).astype(np.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
    cot = r.normal(size=(T, D)).astype(np.float32)
    with meshlib.activate(mesh):
        tok = NamedSharding(mesh, P(("data", "fsdp", "expert")))
        exp = NamedSharding(mesh, P("expert"))
        placed = (jax.device_put(x, tok), jax.device_put(router, NamedSharding(mesh, P())),
                  tuple(jax.device_put(e, exp) for e in experts))
    return mesh, placed, bias, cot


def _run(setup, kind: str, buffer_factor: float = 0.0):
    mesh, (x, router, experts), bias, cot = setup

    def f(x, router, experts):
        w, idx, _ = route(x, router, jnp.asarray(bias), CFG)
        y, dropped = expert_parallel.routed(kind, x, w, idx, *experts, tile=8, capacity_factor=1.0,
                                            buffer_factor=buffer_factor)
        return y, (dropped, idx)

    @jax.jit
    def fwd_bwd(x, router, experts):
        y, vjp, (dropped, idx) = jax.vjp(f, x, router, experts, has_aux=True)
        return y, vjp(jnp.asarray(cot)), dropped, idx

    with meshlib.activate(mesh):
        y, grads, dropped, idx = fwd_bwd(x, router, experts)
    return np.asarray(y), jax.tree.map(np.asarray, grads), int(dropped), np.asarray(idx)


def test_exact_buffer_equals_gather_scatter(setup):
    assert expert_parallel.buffer_rows(T // (DATA * EP), K, E, EP, 0.0) == T // (DATA * EP) * min(K, E // EP)
    y, grads, dropped, _ = _run(setup, "alltoall")
    y_ref, grads_ref, dropped_ref, _ = _run(setup, "dropless")
    assert dropped == dropped_ref == 0
    d_y = float(np.abs(y - y_ref).max())
    # the expert-weight gradients (entries up to ~30) sum their pairs in another order: relative
    d_g = max(float(np.abs(a - b).max() / np.abs(b).max())
              for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)))
    print(f"\nalltoall (exact buffer) vs gather/scatter: max |dy| {d_y:.1e}, max |dgrad| / max |grad| {d_g:.1e}")
    assert d_y <= 1e-6 and d_g <= 1e-6


def test_small_buffer_drops_the_overflow_and_counts_it(setup):
    y, _, dropped, idx = _run(setup, "alltoall", 1.25)
    shards, El = DATA * EP, E // EP
    Tl = T // shards
    B = expert_parallel.buffer_rows(Tl, K, E, EP, 1.25)
    want = 0
    for s in range(shards):                  # the tokens of batch shard s, sent to each expert shard
        counts = np.bincount(idx[s * Tl:(s + 1) * Tl].reshape(-1) // El, minlength=EP)
        want += int(np.maximum(counts - B, 0).sum())
    print(f"\nalltoall at 1.25 x balanced ({B} pairs per destination): {dropped} of {T * K} pairs dropped")
    assert want > 0 and dropped == want
    assert np.isfinite(y).all()



def test_the_model_takes_it_from_the_config():
    """kernels.moe_dispatch=alltoall reaches the MoE layers of the model (tiny.yaml on data 2 x
    expert 4): logits equal those of the default exchange, nothing dropped; with a 1.0 buffer
    factor some pairs drop and the model reports them."""
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (8, 64)), jnp.int32)
    out = {}
    for name, extra in {"dropless": [], "alltoall": ["kernels.moe_dispatch=alltoall"],
                        "alltoall_1.0": ["kernels.moe_dispatch=alltoall", "kernels.moe_buffer_factor=1.0"]}.items():
        cfg = configlib.load(ROOT / "configs" / "tiny.yaml", ["mesh.data=2", "mesh.expert=4", *extra])
        mesh = meshlib.make_mesh(cfg.mesh)
        graphdef, _ = weights.target(cfg, mesh, None)
        state = weights.fresh(cfg, mesh)
        with meshlib.activate(mesh):
            o = jax.jit(lambda st: nnx.merge(graphdef, st)(ids, mtp=True))(state)
        out[name] = (np.asarray(o.logits), int(np.asarray(o.aux["dropped"]).sum()))
    assert np.abs(out["alltoall"][0] - out["dropless"][0]).max() <= 1e-5 and out["alltoall"][1] == 0
    assert out["alltoall_1.0"][1] > 0


def test_a_buffer_factor_below_one_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^kernels.moe_buffer_factor=0.5: must be >= 1 \(x the balanced load\), or 0"):
        configlib.load(ROOT / "configs" / "tiny.yaml", ["kernels.moe_dispatch=alltoall", "kernels.moe_buffer_factor=0.5"])

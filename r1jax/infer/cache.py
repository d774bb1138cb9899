"""The MLA latent cache: allocation, shardings and sizes.

Per layer and token the cache holds the normed latent [kv_lora_rank] and the roped key
[qk_rope_head_dim] (r1jax/model/kv.py says how the model writes and reads them), in fixed
slots of a fixed maximum length. Its dimensions carry logical names, so on a mesh its rows
shard like a batch (over the data axes) and nothing else is split.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from r1jax import logical
from r1jax.config import ModelConfig
from r1jax.model.kv import KV, StackKV
from r1jax.parallel import mesh as meshlib

NAMES = ("layers", "batch", "cache_seq", None)      # [L, slots, max_len, C or R]


def stack_sizes(m: ModelConfig) -> dict[str, int]:
    """Layers per cache stack: the dense prefix, the MoE stack and the MTP modules."""
    sizes = {"dense": m.first_k_dense_replace, "moe": m.num_moe_layers, "mtp": m.num_nextn_predict_layers}
    return {k: v for k, v in sizes.items() if v > 0}


def shapes(m: ModelConfig, slots: int, max_len: int, dtype, *, mtp: bool = True, unrolled: bool = False) -> KV:
    """The cache as ShapeDtypeStructs (no sharding); `unrolled`: one buffer per layer."""
    def stack(n):
        if unrolled:
            return StackKV(tuple(jax.ShapeDtypeStruct((slots, max_len, m.kv_lora_rank), dtype) for _ in range(n)),
                           tuple(jax.ShapeDtypeStruct((slots, max_len, m.qk_rope_head_dim), dtype) for _ in range(n)))
        return StackKV(jax.ShapeDtypeStruct((n, slots, max_len, m.kv_lora_rank), dtype),
                       jax.ShapeDtypeStruct((n, slots, max_len, m.qk_rope_head_dim), dtype))
    return KV({k: stack(n) for k, n in stack_sizes(m).items() if mtp or k != "mtp"})


def shardings(kv: KV, mesh: Mesh) -> KV:
    """Every cache array's NamedSharding on `mesh`: rows over the batch axes."""
    with meshlib.activate(mesh):
        stacked, layer = NamedSharding(mesh, logical.spec(*NAMES)), NamedSharding(mesh, logical.spec(*NAMES[1:]))
    return jax.tree.map(lambda a: stacked if len(a.shape) == 4 else layer, kv)


def zeros(m: ModelConfig, slots: int, max_len: int, dtype, mesh: Mesh | None = None, *, mtp: bool = True,
          unrolled: bool = False, bits: bool = False) -> KV:
    """A zeroed cache, created in its shards when `mesh` is given. `bits`: a 16-bit float cache
    is stored as uint16 bit patterns with `KV.view` naming the dtype (r1jax/model/kv.py says why;
    zero bits are 0.0)."""
    view = None
    if bits and jnp.dtype(dtype).itemsize == 2:
        view, dtype = jnp.dtype(dtype).name, jnp.uint16
    abstract = shapes(m, slots, max_len, dtype, mtp=mtp, unrolled=unrolled)
    if mesh is None:
        kv = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
    else:
        sh = shardings(abstract, mesh)
        kv = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract), out_shardings=sh)()
    return dataclasses.replace(kv, view=view)


def bytes_per_token(m: ModelConfig, dtype, *, mtp: bool = False) -> int:
    """Cache bytes one token occupies over all layers (the MTP module's own when `mtp`)."""
    layers = m.num_hidden_layers + (m.num_nextn_predict_layers if mtp else 0)
    return layers * (m.kv_lora_rank + m.qk_rope_head_dim) * jnp.dtype(dtype).itemsize


def mha_bytes_per_token(m: ModelConfig, dtype) -> int:
    """What per-head keys and values would take (DeepSeek's "naive" cache, HF 4.x, MaxText's
    default): N x (K + R + V) per layer."""
    per_layer = m.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    return m.num_hidden_layers * per_layer * jnp.dtype(dtype).itemsize


def describe(m: ModelConfig, dtype, slots: int, max_len: int) -> str:
    """One line: bytes per token and per slot, against the MHA-equivalent."""
    lat, mha = bytes_per_token(m, dtype), mha_bytes_per_token(m, dtype)
    return (f"latent cache {lat:,} B/token, {lat * max_len / 2**20:.2f} MiB/slot of {max_len} positions, "
            f"{lat * max_len * slots / 2**20:.1f} MiB for {slots} slots ({jnp.dtype(dtype).name}); "
            f"per-head K/V would take {mha:,} B/token ({mha / lat:.1f}x)")

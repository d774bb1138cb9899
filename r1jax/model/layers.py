"""Basic layers: parameters with logical axis names, RMSNorm, embedding, SwiGLU MLP.

Parameters are fp32 masters; `dtype` is the compute dtype they are cast to at use. Every
parameter carries logical axis names in its `out_sharding` metadata, which
`r1jax.parallel.mesh.LOGICAL_RULES` maps to mesh axes.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from r1jax.parallel.mesh import constrain

F32 = jnp.float32


class RouterBias(nnx.Variable):
    """DeepSeek-V3's `e_score_correction_bias`: state that steers expert selection only.

    Not an `nnx.Param`, so gradients and the optimizer never see it; the train step updates it
    from expert loads (aux-loss-free balancing)."""


def normal_param(rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], std: float) -> nnx.Param:
    w = jax.random.normal(rngs.params(), tuple(shape), F32) * std
    return nnx.Param(w, out_sharding=tuple(axes))


def const_param(value: float, shape: Sequence[int], axes: Sequence[str | None]) -> nnx.Param:
    return nnx.Param(jnp.full(tuple(shape), value, F32), out_sharding=tuple(axes))


def cast(w: nnx.Variable | jax.Array, dtype) -> jax.Array:
    v = w[...] if isinstance(w, nnx.Variable) else w
    return v.astype(dtype)


class RMSNorm(nnx.Module):
    """w * x / sqrt(mean(x^2) + eps), normalised in fp32 and cast back before the scale (as HF)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = const_param(1.0, (dim,), ("norm",))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(F32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return cast(self.weight, self.dtype) * y.astype(self.dtype)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, std: float, dtype, *, rngs: nnx.Rngs):
        self.embedding_VD = normal_param(rngs, (vocab, dim), ("vocab", "embed"), std)
        self.dtype = dtype

    def __call__(self, ids_BT: jax.Array) -> jax.Array:
        x = jnp.take(self.embedding_VD[...], ids_BT, axis=0).astype(self.dtype)
        return constrain(x, "batch", "seq", "act_embed")


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Used for dense layers and the shared experts."""

    def __init__(self, dim: int, hidden: int, std: float, dtype, *, rngs: nnx.Rngs):
        self.gate_DF = normal_param(rngs, (dim, hidden), ("embed", "mlp"), std)
        self.up_DF = normal_param(rngs, (dim, hidden), ("embed", "mlp"), std)
        self.down_FD = normal_param(rngs, (hidden, dim), ("mlp", "embed"), std)
        self.dtype = dtype

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        dt = self.dtype
        g = checkpoint_name(jnp.einsum("BTD,DF->BTF", x_BTD, cast(self.gate_DF, dt)), "mlp_gate")
        u = checkpoint_name(jnp.einsum("BTD,DF->BTF", x_BTD, cast(self.up_DF, dt)), "mlp_up")
        h = constrain(jax.nn.silu(g) * u, "batch", "seq", "act_mlp")
        return jnp.einsum("BTF,FD->BTD", h, cast(self.down_FD, dt))

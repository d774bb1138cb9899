"""Basic layers: parameters with logical axis names, RMSNorm, embedding, SwiGLU MLP.

Parameters are fp32 masters; `dtype` is the compute dtype they are cast to at use. Every
variable is created by `r1jax.logical.variable` and carries its dimensions' logical names as
inert metadata; whoever owns a mesh maps them to mesh axes.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from r1jax.config import LoraConfig
from r1jax.logical import axes_of, constrain, mesh_axes, spec, variable
from r1jax.model import lora as loralib
from r1jax.model.lora import project

F32 = jnp.float32


class RouterBias(nnx.Variable):
    """DeepSeek-V3's `e_score_correction_bias`: state that steers expert selection only.

    Not an `nnx.Param`, so gradients and the optimizer never see it; the train step updates it
    from expert loads (aux-loss-free balancing)."""


def normal_param(rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], std: float) -> nnx.Param:
    return variable(nnx.Param, jax.random.normal(rngs.params(), tuple(shape), F32) * std, axes)


def const_param(value: float, shape: Sequence[int], axes: Sequence[str | None]) -> nnx.Param:
    return variable(nnx.Param, jnp.full(tuple(shape), value, F32), axes)


def cast(w: nnx.Variable | jax.Array, dtype) -> jax.Array:
    v = w[...] if isinstance(w, nnx.Variable) else w
    return v.astype(dtype)


def tap(w, z):
    """`w` (a compute-dtype copy of weights) with its gradient routed to `z` (fp32 zeros of the
    same tree) instead: sg(w) + z cast to w's dtype, the same values. Autodiff sums a loop
    constant's gradient over the iterations in the constant's own dtype, so a scan that reads
    a bf16 copy passes z in beside it and taps inside its body: the sum is kept in fp32, as
    when the loop reads the fp32 masters and casts them at each use (ZeRO-1's compute-dtype
    gather, r1jax/train/step.py). Integer leaves pass through."""
    def one(a, b):
        if not jnp.issubdtype(a.dtype, jnp.inexact):
            return a
        return jax.lax.stop_gradient(a) + b.astype(a.dtype)
    return jax.tree.map(one, w, z)


def _contract(x: jax.Array, w: jax.Array, n_in: int) -> jax.Array:
    dims = ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ()))
    return jax.lax.dot_general(x, w, dims)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """x [..., K1..Kn] . w [K1..Kn, N...] -> [..., N...]: a projection contracting x's last `n_in`
    dims with w's first `n_in`; the same as the einsum, with a weight gradient XLA:CPU runs fast.

    Why: for dw = x^T dy (a contraction over the leading, token dims of both) XLA:CPU's layout
    assignment transposes dy inside the elementwise fusion that produces it, a strided loop that
    cost more than the matmul itself (dense_small's SwiGLU backward: 2x the CPU time). Here x^T is
    materialised on its own (x is the smaller operand: K <= N for most projections) and kept out
    of fusions by an optimisation barrier, so the dot runs in XLA's native layout. GPU and TPU
    pass transposes to their GEMMs as flags and get the plain einsum gradient."""
    return _contract(x, w, n_in)


def _dense_fwd(x, w, n_in):
    return _contract(x, w, n_in), (x, w)


def _dense_bwd(n_in, res, dy):
    x, w = res
    n_out = w.ndim - n_in
    dx = jax.lax.dot_general(dy, w, ((tuple(range(dy.ndim - n_out, dy.ndim)), tuple(range(n_in, w.ndim))), ((), ())))
    K, N = math.prod(w.shape[:n_in]), math.prod(w.shape[n_in:])
    x2, dy2 = x.reshape(-1, K), dy.reshape(-1, N)
    if jax.default_backend() == "cpu":
        dw = jax.lax.optimization_barrier(x2.T) @ dy2
    else:
        dw = jax.lax.dot_general(x2, dy2, (((0,), (0,)), ((), ())))
    return dx.astype(x.dtype), dw.reshape(w.shape).astype(w.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


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
        self.embedding_WD = normal_param(rngs, (vocab, dim), ("vocab", "embed"), std)    # W: vocabulary
        self.dtype = dtype

    def __call__(self, ids_BT: jax.Array) -> jax.Array:
        # The table is split over its hidden axis (fsdp and, outside a pipeline's stages,
        # pipeline; expert under mesh.expert_fsdp). Either it is gathered whole over that axis
        # and each shard looks up its own rows, or each shard looks up the rows of every shard
        # that splits the hidden axis with it in its own slice of the table, and an all-to-all
        # hands each its rows whole: the batch rows gathered against the table gathered. The
        # smaller of the two runs (`lookup_in_place`): DeepSeek-V3's table (129,280 x 7,168)
        # has 16x more rows than a device's 8,192 tokens, so its lookup and the gradient's
        # scatter-add stay in place, where the gathered table (read in fp32, as the step keeps
        # the embedding) and its gradient are 3.5 GiB each; a small table is gathered.
        split = mesh_axes("embed")
        batch = axes_of(spec("batch")[0]) if split else ()
        keep = tuple(a for a in batch if a not in split)
        mesh = jax.sharding.get_abstract_mesh()
        size = lambda axes: math.prod(mesh.shape[a] for a in axes)
        vocab = self.embedding_WD.shape[0] // size(mesh_axes("vocab"))
        if not split or not lookup_in_place(vocab, ids_BT.size // size(keep) // size(split)):
            table = constrain(self.embedding_WD[...], "vocab", None)
            x = jnp.take(table, ids_BT, axis=0).astype(self.dtype)
            return constrain(x, "batch", "seq", "act_embed")
        rows = keep[0] if len(keep) == 1 else (keep or None)
        ids = jax.lax.with_sharding_constraint(ids_BT, P(rows, None))
        x = jnp.take(constrain(self.embedding_WD[...], "vocab", "embed"), ids, axis=0)
        x = jax.lax.with_sharding_constraint(x, P(rows, None, split[0] if len(split) == 1 else split))
        return constrain(x.astype(self.dtype), "batch", "seq", "act_embed")


def lookup_in_place(vocab_rows: int, looked_up: int) -> bool:
    """Whether an embedding lookup runs in the table's hidden-axis slices (`Embed`): when the
    rows a device looks up over all the shards it shares the hidden axis with (`looked_up`, its
    own tokens when the hidden axis splits over batch axes) are fewer than the table rows it
    would gather (`vocab_rows`, the vocabulary over its own split). Also the planner's."""
    return looked_up < vocab_rows


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Used for dense layers and the shared experts; with
    `lora` naming `lora_group` (mlp or shared_experts), each projection has an adapter. The
    generator may hold gate and up as one [D, 2F] `gate_DF` (`up_DF` None): one product for both
    (r1jax/infer/generator.py `_unstacked`)."""

    def __init__(self, dim: int, hidden: int, std: float, dtype, lora: LoraConfig | None = None, lora_group: str | None = None, *,
                 rngs: nnx.Rngs):
        self.gate_DF = normal_param(rngs, (dim, hidden), ("embed", "mlp"), std)
        self.up_DF = normal_param(rngs, (dim, hidden), ("embed", "mlp"), std)
        self.down_FD = normal_param(rngs, (hidden, dim), ("mlp", "embed"), std)
        self.dtype = dtype
        D, F = [(dim, "embed")], [(hidden, "mlp")]
        self.lora = loralib.adapters(lora, {"gate_proj": (D, {"gate_DF": F}), "up_proj": (D, {"up_DF": F}),
                                            "down_proj": (F, {"down_FD": D})}, rngs=rngs, group=lora_group)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        if self.up_DF.get_value() is None:   # the generator's layout: gate and up joined, [D, 2F]
            g, u = jnp.split(project(self, x_BTD, "gate_DF", dense, cast, target="gate_proj"), 2, axis=-1)
        else:
            g = checkpoint_name(project(self, x_BTD, "gate_DF", dense, cast, target="gate_proj"), "mlp_gate")  # BTD,DF->BTF
            u = checkpoint_name(project(self, x_BTD, "up_DF", dense, cast, target="up_proj"), "mlp_up")
        h = constrain(jax.nn.silu(g) * u, "batch", "seq", "act_mlp")
        return project(self, h, "down_FD", dense, cast, target="down_proj")       # BTF,FD->BTD

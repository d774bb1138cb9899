"""Expert parallelism: routed experts sharded over the mesh axis the `experts` logical axis maps
to (under the active rules; this module names no mesh axis), tokens exchanged inside
`jax.shard_map` (manual over the batch axes, the rest left to GSPMD).

Three exchanges, chosen by `kernels.moe_dispatch`:
- `capacity`: each shard sends each expert at most C = ceil(cf * T_local * k / E) of its pairs
  through `all_to_all`, the owner runs them as one batched [E_local, ep*C, D] product, a second
  `all_to_all` brings the results back; overflow pairs are dropped and counted. Static shapes
  and the least traffic; `lax.ragged_all_to_all` (exact and variable-size) is unimplemented on
  XLA:CPU, so this fixed-capacity form is the one tests can run.
- `alltoall`: bounded and dropless by default. Each shard sends each other shard at most
  B = ceil(f * T_local * k / ep) pairs (f x the balanced load) through `all_to_all`, with each
  pair's local expert id; the owner runs its experts over the ep*B rows with the dropless tile
  kernel, and a second `all_to_all` returns the results. One token sends a shard at most
  min(k, E_local) pairs, so f = min(ep, E/k) (`kernels.moe_buffer_factor=0`) never drops; a
  smaller f drops the overflow (first choices keep their slots first) and counts it. Moves
  f*k/ep of the tokens each way instead of ep x; DeepSeek-V3 at ep 64 is f = 32 exact, and
  MaxText's ragged buffer factor plays the same part. (`lax.ragged_all_to_all` would send only
  the rows in use; XLA:CPU does not implement it.)
- every other dispatch: each shard all-gathers the tokens of its expert group, runs its local
  experts on the pairs routed to them (with `gather` or `dense` when asked, as decode does; else
  the dropless tile kernel), and a reduce-scatter returns each token's sum. Exact; moves ep x
  the MoE input instead of k/E of it.

Expert-weight gradients stay sharded over the expert axis; shard_map's autodiff sums the
replicated router/shared gradients over the batch axes.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from r1jax import logical
from r1jax.kernels import dispatch


def expert_axis() -> tuple[str | None, int]:
    """(mesh axis the experts are sharded over, its size); (None, 1) without expert parallelism."""
    axes = logical.mesh_axes("experts")
    if not axes:
        return None, 1
    if len(axes) > 1:
        raise ValueError(f"experts may be sharded over one mesh axis, not {axes}")
    return axes[0], jax.sharding.get_abstract_mesh().shape[axes[0]]


def routed(kind: str, x_TD, w, idx, gate, up, down, *, tile: int, capacity_factor: float,
           buffer_factor: float = 0.0):
    """Routed-expert output [T, D] and the global count of dropped pairs, experts sharded."""
    mesh = jax.sharding.get_abstract_mesh()
    axis, ep = expert_axis()
    token_axes = logical.mesh_axes("batch")
    if axis not in token_axes:
        raise ValueError(f"expert parallelism needs the tokens sharded over '{axis}' too (batch rule)")
    E = gate.shape[0]

    def body(x, w, idx, gate, up, down):
        if kind == "capacity":
            y, dropped = _all_to_all(x, w, idx, gate, up, down, axis, ep, E, capacity_factor)
        elif kind == "alltoall":
            y, dropped = _buffered(x, w, idx, gate, up, down, axis, ep, E, buffer_factor, tile)
        else:
            y, dropped = _gather_scatter(kind, x, w, idx, gate, up, down, axis, ep, tile)
        return y, lax.psum(dropped, token_axes)

    tok, exp = P(token_axes), P(axis)
    return jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, exp, exp, exp), out_specs=(tok, P()),
                         axis_names=set(token_axes))(x_TD, w, idx, gate, up, down)


def _gather_scatter(kind, x, w, idx, gate, up, down, axis, ep, tile):
    El = gate.shape[0]
    lo = lax.axis_index(axis) * El
    xs = lax.all_gather(x, axis, tiled=True)                     # [ep*Tl, D]: the expert group's tokens
    ws, ids = lax.all_gather(w, axis, tiled=True), lax.all_gather(idx, axis, tiled=True)
    local = jnp.where((ids >= lo) & (ids < lo + El), ids - lo, El)   # El: routed to another shard
    local_kernel = dispatch.ROUTED[kind if kind in ("gather", "dense") else "dropless"]
    y, _ = local_kernel(xs, ws, local, gate, up, down, tile=tile)
    return lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True), jnp.int32(0)


def _all_to_all(x, w, idx, gate, up, down, axis, ep, E, capacity_factor):
    Tl, k = idx.shape
    D, El = x.shape[1], E // ep
    C = max(1, math.ceil(capacity_factor * Tl * k / E))         # per (source shard, expert)
    pos, keep = dispatch.first_slots(idx, E, C)
    slot = jnp.where(keep, idx * C + pos, E * C)                  # E*C: dropped
    token = jnp.broadcast_to(jnp.arange(Tl, dtype=jnp.int32)[:, None], (Tl, k))
    table = jnp.full((E * C + 1,), Tl, jnp.int32).at[slot.reshape(-1)].set(token.reshape(-1))[:-1]
    send = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[table].reshape(ep, El, C, D)   # dim0: destination
    recv = lax.all_to_all(send, axis, 0, 0)                                                # dim0: source
    xe = recv.transpose(1, 0, 2, 3).reshape(El, ep * C, D)
    h = jax.nn.silu(jnp.einsum("ECD,EDF->ECF", xe, gate)) * jnp.einsum("ECD,EDF->ECF", xe, up)
    ye = jnp.einsum("ECF,EFD->ECD", h, down).reshape(El, ep, C, D).transpose(1, 0, 2, 3)
    back = lax.all_to_all(ye, axis, 0, 0).reshape(E * C, D)                                # owner order
    out = jnp.concatenate([back, jnp.zeros((1, D), back.dtype)])[slot]                     # [Tl,k,D]
    y = jnp.einsum("tkd,tk->td", out, w.astype(x.dtype))
    return y, (Tl * k - keep.sum()).astype(jnp.int32)


def buffer_rows(tokens: int, k: int, experts: int, ep: int, factor: float) -> int:
    """Pairs one shard may send another under `alltoall` (per destination): f x the balanced
    tokens*k/ep, f = min(ep, E/k) when `factor` is 0 (never drops; more is never needed)."""
    exact = min(ep, experts / k)
    f = exact if factor <= 0 else min(factor, exact)
    return max(1, math.ceil(f * tokens * k / ep))


def _buffered(x, w, idx, gate, up, down, axis, ep, E, factor, tile):
    Tl, k = idx.shape
    D, El = x.shape[1], E // ep
    B = buffer_rows(Tl, k, E, ep, factor)
    dest = idx // El                                              # the shard owning each pair's expert
    pos, keep = dispatch.first_slots(dest, ep, B)
    slot = jnp.where(keep, dest * B + pos, ep * B)                # ep*B: dropped
    flat = slot.reshape(-1)
    token = jnp.broadcast_to(jnp.arange(Tl, dtype=jnp.int32)[:, None], (Tl, k)).reshape(-1)
    table = jnp.full((ep * B + 1,), Tl, jnp.int32).at[flat].set(token)[:-1]         # Tl: an empty row
    expert = jnp.full((ep * B + 1,), El, jnp.int32).at[flat].set((idx % El).reshape(-1))[:-1]   # El: none
    send = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[table].reshape(ep, B, D)  # dim0: destination
    recv = lax.all_to_all(send, axis, 0, 0).reshape(ep * B, D)                        # rows by source
    recv_expert = lax.all_to_all(expert.reshape(ep, B), axis, 0, 0).reshape(ep * B, 1)
    ye, _ = dispatch.routed_dropless(recv, jnp.ones((ep * B, 1), x.dtype), recv_expert, gate, up, down, tile=tile)
    back = lax.all_to_all(ye.reshape(ep, B, D), axis, 0, 0).reshape(ep * B, D)        # sender's slot order
    out = jnp.concatenate([back, jnp.zeros((1, D), back.dtype)])[slot]                # [Tl, k, D]
    y = jnp.einsum("tkd,tk->td", out, w.astype(x.dtype))
    return y, (Tl * k - keep.sum()).astype(jnp.int32)

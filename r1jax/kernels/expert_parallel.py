"""Expert parallelism: routed experts sharded over the mesh axis the `experts` logical axis maps
to (under the active rules; this module names no mesh axis), tokens exchanged inside
`jax.shard_map` (manual over the batch axes, the rest left to GSPMD).

Four exchanges, chosen by `kernels.moe_dispatch`:
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
- `hierarchical`: the exchange across nodes deduplicated, as DeepSeek's DeepEP does it. A
  token goes to each node that holds any of its experts once, to the shard at its own position
  there, which passes its pairs on to their shards inside the node and sends back one summed row:
  over InfiniBand a token moves once per node it reaches (with DeepSeek-V3's group-limited routing
  at most topk_group = 4 nodes) instead of once per expert (k = 8). Buffers are f x the balanced
  load at both levels; f = 0 sizes them so that nothing drops.
- `alltoall` and `hierarchical` with `fp8` (kernels.moe_exchange_fp8): the rows going to the
  experts, and the gradients of their outputs going to them in the backward, travel as FP8 e4m3
  with an fp32 scale per 128 channels; the returns stay in the compute dtype (DeepSeek-V3's split).
- every other dispatch: each shard all-gathers the tokens of its expert group, runs its local
  experts on the pairs routed to them (with `gather` or `dense` when asked, as decode does; else
  the dropless tile kernel), and a reduce-scatter returns each token's sum (in fp32). Exact;
  moves ep x the MoE input instead of k/E of it.

Without expert parallelism (`local`) each batch shard runs the dispatch on its own tokens.

Expert-weight gradients stay sharded over the expert axis and are summed over the experts'
copies on the other batch axes in fp32 (the weights enter the exchange marked varying there in
fp32); every exchange sums pair outputs and the shards' partial sums in fp32. So a bf16 step has
no bf16 all-reduce or reduce-scatter here (which XLA:CPU cannot compile either). shard_map's
autodiff sums the replicated router/shared gradients over the batch axes.
"""
from __future__ import annotations

import functools
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


def _copies(axes: tuple[str, ...], *weights):
    """The experts' weights marked varying over `axes` (their copies) in fp32: their gradients are
    summed over the copies (the transpose of this cast) in fp32, not in the compute dtype."""
    return tuple(lax.pcast(a.astype(jnp.float32), axes, to="varying").astype(a.dtype) for a in weights)


def local(kind: str, x_TD, w, idx, gate, up, down, **opts):
    """Routed-expert output [T, D] and dropped pairs without expert parallelism: each batch shard
    runs the dispatch on its own tokens (a shard_map over the batch axes), every expert whole on
    every shard. Left to GSPMD, the dispatch's sort over all tokens gathers the whole batch onto
    every shard, and each shard runs every pair of the batch. `capacity` stays global (its
    capacity is per expert over the whole batch, which a shard's tokens alone would change), as
    does a batch the shards do not divide."""
    token_axes = logical.mesh_axes("batch")
    shards = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in token_axes)
    if kind == "capacity" or shards == 1 or x_TD.shape[0] % shards:
        return dispatch.ROUTED[kind](x_TD, w, idx, gate, up, down, **opts)

    def body(x, w, idx, gate, up, down):
        y, dropped = dispatch.ROUTED[kind](x, w, idx, *_copies(token_axes, gate, up, down), **opts)
        return y, lax.psum(dropped, token_axes)

    tok = P(token_axes)
    return jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(), in_specs=(tok, tok, tok, P(), P(), P()),
                         out_specs=(tok, P()), axis_names=set(token_axes))(x_TD, w, idx, gate, up, down)


def routed(kind: str, x_TD, w, idx, gate, up, down, *, tile: int, capacity_factor: float,
           buffer_factor: float = 0.0, nodes: int = 1, nodes_per_token: float = 1.0, fp8: bool = False):
    """Routed-expert output [T, D] and the global count of dropped pairs, experts sharded.
    `hierarchical`: the expert axis spans `nodes` nodes (its index is node x shards a node +
    position inside it, as r1jax.parallel.mesh lays it out); `nodes_per_token` sizes its buffers
    (`expected_nodes`). `fp8` (alltoall, hierarchical): the rows sent to the experts, and the
    gradients sent back to them, travel as FP8 (`_exchange`)."""
    mesh = jax.sharding.get_abstract_mesh()
    axis, ep = expert_axis()
    token_axes = logical.mesh_axes("batch")
    if axis not in token_axes:
        raise ValueError(f"expert parallelism needs the tokens sharded over '{axis}' too (batch rule)")
    E = gate.shape[0]
    if kind == "hierarchical" and (nodes < 1 or ep % nodes):
        raise ValueError(f"the hierarchical exchange needs the expert axis ({ep}) split into whole nodes, not {nodes}")

    replicated = tuple(a for a in token_axes if a != axis)        # the experts' copies

    def body(x, w, idx, gate, up, down):
        gate, up, down = _copies(replicated, gate, up, down)
        if kind == "capacity":
            y, dropped = _all_to_all(x, w, idx, gate, up, down, axis, ep, E, capacity_factor)
        elif kind == "alltoall":
            y, dropped = _buffered(x, w, idx, gate, up, down, axis, ep, E, buffer_factor, tile, fp8)
        elif kind == "hierarchical":
            y, dropped = _hierarchical(x, w, idx, gate, up, down, axis, ep, E, nodes, nodes_per_token,
                                       buffer_factor, tile, fp8)
        else:
            y, dropped = _gather_scatter(kind, x, w, idx, gate, up, down, axis, ep, tile)
        return y, lax.psum(dropped, token_axes)

    tok, exp = P(token_axes), P(axis)
    return jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, exp, exp, exp), out_specs=(tok, P()),
                         axis_names=set(token_axes))(x_TD, w, idx, gate, up, down)


def _gather_scatter(kind, x, w, idx, gate, up, down, axis, ep, tile):
    El = gate.shape[0]
    lo = lax.axis_index(axis) * El
    xs = _gather_rows(x, axis)                                   # [ep*Tl, D]: the expert group's tokens
    ws, ids = lax.all_gather(w, axis, tiled=True), lax.all_gather(idx, axis, tiled=True)
    local = jnp.where((ids >= lo) & (ids < lo + El), ids - lo, El)   # El: routed to another shard
    local_kernel = dispatch.ROUTED[kind if kind in ("gather", "dense") else "dropless"]
    y, _ = local_kernel(xs, ws, local, gate, up, down, tile=tile)
    return _sum_rows(y, axis), jnp.int32(0)


def _scatter_sum(a, axis):
    # in fp32: the shards' partial sums (outputs forward, input gradients backward) add up in
    # fp32 as the other exchanges' pair sums do (and XLA:CPU cannot compile a bf16 one)
    return lax.psum_scatter(a.astype(jnp.float32), axis, scatter_dimension=0, tiled=True).astype(a.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_rows(x, axis):
    """all_gather of the rows over `axis`; backward, their gradients summed in fp32."""
    return lax.all_gather(x, axis, tiled=True)


_gather_rows.defvjp(lambda x, axis: (_gather_rows(x, axis), None),
                    lambda axis, _, g: (_scatter_sum(g, axis),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _sum_rows(y, axis):
    """The shards' partial rows summed in fp32 and scattered (`_scatter_sum`); backward, the
    gradients all-gathered in the compute dtype."""
    return _scatter_sum(y, axis)


_sum_rows.defvjp(lambda y, axis: (_sum_rows(y, axis), None),
                 lambda axis, _, g: (lax.all_gather(g, axis, tiled=True),))


def _all_to_all(x, w, idx, gate, up, down, axis, ep, E, capacity_factor):
    Tl, k = idx.shape
    D, El = x.shape[1], E // ep
    C = max(1, math.ceil(capacity_factor * Tl * k / E))         # per (source shard, expert)
    pos, keep = dispatch.first_slots(idx, E, C)
    slot = jnp.where(keep, idx * C + pos, E * C)                  # E*C: dropped
    token = jnp.broadcast_to(jnp.arange(Tl, dtype=jnp.int32)[:, None], (Tl, k))
    table = jnp.full((E * C + 1,), Tl, jnp.int32).at[slot.reshape(-1)].set(token.reshape(-1))[:-1]
    weight = jnp.zeros((E * C + 1,), x.dtype).at[slot.reshape(-1)].set(w.astype(x.dtype).reshape(-1))[:-1]
    send = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[table].reshape(ep, El, C, D)   # dim0: destination
    recv = lax.all_to_all(send, axis, 0, 0)                                                # dim0: source
    xe = recv.transpose(1, 0, 2, 3).reshape(El, ep * C, D)
    we = lax.all_to_all(weight.reshape(ep, El, C), axis, 0, 0).transpose(1, 0, 2).reshape(El, ep * C, 1)
    h = jax.nn.silu(jnp.einsum("ECD,EDF->ECF", xe, gate)) * jnp.einsum("ECD,EDF->ECF", xe, up)
    # weighted where the expert ran (`_send_pairs` says why)
    ye = (jnp.einsum("ECF,EFD->ECD", h, down) * we).reshape(El, ep, C, D).transpose(1, 0, 2, 3)
    back = lax.all_to_all(ye, axis, 0, 0).reshape(E * C, D)                                # owner order
    out = jnp.concatenate([back, jnp.zeros((1, D), back.dtype)])[slot]                     # [Tl,k,D]
    return _sum_pairs(out), (Tl * k - keep.sum()).astype(jnp.int32)


def _sum_pairs(out):
    """[R, k, D] weighted pair outputs summed per row in fp32 (one rounding to the compute dtype,
    as the weighted einsum this replaces had)."""
    return out.astype(jnp.float32).sum(1).astype(out.dtype)


def buffer_rows(tokens: int, k: int, experts: int, ep: int, factor: float) -> int:
    """Pairs one shard may send another under `alltoall` (per destination): f x the balanced
    tokens*k/ep, f = min(ep, E/k) when `factor` is 0 (never drops; more is never needed)."""
    exact = min(ep, experts / k)
    f = exact if factor <= 0 else min(factor, exact)
    return max(1, math.ceil(f * tokens * k / ep))


def _buffered(x, w, idx, gate, up, down, axis, ep, E, factor, tile, fp8=False):
    B = buffer_rows(idx.shape[0], idx.shape[1], E, ep, factor)
    return _send_pairs(x, w, idx, gate, up, down, axis, ep, B, tile, fp8=fp8)


FP8_BLOCK = 128          # channels a scale covers: DeepSeek-V3's 1 x 128 activation tiles
FP8_MAX = 448.0          # float8_e4m3fn's largest finite value


def _quantize(a):
    """a [..., D] as float8_e4m3fn and an fp32 scale per block of FP8_BLOCK channels (or of the
    largest block size dividing D), each block's largest magnitude mapped to FP8_MAX."""
    b = math.gcd(a.shape[-1], FP8_BLOCK)
    blocks = a.astype(jnp.float32).reshape(*a.shape[:-1], a.shape[-1] // b, b)
    scale = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / FP8_MAX
    scale = jnp.where(scale > 0, scale, 1.0)
    return (blocks / scale).astype(jnp.float8_e4m3fn), scale


def _move(a, send, fp8: bool):
    if not fp8:
        return send(a)
    q, scale = _quantize(a)
    return (send(q).astype(jnp.float32) * send(scale)).reshape(a.shape).astype(a.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _exchange(a, send, fp8_there: bool, fp8_back: bool):
    """send(a), `send` an all_to_all between shards that is its own inverse (split and concatenated
    along the same axis), so a cotangent goes back through it too. `fp8_there`: a travels as FP8
    (with its scales); `fp8_back`: its cotangent does. DeepSeek-V3 sends the tokens to the experts
    in FP8 going forward and the output gradients to them going backward, and both returns (the
    expert outputs, the input gradients) in bf16."""
    return _move(a, send, fp8_there)


def _exchange_fwd(a, send, fp8_there, fp8_back):
    return _move(a, send, fp8_there), None


def _exchange_bwd(send, fp8_there, fp8_back, _, g):
    return (_move(g, send, fp8_back),)


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _send_pairs(x, w, idx, gate, up, down, axis, n, B, tile, groups=None, fp8=False):
    """y [R, D] = sum_j w[r,j] * expert_{idx[r,j]}(x[r]) with the experts spread over a group of
    n shards (El each; `groups`: axis_index_groups of `axis`, None for the whole axis): each pair
    goes to shard idx // El in one all_to_all of n buffers of B rows, is run there with the
    dropless tiles, and comes back in a second. Ids >= n * El are no pair; pairs past a
    destination's B rows are dropped (first choices first) and counted. `fp8`: the rows to the
    experts and the gradients of their outputs travel as FP8 (`_exchange`).

    Each pair's weight travels with it and is applied on the expert's shard, so the router
    weights' gradient is computed there too (from the output gradient that comes back anyway).
    The returned rows then feed only the layer's output: a remat recompute (train.remat,
    pipeline.stage_remat) of the layer's forward for its backward needs the way there, not the
    way back, and autodiff drops the return (tests/test_moe_alltoall.py counts the compiled
    step's all_to_alls)."""
    R, k = idx.shape
    D, El = x.shape[1], gate.shape[0]
    valid = idx < n * El
    dest = jnp.where(valid, idx // El, n)                         # n: no destination
    pos, keep = dispatch.first_slots(dest, n + 1, B)
    keep = keep & valid
    slot = jnp.where(keep, dest * B + pos, n * B)                 # n*B: not sent
    flat = slot.reshape(-1)
    token = jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32)[:, None], (R, k)).reshape(-1)
    table = jnp.full((n * B + 1,), R, jnp.int32).at[flat].set(token)[:-1]           # R: an empty row
    expert = jnp.full((n * B + 1,), El, jnp.int32).at[flat].set((idx % El).reshape(-1))[:-1]   # El: none
    weight = jnp.zeros((n * B + 1,), x.dtype).at[flat].set(w.astype(x.dtype).reshape(-1))[:-1]
    a2a = functools.partial(lax.all_to_all, axis_name=axis, split_axis=0, concat_axis=0, axis_index_groups=groups)
    send = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[table].reshape(n, B, D)   # dim0: destination
    recv = _exchange(send, a2a, fp8, False).reshape(n * B, D)                          # rows by source
    recv_expert = a2a(expert.reshape(n, B)).reshape(n * B, 1)
    recv_weight = _exchange(weight.reshape(n, B), a2a, False, False).reshape(n * B, 1)
    ye, _ = dispatch.routed_dropless(recv, recv_weight, recv_expert, gate, up, down, tile=tile)
    back = _exchange(ye.reshape(n, B, D), a2a, False, fp8).reshape(n * B, D)
    out = jnp.concatenate([back, jnp.zeros((1, D), back.dtype)])[slot]                # [R, k, D]
    return _sum_pairs(out), (valid & ~keep).sum().astype(jnp.int32)


def expected_nodes(experts: int, k: int, n_group: int, topk_group: int, nodes: int) -> float:
    """Nodes one token's k experts sit on, on average, when routing is balanced (experts in id
    order over `nodes` equal blocks). With group-limited routing and whole groups on a node, a
    token reaches the nodes of its topk_group groups (DeepSeek-V3's node-limited routing: 4 of 8
    groups, so at most 4 nodes); otherwise its k experts fall anywhere."""
    if n_group > 1 and topk_group < n_group and n_group % nodes == 0:
        per = n_group // nodes
        return nodes * (1 - math.comb(n_group - per, topk_group) / math.comb(n_group, topk_group))
    return nodes * (1 - math.comb(experts - experts // nodes, k) / math.comb(experts, k))


def node_rows(tokens: int, nodes_per_token: float, nodes: int, factor: float) -> int:
    """Tokens one shard may send each node under `hierarchical` (one row per token and node):
    f x the balanced tokens * nodes_per_token / nodes, at most every token (`factor` 0: that)."""
    if factor <= 0:
        return tokens
    return max(1, min(tokens, math.ceil(factor * tokens * nodes_per_token / nodes)))


def gpu_rows(tokens: int, k: int, experts_local: int, gpus: int, nodes: int, rows: int, factor: float) -> int:
    """Pairs a node's forwarding shard may send each shard of its node under `hierarchical`:
    f x the balanced tokens * k / gpus (its rows from all nodes carry about `tokens` x k pairs of
    the node's), at most what its nodes x `rows` rows can hold for one shard (`factor` 0: that)."""
    exact = nodes * rows * min(k, experts_local)
    if factor <= 0:
        return exact
    return max(1, min(exact, math.ceil(factor * tokens * k / gpus)))


def _hierarchical(x, w, idx, gate, up, down, axis, ep, E, nodes, nodes_per_token, factor, tile, fp8=False):
    """Two levels, as DeepSeek's DeepEP exchanges: a token crosses to each node holding any of
    its experts once (to the shard of that node at its own position: one all_to_all over the
    shards at that position on every node), with its choices on that node and their weights; that
    shard sends the pairs on to their experts' shards inside its node (`_send_pairs` over the
    node's shards), sums their weighted outputs per token and sends one row back. Across nodes a
    token moves once per node it reaches instead of once per expert."""
    Tl, k = idx.shape
    D, El = x.shape[1], gate.shape[0]
    N, G = nodes, ep // nodes
    per_node = G * El
    B1 = node_rows(Tl, nodes_per_token, N, factor)
    node = idx // per_node                                                    # [Tl, k]
    j = jnp.arange(k)
    same = node[:, :, None] == node[:, None, :]                               # [Tl, k, k]
    first = ~jnp.any(same & (j[None, :] < j[:, None])[None], axis=2)          # no earlier choice there
    rep = jnp.argmax(same, axis=2)                                            # that node's first choice
    pos, keep = dispatch.first_slots(jnp.where(first, node, N), N + 1, B1)
    sent = first & keep
    slot = jnp.where(sent, node * B1 + pos, N * B1)                           # N*B1: no row
    token = jnp.broadcast_to(jnp.arange(Tl, dtype=jnp.int32)[:, None], (Tl, k))
    table = jnp.full((N * B1 + 1,), Tl, jnp.int32).at[slot.reshape(-1)].set(token.reshape(-1))[:-1]
    row_node = (jnp.arange(N * B1, dtype=jnp.int32) // B1)[:, None]
    choices = jnp.concatenate([idx, jnp.full((1, k), E, idx.dtype)])[table]  # [N*B1, k]; E: an empty row
    here = choices // per_node == row_node
    e_rows = jnp.where(here, choices - row_node * per_node, per_node)        # node-local ids; per_node: none
    w_rows = jnp.where(here, jnp.concatenate([w, jnp.zeros((1, k), w.dtype)])[table], 0)
    x_rows = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[table]
    rails = [[n * G + g for n in range(N)] for g in range(G)]                 # one shard per node
    inside = [[n * G + g for g in range(G)] for n in range(N)]                # one node's shards

    a2a = functools.partial(lax.all_to_all, axis_name=axis, split_axis=0, concat_axis=0, axis_index_groups=rails)

    def across(a, there=False, back=False):
        a = a.reshape(N, B1, *a.shape[1:])
        moved = _exchange(a, a2a, there, back) if jnp.issubdtype(a.dtype, jnp.floating) else a2a(a)
        return moved.reshape(N * B1, *a.shape[2:])

    B2 = gpu_rows(Tl, k, El, G, N, B1, factor)
    y_rows, dropped = _send_pairs(across(x_rows, there=fp8), across(w_rows), across(e_rows), gate, up, down, axis,
                                  G, B2, tile, inside, fp8)
    back = across(y_rows, back=fp8)                                           # in this shard's row order
    y = jnp.concatenate([back, jnp.zeros((1, D), back.dtype)])[slot].sum(1)
    lost = ~jnp.take_along_axis(sent, rep, axis=1)                            # pairs whose node row was dropped
    return y, dropped + lost.sum().astype(jnp.int32)

"""Routed-expert compute: y[t] = sum_j w[t,j] * SwiGLU_{idx[t,j]}(x[t]), several ways.

All take x [T,D] (compute dtype), w [T,k] (fp32 combine weights), idx [T,k] int32 and the expert
weights gate/up [E,D,F], down [E,F,D]; all return (y [T,D], dropped pairs int32 scalar).

- `loop`: every expert on every token, masked by its combine weight. E x the FLOPs; the
  reference the others are tested against.
- `dropless`: sort the T*k (token, expert) pairs by expert, pad each expert's run to a multiple
  of `tile` rows so every tile belongs to one expert, then a scan over tiles multiplies each by
  its expert's weights (custom VJP accumulates dW in place). Exact, about the useful FLOPs.
  This is the CPU path: `ragged_dot` lowers there to a dense masked product (E x work).
- `ragged`: the same sort, then `jax.lax.ragged_dot` grouped GEMMs (GPU/TPU).
- `capacity`: each expert takes at most C = ceil(cf * T*k / E) pairs (first choices first, then
  token order); the rest are dropped and counted. Static shapes, batched [E,C,D] matmuls.
- `gather`: each pair's expert weights gathered ([T,k,D,F]): only the selected experts are read
  (and copied once). For decode-sized T on CPU, where a tile scan's per-tile overhead dominates.
- `dense`: every expert on every token as batched matmuls over the stacked weights in place
  (x broadcast to [E,T,D]), the combine weights applied before one down-projection GEMM over
  (E, F). E/k x the FLOPs but no weight copy and no per-expert loop: mid-sized decode batches on CPU.
- `grouped` (inference only: no gradient): the dropless tiles, then one loop over the live
  tiles (unrolled when there are a few), each multiplied by its expert's weights through a
  `switch` on the expert. Given the experts as tuples of separate [D,F]/[F,D] arrays (the
  generator's layout; `up` None with each gate [D, 2F], gate and up side by side), only the
  selected experts' weights are read, once per tile, and never copied; about the useful FLOPs
  at any batch. Stacked [E,...] weights work too, at the cost of a slice of the tile's expert.
  Once each expert averages a few pairs (decode at batch 32), each expert gets static slots
  instead, run as E unrolled GEMMs, and only the overflow takes tiles.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def swiglu(x, gate, up, down):
    """SwiGLU of one expert. `up` None: `gate` is [D, 2F], the gate and up projections side by
    side (the generator's per-expert layout, `join_gate_up`), one product for both."""
    if up is None:
        F = down.shape[-2]
        a = x @ gate
        return (jax.nn.silu(a[..., :F]) * a[..., F:]) @ down
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def join_gate_up(gate, up):
    """Gate and up side by side, [D, 2F]: per expert for tuples of E [D, F] arrays (the
    generator's routed experts), else one array (a dense layer's or the shared experts').

    Why: at decode a selected expert's products are matrix-vector products that stream their
    weights from memory on one core each, slowly at first, and one 1 MB product streams faster
    than two of 0.5 MB (2-core EPYC, each timed as its own call from memory: [256, 512] 52 us,
    [256, 1024] 69 us). The generator joins every SwiGLU's gate and up this way
    (r1jax/infer/generator.py `_unstacked`); what that gained is in the README's Performance."""
    if isinstance(gate, tuple):
        return tuple(jnp.concatenate([g, u], axis=-1) for g, u in zip(gate, up))
    return jnp.concatenate([gate, up], axis=-1)


def split_gate_up(gate, up):
    """(gate, up) stacked [E, D, F] from the generator's tuples, joined (`up` None) or not."""
    if up is None:
        F = gate[0].shape[-1] // 2
        return jnp.stack([g[..., :F] for g in gate]), jnp.stack([g[..., F:] for g in gate])
    return jnp.stack(gate), jnp.stack(up)


def expert_load(idx_Tk: jax.Array, num_experts: int) -> jax.Array:
    """Routed pairs per expert [E] float32 (one-hot sum works under any sharding)."""
    return jax.nn.one_hot(idx_Tk.reshape(-1), num_experts, dtype=jnp.float32).sum(0)


# ------------------------------------------------------------------------------------- loop
def routed_loop(x, w, idx, gate, up, down, **_):
    E = gate.shape[0]
    y = jnp.zeros_like(x)
    for e in range(E):
        ce = jnp.where(idx == e, w, 0.0).sum(1).astype(x.dtype)
        y = y + ce[:, None] * swiglu(x, gate[e], up[e], down[e])
    return y, jnp.int32(0)


# ---------------------------------------------------------------------------------- sorting
def _sort_pairs(idx, E):
    """Pairs (t, j) in token-major order, stably sorted by expert: order, sorted expert, sizes [E]."""
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    return order, flat[order], sizes


# ------------------------------------------------------------------------- dropless (tiles)
def _varying_like(value, *templates):
    """`value` marked as varying over the manual mesh axes the templates vary over. Inside
    shard_map both branches of a cond must agree on that; outside it this is a no-op."""
    axes = frozenset().union(*(jax.typeof(t).manual_axis_type.varying for t in templates))
    missing = tuple(sorted(axes - jax.typeof(value).manual_axis_type.varying))
    return lax.pcast(value, missing, to="varying") if missing else value


def _summed_like(value, template):
    """`value` summed over the manual axes it varies over and `template` does not: a custom VJP's
    cotangent must vary exactly like its primal (a weight replicated over data gets data's sum)."""
    extra = tuple(sorted(jax.typeof(value).manual_axis_type.varying - jax.typeof(template).manual_axis_type.varying))
    return lax.psum(value, extra) if extra else value


def _tile_matmul_scan(x_NBK, w_EKF, tile_e, live_tiles):
    def body(_, a):
        n, xn, e = a
        yn = lax.cond(n < live_tiles,
                      lambda: xn @ lax.dynamic_index_in_dim(w_EKF, e, 0, keepdims=False),
                      lambda: _varying_like(jnp.zeros((xn.shape[0], w_EKF.shape[2]), xn.dtype), xn, w_EKF))
        return None, yn
    return lax.scan(body, None, (jnp.arange(x_NBK.shape[0]), x_NBK, tile_e))[1]


@jax.custom_vjp
def tile_matmul(x_NBK, w_EKF, tile_e, live_tiles):
    """y[n] = x[n] @ w[tile_e[n]] for tiles n < live_tiles, zeros after."""
    return _tile_matmul_scan(x_NBK, w_EKF, tile_e, live_tiles)


def _tile_matmul_fwd(x, w, tile_e, live_tiles):
    return _tile_matmul_scan(x, w, tile_e, live_tiles), (x, w, tile_e, live_tiles)


def _tile_matmul_bwd(res, g):
    x, w, tile_e, live_tiles = res

    def body(dw, a):
        n, xn, gn, e = a

        def live(dw):
            cur = lax.dynamic_index_in_dim(dw, e, 0, keepdims=False)
            dw = lax.dynamic_update_index_in_dim(dw, cur + (xn.T @ gn).astype(jnp.float32), e, 0)
            return dw, gn @ lax.dynamic_index_in_dim(w, e, 0, keepdims=False).T

        return lax.cond(n < live_tiles, live,
                        lambda dw: (dw, _varying_like(jnp.zeros_like(xn), xn, gn, w)), dw)

    # dW accumulates over tiles in fp32 even when the compute dtype is bf16/fp16
    dw0 = _varying_like(jnp.zeros(w.shape, jnp.float32), x, g, w)
    dw, dx = lax.scan(body, dw0, (jnp.arange(x.shape[0]), x, g, tile_e))
    return dx, _summed_like(dw.astype(w.dtype), w), None, None


tile_matmul.defvjp(_tile_matmul_fwd, _tile_matmul_bwd)


def _ranked(idx, E: int):
    """The T*k pairs stably sorted by expert: (order, expert se [T*k] (ids >= E clamped to E-1),
    here [T*k] (the id is < E), rank [T*k] (position within its expert's run), sizes [E])."""
    Tk = idx.size
    order, sorted_e, sizes = _sort_pairs(idx, E)        # bincount drops ids >= E; argsort puts them last
    se = jnp.minimum(sorted_e, E - 1)
    rank = jnp.arange(Tk, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[se]
    return order, se, sorted_e < E, rank, sizes


def _tiles(idx, E: int, tile: int, ranked=None):
    """The dropless layout of the T*k pairs: (row_token [rows] (T: an empty row), tile_e
    [n_tiles], live_tiles, pair_row [T*k] (`rows`: nowhere), n_tiles). Every expert's pairs fill
    whole tiles of `tile` rows; expert ids >= E get no row. `ranked`: `_ranked(idx, E)` with
    `here` narrowed to the pairs to lay out and rank and sizes counted among those alone."""
    T, k = idx.shape
    Tk = T * k
    n_tiles = -(-(Tk + E * (tile - 1)) // tile)        # static bound: every expert wastes < 1 tile
    rows = n_tiles * tile
    order, se, here, rank, sizes = _ranked(idx, E) if ranked is None else ranked
    padded = (sizes + tile - 1) // tile * tile
    padded_end = jnp.cumsum(padded)
    live_tiles = padded_end[-1] // tile
    dest = jnp.where(here, (padded_end - padded)[se] + rank, rows)      # padded row; `rows` = nowhere
    row_token = jnp.full((rows,), T, jnp.int32).at[dest].set(order // k, mode="drop")
    # tile n belongs to the first expert whose padded run ends after row n*tile (a comparison
    # count rather than searchsorted, which shard_map's varying-axis checks reject)
    starts_n = jnp.arange(n_tiles, dtype=jnp.int32)[:, None] * tile
    tile_e = jnp.minimum(jnp.sum(padded_end[None, :] <= starts_n, axis=1), E - 1).astype(jnp.int32)
    pair_row = jnp.zeros((Tk,), jnp.int32).at[order].set(dest)          # (t, j) -> padded row
    return row_token, tile_e, live_tiles, pair_row, n_tiles


def _combine(o_rows, pair_row, w, T: int, k: int, dtype):
    o = jnp.concatenate([o_rows, jnp.zeros((1, o_rows.shape[1]), o_rows.dtype)])   # row `rows`: zeros
    return jnp.einsum("tkd,tk->td", o[pair_row].reshape(T, k, -1), w.astype(dtype))


def routed_dropless(x, w, idx, gate, up, down, *, tile: int = 64, **_):
    """Expert ids >= E (the local expert count) mark pairs handled elsewhere: they get no tile
    and contribute zero (expert parallelism passes every token with only local experts valid)."""
    T, k = idx.shape
    E, D = gate.shape[0], x.shape[1]
    row_token, tile_e, live_tiles, pair_row, n_tiles = _tiles(idx, E, tile)
    x_rows = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[row_token].reshape(n_tiles, tile, D)
    g = tile_matmul(x_rows, gate, tile_e, live_tiles)
    u = tile_matmul(x_rows, up, tile_e, live_tiles)
    o = tile_matmul(jax.nn.silu(g) * u, down, tile_e, live_tiles).reshape(n_tiles * tile, D)
    return _combine(o, pair_row, w, T, k, x.dtype), jnp.int32(0)


# ------------------------------------------------------------------------------ ragged_dot
def routed_ragged(x, w, idx, gate, up, down, **_):
    T, k = idx.shape
    order, _, sizes = _sort_pairs(idx, gate.shape[0])
    xs = x[order // k]
    h = jax.nn.silu(lax.ragged_dot(xs, gate, sizes)) * lax.ragged_dot(xs, up, sizes)
    o = lax.ragged_dot(h, down, sizes)
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=jnp.int32))
    out = o[inv].reshape(T, k, -1)
    return jnp.einsum("tkd,tk->td", out, w.astype(x.dtype)), jnp.int32(0)


# -------------------------------------------------------------------------------- capacity
def capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    return max(1, int(math.ceil(factor * tokens * k / experts)))


def first_slots(key, n: int, cap: int):
    """(position of each pair among the pairs with its key, kept): pairs [T, k] with keys in
    [0, n) claim slots choice-major (every token's first choice before any second), and the
    first `cap` per key keep theirs. The capacity paths' drop rule."""
    T, k = key.shape
    onehot = jax.nn.one_hot(key.T.reshape(-1), n, dtype=jnp.int32)
    pos = ((jnp.cumsum(onehot, axis=0) * onehot).sum(1) - 1).reshape(k, T).T
    return pos, pos < cap


def routed_capacity(x, w, idx, gate, up, down, *, capacity_factor: float = 1.25, **_):
    T, k = idx.shape
    E, D = gate.shape[0], x.shape[1]
    C = capacity(T, k, E, capacity_factor)
    pos, keep = first_slots(idx, E, C)                                   # [T,k] slot in expert
    slot = jnp.where(keep, idx * C + pos, E * C)                         # E*C: the drop sentinel
    token = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[:, None], (T, k))
    table = jnp.full((E * C + 1,), T, jnp.int32).at[slot.reshape(-1)].set(token.reshape(-1))[:-1]
    xe = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[table].reshape(E, C, D)
    h = jax.nn.silu(jnp.einsum("ECD,EDF->ECF", xe, gate)) * jnp.einsum("ECD,EDF->ECF", xe, up)
    ye = jnp.einsum("ECF,EFD->ECD", h, down).reshape(E * C, D)
    out = jnp.concatenate([ye, jnp.zeros((1, D), ye.dtype)])[slot]      # [T,k,D], dropped -> 0
    y = jnp.einsum("tkd,tk->td", out, w.astype(x.dtype))
    return y, (T * k - keep.sum()).astype(jnp.int32)


# ------------------------------------------------------------------- decode-sized batches
def _local(w, idx, E):
    """Combine weights with pairs for expert ids >= E (handled on another shard) zeroed, ids clipped."""
    return jnp.where(idx < E, w, 0.0), jnp.minimum(idx, E - 1)


def routed_gather(x, w, idx, gate, up, down, **_):
    E = gate.shape[0]
    w, e = _local(w, idx, E)
    h = jax.nn.silu(jnp.einsum("TD,TKDF->TKF", x, gate[e])) * jnp.einsum("TD,TKDF->TKF", x, up[e])
    h = h * w[:, :, None].astype(x.dtype)
    return jnp.einsum("TKF,TKFD->TD", h, down[e]), jnp.int32(0)


def routed_dense(x, w, idx, gate, up, down, **_):
    E, (T, D) = gate.shape[0], x.shape
    w, e = _local(w, idx, E)
    comb = jnp.einsum("TK,TKE->ET", w, jax.nn.one_hot(e, E, dtype=w.dtype)).astype(x.dtype)    # [E,T]
    xe = jnp.broadcast_to(x[None], (E, T, D))
    h = jax.nn.silu(jnp.einsum("ETD,EDF->ETF", xe, gate)) * jnp.einsum("ETD,EDF->ETF", xe, up)
    return jnp.einsum("ETF,EFD->TD", h * comb[:, :, None], down), jnp.int32(0)


# `grouped` unrolls its tile loop up to this many tiles: moe_small decode at batch 1 (2 pairs,
# tile 1, 8 experts; quiet 2-core EPYC, best of 6 alternating rounds) took 2.61-2.71 ms a step
# with a loop per expert, 2.44-2.53 with one loop over the tiles, 2.26-2.30 with those two
# tiles unrolled; at batches 8 and 32 (a tile loop of ~8-12 trips) one loop and the loop per
# expert tie (6.01 / 6.16, 11.08 / 11.14 ms). Unrolling costs a switch of E branches per tile
# in the program, so it stays small.
UNROLL_TILES = 4


# `grouped` gives every expert static slots while each averages SLOTS_MIN_MEAN to
# SLOTS_MAX_MEAN pairs (SLOT_FACTOR x the mean, rounded up), the pairs beyond an expert's slots
# in tiles of OVERFLOW_TILE rows. moe_small decode (8 experts, fp32, one process, 8 alternating
# rounds, ms a step best / median): batch 32 (8 pairs an expert) the tile loop 11.85-12.25 /
# 12.18-12.72, slots at 1.5x 10.78-11.30 / 11.53-11.87 (1.25x 11.32, 1.75x 11.53, 2x 11.34);
# batch 8 (2 an expert) a tie (6.31 / 6.80 against 6.15 / 6.86), so the tiles keep it. Past
# SLOTS_MAX_MEAN (prefill) the tiles' loop is a small cost and the slots' padding a large one:
# batch 32's 64-token prefill (512 pairs an expert) took 151-166 ms with the tiles, 178-186
# with slots.
SLOTS_MIN_MEAN = 4
SLOTS_MAX_MEAN = 32
SLOT_FACTOR = 1.5
OVERFLOW_TILE = 2


def _expert_tiles(xs, row_token, tile_e, live, n_tiles, tile, branches, D, dtype):
    """Rows of `tile` tokens each multiplied by its tile's expert through a `switch`: unrolled
    when there are a few tiles (every tile runs; one past the live ones computes a padding row
    nobody reads), else one loop over the live tiles."""
    def body(n, ys):
        xt = xs[lax.dynamic_slice_in_dim(row_token, n * tile, tile)]
        return lax.dynamic_update_slice_in_dim(ys, lax.switch(tile_e[n], branches, xt), n * tile, 0)

    ys = jnp.zeros((n_tiles * tile, D), dtype)
    if n_tiles <= UNROLL_TILES:
        for n in range(n_tiles):
            ys = body(n, ys)
        return ys
    return lax.fori_loop(0, live, body, ys)


def routed_grouped(x, w, idx, gate, up, down, *, tile: int = 8, **_):
    """The dropless tile layout (each expert's pairs padded to whole tiles of `tile` rows), then
    per live tile a `switch` on its expert whose branch multiplies the tile by that expert's
    weights as they lie: a dynamic index into a stack would copy them, and a loop per expert
    costs a while loop per expert and layer even when nobody selected it. Expert ids >= E get
    no rows and contribute zero (as in `dropless`).

    While each expert averages SLOTS_MIN_MEAN to SLOTS_MAX_MEAN pairs (decode at batch 32),
    every expert instead gets C static slots (SLOT_FACTOR x the mean) multiplied as E unrolled
    GEMMs against its own arrays, and only the pairs past an expert's C run through the tiles
    (OVERFLOW_TILE rows each, usually none): no loop trip or switch per tile."""
    T, k = idx.shape
    E, D = len(gate), x.shape[1]
    xs = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])                     # row T: padding
    branches = [lambda xt, e=e: swiglu(xt, gate[e], None if up is None else up[e], down[e]) for e in range(E)]
    if not SLOTS_MIN_MEAN * E <= T * k <= SLOTS_MAX_MEAN * E:
        row_token, tile_e, live, pair_row, n_tiles = _tiles(idx, E, tile)
        ys = _expert_tiles(xs, row_token, tile_e, live, n_tiles, tile, branches, D, x.dtype)
        return _combine(ys, pair_row, w, T, k, x.dtype), jnp.int32(0)
    C = math.ceil(SLOT_FACTOR * T * k / E)
    order, se, here, rank, sizes = _ranked(idx, E)
    slot = jnp.where(here & (rank < C), se * C + rank, E * C)                 # E*C: not in a slot
    slot_token = jnp.full((E * C,), T, jnp.int32).at[slot].set(order // k, mode="drop")
    x_slots = xs[slot_token].reshape(E, C, D)
    y_slots = jnp.concatenate([branches[e](x_slots[e]) for e in range(E)])   # [E*C, D]
    pair_slot = jnp.zeros((T * k,), jnp.int32).at[order].set(slot)            # (t, j) -> slot row
    in_slot = pair_slot < E * C
    # the overflow: the dropless tiles over each expert's pairs past its C slots, from the same sort
    over = (order, se, here & (rank >= C), rank - C, jnp.maximum(sizes - C, 0))
    row_token, tile_e, live, pair_row, n_tiles = _tiles(idx, E, OVERFLOW_TILE, over)
    y_over = _expert_tiles(xs, row_token, tile_e, live, n_tiles, OVERFLOW_TILE, branches, D, x.dtype)
    # pair -> its row of [y_slots; y_over] (pair_row is past y_over, at _combine's zero row, for
    # a pair in a slot or one of another shard's experts)
    src = jnp.where(in_slot, pair_slot, E * C + pair_row)
    return _combine(jnp.concatenate([y_slots, y_over]), src, w, T, k, x.dtype), jnp.int32(0)


ROUTED = {"loop": routed_loop, "gather": routed_gather, "dense": routed_dense, "dropless": routed_dropless,
          "ragged": routed_ragged, "capacity": routed_capacity, "grouped": routed_grouped,
          "alltoall": routed_dropless, "hierarchical": routed_dropless}   # exchanges between expert shards;
                                                                          # alone, dropless


def resolve(name: str) -> str:
    """`auto` -> the exact path that is fast on the current backend."""
    if name != "auto":
        return name
    return "dropless" if jax.default_backend() == "cpu" else "ragged"

"""Blockwise ("flash") attention for MLA's training path: the same causal, segment-restricted
softmax(q.k * scale) v as `mla.dense_attention`, without materialising the [T, S] scores.

Shapes: B batch, T positions (queries and keys are the same sequence), N heads, K nope head dim,
R rope head dim (one rope key shared by all heads), V value head dim, b the block size.

Forward (FlashAttention-2's order): for each query block i, an online softmax runs over key
blocks 0..i only; blocks above the diagonal are all masked and never computed, so the work is
about half of the dense path's. What is kept for the backward is the output and the per-row
log-sum-exp [B, N, T]: O(T) memory where the dense path keeps [B, N, T, T] probabilities.

Backward: for each key block j, the query blocks j..n-1 are revisited, the probabilities are
recomputed from the saved log-sum-exp, and dK, dV of block j are accumulated while dQ is
added into a [B, T, N, K+R] buffer. At most one [B, N, b, b] score tile is live at a time.

Both loops are `fori_loop`s with data-independent bounds, under a custom VJP, so nothing is
differentiated through them. Tensors stay in their [B, T, ...] layout, viewed as [B, n, b, ...];
tiles are read and written in place, so nothing is transposed or copied for the loops. Numerics follow the dense path: scores are computed in the
compute dtype and softmaxed in fp32, probabilities enter P.V in the compute dtype, and every
accumulator is fp32. A sequence that is not a multiple of the block is padded with a segment
id no real token has; the padded rows and keys only see each other and are cut off.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32
PAD_SEGMENT = jnp.iinfo(jnp.int32).min


def _tiles(x: jax.Array, b: int) -> jax.Array:
    """[B, n*b, ...] -> [B, n, b, ...] (a reshape, no copy); tile i is x[:, i]."""
    B, T = x.shape[:2]
    return x.reshape(B, T // b, b, *x.shape[2:])


def _like(inits, *refs):
    """`inits` typed as varying over every manual mesh axis any of `refs` varies over. Inside
    shard_map (the pipeline schedules) a loop's initial carry must have its body's type; outside
    it this is the identity."""
    axes = set().union(*(jax.typeof(r).manual_axis_type.varying for r in refs))

    def one(a):
        missing = tuple(sorted(axes - set(jax.typeof(a).manual_axis_type.varying)))
        return jax.lax.pcast(a, missing, to="varying") if missing else a
    return jax.tree.map(one, inits)


def _scores(qn, qr, kn, kr, sq, sk, i, j, b, scale):
    """[B, N, b, b] fp32 scores of query tile i against key tile j, -inf where masked."""
    s = (jnp.einsum("BTNK,BSNK->BNTS", qn, kn) + jnp.einsum("BTNR,BSR->BNTS", qr, kr)).astype(F32) * scale
    causal = (i * b + jnp.arange(b))[:, None] >= (j * b + jnp.arange(b))[None, :]
    mask = causal[None, None] & (sq[:, None, :, None] == sk[:, None, None, :])
    return jnp.where(mask, s, -jnp.inf)


def _forward(qn, qr, kn, kr, v, seg, scale, b):
    """Tiled inputs [B, n, b, ...] -> (o [B, n, b, N, V] in v's dtype, lse [B, N, n, b] fp32).
    Outputs are written tile by tile into their buffers (no stacking, no transposes)."""
    B, n, _, N, V = v.shape

    def query_tile(i, out):
        o_buf, lse_buf = out
        qn_i, qr_i, sq = qn[:, i], qr[:, i], seg[:, i]

        def key_tile(j, carry):
            m, l, acc = carry
            s = _scores(qn_i, qr_i, kn[:, j], kr[:, j], sq, seg[:, j], i, j, b, scale)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)    # a row with nothing visible yet
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            pv = jnp.einsum("BNTS,BSNV->BNTV", p.astype(v.dtype), v[:, j], preferred_element_type=F32)
            return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv

        init = (jnp.full((B, N, b), -jnp.inf, F32), jnp.zeros((B, N, b), F32), jnp.zeros((B, N, b, V), F32))
        m, l, acc = jax.lax.fori_loop(0, i + 1, key_tile, _like(init, qn, qr, kn, kr, v, seg))
        o = jnp.einsum("BNTV->BTNV", acc / l[..., None]).astype(v.dtype)
        return o_buf.at[:, i].set(o), lse_buf.at[:, :, i].set(m + jnp.log(l))

    bufs = (jnp.zeros(v.shape, v.dtype), jnp.zeros((B, N, n, b), F32))
    return jax.lax.fori_loop(0, n, query_tile, _like(bufs, qn, qr, kn, kr, v, seg))


def _backward(qn, qr, kn, kr, v, seg, o, lse, do, scale, b):
    """Tiled inputs and output cotangent -> tiled (dqn, dqr, dkn, dkr, dv) in fp32."""
    n = v.shape[1]
    zeros = lambda x: jnp.zeros(x.shape, F32)     # noqa: E731
    refs = (qn, qr, kn, kr, v, seg, o, lse, do)
    delta = jnp.einsum("BnTNV,BnTNV->BNnT", do.astype(F32), o.astype(F32))   # rowsum(dO * O)

    def key_tile(j, grads):
        dqn, dqr, dkn, dkr, dv = grads
        kn_j, kr_j, v_j, sk = kn[:, j], kr[:, j], v[:, j], seg[:, j]

        def query_tile(i, carry):
            dqn, dqr, dkn_j, dkr_j, dv_j = carry
            qn_i, qr_i, do_i = qn[:, i], qr[:, i], do[:, i]
            p = jnp.exp(_scores(qn_i, qr_i, kn_j, kr_j, seg[:, i], sk, i, j, b, scale) - lse[:, :, i, :, None])
            dv_j = dv_j + jnp.einsum("BNTS,BTNV->BSNV", p.astype(v.dtype), do_i, preferred_element_type=F32)
            dp = jnp.einsum("BTNV,BSNV->BNTS", do_i, v_j, preferred_element_type=F32)
            ds = (p * (dp - delta[:, :, i, :, None]) * scale).astype(qn.dtype)
            dqn = dqn.at[:, i].add(jnp.einsum("BNTS,BSNK->BTNK", ds, kn_j, preferred_element_type=F32))
            dqr = dqr.at[:, i].add(jnp.einsum("BNTS,BSR->BTNR", ds, kr_j, preferred_element_type=F32))
            dkn_j = dkn_j + jnp.einsum("BNTS,BTNK->BSNK", ds, qn_i, preferred_element_type=F32)
            dkr_j = dkr_j + jnp.einsum("BNTS,BTNR->BSR", ds, qr_i, preferred_element_type=F32)
            return dqn, dqr, dkn_j, dkr_j, dv_j

        init = (dqn, dqr, *_like((zeros(kn_j), zeros(kr_j), zeros(v_j)), *refs))
        dqn, dqr, dkn_j, dkr_j, dv_j = jax.lax.fori_loop(j, n, query_tile, init)
        return dqn, dqr, dkn.at[:, j].set(dkn_j), dkr.at[:, j].set(dkr_j), dv.at[:, j].set(dv_j)

    return jax.lax.fori_loop(0, n, key_tile, _like(tuple(zeros(x) for x in (qn, qr, kn, kr, v)), *refs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _flash(qn, qr, kn, kr, v, seg, scale, b):
    return _forward(qn, qr, kn, kr, v, seg, scale, b)[0]


def _flash_fwd(qn, qr, kn, kr, v, seg, scale, b):
    o, lse = _forward(qn, qr, kn, kr, v, seg, scale, b)
    return o, (qn, qr, kn, kr, v, seg, o, lse)


def _flash_bwd(scale, b, res, do):
    qn, qr, kn, kr, v, seg, o, lse = res
    grads = _backward(qn, qr, kn, kr, v, seg, o, lse, do, scale, b)
    return (*(g.astype(x.dtype) for g, x in zip(grads, (qn, qr, kn, kr, v))), None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_nope_BTNK, q_rope_BTNR, k_nope_BTNK, k_rope_BTR, v_BTNV, segment_ids_BT, scale: float,
                    block: int) -> jax.Array:
    """[B, T, N, V]: causal attention within segments, in blocks of `block` positions."""
    T = v_BTNV.shape[1]
    b = min(block, T)
    pad = -T % b
    if pad:
        widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)   # noqa: E731
        q_nope_BTNK, q_rope_BTNR, k_nope_BTNK, k_rope_BTR, v_BTNV = (
            jnp.pad(x, widths(x)) for x in (q_nope_BTNK, q_rope_BTNR, k_nope_BTNK, k_rope_BTR, v_BTNV))
        segment_ids_BT = jnp.pad(segment_ids_BT, [(0, 0), (0, pad)], constant_values=PAD_SEGMENT)
    tiles = [_tiles(x, b) for x in (q_nope_BTNK, q_rope_BTNR, k_nope_BTNK, k_rope_BTR, v_BTNV, segment_ids_BT)]
    o = _flash(*tiles, scale, b)
    return o.reshape(o.shape[0], -1, *o.shape[3:])[:, :T]

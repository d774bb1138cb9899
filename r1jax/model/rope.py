"""Rotary position embedding for MLA's decoupled rope dims, with YaRN scaling.

Frequencies, YaRN's ramp and its attention factor / softmax mscale follow HF's
`_compute_yarn_parameters` and `yarn_get_mscale` exactly (including `truncate` and the
`mscale and mscale_all_dim` truthiness rule), computed on the host in float32 as HF does.

Interleaved layout (DeepSeek checkpoints): pair (x[2i], x[2i+1]) rotates by angle i and the
result is returned de-interleaved, [x_even*cos - x_odd*sin, x_odd*cos + x_even*sin], like HF.
Queries and keys get the same permutation, so q.k equals DeepSeek's in-place complex form.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from r1jax.config import ModelConfig, RopeType

F32 = jnp.float32


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(cfg: ModelConfig) -> float:
    rs = cfg.rope_scaling
    if rs.factor is not None:
        return float(rs.factor)
    return cfg.max_position_embeddings / rs.original_max_position_embeddings


def inv_freq_and_attention_factor(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """inv_freq [dr/2] float32 and the factor cos/sin are multiplied by."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_extra = (np.float32(1.0) / pos_freqs).astype(np.float32)
    rs = cfg.rope_scaling
    if rs.type is RopeType.default:
        return inv_extra, 1.0
    factor = _yarn_factor(cfg)
    if rs.attention_factor is not None:
        attention_factor = float(rs.attention_factor)
    elif rs.mscale and rs.mscale_all_dim:
        attention_factor = yarn_get_mscale(factor, rs.mscale) / yarn_get_mscale(factor, rs.mscale_all_dim)
    else:
        attention_factor = yarn_get_mscale(factor)
    beta_fast, beta_slow = rs.beta_fast or 32, rs.beta_slow or 1
    L0 = rs.original_max_position_embeddings

    def correction_dim(rot: float) -> float:
        return (dim * math.log(L0 / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extra = (1 - ramp).astype(np.float32)
    inv_inter = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv = inv_inter * (1 - extra) + inv_extra * extra
    return inv.astype(np.float32), attention_factor


def softmax_scale(cfg: ModelConfig) -> float:
    """(dn+dr)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's long-context fix)."""
    scale = cfg.qk_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs.type is not RopeType.default and rs.mscale_all_dim:
        m = yarn_get_mscale(_yarn_factor(cfg), rs.mscale_all_dim)
        scale = scale * m * m
    return scale


def cos_sin(cfg: ModelConfig, positions_BT: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, dr/2] for integer positions, in the compute dtype (as HF casts them)."""
    inv_freq, attention_factor = inv_freq_and_attention_factor(cfg)
    freqs = positions_BT.astype(F32)[..., None] * jnp.asarray(inv_freq)
    return ((jnp.cos(freqs) * attention_factor).astype(dtype),
            (jnp.sin(freqs) * attention_factor).astype(dtype))


def apply(x: jax.Array, cos_BTR: jax.Array, sin_BTR: jax.Array, interleave: bool) -> jax.Array:
    """Rotate x [B, T, (N,) dr]; cos/sin [B, T, dr/2] broadcast over the head axis if present."""
    if x.ndim == 4:
        cos_BTR, sin_BTR = cos_BTR[:, :, None, :], sin_BTR[:, :, None, :]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos_BTR - x2 * sin_BTR, x2 * cos_BTR + x1 * sin_BTR], axis=-1)

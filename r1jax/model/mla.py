"""Multi-head Latent Attention (DeepSeek-V2/V3), training/prefill path.

Shapes: B batch, T/S query/key positions, D hidden, N heads, Q q_lora_rank, C kv_lora_rank,
K qk_nope_head_dim (dn), R qk_rope_head_dim (dr), V v_head_dim.

    q      = q_b(RMSNorm(q_a(x)))  or  q_proj(x)        [B,T,N,K+R]
    c, kr  = split(kv_a(x)); c = RMSNorm(c)             [B,T,C], [B,T,R] (one rope key for all heads)
    kn, v  = split(kv_b(c))                              [B,T,N,K], [B,T,N,V]
    score  = (q_nope.kn + rope(q_rope).rope(kr)) * scale, softmax in fp32 over a causal,
             segment-restricted mask (packed documents never see each other)

The rope part of the score is its own einsum against the single shared rope key, so the key
is never broadcast to N heads. `model.attention` picks how the score/softmax/value core runs:
`dense` materialises the [B, N, T, S] scores (the parity-measured path; fastest at short T),
`flash` runs it in blocks of `model.attention_block` positions (r1jax/model/flash.py; memory
linear in T, about half the FLOPs under the causal mask). The latent norms use eps 1e-6 whatever `rms_norm_eps` is, as in
the reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from r1jax.config import AttentionImpl, ModelConfig
from r1jax.model import rope
from r1jax.model.flash import flash_attention
from r1jax.model.layers import dense, F32, RMSNorm, cast, const_param, normal_param
from r1jax.parallel.mesh import constrain

LATENT_NORM_EPS = 1e-6


def attention_mask(segment_ids_BT: jax.Array) -> jax.Array:
    """[B, 1, T, S] bool: causal and within the same segment."""
    T = segment_ids_BT.shape[1]
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    same = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    return (causal[None] & same)[:, None]


def dense_attention(q_nope_BTNK, q_rope_BTNR, k_nope_BSNK, k_rope_BSR, v_BSNV, segment_ids_BT, scale):
    """[B, T, N, V]: the scores whole, softmax in fp32, as the reference's eager attention."""
    scores = (jnp.einsum("BTNK,BSNK->BNTS", q_nope_BTNK, k_nope_BSNK)
              + jnp.einsum("BTNR,BSR->BNTS", q_rope_BTNR, k_rope_BSR)).astype(F32) * scale
    scores = jnp.where(attention_mask(segment_ids_BT), scores, jnp.finfo(F32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSNV.dtype)
    return jnp.einsum("BNTS,BSNV->BTNV", probs, v_BSNV)


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, *, rngs: nnx.Rngs):
        D, N = cfg.hidden_size, cfg.num_attention_heads
        K, R, V, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        std = cfg.initializer_range
        self.cfg, self.dtype = cfg, dtype
        if cfg.q_lora_rank is None:
            self.wq_DNH = normal_param(rngs, (D, N, K + R), ("embed", "heads", "qk_head"), std)
        else:
            Q = cfg.q_lora_rank
            self.wq_a_DQ = normal_param(rngs, (D, Q), ("embed", "q_lora"), std)
            self.q_norm = RMSNorm(Q, LATENT_NORM_EPS, dtype)
            self.wq_b_QNH = normal_param(rngs, (Q, N, K + R), ("q_lora_in", "heads", "qk_head"), std)
            if cfg.attention_bias:
                self.bq_a_Q = const_param(0.0, (Q,), ("q_lora",))
        self.wkv_a_DC = normal_param(rngs, (D, C + R), ("embed", "kv_lora"), std)
        self.kv_norm = RMSNorm(C, LATENT_NORM_EPS, dtype)
        self.wkv_b_CNH = normal_param(rngs, (C, N, K + V), ("kv_lora_in", "heads", "v_head"), std)
        self.wo_NVD = normal_param(rngs, (N, V, D), ("heads", "v_head", "embed"), std)
        if cfg.attention_bias:
            self.bkv_a_C = const_param(0.0, (C + R,), ("kv_lora",))
            self.bo_D = const_param(0.0, (D,), ("norm",))
        self.scale = rope.softmax_scale(cfg)

    def __call__(self, x_BTD, cos_BTR, sin_BTR, segment_ids_BT):
        cfg, dt = self.cfg, self.dtype
        K, C = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        heads = ("batch", "seq", "act_heads", None)
        if cfg.q_lora_rank is None:
            q = dense(x_BTD, cast(self.wq_DNH, dt))              # BTD,DNH->BTNH
        else:
            qa = dense(x_BTD, cast(self.wq_a_DQ, dt))           # BTD,DQ->BTQ
            if cfg.attention_bias:
                qa = qa + cast(self.bq_a_Q, dt)
            q = dense(self.q_norm(qa), cast(self.wq_b_QNH, dt))  # BTQ,QNH->BTNH
        q = constrain(q, *heads)
        q_nope, q_rope = q[..., :K], rope.apply(q[..., K:], cos_BTR, sin_BTR, cfg.rope_interleave)

        kv_a = dense(x_BTD, cast(self.wkv_a_DC, dt))          # BTD,DC->BTC
        if cfg.attention_bias:
            kv_a = kv_a + cast(self.bkv_a_C, dt)
        c = self.kv_norm(kv_a[..., :C])
        k_rope = rope.apply(kv_a[..., C:], cos_BTR, sin_BTR, cfg.rope_interleave)
        kv = constrain(dense(c, cast(self.wkv_b_CNH, dt)), *heads)          # BTC,CNH->BTNH
        k_nope, v = kv[..., :K], kv[..., K:]

        if cfg.attention == AttentionImpl.flash:
            o = flash_attention(q_nope, q_rope, k_nope, k_rope, v, segment_ids_BT, self.scale, cfg.attention_block)
        else:
            o = dense_attention(q_nope, q_rope, k_nope, k_rope, v, segment_ids_BT, self.scale)
        o = constrain(o, *heads)
        out = dense(o, cast(self.wo_NVD, dt), 2)                # BTNV,NVD->BTD
        if cfg.attention_bias:
            out = out + cast(self.bo_D, dt)
        return checkpoint_name(constrain(out, "batch", "seq", "act_embed"), "attn_out")

"""Multi-head Latent Attention (DeepSeek-V2/V3), training/prefill path.

Shapes: B batch, T/S query/key positions, D hidden, N heads, Q q_lora_rank, C kv_lora_rank,
K qk_nope_head_dim (dn), R qk_rope_head_dim (dr), H = K+R the query/key head dim, V v_head_dim.

    q      = wq_b(RMSNorm(wq_a(x)))  or  wq(x)          [B,T,N,H]
    c      = RMSNorm(wkv_a(x))                          [B,T,C]   the latent (what a decode cache keeps)
    kr     = rope(wk_rope(x))                           [B,T,R]   one rope key for all heads
    kn, v  = wk_b(c), wv_b(c)                           [B,T,N,K], [B,T,N,V]
    score  = (q_nope.kn + rope(q_rope).kr) * scale, softmax in fp32 over a causal,
             segment-restricted mask (packed documents never see each other)

HF fuses wkv_a and wk_rope into one `kv_a_proj_with_mqa` [C+R, D] and wk_b and wv_b into one
`kv_b_proj` [N(K+V), C]; r1jax keeps them apart because the latent, the rope key and the two
up-projections each play their own part in absorbed decoding (r1jax/convert/mapping.py splits
and joins them). The rope part of the score is its own einsum against the single shared rope
key, so the key is never broadcast to N heads. `kernels.attention` picks how the
score/softmax/value core runs: `dense` materialises the [B, N, T, S] scores (the
parity-measured path; fastest at short T), `flash` runs it in blocks of
`kernels.attention_block` positions (r1jax/kernels/flash.py; memory linear in T, about half the
FLOPs under the causal mask). The latent norms use eps 1e-6 whatever `rms_norm_eps` is, as in
the reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from r1jax.config import AttentionImpl, KernelConfig, ModelConfig
from r1jax.kernels.flash import flash_attention
from r1jax.logical import constrain
from r1jax.model import rope
from r1jax.model.layers import dense, F32, RMSNorm, cast, const_param, normal_param

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
    def __init__(self, cfg: ModelConfig, kernels: KernelConfig, dtype, *, rngs: nnx.Rngs):
        D, N = cfg.hidden_size, cfg.num_attention_heads
        K, R, V, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        std = cfg.initializer_range
        self.cfg, self.kernels, self.dtype = cfg, kernels, dtype
        if cfg.q_lora_rank is None:
            self.wq_DNH = normal_param(rngs, (D, N, K + R), ("embed", "heads", "qk_head"), std)
        else:
            Q = cfg.q_lora_rank
            self.wq_a_DQ = normal_param(rngs, (D, Q), ("embed", "q_lora"), std)
            self.q_norm = RMSNorm(Q, LATENT_NORM_EPS, dtype)
            self.wq_b_QNH = normal_param(rngs, (Q, N, K + R), ("q_lora_in", "heads", "qk_head"), std)
            if cfg.attention_bias:
                self.bq_a_Q = const_param(0.0, (Q,), ("q_lora",))
        self.wkv_a_DC = normal_param(rngs, (D, C), ("embed", "kv_lora"), std)
        self.wk_rope_DR = normal_param(rngs, (D, R), ("embed", "qk_rope"), std)
        self.kv_norm = RMSNorm(C, LATENT_NORM_EPS, dtype)
        self.wk_b_CNK = normal_param(rngs, (C, N, K), ("kv_lora_in", "heads", "qk_nope"), std)
        self.wv_b_CNV = normal_param(rngs, (C, N, V), ("kv_lora_in", "heads", "v_head"), std)
        self.wo_NVD = normal_param(rngs, (N, V, D), ("heads", "v_head", "embed"), std)
        if cfg.attention_bias:
            self.bkv_a_C = const_param(0.0, (C,), ("kv_lora",))
            self.bk_rope_R = const_param(0.0, (R,), ("qk_rope",))
            self.bo_D = const_param(0.0, (D,), ("norm",))
        self.scale = rope.softmax_scale(cfg)

    def _bias(self, y, name):
        return y + cast(getattr(self, name), self.dtype) if self.cfg.attention_bias else y

    def __call__(self, x_BTD, cos_BTR, sin_BTR, segment_ids_BT):
        cfg, kn, dt = self.cfg, self.kernels, self.dtype
        K = cfg.qk_nope_head_dim
        heads = ("batch", "seq", "act_heads", None)
        if cfg.q_lora_rank is None:
            q = dense(x_BTD, cast(self.wq_DNH, dt))                                # BTD,DNH->BTNH
        else:
            qa = self._bias(dense(x_BTD, cast(self.wq_a_DQ, dt)), "bq_a_Q")         # BTD,DQ->BTQ
            q = dense(self.q_norm(qa), cast(self.wq_b_QNH, dt))                    # BTQ,QNH->BTNH
        q = constrain(q, *heads)
        q_nope, q_rope = q[..., :K], rope.apply(q[..., K:], cos_BTR, sin_BTR, cfg.rope_interleave)

        c = self.kv_norm(self._bias(dense(x_BTD, cast(self.wkv_a_DC, dt)), "bkv_a_C"))      # BTD,DC->BTC
        k_rope = rope.apply(self._bias(dense(x_BTD, cast(self.wk_rope_DR, dt)), "bk_rope_R"),  # BTD,DR->BTR
                            cos_BTR, sin_BTR, cfg.rope_interleave)
        k_nope = constrain(dense(c, cast(self.wk_b_CNK, dt)), *heads)             # BTC,CNK->BTNK
        v = constrain(dense(c, cast(self.wv_b_CNV, dt)), *heads)                  # BTC,CNV->BTNV

        if kn.attention == AttentionImpl.flash:
            o = flash_attention(q_nope, q_rope, k_nope, k_rope, v, segment_ids_BT, self.scale, kn.attention_block)
        else:
            o = dense_attention(q_nope, q_rope, k_nope, k_rope, v, segment_ids_BT, self.scale)
        o = constrain(o, *heads)
        out = self._bias(dense(o, cast(self.wo_NVD, dt), 2), "bo_D")             # BTNV,NVD->BTD
        return checkpoint_name(constrain(out, "batch", "seq", "act_embed"), "attn_out")

"""Multi-head Latent Attention (DeepSeek-V2/V3): training, prefill and absorbed decode.

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
FLOPs under the causal mask). Decoding writes c and the rope key into the cache and attends
over it with `absorbed_attention` (r1jax/model/kv.py says when). The latent norms use eps 1e-6 whatever `rms_norm_eps` is, as in
the reference.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from r1jax.config import AttentionImpl, KernelConfig, LoraConfig, ModelConfig
from r1jax.kernels.flash import flash_attention
from r1jax.logical import constrain
from r1jax.model import lora as loralib
from r1jax.model import rope
from r1jax.model.kv import LayerKV
from r1jax.model.layers import dense, F32, RMSNorm, cast, const_param, normal_param

LATENT_NORM_EPS = 1e-6
HEADS = ("batch", "seq", "act_heads", None)
# heads-major layouts of the up-projections (absorbed decode's): the permutation of the model's
# [C, N, X] that gives it, and back
HEADS_MAJOR = {"wk_b_CNK": (1, 2, 0), "wv_b_CNV": (1, 0, 2)}     # [N, K, C], [N, C, V]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadsMajor:
    """An up-projection held heads first, as absorbed decode's per-head products read it: wk_b
    [C, N, K] as [N, K, C] and wv_b [C, N, V] as [N, C, V] (the generator's layout,
    r1jax/infer/generator.py). Each product is a dot batched over the heads, which XLA runs with
    the batch dim leading in both operands: a weight held [C, N, X] was transposed at every
    decode step (moe_small, batch 1, profiled: 111 -> 14 us of transposes and copies a step).
    `w[...]` reads like the model's [C, N, X] weight (prefill expands the keys from it), as a
    QArray reads like its float."""
    hm: jax.Array
    perm: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))   # [C, N, X] -> heads-major

    @classmethod
    def of(cls, w, name: str) -> "HeadsMajor":
        return cls(jnp.transpose(w, HEADS_MAJOR[name]), HEADS_MAJOR[name])

    def __getitem__(self, key):
        if key is not Ellipsis:
            raise TypeError(f"a HeadsMajor weight takes [...], not {key!r}")
        return jnp.transpose(self.hm, tuple(self.perm.index(i) for i in range(3)))


def attention_mask(segment_ids_BT: jax.Array) -> jax.Array:
    """[B, 1, T, S] bool: causal and within the same segment."""
    T = segment_ids_BT.shape[1]
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    same = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    return (causal[None] & same)[:, None]


def absorbed_attention(q_nope_BTNK, q_rope_BTNR, wk_b_NKC, wv_b_NCV, c_BSC, kr_BSR, q_pos_BT, scale):
    """[B, T, N, V]: attention over a latent cache without expanding it (DeepSeek's "absorb").
    W_UK is folded into the query (q_nope . (c W_UK) = (q_nope W_UK^T) . c) and W_UV applied to
    the attended latent; key s is visible to a query at position p when s <= p. The score's
    scale is 1/sqrt(K+R) as in the expanded form (the latent's width C does not enter it). The
    up-projections come heads first (`HeadsMajor`)."""
    ql_BTNC = jnp.einsum("BTNK,NKC->BTNC", q_nope_BTNK, wk_b_NKC)
    scores = (jnp.einsum("BTNC,BSC->BNTS", ql_BTNC, c_BSC)
              + jnp.einsum("BTNR,BSR->BNTS", q_rope_BTNR, kr_BSR)).astype(F32) * scale
    visible = jnp.arange(c_BSC.shape[1], dtype=jnp.int32)[None, None, :] <= q_pos_BT[:, :, None]   # [B,T,S]
    scores = jnp.where(visible[:, None], scores, jnp.finfo(F32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(c_BSC.dtype)
    if q_nope_BTNK.shape[1] == 1 and jax.default_backend() == "cpu":
        # a decode step: XLA:CPU runs this product as B x N tiny [S] x [S, C] dots (~8 GFLOP/s);
        # as one multiply-reduce fusion it reads the latent once. moe_small, in one process,
        # alternating: batch 32 11.74-12.22 -> 11.12-11.28 ms a step, batch 8 6.45-6.62 ->
        # 6.22-6.53, batch 1 at a 2,048-token context 4.41-5.04 -> 4.12-4.59
        o_BTNC = jnp.sum(probs[:, :, 0, :, None] * c_BSC[:, None], axis=2)[:, None]
    else:
        o_BTNC = jnp.einsum("BNTS,BSC->BTNC", probs, c_BSC)
    return jnp.einsum("BTNC,NCV->BTNV", o_BTNC, wv_b_NCV)


def dense_attention(q_nope_BTNK, q_rope_BTNR, k_nope_BSNK, k_rope_BSR, v_BSNV, segment_ids_BT, scale):
    """[B, T, N, V]: the scores whole, softmax in fp32, as the reference's eager attention."""
    scores = (jnp.einsum("BTNK,BSNK->BNTS", q_nope_BTNK, k_nope_BSNK)
              + jnp.einsum("BTNR,BSR->BNTS", q_rope_BTNR, k_rope_BSR)).astype(F32) * scale
    scores = jnp.where(attention_mask(segment_ids_BT), scores, jnp.finfo(F32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSNV.dtype)
    return jnp.einsum("BNTS,BSNV->BTNV", probs, v_BSNV)


def lora_specs(cfg: ModelConfig) -> dict[str, tuple]:
    """LoRA targets of an MLA (HF module names) -> (input dims, {r1jax weight: output dims})."""
    D, N = cfg.hidden_size, cfg.num_attention_heads
    K, R, V, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    heads = [(N, "heads"), (K + R, "qk_head")]
    if cfg.q_lora_rank is None:
        specs = {"q_proj": ([(D, "embed")], {"wq_DNH": heads})}
    else:
        Q = cfg.q_lora_rank
        specs = {"q_a_proj": ([(D, "embed")], {"wq_a_DQ": [(Q, "q_lora")]}),
                 "q_b_proj": ([(Q, "q_lora_in")], {"wq_b_QNH": heads})}
    return {**specs,
            "kv_a_proj_with_mqa": ([(D, "embed")], {"wkv_a_DC": [(C, "kv_lora")], "wk_rope_DR": [(R, "qk_rope")]}),
            "kv_b_proj": ([(C, "kv_lora_in")], {"wk_b_CNK": [(N, "heads"), (K, "qk_nope")],
                                                "wv_b_CNV": [(N, "heads"), (V, "v_head")]}),
            "o_proj": ([(N, "heads"), (V, "v_head")], {"wo_NVD": [(D, "embed")]})}


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelConfig, dtype, lora: LoraConfig | None = None, *,
                 rngs: nnx.Rngs):
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
        self.lora = loralib.adapters(lora, lora_specs(cfg), rngs=rngs)

    def _dense(self, x, weight: str, target: str, n_in: int = 1):
        return loralib.project(self, x, weight, dense, cast, n_in, target)

    def _heads_major(self, weight: str, target: str):
        """An up-projection heads first (`HEADS_MAJOR`) in the compute dtype, with its adapter's
        update merged (absorbed decode reads the up-projections whole): as the generator holds
        it, or transposed here."""
        v = getattr(self, weight).get_value()
        if isinstance(v, HeadsMajor) and (self.lora is None or target not in self.lora):
            return v.hm.astype(self.dtype)
        w = v[...]
        if self.lora is not None and target in self.lora:
            w = self.lora[target].merged(w, weight)
        return jnp.transpose(w, HEADS_MAJOR[weight]).astype(self.dtype)

    def _bias(self, y, name):
        return y + cast(getattr(self, name), self.dtype) if self.cfg.attention_bias else y

    def _project(self, x_BTD, cos_BTR, sin_BTR):
        """q_nope [B,T,N,K], roped q_rope [B,T,N,R], the normed latent c [B,T,C], the roped key [B,T,R]."""
        cfg, dt = self.cfg, self.dtype
        K = cfg.qk_nope_head_dim
        if cfg.q_lora_rank is None:
            q = self._dense(x_BTD, "wq_DNH", "q_proj")                            # BTD,DNH->BTNH
        else:
            qa = self._bias(self._dense(x_BTD, "wq_a_DQ", "q_a_proj"), "bq_a_Q")    # BTD,DQ->BTQ
            q = self._dense(self.q_norm(qa), "wq_b_QNH", "q_b_proj")              # BTQ,QNH->BTNH
        q = constrain(q, *HEADS)
        q_nope, q_rope = q[..., :K], rope.apply(q[..., K:], cos_BTR, sin_BTR, cfg.rope_interleave)
        kv_a = "kv_a_proj_with_mqa"
        c = self.kv_norm(self._bias(self._dense(x_BTD, "wkv_a_DC", kv_a), "bkv_a_C"))       # BTD,DC->BTC
        k_rope = rope.apply(self._bias(self._dense(x_BTD, "wk_rope_DR", kv_a), "bk_rope_R"),  # BTD,DR->BTR
                            cos_BTR, sin_BTR, cfg.rope_interleave)
        return q_nope, q_rope, c, k_rope

    def __call__(self, x_BTD, cos_BTR, sin_BTR, segment_ids_BT, kv: LayerKV | None = None):
        """[B,T,D]; with `kv` (r1jax/model/kv.py) also the cache with the new tokens written:
        (out, kv). Training and prefill attend with expanded keys; `kv.absorbed` over the cache."""
        kn, dt = self.kernels, self.dtype
        q_nope, q_rope, c, k_rope = self._project(x_BTD, cos_BTR, sin_BTR)
        if kv is not None:
            kv = kv.write(c, k_rope)
        if kv is not None and kv.absorbed:
            c_BSC, kr_BSR = kv.read()
            o = absorbed_attention(q_nope, q_rope, self._heads_major("wk_b_CNK", "kv_b_proj"),
                                   self._heads_major("wv_b_CNV", "kv_b_proj"), c_BSC.astype(dt), kr_BSR.astype(dt),
                                   kv.positions, self.scale)
        else:
            k_nope = constrain(self._dense(c, "wk_b_CNK", "kv_b_proj"), *HEADS)  # BTC,CNK->BTNK
            v = constrain(self._dense(c, "wv_b_CNV", "kv_b_proj"), *HEADS)       # BTC,CNV->BTNV
            if kn.attention == AttentionImpl.flash:
                o = flash_attention(q_nope, q_rope, k_nope, k_rope, v, segment_ids_BT, self.scale, kn.attention_block)
            else:
                o = dense_attention(q_nope, q_rope, k_nope, k_rope, v, segment_ids_BT, self.scale)
        o = constrain(o, *HEADS)
        out = self._bias(self._dense(o, "wo_NVD", "o_proj", 2), "bo_D")         # BTNV,NVD->BTD
        out = checkpoint_name(constrain(out, "batch", "seq", "act_embed"), "attn_out")
        return out if kv is None else (out, kv)

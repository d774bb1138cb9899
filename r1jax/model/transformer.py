"""The DeepSeek-V3/R1 decoder: embedding, scanned dense and MoE stacks, final norm, LM head, MTP.

Layers 0..first_k_dense_replace-1 use a dense SwiGLU, the rest DeepSeekMoE. Each kind is one
stack whose parameters carry a leading `layers` axis and run under `jax.lax.scan`, so compile
time does not grow with depth; the scanned body is wrapped in `jax.checkpoint` with a policy
built from `checkpoint_name` tags (`attn_out`, `mlp_gate`, `mlp_up`, `moe_routed`).

Multi-Token Prediction (DeepSeek-V3 report, 2.2; HF `MtpLayer`): depth k takes the previous
depth's hidden state h^{k-1} (h^0 = the main model's final-norm output) and the embedding of the
token k positions ahead, h' = eh_proj([enorm(emb); hnorm(h^{k-1})]), runs one MoE block over it
and normalises (`shared_head.norm`); logits come from the shared LM head. Inputs are rolled
left by k, so the last k positions hold wrapped values that the loss masks out.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from r1jax.config import KernelConfig, ModelConfig, Remat
from r1jax.logical import constrain
from r1jax.model import rope
from r1jax.model.layers import F32, MLP, dense, Embed, RMSNorm, cast, normal_param
from r1jax.model.mla import MLA
from r1jax.model.moe import MoE

POLICIES = {
    Remat.none: None,
    Remat.full: jax.checkpoint_policies.nothing_saveable,
    Remat.save_attention: jax.checkpoint_policies.save_only_these_names("attn_out"),
    Remat.save_dots: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # save_attention's set, but parked in pinned host memory until the backward pass needs it
    Remat.offload: jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["attn_out"],
        offload_src="device", offload_dst="pinned_host"),
}


class Output(NamedTuple):
    logits: jax.Array                 # [B, T, W] float32 (W: the vocabulary)
    mtp_logits: jax.Array | None      # [D, B, T, W] float32 (position t predicts token t+k+1)
    aux: dict[str, jax.Array]         # per MoE layer: load [L,E], dropped [L], idx [L,B*T,k],
                                      # balance [L] (summed over rows); per MTP depth the same
                                      # under mtp_load, mtp_dropped, mtp_idx, mtp_balance


class Block(nnx.Module):
    """Pre-norm decoder layer: x + MLA(norm(x)), then + MLP/MoE(norm(.))."""

    def __init__(self, cfg: ModelConfig, kernels: KernelConfig, dtype, moe: bool, *, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.input_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.attn = MLA(cfg, kernels, dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        if moe:
            self.mlp = MoE(cfg, kernels, dtype, rngs=rngs)
        else:
            self.mlp = MLP(D, cfg.intermediate_size, cfg.initializer_range, dtype, rngs=rngs)
        self.is_moe = moe

    def __call__(self, x, cos, sin, segment_ids):
        h = x + self.attn(self.input_norm(x), cos, sin, segment_ids)
        if self.is_moe:
            y, aux = self.mlp(self.post_attn_norm(h))
        else:
            y, aux = self.mlp(self.post_attn_norm(h)), {}
        return constrain(h + y, "batch", "seq", "act_embed"), aux


def _checkpointed(fn, remat: Remat):
    policy = POLICIES[remat]
    if remat is Remat.none:
        return fn
    return jax.checkpoint(fn, policy=policy, prevent_cse=False)


def scan_blocks(graphdef, state, x, cos, sin, segment_ids, remat: Remat, valid=None):
    """Blocks with stacked parameters `state` [n, ...] applied in order under `lax.scan`.

    `valid` [n] bool marks real layers; a padding slot (False) passes its input through and
    reports zero load, drops and balance loss, so its (zero) parameters get exactly zero gradient."""
    def body(carry, xs):
        layer_state, ok = xs
        y, aux = nnx.merge(graphdef, layer_state)(carry, cos, sin, segment_ids)
        if ok is None:
            return y, aux
        return jnp.where(ok, y, carry), jax.tree.map(lambda a: jnp.where(ok, a, jnp.zeros_like(a)), aux)

    return jax.lax.scan(_checkpointed(body, remat), x, (state, valid))


class Stack(nnx.Module):
    """`n` identical blocks with stacked parameters (leading axis `layers`), applied with
    `lax.scan`, always in model order. A pipeline keeps its own layout of these leaves in the
    train state (r1jax/parallel/pipeline.py); the model never sees it."""

    def __init__(self, cfg: ModelConfig, kernels: KernelConfig, dtype, moe: bool, n: int, *, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(r: nnx.Rngs) -> Block:
            return Block(cfg, kernels, dtype, moe, rngs=r)

        self.layers = make(rngs)

    def __call__(self, x, cos, sin, segment_ids, remat: Remat):
        graphdef, state = nnx.split(self.layers)
        return scan_blocks(graphdef, state, x, cos, sin, segment_ids, remat)


class MTPModule(nnx.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelConfig, dtype, *, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.eh_proj_2DD = normal_param(rngs, (2 * D, D), ("mtp_concat", "embed"), cfg.initializer_range)
        self.block = Block(cfg, kernels, dtype, moe=True, rngs=rngs)
        self.final_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.dtype = dtype

    def __call__(self, h_prev, emb_next, cos, sin, segment_ids):
        x = jnp.concatenate([self.enorm(emb_next), self.hnorm(h_prev)], axis=-1)
        x = dense(x, cast(self.eh_proj_2DD, self.dtype))                     # BTE,ED->BTD
        y, aux = self.block(constrain(x, "batch", "seq", "act_embed"), cos, sin, segment_ids)
        return self.final_norm(y), aux


class Transformer(nnx.Module):
    """DeepseekV3ForCausalLM plus MTP. Call: model(input_ids [B,T] int32) -> Output.

    `kernels` (how attention and the routed experts run), `dtype` (compute) and `remat` change
    how the model computes, never what; the parameters are fp32 whatever they are."""

    def __init__(self, cfg: ModelConfig, kernels: KernelConfig = KernelConfig(), dtype=jnp.float32,
                 remat: Remat = Remat.none, *, rngs: nnx.Rngs):
        D, W, std = cfg.hidden_size, cfg.vocab_size, cfg.initializer_range
        self.cfg, self.kernels, self.dtype, self.remat = cfg, kernels, dtype, remat
        self.embed = Embed(W, D, std, dtype, rngs=rngs)
        k = cfg.first_k_dense_replace
        self.dense_layers = Stack(cfg, kernels, dtype, False, k, rngs=rngs) if k > 0 else None
        self.moe_layers = (Stack(cfg, kernels, dtype, True, cfg.num_moe_layers, rngs=rngs)
                           if cfg.num_moe_layers > 0 else None)
        self.final_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.lm_head_DW = None if cfg.tie_word_embeddings else normal_param(rngs, (D, W), ("embed", "vocab"), std)
        self.mtp = nnx.List([MTPModule(cfg, kernels, dtype, rngs=rngs) for _ in range(cfg.num_nextn_predict_layers)])

    def head(self, h_BTD: jax.Array) -> jax.Array:
        if self.lm_head_DW is None:
            logits = jnp.einsum("BTD,WD->BTW", h_BTD, cast(self.embed.embedding_WD, self.dtype))
        else:
            logits = dense(h_BTD, cast(self.lm_head_DW, self.dtype))                     # BTD,DW->BTW
        return constrain(logits.astype(F32), "batch", "seq", "act_vocab")

    def prologue(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Embedding and the dense prefix: (x [B,T,D], positions, segment_ids) with defaults filled."""
        B, T = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if segment_ids is None:
            segment_ids = jnp.ones((B, T), jnp.int32)
        x = self.embed(input_ids)
        if self.dense_layers is not None:
            cos, sin = rope.cos_sin(self.cfg, positions, self.dtype)
            x, _ = self.dense_layers(x, cos, sin, segment_ids, self.remat)
        return x, positions, segment_ids

    def epilogue(self, x: jax.Array, input_ids: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                 *, mtp: bool = False) -> Output:
        """Final norm, LM head and (with `mtp`) the MTP modules on the MoE stack's output."""
        cfg, dt = self.cfg, self.dtype
        h = self.final_norm(x)
        logits = self.head(h)
        if not (mtp and len(self.mtp)):
            return Output(logits, None, {})

        mtp_logits, mtp_aux = [], []
        for depth, module in enumerate(self.mtp, start=1):
            emb = self.embed(jnp.roll(input_ids, -depth, axis=1))
            cos_k, sin_k = rope.cos_sin(cfg, jnp.roll(positions, -depth, axis=1), dt)
            graphdef, state = nnx.split(module)
            run = _checkpointed(lambda st, *a: nnx.merge(graphdef, st)(*a), self.remat)
            # the mask stays on the unshifted segments: a key whose inputs straddle a document
            # boundary is never attended by a query with a valid target
            h, a = run(state, h, emb, cos_k, sin_k, segment_ids)
            mtp_logits.append(self.head(h))
            mtp_aux.append(a)
        aux = {f"mtp_{k}": jnp.stack([a[k] for a in mtp_aux]) for k in mtp_aux[0]}
        return Output(logits, jnp.stack(mtp_logits), aux)

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, *, mtp: bool = False) -> Output:
        """input_ids, positions, segment_ids: [B, T] int32. Positions default to 0..T-1 and
        segment ids to 1 (one document per row); tokens attend only within their segment.
        `mtp=True` also runs the MTP modules and returns their logits."""
        x, positions, segment_ids = self.prologue(input_ids, positions, segment_ids)
        aux: dict[str, jax.Array] = {}
        if self.moe_layers is not None:
            cos, sin = rope.cos_sin(self.cfg, positions, self.dtype)
            x, aux = self.moe_layers(x, cos, sin, segment_ids, self.remat)
        out = self.epilogue(x, input_ids, positions, segment_ids, mtp=mtp)
        return Output(out.logits, out.mtp_logits, {**aux, **out.aux})

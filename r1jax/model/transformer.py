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

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from r1jax.config import KernelConfig, LoraConfig, ModelConfig, Remat
from r1jax.logical import constrain
from r1jax.model import accumulate
from r1jax.model import lora as loralib
from r1jax.model import rope
from r1jax.model.layers import F32, MLP, dense, Embed, RMSNorm, cast, normal_param
from r1jax.model.kv import KV, LayerKV
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
    hidden: jax.Array | None = None   # with a decode cache: the final-norm output [B, T, D]
    kv: KV | None = None              # with a decode cache: the cache, new tokens written


class Block(nnx.Module):
    """Pre-norm decoder layer: x + MLA(norm(x)), then + MLP/MoE(norm(.))."""

    def __init__(self, cfg: ModelConfig, kernels: KernelConfig, dtype, moe: bool, lora: LoraConfig | None = None,
                 *, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.input_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.attn = MLA(cfg, kernels, dtype, lora, rngs=rngs)
        self.post_attn_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        if moe:
            self.mlp = MoE(cfg, kernels, dtype, lora, rngs=rngs)
        else:
            self.mlp = MLP(D, cfg.intermediate_size, cfg.initializer_range, dtype, lora, "mlp", rngs=rngs)
        self.is_moe = moe

    def __call__(self, x, cos, sin, segment_ids, kv: LayerKV | None = None, replay=None):
        """(y, aux), or (y, aux, kv) when extending the decode cache `kv`. `replay` [B,T,k]: the
        MoE's expert ids to replay (`moe.route`)."""
        a = self.attn(self.input_norm(x), cos, sin, segment_ids, kv)
        if kv is not None:
            a, kv = a
        h = x + a
        if self.is_moe:
            y, aux = self.mlp(self.post_attn_norm(h), replay)
        else:
            y, aux = self.mlp(self.post_attn_norm(h)), {}
        y = constrain(h + y, "batch", "seq", "act_embed")
        return (y, aux) if kv is None else (y, aux, kv)


def _checkpointed(fn, remat: Remat):
    policy = POLICIES[remat]
    if remat is Remat.none:
        return fn
    return jax.checkpoint(fn, policy=policy, prevent_cse=False)


MOE_STACK = 1       # the MoE stack's number for LoRA dropout's per-layer keys (the dense prefix is 0)


def scan_blocks(graphdef, state, x, cos, sin, segment_ids, remat: Remat, valid=None, replay=None, keys=None,
                stack: int | None = None, sums=None, at=None):
    """Blocks with stacked parameters `state` [n, ...] applied in order under `lax.scan`.

    `valid` [n] bool marks real layers; a padding slot (False) passes its input through and
    reports zero load, drops and balance loss, so its (zero) parameters get exactly zero gradient.
    `replay` [n, B, T, k]: each layer's expert ids to replay (`moe.route`). `keys` [n]: each
    layer's LoRA dropout key (`lora.layer_keys`). The backward can add the layers' gradients
    in place into a running fp32 sum (r1jax/model/accumulate.py): `stack` (the model's
    stack number) finds it in an open `accumulate.into`; `sums` ({path in `state`: [n, ...]})
    passes it in, and then the return is (y, aux, sums). With `at`, `state` and `sums` are
    [R, n, ...] and the stack is their slice `at` (taken inside: `accumulate.scan_into`)."""
    def run(h, xs, cos=cos, sin=sin, segment_ids=segment_ids):
        layer_state, ok, rep, key = xs
        with loralib.layer_key(key):
            y, aux = nnx.merge(graphdef, layer_state)(h, cos, sin, segment_ids, replay=rep)
        if ok is None:
            return y, aux
        return jnp.where(ok, y, h), jax.tree.map(lambda a: jnp.where(ok, a, jnp.zeros_like(a)), aux)

    box = stack is not None and valid is None and accumulate.running(stack)
    if box or sums is not None:
        template = list(nnx.to_flat_state(state))

        def layer(flat, h, xs_i, env):
            ok, rep, key = xs_i
            st = nnx.from_flat_state([(p, v.replace(flat[p])) for p, v in template])
            return run(h, (st, ok, rep, key), *env)

        flat = {p: v.get_value() for p, v in template}
        env = (cos, sin, segment_ids)
        policy = functools.partial(_checkpointed, remat=remat)
        if sums is None:
            return accumulate.scan(layer, flat, x, (valid, replay, keys), env, stack, policy)
        return accumulate.scan_into(layer, flat, x, (valid, replay, keys), env, sums, at, policy)
    return jax.lax.scan(_checkpointed(run, remat), x, (state, valid, replay, keys))


def scan_blocks_kv(graphdef, state, x, cos, sin, segment_ids, kv: KV, name: str):
    """`scan_blocks` extending stack `name` of the decode cache: the stack's whole cache rides in
    the carry and each layer writes its entries in place at its index (as a scan's xs -> ys it
    would be copied every step). -> (x, aux, kv)."""
    def body(carry, xs):
        h, st = carry
        layer_state, layer = xs
        y, aux, lkv = nnx.merge(graphdef, layer_state)(h, cos, sin, segment_ids, kv.with_stack(name, st).layer(name, layer))
        return (y, lkv.stack), aux

    stack = kv.stacks[name]
    (x, stack), aux = jax.lax.scan(body, (x, stack), (state, jnp.arange(stack.latent.shape[0], dtype=jnp.int32)))
    return x, aux, kv.with_stack(name, stack)


class Stack(nnx.Module):
    """`n` identical blocks with stacked parameters (leading axis `layers`), applied with
    `lax.scan`, always in model order. A pipeline keeps its own layout of these leaves in the
    train state (r1jax/parallel/pipeline.py); the model never sees it."""

    def __init__(self, cfg: ModelConfig, kernels: KernelConfig, dtype, moe: bool, n: int,
                 lora: LoraConfig | None = None, *, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(r: nnx.Rngs) -> Block:
            return Block(cfg, kernels, dtype, moe, lora, rngs=r)

        self.layers = make(rngs)

    def __call__(self, x, cos, sin, segment_ids, remat: Remat, kv: KV | None = None, name: str = "",
                 layers: list[nnx.State] | None = None, replay=None, stack: int = 0):
        """(x, aux); with the decode cache `kv`, (x, aux, kv) with stack `name`'s entries written.
        `stack` numbers the model's stacks for LoRA dropout's keys (`lora.layer_keys`).

        `layers` (decode): the stack's parameters as one state per layer, run unrolled, each
        layer's cache its own buffer. On CPU a scanned decode step copies every layer's weights
        out of the stack before using them (2.3x the time of separate arrays at decode shapes;
        static slices of the stack are slower still), and decode reads every weight once."""
        graphdef, state = nnx.split(self.layers)
        if kv is None:
            keys = loralib.layer_keys(jax.tree.leaves(state)[0].shape[0], stack)
            return scan_blocks(graphdef, state, x, cos, sin, segment_ids, remat, replay=replay, keys=keys, stack=stack)
        if layers is None:
            return scan_blocks_kv(graphdef, state, x, cos, sin, segment_ids, kv, name)
        auxes = []
        for i, layer_state in enumerate(layers):
            x, aux, lkv = nnx.merge(graphdef, layer_state)(x, cos, sin, segment_ids, kv.layer(name, i))
            kv = kv.with_stack(name, lkv.stack)
            auxes.append(aux)
        return x, jax.tree.map(lambda *a: jnp.stack(a), *auxes), kv


class MTPModule(nnx.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelConfig, dtype, *, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.eh_proj_2DD = normal_param(rngs, (2 * D, D), ("mtp_concat", "embed"), cfg.initializer_range)
        self.block = Block(cfg, kernels, dtype, moe=True, rngs=rngs)
        self.final_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.dtype = dtype

    def __call__(self, h_prev, emb_next, cos, sin, segment_ids, kv: LayerKV | None = None):
        x = jnp.concatenate([self.enorm(emb_next), self.hnorm(h_prev)], axis=-1)
        x = dense(x, cast(self.eh_proj_2DD, self.dtype))                     # BTE,ED->BTD
        out = self.block(constrain(x, "batch", "seq", "act_embed"), cos, sin, segment_ids, kv)
        return (self.final_norm(out[0]), *out[1:])


class Transformer(nnx.Module):
    """DeepseekV3ForCausalLM plus MTP. Call: model(input_ids [B,T] int32) -> Output.

    `kernels` (how attention and the routed experts run), `dtype` (compute) and `remat` change
    how the model computes, never what; the parameters are fp32 whatever they are. `lora` adds
    adapters to the main model's layers (r1jax/model/lora.py); the MTP modules get none."""

    def __init__(self, cfg: ModelConfig, kernels: KernelConfig = KernelConfig(), dtype=jnp.float32,
                 remat: Remat = Remat.none, lora: LoraConfig | None = None, *, rngs: nnx.Rngs):
        D, W, std = cfg.hidden_size, cfg.vocab_size, cfg.initializer_range
        self.cfg, self.kernels, self.dtype, self.remat = cfg, kernels, dtype, remat
        self.embed = Embed(W, D, std, dtype, rngs=rngs)
        k = cfg.first_k_dense_replace
        self.dense_layers = Stack(cfg, kernels, dtype, False, k, lora, rngs=rngs) if k > 0 else None
        self.moe_layers = (Stack(cfg, kernels, dtype, True, cfg.num_moe_layers, lora, rngs=rngs)
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
                 segment_ids: jax.Array | None = None, *, mtp: bool = False, kv: KV | None = None,
                 at: jax.Array | None = None, layers: dict[str, list[nnx.State]] | None = None,
                 routing: jax.Array | None = None) -> Output:
        """input_ids, positions, segment_ids: [B, T] int32. Positions default to 0..T-1 and
        segment ids to 1 (one document per row); tokens attend only within their segment.
        `mtp=True` also runs the MTP modules and returns their logits.

        With `kv` (r1jax/model/kv.py), the tokens extend the decode cache: prefill
        (`kv.absorbed=False`) or decode; the output carries the cache and the final-norm hidden
        state at every position. `at` [B, T'] picks the positions logits are computed at (a
        prompt's last token), as the LM head over every position would dominate prefill.
        `layers` gives stacks unrolled, one state per layer (`Stack.__call__`).
        `routing` [B, T, L, k] (Rollout Routing Replay): the MoE stack's expert ids per token and
        layer, -1 where the router chooses (the generator records them: `Request.routing`)."""
        if kv is not None:
            return self._extend(input_ids, positions, segment_ids, kv, at, layers or {})
        x, positions, segment_ids, aux = self.trunk(input_ids, positions, segment_ids, routing)
        out = self.epilogue(x, input_ids, positions, segment_ids, mtp=mtp)
        return Output(out.logits, out.mtp_logits, {**aux, **out.aux})

    def trunk(self, input_ids: jax.Array, positions: jax.Array | None = None,
              segment_ids: jax.Array | None = None, routing: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
        """The prologue and the MoE stack, what `epilogue` runs on: (x [B,T,D], positions,
        segment_ids, the stack's aux). The train step runs the epilogue apart, in row chunks
        (`train.epilogue_chunks`)."""
        x, positions, segment_ids = self.prologue(input_ids, positions, segment_ids)
        aux: dict[str, jax.Array] = {}
        if self.moe_layers is not None:
            cos, sin = rope.cos_sin(self.cfg, positions, self.dtype)
            replay = None if routing is None else jnp.moveaxis(routing, 2, 0)
            x, aux = self.moe_layers(x, cos, sin, segment_ids, self.remat, replay=replay, stack=MOE_STACK)
        return x, positions, segment_ids, aux

    def _extend(self, input_ids, positions, segment_ids, kv: KV, at, layers) -> Output:
        B, T = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if segment_ids is None:
            segment_ids = jnp.ones((B, T), jnp.int32)
        kv = dataclasses.replace(kv, positions=positions)
        cos, sin = rope.cos_sin(self.cfg, positions, self.dtype)
        x = self.embed(input_ids)
        aux: dict[str, jax.Array] = {}
        for name, stack in (("dense", self.dense_layers), ("moe", self.moe_layers)):
            if stack is not None:
                x, a, kv = stack(x, cos, sin, segment_ids, Remat.none, kv, name, layers.get(name))
                aux = aux or a
        h = self.final_norm(x)
        h_at = h if at is None else jnp.take_along_axis(h, at[:, :, None], axis=1)
        return Output(self.head(h_at), None, aux, h, dataclasses.replace(kv, positions=None))

    def draft(self, h_BTD: jax.Array, next_ids: jax.Array, index: jax.Array, kv: KV,
              at: jax.Array | None = None) -> Output:
        """The first MTP module as a drafter (DeepSeek-V3 report, 5.4.3): at cache index t it
        combines the main model's final hidden state h_t with the embedding of token t+1 and
        predicts token t+2. As in training, its block sees the rope position of token t+1;
        `index` [B, T] are the cache entries it writes (its own stack, "mtp")."""
        positions = index + 1
        cos, sin = rope.cos_sin(self.cfg, positions, self.dtype)
        kv = dataclasses.replace(kv, positions=index)
        segment_ids = jnp.ones(index.shape, jnp.int32)
        layer = 0 if isinstance(kv.stacks["mtp"].latent, tuple) else jnp.int32(0)
        h, aux, lkv = self.mtp[0](h_BTD, self.embed(next_ids), cos, sin, segment_ids, kv.layer("mtp", layer))
        if at is not None:
            h = jnp.take_along_axis(h, at[:, :, None], axis=1)
        return Output(self.head(h), None, aux, h, dataclasses.replace(kv.with_stack("mtp", lkv.stack), positions=None))

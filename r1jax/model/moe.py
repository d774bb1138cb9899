"""DeepSeekMoE: sigmoid router with group-limited top-k, routed experts, shared experts.

Routing (per token, fp32), as DeepSeek-V3 and HF `DeepseekV3TopkRouter`:
    s      = sigmoid(x W_r)                               [T,E]
    choice = s + e_score_correction_bias                  selection only, never in the weights
    groups = contiguous blocks of E/G experts; group score = sum of its top-2 choice values
    keep the `topk_group` best groups, pick the top-k experts inside them by `choice`
    w      = s[idx] (/ sum when norm_topk_prob) * routed_scaling_factor
    y      = sum_j w_j SwiGLU_{idx_j}(x) + SharedSwiGLU(x)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from r1jax.config import KernelConfig, LoraConfig, ModelConfig
from r1jax.kernels import dispatch, expert_parallel
from r1jax.logical import constrain, variable
from r1jax.model import lora as loralib
from r1jax.model.layers import F32, MLP, RouterBias, normal_param


def _experts(v: nnx.Variable, dtype):
    """A routed-expert weight in the compute dtype: stacked [E, ...], or (the generator's layout,
    r1jax/infer/generator.py) a tuple of E separate arrays that `grouped` reads in place; None
    for `up` where the generator joined it to `gate` (`dispatch.join_gate_up`)."""
    a = v.get_value() if isinstance(v, nnx.Variable) else v
    if a is None:
        return None
    return tuple(e.astype(dtype) for e in a) if isinstance(a, tuple) else a.astype(dtype)


def route(x_TD: jax.Array, weight_DE: jax.Array, bias_E: jax.Array, cfg: ModelConfig,
          replay_Tk: jax.Array | None = None):
    """-> combine weights w [T,k] fp32, expert ids idx [T,k] int32, scores s [T,E] fp32.

    `replay_Tk` (Rollout Routing Replay): expert ids chosen elsewhere (the rollout's generator),
    -1 where none was recorded; a token that has them uses them instead of its own choice, and
    its combine weights are this forward's scores at those experts (so the router still learns)."""
    T = x_TD.shape[0]
    E, G, k = cfg.n_routed_experts, cfg.n_group, cfg.num_experts_per_tok
    s = jax.nn.sigmoid(jnp.einsum("TD,DE->TE", x_TD.astype(F32), weight_DE.astype(F32)))
    choice = jax.lax.stop_gradient(s) + bias_E.astype(F32)
    if cfg.topk_group < G:
        group_score = jax.lax.top_k(choice.reshape(T, G, E // G), 2)[0].sum(-1)       # [T,G]
        _, group_idx = jax.lax.top_k(group_score, cfg.topk_group)
        group_keep = (group_idx[:, :, None] == jnp.arange(G)).any(1)                    # [T,G]
        choice = jnp.where(jnp.repeat(group_keep, E // G, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, k)
    if replay_Tk is not None:
        idx = jnp.where(replay_Tk[:, :1] >= 0, replay_Tk, idx)
    w = jnp.take_along_axis(s, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx.astype(jnp.int32), s


def sequence_balance_loss(s_TE: jax.Array, idx_Tk: jax.Array, rows: int) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20) without alpha, summed over rows (the
    step divides by the batch's row count): per row, sum_i f_i P_i with f_i = E/(k T) * (tokens
    routed to i), P_i = mean_t s'_i,t, s' = s / sum_j s_j. f carries no gradient; the loss
    reaches the router only through P."""
    T, E = s_TE.shape
    k = idx_Tk.shape[1]
    s = s_TE.reshape(rows, T // rows, E)
    counts = jnp.zeros((rows, E), jnp.float32).at[                                      # [rows,E]
        jnp.arange(rows)[:, None], idx_Tk.reshape(rows, -1)].add(1.0)
    f = jax.lax.stop_gradient(counts * E / (k * (T // rows)))
    p = (s / s.sum(-1, keepdims=True)).mean(1)
    return jnp.sum(f * p)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelConfig, dtype, lora: LoraConfig | None = None, *,
                 rngs: nnx.Rngs):
        D, E, F = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        std = cfg.initializer_range
        self.cfg, self.kernels, self.dtype = cfg, kernels, dtype
        self.router_DE = normal_param(rngs, (D, E), ("embed", "router"), std)
        self.router_bias_E = variable(RouterBias, jnp.zeros((E,), F32), ("router",))
        self.gate_EDF = normal_param(rngs, (E, D, F), ("experts", "embed", "moe_mlp"), std)
        self.up_EDF = normal_param(rngs, (E, D, F), ("experts", "embed", "moe_mlp"), std)
        self.down_EFD = normal_param(rngs, (E, F, D), ("experts", "moe_mlp", "embed"), std)
        self.shared = (MLP(D, F * cfg.n_shared_experts, std, dtype, lora, "shared_experts", rngs=rngs)
                       if cfg.n_shared_experts else None)
        # routed experts' adapters: one (a, b) pair per expert and projection (PEFT's target_parameters)
        ex = [(E, "experts")]
        self.lora = loralib.adapters(lora, {"gate_proj": ([(D, "embed")], {"gate_EDF": [(F, "moe_mlp")]}),
                                            "up_proj": ([(D, "embed")], {"up_EDF": [(F, "moe_mlp")]}),
                                            "down_proj": ([(F, "moe_mlp")], {"down_EFD": [(D, "embed")]})},
                                     rngs=rngs, group="experts", lead=ex)

    def _routed(self):
        """The routed experts' weights, with their adapters' updates merged (the dispatch kernels
        read each expert's weights whole)."""
        ws = (self.gate_EDF, self.up_EDF, self.down_EFD)
        if self.lora is None:
            return ws
        return tuple(self.lora[t].merged(w[...], name) for t, name, w in
                     zip(("gate_proj", "up_proj", "down_proj"), ("gate_EDF", "up_EDF", "down_EFD"), ws))

    def __call__(self, x_BTD: jax.Array, replay_BTk: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`replay_BTk`: expert ids to use instead of the router's choice (`route`)."""
        cfg, c = self.cfg, self.kernels.moe_chunks
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        replay = None if replay_BTk is None else replay_BTk.reshape(B * T, -1)
        w, idx, scores = route(x_TD, self.router_DE[...], self.router_bias_E[...], cfg, replay)
        weights = tuple(v.get_value() if isinstance(v, nnx.Variable) else v for v in self._routed())
        if c > 1 and T % c == 0 and not isinstance(weights[0], tuple):
            y, dropped = self._chunked(x_BTD, w, idx, weights)
        else:
            y, dropped = self._dispatch(x_TD, w, idx, weights)
        y = checkpoint_name(constrain(y.reshape(B, T, D), "batch", "seq", "act_embed"), "moe_routed")
        if self.shared is not None:
            y = y + self.shared(x_BTD)
        aux = {"load": dispatch.expert_load(idx, cfg.n_routed_experts), "dropped": dropped, "idx": idx,
               "balance": sequence_balance_loss(scores, idx, B)}
        return y, aux

    def _chunked(self, x_BTD, w_Tk, idx_Tk, weights):
        """kernels.moe_chunks: the routed experts over c equal slices of every row's sequence, one
        after another in a scan whose body is rematerialised, so the dispatch's buffers and each
        pair's expert output are live for one slice at a time, in the forward and in the backward.
        The experts enter the scan in their parameter dtype and are cast inside it: their
        gradients add up over the slices in that dtype (fp32), not in the compute dtype."""
        c = self.kernels.moe_chunks
        B, T, D = x_BTD.shape

        def slices(a):                        # [B*T, ...] -> [c, B*T/c, ...], each every row's slice
            a = a.reshape(B, c, T // c, *a.shape[1:])
            return jnp.moveaxis(a, 1, 0).reshape(c, B * (T // c), *a.shape[3:])

        def body(_, xs):             # no carry: inside a pipeline stage it would need marking varying
            return None, self._dispatch(*xs, weights)

        _, (y, dropped) = jax.lax.scan(jax.checkpoint(body, prevent_cse=False), None,
                                       (slices(x_BTD.reshape(B * T, D)), slices(w_Tk), slices(idx_Tk)))
        return jnp.moveaxis(y.reshape(c, B, T // c, D), 0, 1).reshape(B * T, D), dropped.sum()

    def _dispatch(self, x_TD, w, idx, weights):
        """Routed-expert output [T, D] and the dropped pairs' count for these tokens."""
        cfg, kn = self.cfg, self.kernels
        kind = dispatch.resolve(kn.moe_dispatch.value)
        experts = tuple(_experts(v, self.dtype) for v in weights)
        if isinstance(experts[0], tuple) and kind != "grouped":
            experts = (*dispatch.split_gate_up(experts[0], experts[1]), jnp.stack(experts[2]))
        if not isinstance(experts[0], tuple):
            # each expert whole over the hidden axis (fsdp, and outside a pipeline's stages
            # pipeline, split it): against split weights GSPMD regathers the data shard's tokens
            experts = tuple(constrain(e, *names) for e, names in zip(
                experts, (("experts", None, "moe_mlp"), ("experts", None, "moe_mlp"), ("experts", "moe_mlp", None))))
        opts = dict(tile=kn.moe_tile_size, capacity_factor=kn.capacity_factor)
        if expert_parallel.expert_axis()[1] > 1:        # experts sharded: exchange tokens (shard_map)
            nodes = max(1, kn.moe_nodes)
            return expert_parallel.routed(
                kind, x_TD, w, idx, *experts, buffer_factor=kn.moe_buffer_factor, nodes=nodes,
                nodes_per_token=expert_parallel.expected_nodes(cfg.n_routed_experts, cfg.num_experts_per_tok,
                                                               cfg.n_group, cfg.topk_group, nodes),
                fp8=kn.moe_exchange_fp8, **opts)
        if isinstance(experts[0], tuple):          # the generator's per-expert arrays (`grouped`)
            return dispatch.ROUTED[kind](x_TD, w, idx, *experts, **opts)
        return expert_parallel.local(kind, x_TD, w, idx, *experts, **opts)

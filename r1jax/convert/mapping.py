"""The name and layout map between HF DeepseekV3 checkpoints and r1jax parameters.

One `Entry` per HF tensor: which r1jax leaf it belongs to, at which index of the leaf's
stacked leading dims (layer, and expert for routed experts), and how the layout changes.
HF stores Linear weights `[out, in]`; r1jax stores einsum operands `[in, out]`, with heads split
out (`[Q, N, K+R]` for q_b, `[N, V, D]` for o_proj). Routed experts are per-expert tensors in
the checkpoint (`mlp.experts.{e}.gate_proj.weight`) and one `[E, D, F]` array here.

MTP depth d is stored as DeepSeek does, as layer `num_hidden_layers + d`: the block's own
weights plus `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and copies of the shared
`embed_tokens` and `shared_head.head` (written for compatibility, ignored when read).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from r1jax.config import ModelConfig

Path = tuple  # an nnx flat-state path, e.g. ("moe_layers", "layers", "mlp", "gate_EDF")


@dataclasses.dataclass(frozen=True)
class Entry:
    key: str                          # HF tensor name
    path: Path                        # r1jax leaf
    index: tuple[int, ...]            # index into the leaf's stacked leading dims
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    fp32: bool = False                # kept float32 in HF checkpoints whatever their dtype


def _same(x):
    return x


def _t(x):
    return x.T


def _heads_in(N: int, H: int):
    """HF [N*H, X] <-> ours [X, N, H] (q_proj, q_b_proj, kv_b_proj)."""
    return (lambda x: x.reshape(N, H, -1).transpose(2, 0, 1),
            lambda y: y.transpose(1, 2, 0).reshape(N * H, -1))


def _heads_out(N: int, V: int):
    """HF [D, N*V] <-> ours [N, V, D] (o_proj)."""
    return (lambda x: x.reshape(-1, N, V).transpose(1, 2, 0),
            lambda y: y.transpose(2, 0, 1).reshape(y.shape[2], N * V))


def _block(cfg: ModelConfig, hf: str, ours: Path, index: tuple[int, ...], moe: bool) -> list[Entry]:
    D, N = cfg.hidden_size, cfg.num_attention_heads
    K, R, V, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    out: list[Entry] = []

    def add(key, leaf, shape, fwd=_same, back=_same, fp32=False, idx=index):
        out.append(Entry(f"{hf}.{key}", ours + leaf, idx, tuple(shape), fwd, back, fp32))

    add("input_layernorm.weight", ("input_norm", "weight"), (D,))
    add("post_attention_layernorm.weight", ("post_attn_norm", "weight"), (D,))
    a = ("attn",)
    if cfg.q_lora_rank is None:
        add("self_attn.q_proj.weight", a + ("wq_DNH",), (N * (K + R), D), *_heads_in(N, K + R))
    else:
        Q = cfg.q_lora_rank
        add("self_attn.q_a_proj.weight", a + ("wq_a_DQ",), (Q, D), _t, _t)
        add("self_attn.q_a_layernorm.weight", a + ("q_norm", "weight"), (Q,))
        add("self_attn.q_b_proj.weight", a + ("wq_b_QNH",), (N * (K + R), Q), *_heads_in(N, K + R))
        if cfg.attention_bias:
            add("self_attn.q_a_proj.bias", a + ("bq_a_Q",), (Q,))
    add("self_attn.kv_a_proj_with_mqa.weight", a + ("wkv_a_DC",), (C + R, D), _t, _t)
    add("self_attn.kv_a_layernorm.weight", a + ("kv_norm", "weight"), (C,))
    add("self_attn.kv_b_proj.weight", a + ("wkv_b_CNH",), (N * (K + V), C), *_heads_in(N, K + V))
    add("self_attn.o_proj.weight", a + ("wo_NVD",), (D, N * V), *_heads_out(N, V))
    if cfg.attention_bias:
        add("self_attn.kv_a_proj_with_mqa.bias", a + ("bkv_a_C",), (C + R,))
        add("self_attn.o_proj.bias", a + ("bo_D",), (D,))
    m = ("mlp",)
    if not moe:
        F = cfg.intermediate_size
        add("mlp.gate_proj.weight", m + ("gate_DF",), (F, D), _t, _t)
        add("mlp.up_proj.weight", m + ("up_DF",), (F, D), _t, _t)
        add("mlp.down_proj.weight", m + ("down_FD",), (D, F), _t, _t)
        return out
    E, F = cfg.n_routed_experts, cfg.moe_intermediate_size
    add("mlp.gate.weight", m + ("router_DE",), (E, D), _t, _t, fp32=True)
    add("mlp.gate.e_score_correction_bias", m + ("router_bias_E",), (E,), fp32=True)
    for e in range(E):
        ie = index + (e,)
        add(f"mlp.experts.{e}.gate_proj.weight", m + ("gate_EDF",), (F, D), _t, _t, idx=ie)
        add(f"mlp.experts.{e}.up_proj.weight", m + ("up_EDF",), (F, D), _t, _t, idx=ie)
        add(f"mlp.experts.{e}.down_proj.weight", m + ("down_EFD",), (D, F), _t, _t, idx=ie)
    if cfg.n_shared_experts:
        S = F * cfg.n_shared_experts
        add("mlp.shared_experts.gate_proj.weight", m + ("shared", "gate_DF"), (S, D), _t, _t)
        add("mlp.shared_experts.up_proj.weight", m + ("shared", "up_DF"), (S, D), _t, _t)
        add("mlp.shared_experts.down_proj.weight", m + ("shared", "down_FD"), (D, S), _t, _t)
    return out


def main_entries(cfg: ModelConfig) -> list[Entry]:
    """Every tensor of the main model (what `DeepseekV3ForCausalLM` loads)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    out = [Entry("model.embed_tokens.weight", ("embed", "embedding_VD"), (), (V, D), _same, _same)]
    for i in range(cfg.num_hidden_layers):
        if i < cfg.first_k_dense_replace:
            out += _block(cfg, f"model.layers.{i}", ("dense_layers", "layers"), (i,), moe=False)
        else:
            out += _block(cfg, f"model.layers.{i}", ("moe_layers", "layers"),
                          (i - cfg.first_k_dense_replace,), moe=True)
    out.append(Entry("model.norm.weight", ("final_norm", "weight"), (), (D,), _same, _same))
    if not cfg.tie_word_embeddings:
        out.append(Entry("lm_head.weight", ("lm_head_DV",), (), (V, D), _t, _t))
    return out


def mtp_entries(cfg: ModelConfig) -> list[Entry]:
    """MTP modules under DeepSeek's `model.layers.{num_hidden_layers + d}.*` names."""
    D = cfg.hidden_size
    out: list[Entry] = []
    for d in range(cfg.num_nextn_predict_layers):
        hf, ours = f"model.layers.{cfg.num_hidden_layers + d}", ("mtp", d)
        out += [
            Entry(f"{hf}.enorm.weight", ours + ("enorm", "weight"), (), (D,), _same, _same),
            Entry(f"{hf}.hnorm.weight", ours + ("hnorm", "weight"), (), (D,), _same, _same),
            Entry(f"{hf}.eh_proj.weight", ours + ("eh_proj_2DD",), (), (D, 2 * D), _t, _t),
            Entry(f"{hf}.shared_head.norm.weight", ours + ("final_norm", "weight"), (), (D,), _same, _same),
        ]
        out += _block(cfg, hf, ours + ("block",), (), moe=True)
    return out


def mtp_shared_copies(cfg: ModelConfig) -> list[Entry]:
    """The per-depth copies of the shared embedding and head that DeepSeek checkpoints carry."""
    D, V = cfg.hidden_size, cfg.vocab_size
    head = Entry("", ("lm_head_DV",), (), (V, D), _t, _t) if not cfg.tie_word_embeddings else \
        Entry("", ("embed", "embedding_VD"), (), (V, D), _same, _same)
    out = []
    for d in range(cfg.num_nextn_predict_layers):
        hf = f"model.layers.{cfg.num_hidden_layers + d}"
        out.append(Entry(f"{hf}.embed_tokens.weight", ("embed", "embedding_VD"), (), (V, D), _same, _same))
        out.append(dataclasses.replace(head, key=f"{hf}.shared_head.head.weight"))
    return out

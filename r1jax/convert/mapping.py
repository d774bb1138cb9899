"""The name and layout map between HF DeepseekV3 checkpoints and r1jax parameters.

One `Entry` per HF tensor: which r1jax leaves it is made of, at which index of their stacked
leading dims (layer, and expert for routed experts), and how the layout changes both ways.
HF stores Linear weights `[out, in]`; r1jax stores einsum operands `[in, out]`, with heads split
out (`[Q, N, K+R]` for q_b, `[N, V, D]` for o_proj). Two HF tensors fuse what r1jax keeps
apart: `kv_a_proj_with_mqa` [C+R, D] is the latent's down-projection `wkv_a_DC` then the shared
rope key `wk_rope_DR`; `kv_b_proj` [N*(K+V), C] holds, per head, the key up-projection
`wk_b_CNK` then the value one `wv_b_CNV`. Routed experts are per-expert tensors in the
checkpoint (`mlp.experts.{e}.gate_proj.weight`) and one `[E, D, F]` array here.

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
    paths: tuple[Path, ...]           # the r1jax leaves it is made of (two where HF fuses projections)
    index: tuple[int, ...]            # index into each leaf's stacked leading dims
    hf_shape: tuple[int, ...]
    split: Callable[[np.ndarray], tuple[np.ndarray, ...]]   # HF tensor -> one value per path
    join: Callable[..., np.ndarray]                           # one value per path -> HF tensor
    fp32: bool = False                # kept float32 in HF checkpoints whatever their dtype

    def gather(self, leaf: Callable[[Path], np.ndarray]) -> np.ndarray:
        """This HF tensor from the r1jax leaves `leaf(path)` (whole stacked arrays)."""
        return self.join(*(np.asarray(leaf(p))[self.index] for p in self.paths))


def _one(path: Path, fwd=None, back=None):
    """(paths, split, join) of an HF tensor that is one r1jax leaf, `fwd` HF -> ours."""
    fwd, back = fwd or (lambda x: x), back or (lambda y: y)
    return (path,), (lambda x: (fwd(x),)), back


def _t(x):
    return x.T


def _heads_in(N: int, H: int):
    """HF [N*H, X] <-> ours [X, N, H] (q_proj, q_b_proj)."""
    return (lambda x: x.reshape(N, H, -1).transpose(2, 0, 1),
            lambda y: y.transpose(1, 2, 0).reshape(N * H, -1))


def _heads_out(N: int, V: int):
    """HF [D, N*V] <-> ours [N, V, D] (o_proj)."""
    return (lambda x: x.reshape(-1, N, V).transpose(1, 2, 0),
            lambda y: y.transpose(2, 0, 1).reshape(y.shape[2], N * V))


def _rows(a: Path, b: Path, n: int, fwd=None, back=None):
    """An HF tensor whose first n rows are leaf `a` and the rest leaf `b` (kv_a_proj_with_mqa:
    the latent's down-projection, then the shared rope key)."""
    fwd, back = fwd or (lambda x: x), back or (lambda y: y)
    return (a, b), (lambda x: (fwd(x[:n]), fwd(x[n:]))), (lambda y, z: np.concatenate([back(y), back(z)]))


def _kv_b(a: Path, b: Path, N: int, K: int, V: int):
    """HF kv_b_proj [N*(K+V), C], per head K key rows then V value rows <-> ours [C,N,K], [C,N,V]."""
    def split(x):
        x = x.reshape(N, K + V, -1)
        return x[:, :K].transpose(2, 0, 1), x[:, K:].transpose(2, 0, 1)

    def join(k, v):
        return np.concatenate([k.transpose(1, 2, 0), v.transpose(1, 2, 0)], axis=1).reshape(N * (K + V), -1)
    return (a, b), split, join


def _block(cfg: ModelConfig, hf: str, ours: Path, index: tuple[int, ...], moe: bool) -> list[Entry]:
    D, N = cfg.hidden_size, cfg.num_attention_heads
    K, R, V, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    out: list[Entry] = []

    def add(key, shape, parts, fp32=False, idx=index):
        paths, split, join = parts
        out.append(Entry(f"{hf}.{key}", tuple(ours + p for p in paths), idx, tuple(shape), split, join, fp32))

    add("input_layernorm.weight", (D,), _one(("input_norm", "weight")))
    add("post_attention_layernorm.weight", (D,), _one(("post_attn_norm", "weight")))
    a = ("attn",)
    if cfg.q_lora_rank is None:
        add("self_attn.q_proj.weight", (N * (K + R), D), _one(a + ("wq_DNH",), *_heads_in(N, K + R)))
    else:
        Q = cfg.q_lora_rank
        add("self_attn.q_a_proj.weight", (Q, D), _one(a + ("wq_a_DQ",), _t, _t))
        add("self_attn.q_a_layernorm.weight", (Q,), _one(a + ("q_norm", "weight")))
        add("self_attn.q_b_proj.weight", (N * (K + R), Q), _one(a + ("wq_b_QNH",), *_heads_in(N, K + R)))
        if cfg.attention_bias:
            add("self_attn.q_a_proj.bias", (Q,), _one(a + ("bq_a_Q",)))
    add("self_attn.kv_a_proj_with_mqa.weight", (C + R, D), _rows(a + ("wkv_a_DC",), a + ("wk_rope_DR",), C, _t, _t))
    add("self_attn.kv_a_layernorm.weight", (C,), _one(a + ("kv_norm", "weight")))
    add("self_attn.kv_b_proj.weight", (N * (K + V), C), _kv_b(a + ("wk_b_CNK",), a + ("wv_b_CNV",), N, K, V))
    add("self_attn.o_proj.weight", (D, N * V), _one(a + ("wo_NVD",), *_heads_out(N, V)))
    if cfg.attention_bias:
        add("self_attn.kv_a_proj_with_mqa.bias", (C + R,), _rows(a + ("bkv_a_C",), a + ("bk_rope_R",), C))
        add("self_attn.o_proj.bias", (D,), _one(a + ("bo_D",)))
    m = ("mlp",)
    if not moe:
        F = cfg.intermediate_size
        add("mlp.gate_proj.weight", (F, D), _one(m + ("gate_DF",), _t, _t))
        add("mlp.up_proj.weight", (F, D), _one(m + ("up_DF",), _t, _t))
        add("mlp.down_proj.weight", (D, F), _one(m + ("down_FD",), _t, _t))
        return out
    E, F = cfg.n_routed_experts, cfg.moe_intermediate_size
    add("mlp.gate.weight", (E, D), _one(m + ("router_DE",), _t, _t), fp32=True)
    add("mlp.gate.e_score_correction_bias", (E,), _one(m + ("router_bias_E",)), fp32=True)
    for e in range(E):
        ie = index + (e,)
        add(f"mlp.experts.{e}.gate_proj.weight", (F, D), _one(m + ("gate_EDF",), _t, _t), idx=ie)
        add(f"mlp.experts.{e}.up_proj.weight", (F, D), _one(m + ("up_EDF",), _t, _t), idx=ie)
        add(f"mlp.experts.{e}.down_proj.weight", (D, F), _one(m + ("down_EFD",), _t, _t), idx=ie)
    if cfg.n_shared_experts:
        S = F * cfg.n_shared_experts
        add("mlp.shared_experts.gate_proj.weight", (S, D), _one(m + ("shared", "gate_DF"), _t, _t))
        add("mlp.shared_experts.up_proj.weight", (S, D), _one(m + ("shared", "up_DF"), _t, _t))
        add("mlp.shared_experts.down_proj.weight", (D, S), _one(m + ("shared", "down_FD"), _t, _t))
    return out


def _entry(key: str, path: Path, shape, fwd=None, back=None) -> Entry:
    paths, split, join = _one(path, fwd, back)
    return Entry(key, paths, (), tuple(shape), split, join)


def main_entries(cfg: ModelConfig) -> list[Entry]:
    """Every tensor of the main model (what `DeepseekV3ForCausalLM` loads)."""
    D, W = cfg.hidden_size, cfg.vocab_size
    out = [_entry("model.embed_tokens.weight", ("embed", "embedding_WD"), (W, D))]
    for i in range(cfg.num_hidden_layers):
        if i < cfg.first_k_dense_replace:
            out += _block(cfg, f"model.layers.{i}", ("dense_layers", "layers"), (i,), moe=False)
        else:
            out += _block(cfg, f"model.layers.{i}", ("moe_layers", "layers"),
                          (i - cfg.first_k_dense_replace,), moe=True)
    out.append(_entry("model.norm.weight", ("final_norm", "weight"), (D,)))
    if not cfg.tie_word_embeddings:
        out.append(_entry("lm_head.weight", ("lm_head_DW",), (W, D), _t, _t))
    return out


def mtp_entries(cfg: ModelConfig) -> list[Entry]:
    """MTP modules under DeepSeek's `model.layers.{num_hidden_layers + d}.*` names."""
    D = cfg.hidden_size
    out: list[Entry] = []
    for d in range(cfg.num_nextn_predict_layers):
        hf, ours = f"model.layers.{cfg.num_hidden_layers + d}", ("mtp", d)
        out += [
            _entry(f"{hf}.enorm.weight", ours + ("enorm", "weight"), (D,)),
            _entry(f"{hf}.hnorm.weight", ours + ("hnorm", "weight"), (D,)),
            _entry(f"{hf}.eh_proj.weight", ours + ("eh_proj_2DD",), (D, 2 * D), _t, _t),
            _entry(f"{hf}.shared_head.norm.weight", ours + ("final_norm", "weight"), (D,)),
        ]
        out += _block(cfg, hf, ours + ("block",), (), moe=True)
    return out


def mtp_shared_copies(cfg: ModelConfig) -> list[Entry]:
    """The per-depth copies of the shared embedding and head that DeepSeek checkpoints carry."""
    D, W = cfg.hidden_size, cfg.vocab_size
    out = []
    for d in range(cfg.num_nextn_predict_layers):
        hf = f"model.layers.{cfg.num_hidden_layers + d}"
        out.append(_entry(f"{hf}.embed_tokens.weight", ("embed", "embedding_WD"), (W, D)))
        out.append(_entry(f"{hf}.shared_head.head.weight", ("embed", "embedding_WD"), (W, D)) if cfg.tie_word_embeddings
                   else _entry(f"{hf}.shared_head.head.weight", ("lm_head_DW",), (W, D), _t, _t))
    return out

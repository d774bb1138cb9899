"""Model FLOPs utilisation: analytic training FLOPs per token over the devices' peak.

XLA's cost analysis counts a scanned layer body once, so FLOPs are counted from the config:
6 x the matmul parameters a token activates (routed experts k of E; the embedding lookup is not
a matmul; the LM head is, once per MTP depth too) plus the causal attention core,
3 x T x N x (qk_head_dim + v_head_dim) per attention layer (QK^T and PV over T/2 keys on
average, times 3 for forward and backward)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from r1jax.config import DType, ModelConfig
from r1jax.model.params import count

# dense tensor-core peaks, FLOP/s per device (vendor datasheets); fp32 runs use TF32 rates
GPU_PEAKS = {"H200": {"bf16": 989e12, "fp32": 494e12}, "H100": {"bf16": 989e12, "fp32": 494e12},
             "A100": {"bf16": 312e12, "fp32": 156e12}}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    n = count(cfg)
    D, V, E, k = cfg.hidden_size, cfg.vocab_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    matmul = n.activated - V * D                       # the embedding is a lookup
    if cfg.num_nextn_predict_layers:
        per_block_routed = 3 * D * cfg.moe_intermediate_size * E
        mtp_active = n.mtp - cfg.num_nextn_predict_layers * round(per_block_routed * (1 - k / E))
        matmul += mtp_active + cfg.num_nextn_predict_layers * V * D      # own weights + shared head
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    attention = 3 * seq_len * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * layers
    return 6.0 * matmul + attention


def measured_cpu_peak(seconds: float = 0.3) -> float:
    """FLOP/s of a 1024^3 float32 matmul on this host (the CPU's practical peak)."""
    a = jnp.ones((1024, 1024), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        f(a).block_until_ready()
        n += 1
    return 2 * 1024**3 * n / (time.perf_counter() - t0)


def peak_flops(devices: list, dtype: DType) -> tuple[float, str]:
    """(total peak FLOP/s of `devices`, how it was obtained)."""
    d = devices[0]
    if d.platform == "cpu":        # fake CPU devices share the host's cores
        return measured_cpu_peak(), "measured 1024^3 float32 matmul on this host"
    kind = "fp32" if dtype is DType.fp32 else "bf16"
    for name, peaks in GPU_PEAKS.items():
        if name in d.device_kind:
            return peaks[kind] * len(devices), f"{name} datasheet {kind} peak x {len(devices)}"
    return float("nan"), f"unknown peak for {d.device_kind}"

"""Model FLOPs utilisation: analytic training FLOPs per token over the devices' peak.

XLA's cost analysis counts a scanned layer body once, so FLOPs are counted from the config:
6 x the matmul parameters a token activates (routed experts k of E; the embedding lookup is not
a matmul; the LM head is, once per MTP depth too) plus the causal attention core,
3 x T x N x (qk_head_dim + v_head_dim) per attention layer (QK^T and PV over T/2 keys on
average, times 3 for forward and backward).

On CPU the peak is measured: the best of several short timings of a 1024^3 float32 matmul (other
work on the machine only ever slows one down), cached per host, CPU model, core count and jax
version in ~/.cache/r1jax/cpu_peak.json (under $XDG_CACHE_HOME when set), so that runs on one host
divide by the same number. It is approximate all the same: single measurements ranged 87-170
GFLOP/s on one shared 2-core host, and XLA's dot is not the hardware's peak."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

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


def measured_cpu_peak(trials: int = 8, seconds: float = 0.1) -> float:
    """FLOP/s of a 1024^3 float32 matmul on this host (the CPU's practical peak): the best of
    `trials` timings of `seconds` each."""
    a = jnp.ones((1024, 1024), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    best = 0.0
    for _ in range(trials):
        n, t0 = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - t0 < seconds:
            f(a).block_until_ready()
            n += 1
        best = max(best, 2 * 1024**3 * n / (time.perf_counter() - t0))
    return best


def cpu_model() -> str:
    """This host's CPU model name (what bench results and the CPU-peak cache are keyed by)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak_cache() -> Path:
    """Where measured CPU peaks are kept, one per host key."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "r1jax" / "cpu_peak.json"


def cached_cpu_peak() -> tuple[float, str]:
    """(this host's measured CPU peak, how): from the cache when it holds this host's, else measured
    now and stored (a cache that cannot be read or written only costs a measurement)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = f"{platform.node()} | {cpu_model()} | {cores} cores | jax {jax.__version__}"
    path = cpu_peak_cache()
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if not isinstance(table, dict):
        table = {}
    hit = table.get(key)
    if isinstance(hit, dict) and isinstance(hit.get("flops"), (int, float)) and hit["flops"] > 0:
        return float(hit["flops"]), _how(hit.get("measured", "?"), f"cached in {path}")
    flops, when = measured_cpu_peak(), time.strftime("%Y-%m-%d %H:%M")
    table[key] = {"flops": flops, "measured": when}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)           # several processes may measure at once; each file is whole
        where = f"cached in {path}"
    except OSError:
        tmp.unlink(missing_ok=True)
        where = f"not cached ({path} is not writable)"
    return flops, _how(when, where)


def _how(when: str, where: str) -> str:
    return (f"approximate: the best 1024^3 float32 matmul rate measured on this host at {when}, {where} "
            f"(delete it to measure again)")


def peak_flops(devices: list, dtype: DType) -> tuple[float, str]:
    """(total peak FLOP/s of `devices`, how it was obtained)."""
    d = devices[0]
    if d.platform == "cpu":        # fake CPU devices share the host's cores
        return cached_cpu_peak()
    kind = "fp32" if dtype is DType.fp32 else "bf16"
    for name, peaks in GPU_PEAKS.items():
        if name in d.device_kind:
            return peaks[kind] * len(devices), f"{name} datasheet {kind} peak x {len(devices)}"
    return float("nan"), f"unknown peak for {d.device_kind}"

"""A LoRA run's adapters as a PEFT adapter directory: `adapter_config.json` + `adapter_model.safetensors`,
which `peft.PeftModel.from_pretrained(DeepseekV3ForCausalLM, DIR)` loads over the base model.

r1jax's adapters are per HF module already (r1jax/model/lora.py), so export is a relayout:
- a module PEFT adapts as a Linear (`target_modules`): lora_A [r, in] = a [*in, r] flattened and
  transposed (HF's input order is r1jax's row-major input dims: o_proj's in is head-major N*V);
  lora_B [out, r] is the b leaves through the base weight's own HF layout (`mapping.Entry.join`
  with the rank in place of the input dim), which fuses kv_a_proj_with_mqa's latent and rope key
  and interleaves kv_b_proj's per-head key and value rows exactly as the base weight.
- routed experts (`target_parameters`): transformers holds each layer's experts as fused
  `gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F] parameters, which PEFT wraps in nested
  `ParamWrapper`s keyed without the parameter name (gate_up inside as `experts.base_layer`,
  down outside as `experts`). Their lora_A is expert-major [E*r, in] and lora_B rank-major
  [out, r*E], dW_e = (alpha/r) * B_e A_e. r1jax's separate gate and up adapters become one of
  rank 2r: A stacked, B block-diagonal, with `rank_pattern` 2r and `alpha_pattern` keeping the
  scale (2 alpha; sqrt(2) alpha with rsLoRA).

peft <= 0.21.2 under transformers >= 5 rewrites any target named gate_proj / up_proj / down_proj
into the routed experts' parameters (peft issue 3711), so adapters on the dense layers' MLP or the
shared experts load onto the wrong weights there. They are written correctly here; `export` warns.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np

from r1jax.checkpoint import params as ckpt
from r1jax.config import ConfigError, LoraConfig, ModelConfig
from r1jax.convert import safetensors_io
from r1jax.convert.mapping import main_entries

PREFIX = "base_model.model."
PEFT_BUG = ("peft <= 0.21.2 with transformers >= 5 moves adapters on gate_proj/up_proj/down_proj onto the routed "
            "experts (peft issue 3711): the dense-layer MLP and shared-expert adapters written here will not load "
            "where they belong until that is fixed; orbax-to-hf writes the merged weights instead")
LINEAR_TARGETS = {"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                  "gate_proj", "up_proj", "down_proj"}


def _module_and_target(key: str) -> tuple[str, str]:
    """HF weight name -> (module name, LoRA target): ...self_attn.q_a_proj.weight -> q_a_proj;
    ...mlp.shared_experts.up_proj.weight -> up_proj (group shared_experts)."""
    module = key[: -len(".weight")]
    return module, module.rsplit(".", 1)[1]


def _group(key: str) -> str:
    return "shared_experts" if ".shared_experts." in key else ("mlp" if ".mlp." in key else "attention")


def tensors(cfg: ModelConfig, lo: LoraConfig, get: Callable[[tuple], np.ndarray], have: set[tuple]) -> dict:
    """{PEFT key: array} for every adapter a run holds (`have`: its leaves' string paths)."""
    out: dict[str, np.ndarray] = {}
    r = lo.rank
    for e in main_entries(cfg):
        if (not e.key.startswith("model.layers.") or not e.key.endswith(".weight")
                or ".experts." in e.key and ".shared_experts." not in e.key):
            continue
        module, target = _module_and_target(e.key)
        if target not in LINEAR_TARGETS:
            continue
        owner = tuple(map(str, e.paths[0][:-1]))
        a_path = owner + ("lora", target, "a")
        if a_path not in have:
            continue
        a = np.asarray(get(a_path), np.float32)[e.index]                       # [*in, r]
        bs = [np.asarray(get(owner + ("lora", target, "b", str(p[-1]))), np.float32)[e.index] for p in e.paths]
        out[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
        # the b leaves through the base weight's layout, the rank standing in for its input dim;
        # o_proj's join folds its two input dims, and its b has one output dim: just transpose
        lora_b = bs[0].T if target == "o_proj" else e.join(*bs)
        out[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(lora_b)
    out.update(_experts(cfg, lo, get, have))
    return out


def _experts(cfg: ModelConfig, lo: LoraConfig, get, have) -> dict:
    out: dict[str, np.ndarray] = {}
    k = cfg.first_k_dense_replace
    for layer in range(k, cfg.num_hidden_layers):
        owner = ("moe_layers", "layers", "mlp", "lora")
        if owner + ("gate_proj", "a") not in have:
            return out
        i = layer - k

        def ab(t, w):
            return (np.asarray(get(owner + (t, "a")), np.float32)[i],                  # [E, in, r]
                    np.asarray(get(owner + (t, "b", w)), np.float32)[i])               # [E, r, out]
        (ag, bg), (au, bu), (ad, bd) = ab("gate_proj", "gate_EDF"), ab("up_proj", "up_EDF"), ab("down_proj", "down_EFD")
        E, D, r = ag.shape
        F = bg.shape[-1]
        a_gu = np.concatenate([ag.transpose(0, 2, 1), au.transpose(0, 2, 1)], axis=1)   # [E, 2r, D]
        b_gu = np.zeros((E, 2 * F, 2 * r), np.float32)                                   # block-diagonal per expert
        b_gu[:, :F, :r] = bg.transpose(0, 2, 1)
        b_gu[:, F:, r:] = bu.transpose(0, 2, 1)
        hf = f"{PREFIX}model.layers.{layer}.mlp.experts"
        out[f"{hf}.base_layer.lora_A.weight"] = a_gu.reshape(E * 2 * r, D)
        out[f"{hf}.base_layer.lora_B.weight"] = np.ascontiguousarray(b_gu.transpose(1, 2, 0).reshape(2 * F, 2 * r * E))
        out[f"{hf}.lora_A.weight"] = np.ascontiguousarray(ad.transpose(0, 2, 1).reshape(E * r, F))
        out[f"{hf}.lora_B.weight"] = np.ascontiguousarray(bd.transpose(2, 1, 0).reshape(D, r * E))
    return out


def adapter_config(cfg: ModelConfig, lo: LoraConfig, base: str | None) -> dict:
    """PEFT's LoraConfig for these adapters (the keys PEFT 0.21 needs to rebuild them)."""
    modules = []
    for t in lo.targets:
        if t in ("mlp", "shared_experts"):
            modules += ["gate_proj", "up_proj", "down_proj"]
        elif t in ("q_a_proj", "q_b_proj") and cfg.q_lora_rank is None:
            modules.append("q_proj")
        elif t != "experts":
            modules.append(t)
    experts = "experts" in lo.targets
    pattern = r".*\.experts\.gate_up_proj"
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": lo.rank, "lora_alpha": lo.alpha, "lora_dropout": lo.dropout, "bias": "none",
        "use_rslora": lo.rslora, "use_dora": False, "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None,
        "target_modules": sorted(set(modules)) or None,
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts else None,
        # gate and up travel as one adapter of rank 2r; its alpha keeps the scale alpha/r
        "rank_pattern": {pattern: 2 * lo.rank} if experts else {},
        "alpha_pattern": {pattern: lo.alpha * (math.sqrt(2) if lo.rslora else 2)} if experts else {},
        "exclude_modules": None, "layers_to_transform": None, "layers_pattern": None,
    }


def export(src: str | Path, dst: str | Path, *, step: int | None = None, base: str | None = None,
           log: Callable[[str], None] = print) -> tuple[ModelConfig, LoraConfig, int]:
    """A LoRA run's checkpoint directory -> a PEFT adapter directory. -> (model, lora, tensors)."""
    lo = ckpt.read_lora_config(src)
    if lo is None:
        raise ConfigError(f"{src}: holds no LoRA adapters (no {ckpt.LORA_CONFIG}); orbax-to-hf converts a "
                          f"full fine-tune")
    cfg = ckpt.read_model_config(src)
    reader = ckpt.ParamsReader(src, step, merged=False)
    if {"mlp", "shared_experts"} & set(lo.targets):
        log(f"warning: {PEFT_BUG}")
    out = tensors(cfg, lo, reader.read, set(reader.shapes))
    dst = Path(dst)
    safetensors_io.write(dst, [(k, v.shape, np.float32) for k, v in out.items()], out.__getitem__,
                         max_shard_bytes=1 << 62, single="adapter_model.safetensors")
    (dst / "adapter_config.json").write_text(json.dumps(adapter_config(cfg, lo, base), indent=2))
    return cfg, lo, len(out)

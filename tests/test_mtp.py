"""Multi-Token Prediction: logits equal transformers' `MtpModel` (the module HF uses to run
DeepSeek's MTP weights), weights round-trip under `model.layers.{L+d}.*`, and the loss falls."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file
from transformers import DeepseekV3ForCausalLM
from transformers.modeling_layers import MtpModel

from hf_ref import hf_model
from r1jax import model as modellib
from r1jax import weights
from r1jax.config import ModelConfig
from r1jax.convert import hf
from r1jax.train.objectives import NextToken


def _with_mtp(tmp_path, depth: int):
    """An HF checkpoint dir holding main + MTP weights (r1jax writes the MTP part), and its model."""
    ref = hf_model(seed=3)
    ref.save_pretrained(tmp_path / "main")
    cfg0, ours = hf.load(tmp_path / "main")
    cfg = dataclasses.replace(cfg0, num_nextn_predict_layers=depth)
    # fresh MTP modules (routing-varying router scale), main weights from the reference
    fresh = weights.create(cfg, seed=7)
    values = modellib.leaves(nnx.state(fresh))
    values.update(modellib.leaves(nnx.state(ours)))
    rng = np.random.default_rng(0)
    for p in list(values):
        if p[0] == "mtp" and p[-1] in ("router_DE",):
            values[p] = jnp.asarray(rng.normal(0, 2 / np.sqrt(cfg.hidden_size), values[p].shape), jnp.float32)
        elif p[0] == "mtp" and p[-1] == "router_bias_E":
            values[p] = jnp.asarray(rng.normal(0, 0.3, values[p].shape), jnp.float32)
        elif p[0] == "mtp" and p[-1] not in ("weight",):
            values[p] = jnp.asarray(rng.normal(0, 1 / np.sqrt(values[p].shape[0]), values[p].shape), jnp.float32)
    graphdef, state = nnx.split(fresh)
    model = nnx.merge(graphdef, modellib.with_leaves(state, values))
    hf.save(model, cfg, tmp_path / "full")
    return cfg, model, ref


def _hf_mtp(main: DeepseekV3ForCausalLM, directory, cfg: ModelConfig) -> MtpModel:
    """transformers' MtpModel with the MTP tensors renamed the way its loader does."""
    mtp = MtpModel(main, cfg.num_nextn_predict_layers).eval()
    sd = load_file(str(directory / "model.safetensors"))
    L = cfg.num_hidden_layers
    state = {}
    for d in range(cfg.num_nextn_predict_layers):
        pre = f"model.layers.{L + d}."
        own = {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}
        for k, v in own.items():
            if k in ("embed_tokens.weight", "shared_head.head.weight") or ".experts." in k:
                continue
            if k.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
                state[f"layers.{d}.{k}"] = v
            elif k == "shared_head.norm.weight":
                state[f"layers.{d}.post_norm.weight"] = v
            else:
                state[f"layers.{d}.mtp_block.{k}"] = v
        E = cfg.n_routed_experts
        state[f"layers.{d}.mtp_block.mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([own[f"mlp.experts.{e}.gate_proj.weight"], own[f"mlp.experts.{e}.up_proj.weight"]])
            for e in range(E)])
        state[f"layers.{d}.mtp_block.mlp.experts.down_proj"] = torch.stack(
            [own[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k.startswith(("embed_tokens", "shared_head")) for k in missing), missing
    return mtp


def test_mtp_logits_match_transformers_mtp_model(tmp_path):
    cfg, model, _ = _with_mtp(tmp_path, depth=2)
    main = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    mtp = _hf_mtp(main, tmp_path / "full", cfg)
    B, T = 2, 20
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(T)[None].expand(B, T)
    with torch.no_grad():
        h = main.model(ids, output_hidden_states=True).hidden_states[-1]      # post final norm
        h1 = mtp.forward_layer(0, h[:, :-1], position_ids=pos[:, 1:], mtp_cache=None, input_ids=ids[:, 1:])
        h2 = mtp.forward_layer(1, h1[:, :-1], position_ids=pos[:, 2:], mtp_cache=None, input_ids=ids[:, 2:])
        ref1, ref2 = main.lm_head(h1).numpy(), main.lm_head(h2).numpy()

    # the reloaded checkpoint must carry the MTP weights r1jax wrote
    cfg2, reloaded = hf.load(tmp_path / "full")
    assert cfg2.num_nextn_predict_layers == 2
    out = jax.jit(lambda m, x: m(x, mtp=True))(reloaded, jnp.asarray(ids.numpy(), jnp.int32))
    d1 = float(np.abs(np.asarray(out.mtp_logits[0, :, : T - 1]) - ref1).max())
    d2 = float(np.abs(np.asarray(out.mtp_logits[1, :, : T - 2]) - ref2).max())
    varied = len({tuple(sorted(r)) for r in np.asarray(out.aux["mtp_idx"][0])})
    print(f"\nMTP depth 1 max|dlogits|={d1:.2e}, depth 2 max|dlogits|={d2:.2e}, "
          f"{varied} distinct expert sets in the depth-1 block")
    assert varied > 4
    assert d1 <= 2e-5 and d2 <= 2e-5


def test_mtp_weights_round_trip_under_deepseek_names(tmp_path):
    cfg, model, _ = _with_mtp(tmp_path, depth=1)
    sd = load_file(str(tmp_path / "full" / "model.safetensors"))
    L = cfg.num_hidden_layers
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "embed_tokens.weight", "mlp.gate.e_score_correction_bias",
                 "mlp.experts.7.down_proj.weight", "self_attn.kv_b_proj.weight"):
        assert f"model.layers.{L}.{name}" in sd, name
    assert np.array_equal(sd[f"model.layers.{L}.shared_head.head.weight"].numpy(), sd["lm_head.weight"].numpy())
    _, back = hf.load(tmp_path / "full")
    a, b = modellib.leaves(nnx.state(model)), modellib.leaves(nnx.state(back))
    assert a.keys() == b.keys()
    for p in a:
        assert np.array_equal(np.asarray(a[p]), np.asarray(b[p])), p


@pytest.mark.slow      # 30 training steps: `make test`
def test_mtp_loss_falls(tmp_path):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
                      first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                      qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
                      num_nextn_predict_layers=1)
    model = weights.create(cfg)
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)      # plain flax: no mesh anywhere
    objective = NextToken(mtp_weight=1.0, mtp_depth=1)
    # a learnable stream: each row counts up by a row-specific stride, so t+2 is predictable
    starts = np.arange(8)[:, None]
    ids = jnp.asarray((starts + 3 * np.arange(32)[None]) % cfg.vocab_size, jnp.int32)
    batch = {"ids": ids, "segment_ids": jnp.ones_like(ids)}

    @nnx.jit
    def step(model, opt):
        def loss_fn(m):
            loss_sum, tokens, metrics = objective(m(ids, mtp=True), batch)
            return loss_sum / tokens, metrics
        (_, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        opt.update(model, grads)
        s, c = metrics["mtp_loss"]
        return s / c

    curve = [float(step(model, opt)) for _ in range(30)]
    print(f"\nMTP loss: {curve[0]:.3f} -> {curve[-1]:.3f} in 30 steps")
    assert curve[-1] < 0.5 * curve[0]

"""Builders for the PyTorch reference: HF `DeepseekV3ForCausalLM` with weights that make routing
vary from token to token (HF's default init gives near-constant routing and hides bugs)."""
from __future__ import annotations

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24,
            qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
            num_experts_per_tok=3, first_k_dense_replace=1, max_position_embeddings=128,
            rms_norm_eps=1e-6, tie_word_embeddings=False)


def hf_model(seed: int = 0, **overrides) -> DeepseekV3ForCausalLM:
    cfg = DeepseekV3Config(**{**TINY, **overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "mlp.gate.weight" in name:          # router: logits of O(1) so top-k changes per token
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[1]) * 2.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
            else:
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[-1]))
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0.0, 0.3)
    return model


def checkpoint_grads(model: DeepseekV3ForCausalLM) -> dict[str, np.ndarray]:
    """Gradients under checkpoint names (HF fuses experts in memory; split them back)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().numpy()
        if name.endswith("mlp.experts.gate_up_proj"):
            F = g.shape[1] // 2
            for e in range(g.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = g[e, :F]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = g[e, F:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(g.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = g[e]
        else:
            out[name] = g
    return out


def router_topk(model: DeepseekV3ForCausalLM):
    """Hooks collecting each MoE layer's chosen experts; returns (list, remove)."""
    chosen = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: chosen.append(out[2].detach().numpy()))
             for name, m in model.named_modules() if name.endswith("mlp.gate")]
    return chosen, lambda: [h.remove() for h in hooks]

"""Training parity with PyTorch: identical weights and batches, 20 AdamW steps (lr 1e-3, betas
0.9/0.95, eps 1e-8, weight decay 0.1 on matrices only, clip 1.0, fp32, no router-bias update, no
balance loss, no MTP): per-step loss within 1e-4 of transformers' model under torch.optim.AdamW."""
from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import torch

from hf_ref import hf_model
from r1jax import config as configlib
from r1jax.config import Config, OptimConfig, TrainConfig
from r1jax.convert import hf
from r1jax.parallel.mesh import single_device_mesh
from r1jax.train.step import build

STEPS, B, T, LR, WD = 20, 4, 32, 1e-3, 0.1


def test_twenty_adamw_steps_match_pytorch(tmp_path):
    ref = hf_model(seed=5).train()
    ref.save_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    pool = [rng.integers(0, ref.config.vocab_size, (B, T)) for _ in range(2)]
    batches = [pool[i % 2] for i in range(STEPS)]       # revisited batches: something to learn

    # PyTorch: the optimizer groups mirror r1jax's decay mask (no decay on norms and biases)
    no_decay = [p for n, p in ref.named_parameters() if "norm" in n or n.endswith("bias")]
    decay = [p for n, p in ref.named_parameters() if not ("norm" in n or n.endswith("bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    torch_losses = []
    for ids in batches:
        x = torch.as_tensor(ids)
        loss = ref(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        torch_losses.append(loss.item())

    mcfg, model = hf.load(tmp_path)
    cfg = configlib.from_dict({**configlib.to_dict(Config()), "model": configlib.to_dict(mcfg),
                               "mesh": {"data": 1}, "data": {"seq_len": T}, "loss": {"seq_aux_loss_alpha": 0.0},
                               "optim": configlib.to_dict(OptimConfig(lr=LR, warmup_ratio=0.0, min_lr_ratio=1.0,
                                                                      weight_decay=WD, clip_norm=1.0,
                                                                      bias_update_rate=0.0)),
                               "train": configlib.to_dict(TrainConfig(steps=STEPS, global_batch_size=B))})
    setup = build(cfg, single_device_mesh(), model)
    state, step = setup.state, setup.step
    ours = []
    for ids in batches:
        batch = {"ids": jnp.asarray(ids, jnp.int32), "segment_ids": jnp.ones((B, T), jnp.int32),
                 "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))}
        state, m = step(state, batch)
        ours.append(float(m["loss"]))

    diffs = np.abs(np.asarray(ours) - np.asarray(torch_losses))
    print(f"\nloss {torch_losses[0]:.4f} -> {torch_losses[-1]:.4f} (torch) / {ours[-1]:.4f} (r1jax); "
          f"max per-step |dloss| {diffs.max():.1e} at step {int(diffs.argmax()) + 1}")
    assert torch_losses[-1] < torch_losses[0] - 0.5            # it trains
    assert diffs.max() <= 1e-4

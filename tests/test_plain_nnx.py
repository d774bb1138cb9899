"""The model is a plain Flax NNX module: the flax-idiomatic fine-tuning loop (`hf.load`,
`nnx.Optimizer(..., wrt=nnx.Param)`, an `nnx.jit` step with `nnx.value_and_grad`) runs with no
mesh at all, and inside a user's own mesh whose axis names mean nothing to r1jax, in a fresh
process; three AdamW steps equal torch's AdamW on the same HF weights within 1e-4."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from hf_ref import hf_model

LR, WD, STEPS = 1e-3, 0.1, 3

LOOP = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from r1jax.convert import hf
    from r1jax.train.objectives import NextToken

    directory, ids = sys.argv[1], jnp.asarray(np.load(sys.argv[2]))
    batch = {"ids": ids, "segment_ids": jnp.ones_like(ids)}

    def run():
        cfg, model = hf.load(directory)
        opt = nnx.Optimizer(model, optax.adamw(%(lr)r, b1=0.9, b2=0.95, eps=1e-8, weight_decay=%(wd)r), wrt=nnx.Param)
        objective = NextToken()

        @nnx.jit
        def step(model, opt, batch):
            def loss_fn(m):
                loss_sum, tokens, _ = objective(m(batch["ids"]), batch)
                return loss_sum / tokens
            loss, grads = nnx.value_and_grad(loss_fn)(model)
            opt.update(model, grads)
            return loss
        return [float(step(model, opt, batch)) for _ in range(%(steps)d)]

    out = {"no_mesh": run()}
    with jax.set_mesh(jax.make_mesh((2, 4), ("rows", "cols"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)):
        out["user_mesh"] = run()
    print("RESULT", json.dumps(out))
""") % {"lr": LR, "wd": WD, "steps": STEPS}


@pytest.mark.slow      # a fresh process and torch: `make test`
def test_flax_loop_without_a_mesh_matches_torch_adamw(tmp_path):
    ref = hf_model(seed=8).train()
    ref.save_pretrained(tmp_path / "hf")
    ids = np.random.default_rng(0).integers(0, ref.config.vocab_size, (4, 24)).astype(np.int32)
    np.save(tmp_path / "ids.npy", ids)

    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD)
    want = []
    for _ in range(STEPS):
        x = torch.as_tensor(ids, dtype=torch.long)
        loss = ref(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(loss.item())

    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"} | {"JAX_NUM_CPU_DEVICES": "8"}
    r = subprocess.run([sys.executable, "-c", LOOP, str(tmp_path / "hf"), str(tmp_path / "ids.npy")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
    for where, losses in got.items():
        d = np.abs(np.asarray(losses) - np.asarray(want))
        print(f"\n{where}: r1jax {losses} torch {want}; max |dloss| {d.max():.1e}")
        assert d.max() <= 1e-4, where
    assert want[-1] < want[0]

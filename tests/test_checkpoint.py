"""Checkpoints and the model's order: a run on a circular pipeline with uneven stages (tiny with 5
MoE layers on 2 stages x 2 repeats: 8 slots, 3 of them padding) saves its MoE stack in stage
slots, and everything that leaves the run sees the model in model order: `hf.save` of the
state's model, `orbax-to-hf` of its checkpoint (loaded by transformers) and a restore onto one
device all give the logits of the pipelined forward. Resuming restores into the abstract state:
peak memory stays at the state's size, where the old way (a fresh state, then the restore) held
two."""
from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from r1jax import config as configlib
from r1jax import weights
from r1jax.checkpoint.manager import Checkpointer
from r1jax.convert import hf
from r1jax.parallel import mesh as meshlib
from r1jax.parallel import pipeline
from r1jax.train import optim
from r1jax.train import state as statelib
from r1jax.train.__main__ import main as train_main
from r1jax.train.step import trunk

pytestmark = pytest.mark.slow      # whole runs, meshes or processes: `make test`, not `make check`

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
CIRCULAR = ["model.num_hidden_layers=6", "mesh.data=2", "mesh.tensor=2", "mesh.pipeline=2", "train.microbatches=2",
            "pipeline.schedule=circular", "pipeline.repeats=2"]


def _restored(cfg, mesh, directory):
    """The run's state restored from its latest checkpoint onto `mesh` (in that mesh's layout)."""
    layout = pipeline.mesh_layout(cfg, mesh)
    graphdef, target = weights.target(cfg, mesh, layout)
    abstract, _ = statelib.abstract(target, optim.make(cfg.optim, cfg.train.steps), cfg, mesh)
    ckpt = Checkpointer(directory, every=100, keep=1, model_cfg=cfg.model, layout=layout)
    state, _, note = ckpt.restore(ckpt.latest_step(), abstract)
    ckpt.close()
    return graphdef, state, layout, note


def _hf_logits(directory, ids):
    m = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return m(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()


def test_circular_uneven_layout_round_trips_in_model_order(tmp_path):
    run = tmp_path / "run"
    assert train_main(["--config", str(TINY), "--run-dir", str(run), *CIRCULAR, "train.steps=2", "train.log_every=1",
                       "train.eval_batches=0", "checkpoint.every=100"]) == 0
    cfg = configlib.load(TINY, CIRCULAR)
    mesh = meshlib.make_mesh(cfg.mesh)
    graphdef, state, layout, _ = _restored(cfg, mesh, run / "checkpoints")
    assert layout == pipeline.Layout(5, 2, 2) and layout.slots == 8 and not layout.identity
    ids = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (4, 32)).astype(np.int32)
    batch = {"ids": jnp.asarray(ids), "segment_ids": jnp.ones((4, 32), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), (4, 32))}
    def pipelined(st):                    # what training computes: the stack run from its slots
        m = nnx.merge(graphdef, st["params"], st["rest"])
        x, positions, segment_ids, _ = trunk(m, batch, cfg, layout)
        return m.epilogue(x, batch["ids"], positions, segment_ids).logits

    with meshlib.activate(mesh):
        trained = np.asarray(jax.jit(pipelined)(state))

    model = statelib.model(graphdef, state, layout)
    hf.save(model, cfg.model, tmp_path / "saved")
    _, reloaded = hf.load(tmp_path / "saved")
    assert hf.orbax_to_hf(run / "checkpoints", tmp_path / "converted").num_hidden_layers == 6
    graphdef1, state1, layout1, note = _restored(cfg, meshlib.single_device_mesh(), run / "checkpoints")
    assert layout1 is None and "moved from pipeline layout" in note
    one = statelib.model(graphdef1, state1, None)
    logits = jax.jit(lambda m: m(jnp.asarray(ids)).logits)
    got = {"state's model": np.asarray(logits(model)),
           "hf.save -> hf.load": np.asarray(logits(reloaded)),
           "hf.save -> transformers": _hf_logits(tmp_path / "saved", ids),
           "orbax-to-hf -> transformers": _hf_logits(tmp_path / "converted", ids),
           "restored on 1 device": np.asarray(logits(one))}
    for k, v in got.items():
        d = float(np.abs(v - trained).max())
        print(f"\n{k}: max|dlogits| vs the pipelined forward {d:.1e}")
        assert d <= 2e-5, k


PROBE = textwrap.dedent("""
    import json, sys
    import grain, jax, jax.numpy as jnp
    from r1jax import config as configlib, weights
    from r1jax.checkpoint.manager import Checkpointer
    from r1jax.parallel import mesh as meshlib
    from r1jax.train import optim, state as statelib

    directory, mode = sys.argv[1], sys.argv[2]
    cfg = configlib.load(sys.argv[3], sys.argv[4:])
    mesh = meshlib.make_mesh(cfg.mesh)
    tx = optim.make(cfg.optim, cfg.train.steps)
    graphdef, target = weights.target(cfg, mesh, None)
    ckpt = Checkpointer(directory, every=1, keep=1, model_cfg=cfg.model, layout=None)
    data = iter(grain.MapDataset.range(4).to_iter_dataset())
    if mode == "save":
        state, _ = statelib.create(weights.fresh(cfg, mesh), tx, cfg, mesh)
        ckpt.save(state, data, force=True)
        ckpt.close()
        sys.exit(0)
    abstract, _ = statelib.abstract(target, tx, cfg, mesh)
    state_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
    jnp.zeros(1).block_until_ready()
    held = None
    if mode == "fresh-then-restore":        # what resuming did before: a fresh state, then the restore
        held = jax.block_until_ready(statelib.create(weights.fresh(cfg, mesh), tx, cfg, mesh)[0])
    rss = lambda key: int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key)))
    base = rss("VmRSS:") - (sum(a.nbytes for a in jax.tree.leaves(held)) // 1024 if held else 0)
    open("/proc/self/clear_refs", "w").write("5")          # VmHWM := VmRSS from here on
    state, _, _ = ckpt.restore(ckpt.latest_step(), abstract, data)
    jax.block_until_ready(state)
    print("RESULT", json.dumps({"state_bytes": state_bytes, "peak_above_base": (rss("VmHWM:") - base) * 1024}))
""")


def test_resume_holds_one_copy_of_the_state(tmp_path):
    """A 76M-parameter model (874 MiB of fp32 weights and AdamW moments) on the suite's 8 CPU
    devices with fsdp 8, in fresh processes: the restore's peak RSS above the process before it
    is at most 1.1x the state, where a fresh state first (what resuming did before) holds two."""
    big = ["model.vocab_size=32000", "model.hidden_size=512", "model.intermediate_size=2048",
           "model.moe_intermediate_size=512", "model.n_routed_experts=16", "model.num_hidden_layers=4",
           "model.num_nextn_predict_layers=0", "mesh.data=1", "mesh.fsdp=8"]
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8"}

    def probe(mode):
        r = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "ckpt"), mode, str(TINY), *big],
                           capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):]) \
            if mode != "save" else None
    probe("save")
    now, before = probe("restore"), probe("fresh-then-restore")
    ratio, old = now["peak_above_base"] / now["state_bytes"], before["peak_above_base"] / before["state_bytes"]
    print(f"\nstate {now['state_bytes'] / 2**20:.0f} MiB; resume peak {ratio:.2f}x the state "
          f"(fresh state first, as before: {old:.2f}x)")
    assert ratio <= 1.1
    assert old >= 1.8

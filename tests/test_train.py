"""The training entry point end to end on the tiny config (8 fake devices, data parallel):
the loss falls, tensorboardX and JSONL records, the resolved config, the PNG and Orbax
checkpoints land in the run directory, and the checkpoint converts to HF."""
from __future__ import annotations

import glob
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml
from tensorboardX.proto import event_pb2

from r1jax import config as configlib
from r1jax.data import tokenizer as toklib
from r1jax.data.sources import open_corpus
from r1jax.data.pipeline import lm_batches, split_documents
from r1jax.train.__main__ import main as train_main

pytestmark = pytest.mark.slow      # whole runs, meshes or processes: `make test`, not `make check`

ROOT = Path(__file__).resolve().parents[1]


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            while (hdr := f.read(12)) and len(hdr) == 12:
                (n,) = struct.unpack("<Q", hdr[:8])
                ev = event_pb2.Event.FromString(f.read(n))
                f.read(4)
                for v in ev.summary.value:
                    if v.HasField("simple_value"):
                        out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


TINY_ARGS = ["train.steps=16", "train.log_every=1", "checkpoint.every=8", "train.eval_every=8"]


COMPILES: list[str] = []


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """16 steps with an eval every 8 (at 8, and at the end); XLA compiles are recorded by name."""
    import jax

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            COMPILES.append(kw.get("fun_name", ""))
    run = tmp_path_factory.mktemp("tiny") / "run"
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        assert train_main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(run), *TINY_ARGS]) == 0
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return run


def test_train_and_eval_steps_compile_once_per_run(tiny_run):
    evals = [r for r in map(json.loads, (tiny_run / "metrics.jsonl").read_text().splitlines()) if r.get("split")]
    assert len(evals) == 2
    assert COMPILES.count("jit(eval_step)") == 1 and COMPILES.count("jit(train_step)") == 1, COMPILES


def test_loss_falls_and_records_land(tiny_run):
    recs = [json.loads(l) for l in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "split" not in r]
    assert [r["step"] for r in train] == list(range(1, 17))
    for key in ("loss", "lm_loss", "mtp_loss", "lr", "grad_norm", "param_norm",
                "expert_imbalance", "loss_scale", "balance_loss"):
        assert all(np.isfinite(r[key]) for r in train), key
    # step 1's window holds only the compiling step: it has no timing (log_every=1), every later one has
    assert not {"tokens_per_s", "step_time", "mfu", "data_wait"} & set(train[0])
    for key in ("tokens_per_s", "step_time", "mfu", "data_wait"):
        assert all(np.isfinite(r[key]) for r in train[1:]), key
    assert len(train[0]["expert_imbalance_layers"]) == 2
    first, last = np.mean([r["lm_loss"] for r in train[:3]]), np.mean([r["lm_loss"] for r in train[-3:]])
    print(f"\ntiny run: lm loss {first:.3f} -> {last:.3f}")
    assert last < first - 0.5
    evals = [r for r in recs if r.get("split") == "eval"]
    assert [r["step"] for r in evals] == [8, 16] and all(r["perplexity"] > 1 for r in evals)
    scalars = read_scalars(tiny_run / "tensorboard")
    for tag in ("train/loss", "train/mtp_loss", "train/lr", "train/grad_norm", "train/param_norm",
                "train/tokens_per_s", "train/step_time", "train/mfu", "train/expert_imbalance",
                "train/loss_scale", "moe/imbalance_layer_0", "moe/imbalance_layer_1", "eval/loss",
                "eval/perplexity"):
        assert tag in scalars, tag
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 17))
    assert np.isclose(scalars["train/loss"][-1][1], train[-1]["loss"], rtol=1e-6)
    assert (tiny_run / "loss.png").stat().st_size > 1000
    assert (tiny_run / "tokenizer.json").is_file()


def test_run_dir_holds_resolved_config_and_checkpoints(tiny_run):
    cfg = configlib.from_dict(yaml.safe_load((tiny_run / "config.yaml").read_text()))
    assert cfg.train.steps == 16 and cfg.checkpoint.every == 8
    steps = sorted(int(p.name) for p in (tiny_run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [8, 16]
    for item in ("params", "opt_state", "meta", "data"):
        assert (tiny_run / "checkpoints" / "16" / item).exists(), item
    meta = json.loads((tiny_run / "checkpoints" / "16" / "meta" / "metadata").read_text())
    assert meta["step"] == 16 and meta["loss_scale"] == 1.0 and meta["data_shards"] == 1
    final = json.loads((tiny_run / "final.json").read_text())
    assert final["step"] == 16 and "eval_loss" in final and final["stopped"] is None


def test_restart_equals_straight_run_bitwise(tiny_run, tmp_path):
    """N steps, stop (checkpoint), restart, N steps == 2N steps straight: per-step loss and final
    parameters bitwise (the data iterator, optimizer, router biases and step all restore)."""
    run = tmp_path / "resumed"
    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(run), *TINY_ARGS]
    assert train_main(args + ["train.stop_at=8"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["8"]
    assert json.loads((run / "final.json").read_text())["stopped"] == "train.stop_at"
    assert train_main(args) == 0

    def losses(r):
        return [(x["step"], x["loss"], x["grad_norm"]) for x in map(json.loads, (r / "metrics.jsonl").read_text()
                                                                     .splitlines()) if "split" not in x]
    a, b = losses(tiny_run), losses(run)
    assert [s for s, *_ in b] == list(range(1, 17))
    assert a == b
    from r1jax.checkpoint.params import ParamsReader
    ra, rb = ParamsReader(tiny_run / "checkpoints"), ParamsReader(run / "checkpoints")
    assert ra.step == rb.step == 16 and ra.shapes.keys() == rb.shapes.keys()
    for key in ra.shapes:
        assert np.array_equal(ra.read(key), rb.read(key)), key
    print(f"\nrestart at 8 of 16: {len(a)} per-step losses and {len(ra.shapes)} parameter arrays bitwise equal")


def test_resume_with_another_architecture_is_refused_and_changes_nothing(tiny_run, capsys):
    before = {p: p.stat().st_mtime_ns for p in tiny_run.rglob("*") if p.is_file()}
    rc = train_main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(tiny_run), *TINY_ARGS,
                     "model.moe_intermediate_size=48"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "moe_intermediate_size=32 but the config says moe_intermediate_size=48" in err[0]
    assert {p: p.stat().st_mtime_ns for p in tiny_run.rglob("*") if p.is_file()} == before


def test_training_checkpoint_converts_to_hf(tiny_run, tmp_path):
    from r1jax.convert.__main__ import main as convert_main
    assert convert_main(["orbax-to-hf", str(tiny_run / "checkpoints"), str(tmp_path / "hf")]) == 0
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert m.config.num_hidden_layers == 3


def test_generate_samples_from_the_run_directory(tiny_run, tmp_path):
    """`python -m r1jax.generate --model RUN_DIR`: the run's checkpoint and tokenizer; with
    --speculative (its trained MTP module drafting) the greedy completions are the same."""
    import os
    import subprocess
    import sys
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "def main("}\n{"prompt": "import os\\nimport", "max_new_tokens": 5}\n')
    outs = []
    for extra in ([], ["--speculative"]):
        dst = tmp_path / f"out{len(outs)}.jsonl"
        p = subprocess.run([sys.executable, "-m", "r1jax.generate", "--model", str(tiny_run), "--input", str(src),
                            "--output", str(dst), "--max-new-tokens", "12", "--ignore-eos", *extra],
                           capture_output=True, text=True, env={**os.environ, "JAX_NUM_CPU_DEVICES": "1"}, cwd=ROOT)
        assert p.returncode == 0, p.stderr
        outs.append([json.loads(x) for x in dst.read_text().splitlines()])
    assert "MTP drafts accepted" in p.stderr
    assert outs[0] == outs[1]
    assert [r["completion_tokens"] for r in outs[0]] == [12, 5] and all(r["completion"] for r in outs[0])


def test_packing_keeps_every_token_and_splits_long_documents():
    cfg = configlib.load(ROOT / "configs" / "tiny.yaml")
    docs = open_corpus(cfg.data)
    tok = toklib.train((docs[i] for i in range(50)), 512)
    eos = toklib.eos_id(tok)
    idx = list(range(6))
    rows = list(lm_batches(docs, idx, tok, eos, seq_len=64, batch_size=1, seed=0, epochs=1))
    ids = np.concatenate([r["ids"][0] for r in rows])
    seg = np.concatenate([r["segment_ids"][0] for r in rows])
    n_expected = sum(len(tok.encode(docs[i]).ids) + 1 for i in idx)
    assert (seg > 0).sum() == n_expected                  # nothing dropped, long docs split across rows
    assert (ids[seg > 0] == eos).sum() == len(idx)        # one EOS per document
    for r in rows:
        s, p = r["segment_ids"][0], r["positions"][0]
        starts = np.flatnonzero(np.diff(s, prepend=-1) != 0)
        for a, b in zip(starts, list(starts[1:]) + [len(s)]):
            if s[a]:
                assert list(p[a:b]) == list(range(b - a))
    split = split_documents(100, 0.1, seed=0)
    assert len(split.eval) == 10 and not set(split.eval) & set(split.train)
    assert sorted(split.eval + split.train) == list(range(100))


@pytest.mark.parametrize("sig,terminal", [("SIGUSR1", True), ("SIGTERM", False)])
def test_preemption_signal_saves_and_exits_cleanly(tmp_path, sig, terminal):
    """What SLURM sends before a time limit or a preemption: finish the step, save, say so, exit 0.
    The SIGUSR1 run writes to a pseudo-terminal, where the console shows a progress bar."""
    import pty
    import signal
    import subprocess
    import sys
    import threading
    import time
    run = tmp_path / "run"
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1", "COLUMNS": "120"}   # one device: the signal path is tested
    cmd = [sys.executable, "-m", "r1jax.train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(run),
           "train.steps=1000", "train.log_every=1", "checkpoint.every=500"]
    chunks: list[bytes] = []
    if terminal:
        master, slave = pty.openpty()
        proc = subprocess.Popen(cmd, stdout=slave, stderr=subprocess.PIPE, env=env)
        os.close(slave)

        def drain():
            while True:
                try:
                    data = os.read(master, 4096)
                except OSError:           # EIO once the child has closed the terminal
                    return
                if not data:
                    return
                chunks.append(data)
        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
    else:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.5)
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=300)
    if terminal:
        reader.join(timeout=10)
        out = b"".join(chunks)
    out = out.decode(errors="replace")
    assert proc.returncode == 0, err[-2000:]
    line = next(l for l in out.splitlines() if "preempted at step" in l)
    step = int(line.split("preempted at step")[1].split()[0])
    print(f"\n{sig}: {line.strip()}")
    assert 2 <= step < 1000
    assert (run / "checkpoints" / str(step) / "params").is_dir()
    assert json.loads((run / "final.json").read_text())["stopped"] == sig
    assert ("━" in out) == terminal                      # rich's bar on a terminal, plain lines otherwise
    assert "step 1/1000 | loss" in out


@pytest.mark.parametrize("mesh_overrides", [["mesh.data=1"], ["mesh.data=4", "mesh.pipeline=2",
                                                               "train.microbatches=2", "train.global_batch_size=8",
                                                               "model.num_hidden_layers=6"]])
def test_init_from_hf_and_orbax(tmp_path, mesh_overrides):
    """init_from places the source's leaves as they are (on a pipeline, the MoE stack in its stage
    slots); the MTP modules an HF checkpoint lacks are the ones a fresh init of this config gives."""
    import jax
    from flax import nnx

    from hf_ref import hf_model
    from r1jax import model as modellib
    from r1jax import weights
    from r1jax.config import ConfigError
    from r1jax.convert import hf
    from r1jax.parallel import mesh as meshlib
    from r1jax.parallel import pipeline
    layers = 6 if "mesh.pipeline=2" in mesh_overrides else 3
    hf_model(seed=6, num_hidden_layers=layers).save_pretrained(tmp_path / "hf")
    hf.hf_to_orbax(tmp_path / "hf", tmp_path / "orbax")
    _, ref = hf.load(tmp_path / "hf")
    want = modellib.leaves(nnx.state(ref))
    for src in (f"hf:{tmp_path / 'hf'}", f"orbax:{tmp_path / 'orbax'}"):
        cfg = configlib.load(None, [f"model.hf_config={tmp_path / 'hf'}", f"model.init_from={src}",
                                    "model.num_nextn_predict_layers=1", "data.seq_len=32", *mesh_overrides])
        mesh = meshlib.make_mesh(cfg.mesh, jax.devices()[:8 if "mesh.pipeline=2" in mesh_overrides else 1])
        layout = pipeline.mesh_layout(cfg, mesh)
        state = weights.initial(cfg, mesh, layout, log=lambda _: None)
        got = modellib.leaves(pipeline.to_layers(state, layout))
        assert all(np.array_equal(np.asarray(got[p]), np.asarray(v)) for p, v in want.items()), src
        fresh = modellib.leaves(pipeline.to_layers(weights.fresh(cfg, mesh, layout), layout))
        mtp = [p for p in got if p[0] == "mtp"]           # the checkpoint has no MTP: those start fresh
        assert mtp and all(np.array_equal(np.asarray(got[p]), np.asarray(fresh[p])) for p in mtp), src
        if layout is not None:                             # born in the run's shards: stack slots over pipeline
            stack = modellib.leaves(state)[("moe_layers", "layers", "mlp", "gate_EDF")]
            assert stack.shape[0] == layout.slots and stack.sharding.spec[0] == "pipeline"
    cfg = configlib.load(None, [f"model.hf_config={tmp_path / 'hf'}", f"model.init_from=hf:{tmp_path / 'hf'}",
                                "model.moe_intermediate_size=48", "data.seq_len=32", "mesh.data=1"])
    with pytest.raises(ConfigError, match="moe_intermediate_size=32 but the config says moe_intermediate_size=48"):
        weights.initial(cfg, meshlib.single_device_mesh(), None)

"""Bad steps, loss spikes, gradient-norm alerts and rollback (r1jax/train/guard.py, loop.py, step.py).

- The step: a non-finite loss or gradient leaves the whole state (parameters, moments, router
  biases) bitwise as it was, in fp32, bf16 and fp16, and the next good step updates as usual.
- The guard on synthetic metrics: a streak of train.max_bad_steps asks for a rollback, fp16's
  overflow skips do not; a spike is judged against the window before it; the gradient-norm std
  alert fires once when it crosses the threshold and runs train.alert_command with its env.
- Real runs (python -m r1jax.train, tiny.yaml) with fire drills: NaN through the data, NaN through a
  parameter, a spike through a corrupted batch. Each ends finite, rolls back exactly once, records
  the skipped batches in the checkpoint meta, and never saves a non-finite checkpoint.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from runs import TINY, tiny_batches

from r1jax import config as configlib
from r1jax.config import ConfigError
from r1jax.parallel import mesh as meshlib
from r1jax.train import guard
from r1jax.train.step import build

ROOT = Path(__file__).resolve().parents[1]


class Writer:            # the MetricsWriter calls the guard makes, kept for the assertions
    def __init__(self):
        self.events = []

    def event(self, step, kind, fields):
        self.events.append((step, kind, fields))


def _guard(tmp_path, overrides=(), command=None):
    cfg = configlib.load(TINY, list(overrides))
    w = Writer()
    alerts = guard.Alerts(command, str(tmp_path), w)
    return guard.Guard(cfg.train, alerts), w, alerts


def _m(loss, gn=1.0, skipped=0.0):
    return {"loss": np.float32(loss), "grad_norm": np.float32(gn), "skipped": np.float32(skipped)}


# ------------------------------------------------------------------------------------ the step
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_a_non_finite_step_changes_nothing(dtype):
    cfg = configlib.load(TINY, [f"train.dtype={dtype}", "mesh.data=1", "optim.warmup_ratio=0"])
    s = build(cfg, meshlib.make_mesh(cfg.mesh, jax.devices()[:1]))
    good, bad = tiny_batches(cfg, 2)
    bad["ids"][3, 5] = cfg.model.vocab_size          # out of range: the embedding lookup gives NaN
    before = jax.device_get({k: s.state[k] for k in ("params", "rest", "opt")})
    state, m = s.step(s.state, bad)
    assert float(m["skipped"]) == 1.0 and not math.isfinite(float(m["loss"]))
    after = jax.device_get({k: state[k] for k in ("params", "rest", "opt")})
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)
    assert int(state["step"]) == 1
    state, m = s.step(state, good)
    assert float(m["skipped"]) == 0.0 and math.isfinite(float(m["loss"]))
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before["params"]),
                                                       jax.tree.leaves(jax.device_get(state["params"])))]
    assert all(moved)


# ----------------------------------------------------------------------------------- the guard
def test_bad_streak_asks_for_rollback_at_max_bad_steps(tmp_path):
    g, w, _ = _guard(tmp_path, ["train.max_bad_steps=3"])
    assert g.inspect(1, [_m(5.0), _m(float("nan"), skipped=1), _m(4.9)]) is None       # one bad step: skipped only
    assert g.inspect(4, [_m(float("nan"), float("nan"), 1), _m(float("inf"), skipped=1)]) is None
    v = g.inspect(6, [_m(float("nan"), skipped=1), _m(4.8)])
    assert (v.kind, v.first, v.last) == ("bad_steps", 4, 6)
    assert g.bad_total == 4 and [e[0] for e in w.events if e[1] == "bad_step"] == [2, 4, 5, 6]


def test_fp16_overflow_skips_are_the_loss_scalers_business(tmp_path):
    g, w, _ = _guard(tmp_path, ["train.dtype=fp16", "train.max_bad_steps=2"])
    assert g.inspect(1, [_m(7.0, float("inf"), 1)] * 10) is None           # finite loss: scale overflow
    assert not w.events
    assert g.inspect(11, [_m(float("nan"), skipped=1)] * 2).kind == "bad_steps"


def test_spike_is_judged_against_the_window_before_it(tmp_path):
    g, w, _ = _guard(tmp_path, ["train.spike_policy=rollback", "train.spike_zscore=6", "train.spike_window=30"])
    rng = np.random.default_rng(0)
    calm = [_m(3.0 + 0.05 * x) for x in rng.standard_normal(25)]
    assert g.inspect(1, calm) is None
    assert g.inspect(26, [_m(3.2)]) is None                # 4 sigma: not a spike at 6
    v = g.inspect(27, [_m(3.6)])                           # 12 sigma
    assert (v.kind, v.first) == ("spike", 27) and "loss spike at step 27" in v.line
    assert g.losses[-1][0] == 26                           # a spike never joins its own history
    g.forget_after(20)
    assert max(s for s, _ in g.losses) == 20


def test_spike_warn_logs_and_goes_on(tmp_path):
    g, w, _ = _guard(tmp_path, ["train.spike_policy=warn"])
    assert g.inspect(1, [_m(3.0 + 0.01 * (i % 3)) for i in range(30)] + [_m(9.0)]) is None
    assert [e[1] for e in w.events] == ["spike"] and g.spikes == 1


def test_grad_norm_std_alert_fires_once_and_runs_the_hook(tmp_path):
    out = tmp_path / "paged.txt"
    cmd = f'echo "$R1JAX_ALERT_KIND $R1JAX_ALERT_STEP $R1JAX_RUN_DIR" >> {out}'
    g, w, alerts = _guard(tmp_path, ["train.grad_norm_window=10", "train.grad_norm_std_alert=0.5"], command=cmd)
    g.inspect(1, [_m(3.0, 1.0 + 0.1 * (i % 2)) for i in range(20)])       # std 0.05
    g.inspect(21, [_m(3.0, 1.0 + 2.0 * (i % 2)) for i in range(10)])      # std 1.0 once the window is full
    g.inspect(31, [_m(3.0, 1.0 + 2.0 * (i % 2)) for i in range(10)])      # still above: no second alert
    alerts.close()
    fired = [e for e in w.events if e[1] == "alert_grad_norm_std"]
    assert len(fired) == 1 and fired[0][2]["std"] > 0.5
    assert out.read_text().split() == ["alert_grad_norm_std", str(fired[0][0]), str(tmp_path)]
    assert g.stats()["grad_norm_std"] > 0.5


def test_bad_fault_specs_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"train.inject_faults: 'nan@3' is not KIND@STEP"):
        configlib.load(TINY, ["train.inject_faults=[nan@3]"])
    with pytest.raises(ConfigError, match=r"data.paths: expects a list; write data.paths=\[a,b\]"):
        configlib.load(TINY, ["data.paths=/x.jsonl"])


# -------------------------------------------------------------------------------- real runs
def _train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "r1jax.train", "--config", str(TINY), "--run-dir", str(run_dir),
           "train.steps=40", "train.log_every=4", "checkpoint.every=8", "checkpoint.keep=10", "train.eval_batches=0",
           "mesh.data=1", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "JAX_NUM_CPU_DEVICES": "1"})


def _records(run_dir: Path):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _saved_checkpoints_are_finite(run_dir: Path) -> list[int]:
    import orbax.checkpoint as ocp
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    for s in steps:
        tree = ocp.PyTreeCheckpointer().restore(run_dir / "checkpoints" / str(s) / "params")
        for leaf in jax.tree.leaves(tree):
            assert np.all(np.isfinite(np.asarray(leaf, np.float32))), f"checkpoint {s} holds a non-finite value"
    return steps


@pytest.mark.slow
def test_fire_drills_roll_back_once_each_and_never_save_a_bad_state(tmp_path):
    """The three drills in one run (one compile instead of three): NaN through the data, NaN
    through a parameter, a spike through a corrupted batch. Each rolls back exactly once, to
    the checkpoint before it, skipping the batches read since."""
    drills = {11: ("nan_data", "bad_steps"), 21: ("nan_param", "bad_steps"), 34: ("spike", "spike")}
    run = tmp_path / "run"
    p = _train(run, "train.inject_faults=[" + ",".join(f"{k}@{s}" for s, (k, _) in drills.items()) + "]",
               "train.max_bad_steps=1", "train.spike_policy=rollback", "train.spike_zscore=5", "train.spike_window=20")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rollbacks = [r for r in _records(run) if r.get("event") == "rollback"]
    assert len(rollbacks) == 3, p.stdout[-3000:]
    assert p.stdout.count("rolled back to the checkpoint of step") == 3
    ranges = []
    for rb, (at, (_, reason)) in zip(rollbacks, drills.items()):
        to, (lo, hi) = rb["to_step"], rb["skipped_batches"]
        assert rb["reason"] == reason and to < at <= hi and lo == to + 1 and to % 8 == 0, rb
        ranges.append([lo, hi])
    final = json.loads((run / "final.json").read_text())
    assert final["step"] == 40 and math.isfinite(final["loss"])
    steps = _saved_checkpoints_are_finite(run)
    assert steps[-1] == 40
    meta = json.loads((run / "checkpoints" / "40" / "meta" / "metadata").read_text())
    assert meta["skipped_batches"] == ranges and meta["rollbacks"] == 3


@pytest.mark.slow
def test_watchdog_reports_a_stalled_step_with_stacks(tmp_path):
    run = tmp_path / "run"
    # factor 5 and 3 s: a log window slowed 2x by a busy machine (as in a CI run while other tests
    # ran on the same 2 cores) is not a stall; the injected stall sleeps twice the limit anyway
    p = _train(run, "train.steps=20", "train.watchdog_factor=5", "train.watchdog_min_s=3", "train.watchdog_stacks=true",
               "train.inject_faults=[stall@14]")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "alert: watchdog: no progress for" in p.stdout and "a hang in a collective" in p.stdout
    assert "watchdog: progress again after" in p.stdout
    assert "most recent call first" in p.stderr and "r1jax-step-watchdog" not in p.stdout      # every thread's stack
    assert [r["step"] for r in _records(run) if r.get("event") == "watchdog"] == [12]

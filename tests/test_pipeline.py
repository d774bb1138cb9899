"""Pipeline layout and schedules as data (no compiles): where layers live, the lock-step 1F1B's
ticks, the bubble, and the config errors. The schedules' numbers are checked end to end in test_mesh.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from r1jax import config as configlib
from r1jax.config import Schedule
from r1jax.parallel.pipeline import Layout, bubble, ticks_1f1b

ROOT = Path(__file__).resolve().parents[1]


def test_uneven_layers_pad_the_last_stage():
    """DeepSeek-V3: 58 MoE layers on 4 stages are 15 + 15 + 15 + 13, in model order."""
    lay = Layout(58, 4)
    per_stage = lay.order.reshape(4, -1)
    assert lay.slots == 60 and [int((r >= 0).sum()) for r in per_stage] == [15, 15, 15, 13]
    assert list(lay.order[lay.valid]) == list(range(58))
    x = np.arange(58 * 3).reshape(58, 3)
    slots = lay.to_slots(x)
    assert np.array_equal(lay.to_layers(slots), x) and not slots[~lay.valid].any()
    assert Layout(58, 1).identity and Layout(8, 4).identity and not lay.identity


def test_circular_layout_interleaves_virtual_stages():
    """Virtual stage v = r*P + s lives on device s: with P=2, R=2 and 8 layers device 0 holds
    layers 0,1 (v0) and 4,5 (v2)."""
    lay = Layout(8, 2, 2)
    assert lay.order.reshape(2, -1).tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert Layout(2, 2, 2).order.reshape(2, -1).tolist() == [[0, -1], [1, -1]]     # tiny: 2 layers, 4 virtual


@pytest.mark.parametrize("P,M", [(2, 2), (2, 4), (4, 4), (4, 8), (3, 5), (4, 2), (16, 128)])
def test_1f1b_lock_step_ticks(P, M):
    """The lock-step 1F1B's rule (stage s: forward of t-s, backward of t-(2P-2-s)) runs every
    forward after the previous stage's and every backward after the next stage's, each one tick
    later (what the ppermutes deliver), the last stage's backward in its forward's tick, and no
    stage input is overwritten in its ring before its backward reads it."""
    T, ring = ticks_1f1b(P, M)
    assert T == M + 2 * P - 2 and ring == 2 * P - 1
    fwd = {(s, t - s): t for t in range(T) for s in range(P) if 0 <= t - s < M}
    bwd = {(s, t - (2 * P - 2 - s)): t for t in range(T) for s in range(P) if 0 <= t - (2 * P - 2 - s) < M}
    assert len(fwd) == len(bwd) == P * M                      # every (stage, microbatch) once each way
    for s in range(P):
        for m in range(M):
            if s:
                assert fwd[(s, m)] == fwd[(s - 1, m)] + 1
            if s < P - 1:
                assert bwd[(s, m)] == bwd[(s + 1, m)] + 1
            else:
                assert bwd[(s, m)] == fwd[(s, m)]
            # written at its forward into slot m % ring; later forwards of this stage must not reuse it first
            reused = [n for n in range(m + 1, M) if n % ring == m % ring and fwd[(s, n)] <= bwd[(s, m)]]
            assert not reused
    busy = sum(1 for v in (fwd, bwd) for _ in v) / 2 / (T * P)
    assert abs(1 - busy - bubble(P, M, schedule=Schedule.onefoneb)) < 1e-12


def test_bubble():
    assert bubble(4, 8) == pytest.approx(3 / 11)
    assert bubble(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble(1, 8) == 0
    assert bubble(4, 8, schedule=Schedule.onefoneb) == pytest.approx(6 / 14)


@pytest.mark.parametrize("overrides,needle", [
    (["mesh.data=2", "mesh.pipeline=4", "pipeline.schedule=1f1b", "train.microbatches=2"],
     "train.microbatches=2: under pipeline.schedule=1f1b each pipeline microbatch's rows on one data shard (2)"),
    (["mesh.data=4", "mesh.pipeline=2", "pipeline.schedule=circular", "pipeline.repeats=2"],
     "train.microbatches=1: the circular schedule needs at least mesh.pipeline=2"),
    (["mesh.data=4", "mesh.pipeline=2", "pipeline.repeats=2"], "pipeline.repeats=2: only the circular schedule"),
    (["mesh.data=4", "mesh.pipeline=2", "train.microbatches=3"], "train.microbatches=3"),
    (["mesh.data=4", "mesh.pipeline=2", "model.num_hidden_layers=1"], "mesh.pipeline=2: the pipeline splits"),
    (["mesh.data=4", "mesh.pipeline=2", "train.microbatches=2", "pipeline.schedule=1f1b", "pipeline.stage_remat=true"],
     "pipeline.stage_remat=true: 1f1b already keeps only each stage's input"),
])
def test_pipeline_config_errors(overrides, needle):
    with pytest.raises(configlib.ConfigError) as e:
        configlib.load(ROOT / "configs" / "tiny.yaml", overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)

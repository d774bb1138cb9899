"""Pipeline layout and schedules as data (no compiles): where layers live, the 1F1B table, the
bubble, and the config errors. The schedules' numbers are checked end to end in test_mesh.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from r1jax import config as configlib
from r1jax.parallel.pipeline import Layout, bubble, schedule_1f1b

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


@pytest.mark.parametrize("P,M", [(2, 2), (2, 4), (4, 4), (4, 8), (3, 5), (4, 2)])
def test_1f1b_table(P, M):
    op, mb, recv_f, recv_b, (k_act, k_in, k_grad) = schedule_1f1b(P, M)
    T = op.shape[0]
    assert T == 2 * (M + P - 1)                               # lockstep: the bubble is (P-1)/(M+P-1)
    assert abs(1 - (op > 0).sum() / (T * P) - bubble(P, M)) < 1e-12
    when = {}
    for t in range(T):
        for s in range(P):
            if op[t, s]:
                when[(s, "FB"[op[t, s] - 1], int(mb[t, s]))] = t
    for s in range(P):
        for m in range(M):
            f, b = when[(s, "F", m)], when[(s, "B", m)]
            assert f < b
            if s:
                assert when[(s - 1, "F", m)] < f and recv_f[when[(s - 1, "F", m)], s] == m
            if s < P - 1:
                assert when[(s + 1, "B", m)] < b and recv_b[when[(s + 1, "B", m)], s] == m
        # stage s keeps at most P - s stage inputs: the memory 1F1B is for
        held = max(sum(1 for m in range(M) if when[(s, "F", m)] <= t < when[(s, "B", m)]) for t in range(T))
        assert held <= P - s
    assert k_in <= P and k_act <= 2 and k_grad <= 2


def test_bubble():
    assert bubble(4, 8) == pytest.approx(3 / 11)
    assert bubble(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble(1, 8) == 0


@pytest.mark.parametrize("overrides,needle", [
    (["mesh.data=2", "mesh.pipeline=2", "mesh.tensor=2", "pipeline.schedule=1f1b", "train.microbatches=2"],
     "pipeline.schedule=1f1b: mesh.tensor=2"),
    (["mesh.data=4", "mesh.pipeline=2", "pipeline.schedule=circular", "pipeline.repeats=2"],
     "train.microbatches=1: the circular schedule needs at least mesh.pipeline=2"),
    (["mesh.data=4", "mesh.pipeline=2", "pipeline.repeats=2"], "pipeline.repeats=2: only the circular schedule"),
    (["mesh.data=2", "mesh.pipeline=2", "mesh.expert=2"], "mesh.expert=2: expert parallelism inside pipeline"),
    (["mesh.data=4", "mesh.pipeline=2", "train.microbatches=3"], "train.microbatches=3"),
    (["mesh.data=4", "mesh.pipeline=2", "model.num_hidden_layers=1"], "mesh.pipeline=2: the pipeline splits"),
])
def test_pipeline_config_errors(overrides, needle):
    with pytest.raises(configlib.ConfigError) as e:
        configlib.load(ROOT / "configs" / "tiny.yaml", overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)

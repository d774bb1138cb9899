"""The node-aware mesh (mesh.dcn_<axis>; r1jax/parallel/mesh.py:hybrid_order), on fake clusters:

- DeepSeek-V3's 2048-GPU layout (data 2 x expert 64 x pipeline 16 over 256 nodes of 8 GPUs, EP64 =
  8 GPUs x 8 nodes): every expert group is exactly 8 nodes x 8 GPUs, every pipeline or data group
  has one GPU on each of its nodes;
- the seeds' layout (tensor 8 inside a node x pipeline 4 x data across nodes): tensor never
  leaves a node;
- the layout equals JAX's own `create_hybrid_device_mesh(process_is_granule=True)` on fake GPUs;
- sizes that cannot be laid out are refused in one line; with every dcn size at 1 the layout is
  the devices' order, as before.
The two-process run of a node-aware mesh is in tests/test_multiprocess.py.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.experimental import mesh_utils

from r1jax import config as configlib
from r1jax.config import ConfigError, MeshConfig
from r1jax.parallel.mesh import AXES, hybrid_order, make_mesh, one_stage, spans

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
NODE_GPUS = 8


def _layout(nodes: int, **sizes: int):
    """(node of each mesh position as an array of the mesh's shape, local GPU of each) for a
    cluster of `nodes` x 8 GPUs; sizes: data=2, dcn_data=2, ..."""
    shape = {a: sizes.get(a, 1) for a in AXES}
    dcn = {a: sizes.get(f"dcn_{a}", 1) for a in AXES}
    pairs = [(n, g) for n in range(nodes) for g in range(NODE_GPUS)]
    order = hybrid_order(shape, dcn, [n for n, _ in pairs])
    assert sorted(order.reshape(-1).tolist()) == list(range(len(pairs)))      # each GPU once
    node = np.vectorize(lambda i: pairs[i][0])(order)
    gpu = np.vectorize(lambda i: pairs[i][1])(order)
    return node, gpu


def _groups(arr: np.ndarray, axis: str) -> np.ndarray:
    """[groups, size]: the lines of `arr` along mesh axis `axis` (the other axes fixed)."""
    i = AXES.index(axis)
    return np.moveaxis(arr, i, -1).reshape(-1, arr.shape[i])


def test_deepseek_layout_keeps_each_expert_group_on_8_nodes_of_8_gpus():
    node, gpu = _layout(256, data=2, expert=64, pipeline=16, dcn_data=2, dcn_expert=8, dcn_pipeline=16)
    ep = _groups(node, "expert")
    assert ep.shape == (32, 64)
    for line in ep:
        nodes, count = np.unique(line, return_counts=True)
        assert len(nodes) == 8 and set(count) == {NODE_GPUS}            # 8 nodes, all 8 GPUs of each
    for axis, size in (("pipeline", 16), ("data", 2)):
        for n_line, g_line in zip(_groups(node, axis), _groups(gpu, axis)):
            assert len(set(n_line)) == size and len(set(g_line)) == 1    # one GPU per node, the same one


def test_seed_layout_keeps_tensor_inside_a_node():
    node, _ = _layout(32, tensor=8, pipeline=4, data=8, dcn_pipeline=4, dcn_data=8)
    assert all(len(set(line)) == 1 for line in _groups(node, "tensor"))
    assert all(len(set(line)) == 4 for line in _groups(node, "pipeline"))
    # the default order would have put pipeline inside a node and tensor across two
    old_node = (np.arange(256) // NODE_GPUS).reshape([{"tensor": 8, "pipeline": 4, "data": 8}.get(a, 1) for a in AXES])
    assert all(len(set(line)) == 1 for line in _groups(old_node, "pipeline"))
    assert all(len(set(line)) > 1 for line in _groups(old_node, "tensor"))


@dataclasses.dataclass(frozen=True)
class FakeGPU:
    id: int
    process_index: int
    platform: str = "gpu"
    device_kind: str = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("sizes", [
    dict(data=2, tensor=2, expert=8, pipeline=4, dcn_data=2, dcn_expert=2, dcn_pipeline=4),
    dict(data=4, fsdp=8, expert=4, dcn_data=4, dcn_expert=4),
    dict(fsdp=16, tensor=8, dcn_fsdp=16),
])
def test_layout_is_jax_hybrid_device_mesh(sizes):
    shape = {a: sizes.get(a, 1) for a in AXES}
    dcn = {a: sizes.get(f"dcn_{a}", 1) for a in AXES}
    nodes = int(np.prod(list(dcn.values())))
    devices = [FakeGPU(n * NODE_GPUS + g, n) for n in range(nodes) for g in range(NODE_GPUS)]
    ours = hybrid_order(shape, dcn, [d.process_index for d in devices])
    theirs = mesh_utils.create_hybrid_device_mesh([shape[a] // dcn[a] for a in AXES], [dcn[a] for a in AXES],
                                                  devices, process_is_granule=True)
    assert np.array_equal(np.vectorize(lambda i: devices[i].id)(ours), np.vectorize(lambda d: d.id)(theirs))


def test_sizes_that_cannot_be_laid_out_are_refused_in_one_line():
    shape = {a: 1 for a in AXES} | {"expert": 8, "data": 2}
    with pytest.raises(ConfigError, match=r"^mesh.dcn_expert=4: the axes span 4 nodes, but the job has 2 processes \(one per node\)"):
        hybrid_order(shape, {a: 1 for a in AXES} | {"expert": 4}, [0] * 8 + [1] * 8)
    with pytest.raises(ConfigError, match=r"each node must hold 4 devices .* but the processes hold \[2, 4, 6\]"):
        hybrid_order(shape, {a: 1 for a in AXES} | {"expert": 4}, [0] * 2 + [1] * 6 + [2] * 4 + [3] * 4)
    with pytest.raises(ConfigError, match=r"^mesh.dcn_expert=3: must divide mesh.expert \(8\)"):
        configlib.load(TINY, ["mesh.expert=8", "mesh.dcn_expert=3"])
    with pytest.raises(ConfigError, match=r"^mesh.dcn_pipeline=0: must be a positive integer"):
        configlib.load(TINY, ["mesh.dcn_pipeline=0"])


def test_one_process_default_layout_is_the_device_order():
    m = make_mesh(MeshConfig(data=-1), jax.devices())
    assert list(m.devices.reshape(-1)) == list(jax.devices()) and spans(m) == {}
    with pytest.raises(ConfigError, match=r"the job has 1 process "):
        make_mesh(MeshConfig(data=-1, dcn_data=2), jax.devices())



def test_generation_in_one_process_drops_the_run_s_node_layout():
    """A run trained with its pipeline across 2 processes (mesh.dcn_pipeline=2) generates and
    evaluates in one process: the pipeline folds into data and the dcn sizes go (make_mesh
    refused the run's own mesh there: dcn_pipeline=2 must divide pipeline 1)."""
    run = MeshConfig(data=2, expert=2, pipeline=2, dcn_pipeline=2, expert_fsdp=True)
    got = one_stage(run)
    assert (got.data, got.expert, got.pipeline) == (-1, 2, 1)
    assert all(getattr(got, f"dcn_{a}") == 1 for a in AXES)
    assert dict(make_mesh(got).shape) == {"data": 4, "fsdp": 1, "tensor": 1, "expert": 2, "pipeline": 1}
    with pytest.raises(ConfigError, match="must divide mesh.pipeline"):
        make_mesh(dataclasses.replace(run, pipeline=1, data=-1))

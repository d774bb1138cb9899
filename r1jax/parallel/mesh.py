"""The device mesh and the one table that maps logical axis names to mesh axes.

Model code names logical axes only (`embed`, `heads`, `experts`, `batch`, ...; r1jax/logical.py);
this module is the single place where they meet mesh axes: `shardings` turns variables' names
into NamedShardings (what jit `out_shardings` create parameters in), `activate` makes the rules
current for activation constraints and shard_map inside a traced step.

Axis type: Auto (GSPMD). Under jax 0.10's default, Explicit, every einsum that contracts a
sharded dimension needs an `out_sharding`, every gather (embedding lookup, the MoE token
gathers, integer-label cross-entropy) needs `.at[].get(out_sharding=)`, and
`with_sharding_constraint` turns into an assertion. With Auto, flax/optax built-ins and the MoE
gathers run unchanged and XLA places the collectives; the two holes Auto leaves (gradients and
`jit` outputs whose sharding is not pinned) are closed by always passing `out_shardings` for
state and constraining gradients to the parameters' annotations.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Hashable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from r1jax import logical
from r1jax.config import ConfigError, MeshConfig, dcn_sizes, resolve_mesh_shape

AXES = ("data", "fsdp", "tensor", "expert", "pipeline")

# logical axis -> mesh axis (or axes, or None = replicated). First match wins per name.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("batch", ("data", "fsdp", "expert", "pipeline")),   # pipeline: outside the stages (parallel/pipeline.py)
    ("seq", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # parameters (ZeRO-3 style over fsdp; Megatron-style tensor parallel over tensor). `pipeline`
    # is an fsdp axis too for the leaves outside the pipelined stack (embedding, dense prefix,
    # head, MTP: MaxText's way), so no stage holds them whole; the stack's leaves take `pipeline`
    # for their `stages` axis first and keep fsdp alone here (logical.spec: one dimension an axis)
    ("embed", ("fsdp", "pipeline")),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("q_lora", None),
    ("kv_lora", None),
    ("q_lora_in", ("fsdp", "pipeline")),     # the latent as an input (wq_b, wkv_b): no embed axis
    ("kv_lora_in", ("fsdp", "pipeline")),
    ("qk_head", None),
    ("qk_nope", None),
    ("qk_rope", None),
    ("v_head", None),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("moe_mlp", "tensor"),
    ("router", None),
    ("mtp_concat", None),
    ("norm", None),
    ("layers", None),
    ("lora_rank", None),             # LoRA adapters' rank (r1jax/model/lora.py)
    ("cache_seq", None),             # the decode cache's positions (r1jax/infer/cache.py)
    ("stages", "pipeline"),          # the pipelined MoE stack's slots (see parallel/pipeline.py)
)

# mesh.expert_fsdp: the weights' embedding-width dimensions (those of the rules above that shard
# over fsdp) also split over `expert`, a batch axis for everything but the routed experts, so the
# attention, shared-expert, router, dense and outer weights are ZeRO-3-sharded over the expert
# group as over fsdp (MaxText's `embed` rule) and gathered per layer where they run. The routed
# experts' `experts` dimension takes `expert` first (logical.spec), so they are unchanged.
_EXPERT_FSDP = {"embed", "q_lora_in", "kv_lora_in"}


def rules(cfg: MeshConfig | None = None) -> tuple:
    """The rules table for a mesh config: LOGICAL_RULES, with `expert` added to the weights'
    fsdp dimensions under `mesh.expert_fsdp`."""
    if cfg is None or not cfg.expert_fsdp:
        return LOGICAL_RULES
    return tuple((name, (*logical.axes_of(axes), "expert") if name in _EXPERT_FSDP else axes)
                 for name, axes in LOGICAL_RULES)


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A 5-axis Auto mesh over `devices` (default: all) with sizes from `cfg` (-1 filled in).

    With every `mesh.dcn_<axis>` at 1 the devices are laid out in their order (jax.devices():
    process by process), the first axis outermost. Otherwise the layout is node-aware
    (`hybrid_order`): each process is a node, axis a spans dcn_<a> of them and keeps the rest
    inside each, as `mesh_utils.create_hybrid_device_mesh(process_is_granule=True)` does."""
    devices = list(jax.devices()) if devices is None else list(devices)
    shape = resolve_mesh_shape(cfg, len(devices))
    dcn = dcn_sizes(cfg)
    if all(v == 1 for v in dcn.values()):
        order = np.arange(len(devices))
    else:
        order = hybrid_order(shape, dcn, [d.process_index for d in devices])
    arr = np.empty(len(devices), dtype=object)
    arr[:] = [devices[i] for i in order.reshape(-1)]
    return Mesh(arr.reshape([shape[a] for a in AXES]), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def hybrid_order(shape: dict[str, int], dcn: dict[str, int], nodes: Sequence[Hashable]) -> np.ndarray:
    """The device layout of a node-aware mesh, as positions into a device list whose i-th device
    sits on node `nodes[i]`: an int array of the mesh's shape (AXES order).

    Axis a spans dcn[a] nodes and shape[a] // dcn[a] devices inside each node; its index is
    node coordinate * inside size + inside coordinate. Nodes are taken in order of first
    appearance, laid out over the dcn sizes with the first axis outermost; each node's devices
    keep their order and are laid out over the inside sizes the same way. So `tensor` (and any
    axis with dcn 1) never leaves a node, and an axis with inside size 1 has one device per node.
    A pure function of (node, local position): tests check it on fake clusters."""
    for a in AXES:
        if shape[a] % dcn[a]:
            raise ConfigError(f"mesh.dcn_{a}={dcn[a]}: must divide mesh.{a} ({shape[a]})")
    inside = {a: shape[a] // dcn[a] for a in AXES}
    members: dict[Hashable, list[int]] = {}
    for i, node in enumerate(nodes):
        members.setdefault(node, []).append(i)
    want_nodes, want_local = math.prod(dcn.values()), math.prod(inside.values())
    dcn_text = " x ".join(f"mesh.dcn_{a}={dcn[a]}" for a in AXES if dcn[a] > 1)
    if len(members) != want_nodes:
        raise ConfigError(f"{dcn_text}: the axes span {want_nodes} nodes, but the job has {len(members)} "
                          f"process{'es' if len(members) != 1 else ''} (one per node); make the mesh.dcn_* "
                          f"sizes multiply to {len(members)}")
    sizes = {len(m) for m in members.values()}
    if sizes != {want_local}:
        raise ConfigError(f"{dcn_text}: each node must hold {want_local} devices (the mesh sizes divided by "
                          f"the dcn sizes), but the processes hold {sorted(sizes)}")
    grid = np.asarray(list(members.values()), dtype=np.int64)          # [node, local]
    grid = grid.reshape([dcn[a] for a in AXES] + [inside[a] for a in AXES])
    n = len(AXES)
    grid = grid.transpose([k for i in range(n) for k in (i, n + i)])   # (dcn_a, inside_a) per axis
    return grid.reshape([shape[a] for a in AXES])


def spans(mesh: Mesh) -> dict[str, int]:
    """{axis: processes one line of it spans} for the axes that leave a process, read from the
    mesh's devices (what the layout really is, dcn sizes or not)."""
    out = {}
    for i, a in enumerate(mesh.axis_names):
        line = np.moveaxis(mesh.devices, i, 0).reshape(mesh.devices.shape[i], -1)[:, 0]
        n = len({d.process_index for d in line})
        if n > 1:
            out[a] = n
    return out


def one_stage(cfg: MeshConfig) -> MeshConfig:
    """A run's mesh section for generation and evaluation, which run the model as one stage: a
    pipeline axis folds into data; in one process its node-aware sizes go too (they describe
    how a multi-process job's devices sit on nodes, and one process is one node)."""
    if cfg.pipeline > 1:
        cfg = dataclasses.replace(cfg, pipeline=1, data=-1)
    if jax.process_count() == 1:
        cfg = dataclasses.replace(cfg, **{f"dcn_{a}": 1 for a in AXES})
    return cfg


def single_device_mesh(device=None) -> Mesh:
    device = jax.devices()[0] if device is None else device
    return make_mesh(MeshConfig(data=1), [device])


@contextlib.contextmanager
def activate(mesh: Mesh, table: tuple = LOGICAL_RULES):
    """Mesh + logical rules (`table`: `rules(cfg.mesh)`): needed wherever annotated variables
    are created or resolved."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(table):
        yield mesh


class MeshedJit:
    """A jitted function that is traced (and run) with `mesh` and the rules active, so that
    activation constraints and shard_map inside it see the mesh. `jax.set_mesh` cannot be
    entered inside `jax.jit`, and `jit` does not capture the context it was created in."""

    def __init__(self, fn, mesh: Mesh, table: tuple = LOGICAL_RULES):
        self.fn, self.mesh, self.table = fn, mesh, table

    def __call__(self, *args, **kwargs):
        with activate(self.mesh, self.table):
            return self.fn(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with activate(self.mesh, self.table):
            return self.fn.lower(*args, **kwargs)


def shardings(tree, mesh: Mesh, table: tuple = LOGICAL_RULES):
    """`tree` with every nnx Variable's value replaced by the NamedSharding its logical names
    resolve to on `mesh` under `table` (abstract or concrete leaves); plain leaves (counters)
    are replicated."""
    def one(x):
        if isinstance(x, nnx.Variable):
            return x.replace(NamedSharding(mesh, logical.spec(*logical.names_of(x))))
        return replicated(mesh)
    with activate(mesh, table):
        return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch arrays [B, ...] (ids, masks, per-row values): rows over the batch axes, the rest whole."""
    with activate(mesh):
        return NamedSharding(mesh, logical.spec("batch"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put(target: nnx.State, get) -> nnx.State:
    """`target` (an nnx.State of ShapeDtypeStructs carrying shardings) filled leaf by leaf with
    `get(path)` (a host array of the leaf's shape). Each array is created directly in its shards
    from slices of the host array, so no device ever holds a whole copy it does not own, and every
    process of a multi-host job builds the same global array."""
    out = []
    for path, var in nnx.to_flat_state(target):
        want = var.get_value()
        host = np.asarray(get(path))
        if host.shape != tuple(want.shape):
            raise ValueError(f"{'/'.join(map(str, path))}: got shape {host.shape}, expected {tuple(want.shape)}")
        host = host.astype(want.dtype, copy=False)
        out.append((path, var.replace(jax.make_array_from_callback(want.shape, want.sharding, lambda idx: host[idx]))))
        del host
    return nnx.from_flat_state(out)

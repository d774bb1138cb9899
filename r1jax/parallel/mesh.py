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

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from r1jax import logical
from r1jax.config import MeshConfig, resolve_mesh_shape

AXES = ("data", "fsdp", "tensor", "expert", "pipeline")

# logical axis -> mesh axis (or axes, or None = replicated). First match wins per name.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("batch", ("data", "fsdp", "expert")),
    ("seq", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # parameters (ZeRO-3 style over fsdp; Megatron-style tensor parallel over tensor)
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("q_lora", None),
    ("kv_lora", None),
    ("q_lora_in", "fsdp"),           # the latent as an input (wq_b, wkv_b): these have no embed axis
    ("kv_lora_in", "fsdp"),
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


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A 5-axis Auto mesh over `devices` (default: all) with sizes from `cfg` (-1 filled in)."""
    devices = list(jax.devices()) if devices is None else list(devices)
    shape = resolve_mesh_shape(cfg, len(devices))
    arr = np.asarray(devices, dtype=object).reshape([shape[a] for a in AXES])
    return Mesh(arr, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def single_device_mesh(device=None) -> Mesh:
    device = jax.devices()[0] if device is None else device
    return make_mesh(MeshConfig(data=1), [device])


@contextlib.contextmanager
def activate(mesh: Mesh):
    """Mesh + logical rules: needed wherever annotated variables are created or resolved."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_RULES):
        yield mesh


class MeshedJit:
    """A jitted function that is traced (and run) with `mesh` and the rules active, so that
    activation constraints and shard_map inside it see the mesh. `jax.set_mesh` cannot be
    entered inside `jax.jit`, and `jit` does not capture the context it was created in."""

    def __init__(self, fn, mesh: Mesh):
        self.fn, self.mesh = fn, mesh

    def __call__(self, *args, **kwargs):
        with activate(self.mesh):
            return self.fn(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with activate(self.mesh):
            return self.fn.lower(*args, **kwargs)


def shardings(tree, mesh: Mesh):
    """`tree` with every nnx Variable's value replaced by the NamedSharding its logical names
    resolve to on `mesh` (abstract or concrete leaves); plain leaves (counters) are replicated."""
    def one(x):
        if isinstance(x, nnx.Variable):
            return x.replace(NamedSharding(mesh, logical.spec(*logical.names_of(x))))
        return replicated(mesh)
    with activate(mesh):
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

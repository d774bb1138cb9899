"""The device mesh and the one table that maps logical axis names to mesh axes.

Model code names logical axes only (`embed`, `heads`, `experts`, `batch`, ...); this module is
the single place where they meet mesh axes.

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
import flax.core.spmd as fspmd
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

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
    ("v_head", None),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("moe_mlp", "tensor"),
    ("router", None),
    ("mtp_concat", None),
    ("norm", None),
    ("layers", None),
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


def logical_spec(*names: str | None) -> P:
    """PartitionSpec for logical names under the active rules."""
    return P(*fspmd.from_sharding_rules(names, fspmd.get_logical_axis_rules()))


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """Sharding constraint on an activation by logical names; a no-op outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not fspmd.get_logical_axis_rules():
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(*names))


def state_shardings(abstract_state, mesh: Mesh):
    """NamedShardings for an (abstract) nnx.State from its variables' logical annotations."""
    with activate(mesh):
        return nnx.get_named_sharding(abstract_state, mesh)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())

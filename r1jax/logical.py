"""Logical axis names: what model code says about sharding, and all it says.

Every variable is created by `variable` with its dimensions' logical names (`embed`, `heads`,
`experts`, ...) as inert metadata: eager sharding is off, so creating, transforming or
optimising a model (`nnx.Optimizer`, `nnx.vmap`, `nnx.jit`) never turns the names into sharding
commands, inside a mesh or outside one. Parameters are placed by whoever owns a mesh
(`r1jax.parallel.mesh.shardings` reads the names through its rules table and passes them as jit
`out_shardings`). Activations are constrained by name with `constrain`, which resolves the names
through the logical-axis rules active at trace time and does nothing when none are.

This module knows no mesh axis; `r1jax/parallel/mesh.py` holds the one rules table.
"""
from __future__ import annotations

from typing import Sequence

import flax.core.spmd as fspmd
import jax
from flax import nnx
from jax.sharding import PartitionSpec

NAMES = "out_sharding"      # the variable metadata key the names live under (flax's spelling)


def variable(cls: type[nnx.Variable], value: jax.Array, names: Sequence[str | None]) -> nnx.Variable:
    """A `cls` variable holding `value` whose dimensions carry `names`, as metadata only."""
    names = tuple(names)
    if len(names) != value.ndim:
        raise ValueError(f"{len(names)} logical names {names} for a {value.ndim}-d value")
    return cls(value, eager_sharding=False, **{NAMES: names})


def names_of(var: nnx.Variable) -> tuple[str | None, ...]:
    """The logical names of a variable's dimensions (() when it has none)."""
    return tuple(var.get_metadata().get(NAMES) or ())


def rules_active() -> bool:
    """Whether a mesh and logical-axis rules are active (inside the owner's jit or context)."""
    return not jax.sharding.get_abstract_mesh().empty and bool(fspmd.get_logical_axis_rules())


def spec(*names: str | None) -> PartitionSpec:
    """The PartitionSpec `names` resolve to under the active rules (first match wins); a name
    the rules do not know is an error, never a mesh axis of the same spelling."""
    rules: dict = {}
    for name, axes in fspmd.get_logical_axis_rules():
        rules.setdefault(name, axes)
    unknown = [n for n in names if n is not None and n not in rules]
    if unknown:
        raise ValueError(f"logical axis '{unknown[0]}' has no rule (known: {', '.join(rules)})")
    # a mesh axis splits one dimension at most: a later dimension whose rule names an axis an
    # earlier one took goes without it (the pipelined stack's `stages` take `pipeline` first, so
    # its `embed` is over fsdp alone; outside the stack `embed` is over fsdp and pipeline)
    used = set(jax.sharding.get_abstract_mesh().manual_axes)
    out = []
    for n in names:
        entry = None if n is None else _without(rules[n], used)
        used.update(axes_of(entry))
        out.append(entry)
    return PartitionSpec(*out)


def axes_of(entry) -> tuple[str, ...]:
    """A PartitionSpec entry (None, a mesh axis, or a tuple of them) as a tuple of mesh axes."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _without(entry, taken: set[str]):
    """A rule's mesh axes less those `taken`: manual here (inside a shard_map over `pipeline`, the
    pipeline's stages, the batch is whole over it, though outside it is sharded over it too) or
    used by an earlier dimension."""
    if not taken or entry is None:
        return entry
    if isinstance(entry, str):
        return None if entry in taken else entry
    kept = tuple(a for a in entry if a not in taken)
    return kept[0] if len(kept) == 1 else (kept or None)


def mesh_axes(name: str) -> tuple[str, ...]:
    """The mesh axes (of size > 1) logical `name` is sharded over under the active rules; ()
    without rules. For code that must know the axes it exchanges data over (expert parallelism)."""
    if not rules_active():
        return ()
    entry = spec(name)[0] if len(spec(name)) else None
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a in axes_of(entry) if mesh.shape[a] > 1)


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """Sharding constraint on an activation by logical names; a no-op without active rules."""
    if not rules_active():
        return x
    return jax.lax.with_sharding_constraint(x, spec(*names))

"""The train state: what a step carries from one step to the next, and where it lives.

    {"params": nnx.State      the trainable leaves: the model's nnx.Param leaves (fp32 masters), or
                              with LoRA only its adapters (nnx.LoRAParam)
     "rest": nnx.State        its other variables (the router biases; with LoRA the frozen base
                              weights too, in lora.base_dtype: no gradient, no optimizer state)
     "opt": optax state       Adam's moments, sharded like params
     "step": int32            optimizer steps taken
     "loss_scale": {"scale": float32, "good_steps": int32}    fp16's dynamic loss scale}

`params` and `rest` are in the run's pipeline layout (the MoE stack in stage slots, see
r1jax/parallel/pipeline.py; model order without a pipeline), and every variable carries the
logical names its sharding comes from. `abstract` describes the whole state as
ShapeDtypeStructs with shardings and allocates nothing: a resumed run restores straight into it.

ZeRO-1 (`optim.zero1`): `params` and the per-parameter leaves of `opt` (Adam's mu and nu) are
also split over mesh axis `data` (and `expert`, for leaves not already split over it): see
`zero1_spec`. Each device then holds 1/data (1/(data x expert)) of the fp32 masters and moments
that its model shard replicates. The train step gathers the masters to the model's own sharding
(`model_shardings`, what the logical names say) for the forward and backward, and
reduce-scatters the gradients back for the optimizer (r1jax/train/step.py). `rest` and the counters are unchanged.
Checkpoints hold global arrays, so a run restores into either layout.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from r1jax import logical
from r1jax.config import Config, DType
from r1jax.parallel import mesh as meshlib
from r1jax.parallel import pipeline

State = dict[str, Any]


def split(model_state: nnx.State, cfg: Config | None = None) -> tuple[nnx.State, nnx.State]:
    """(trainable leaves, everything else) of a model's state: its Params, or its LoRA adapters
    when it has any (the base Params then join the rest, stored in `cfg.lora.base_dtype`)."""
    if not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(model_state)):
        return nnx.split_state(model_state, nnx.Param, ...)
    params, rest = nnx.split_state(model_state, nnx.LoRAParam, ...)
    if cfg is not None and cfg.lora.base_dtype is DType.bf16:
        rest = jax.tree.map(_to_bf16, rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return params, rest


def _to_bf16(var):
    if not isinstance(var, nnx.Param):
        return var                   # router biases steer selection: kept fp32
    v = var.get_value()
    if isinstance(v, jax.ShapeDtypeStruct):
        return var.replace(jax.ShapeDtypeStruct(v.shape, jnp.bfloat16, sharding=v.sharding))
    return var.replace(v.astype(jnp.bfloat16))


def _counters(cfg: Config) -> dict:
    t = cfg.train
    scale = t.loss_scale_init if t.dtype is DType.fp16 else 1.0
    return {"step": jnp.int32(0), "loss_scale": {"scale": jnp.float32(scale), "good_steps": jnp.int32(0)}}


ZERO1_AXES = ("data", "expert")


def zero1_spec(shape: tuple[int, ...], spec: PartitionSpec, axis_sizes: Mapping[str, int]) -> PartitionSpec:
    """The ZeRO-1 spec of a leaf of `shape` whose model sharding is `spec`, on a mesh of
    `axis_sizes` ({axis: size}): mesh axes `data` and `expert` (expert only when `spec` does not
    use it already; axes of size 1 are left out) are appended to the first dimension whose size
    divides by the product of the axes that dimension is already split over times theirs. If no
    dimension does, `data` alone is tried the same way; if none divides by that either, `spec`
    is returned as it is. A pure function of shapes and sizes (the planner counts bytes with it).

    The new axes go after the dimension's own, so each model shard is split further: the step's
    gather back to the model sharding is an all-gather over the new axes alone."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries for a in logical.axes_of(e)}
    new = tuple(a for a in ZERO1_AXES if a not in used and axis_sizes.get(a, 1) > 1)
    for axes in dict.fromkeys([new, tuple(a for a in new if a == "data")]):
        if not axes:
            continue
        k = math.prod(axis_sizes[a] for a in axes)
        for i, (n, e) in enumerate(zip(shape, entries)):
            if n % (math.prod(axis_sizes[a] for a in logical.axes_of(e)) * k) == 0:
                joined = logical.axes_of(e) + axes
                entries[i] = joined[0] if len(joined) == 1 else joined
                return PartitionSpec(*entries)
    return spec


def zero1(tree: State, shardings: State, mesh: Mesh) -> State:
    """`shardings` (the state's, from `meshlib.shardings(tree, mesh)`) with the leaves of
    `params` and the per-parameter leaves of `opt` (its nnx Variables: Adam's mu and nu) in
    their ZeRO-1 shardings (`zero1_spec`); `tree` gives the shapes. `rest` and the counters
    (plain leaves, replicated) stay as they are."""
    sizes = dict(mesh.shape)

    def one(a, s):
        if not isinstance(s, nnx.Variable):
            return s
        sh = s.get_value()
        return s.replace(NamedSharding(mesh, zero1_spec(tuple(a.shape), sh.spec, sizes)))

    def part(t, s):
        return jax.tree.map(one, t, s, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return {**shardings, "params": part(tree["params"], shardings["params"]), "opt": part(tree["opt"], shardings["opt"])}


def model_shardings(params_shardings: nnx.State, mesh: Mesh, table: tuple = meshlib.LOGICAL_RULES) -> nnx.State:
    """The model's own shardings of the trainable leaves (what their logical names resolve to
    under `table`, the run's `meshlib.rules`), whatever `params_shardings` (the state's: ZeRO-1
    or not) says."""
    return meshlib.shardings(params_shardings, mesh, table)


def abstract(model_state: nnx.State, tx: optax.GradientTransformation, cfg: Config,
             mesh: Mesh) -> tuple[State, State]:
    """(the state as ShapeDtypeStructs carrying their shardings, the shardings) for a model state
    (abstract or concrete) already in the run's layout; with `optim.zero1` the masters and
    moments in their ZeRO-1 shardings."""
    params, rest = split(model_state, cfg)
    tree = {"params": params, "rest": rest, "opt": jax.eval_shape(tx.init, params),
            **jax.eval_shape(lambda: _counters(cfg))}
    shardings = meshlib.shardings(tree, mesh, meshlib.rules(cfg.mesh))
    if cfg.optim.zero1:
        shardings = zero1(tree, shardings, mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings), shardings


def create(model_state: nnx.State, tx: optax.GradientTransformation, cfg: Config,
           mesh: Mesh) -> tuple[State, State]:
    """(a fresh run's state, its shardings) around concrete weights already in their shards:
    the optimizer state is created directly in its shardings (with `optim.zero1`, the masters
    are resharded into theirs first)."""
    params, rest = split(model_state, cfg)
    _, shardings = abstract(model_state, tx, cfg, mesh)
    if cfg.optim.zero1:
        params = jax.device_put(params, shardings["params"])
    opt = jax.jit(tx.init, out_shardings=shardings["opt"])(params)
    counters = _counters(cfg)
    return {"params": params, "rest": rest, "opt": opt,
            **jax.device_put(counters, {k: shardings[k] for k in counters})}, shardings


def model(graphdef: nnx.GraphDef, state: State, layout: pipeline.Layout | None) -> nnx.Module:
    """The model a train state holds, in model order (the MoE stack gathered out of its slots)."""
    return nnx.merge(graphdef, pipeline.to_layers(state["params"], layout), pipeline.to_layers(state["rest"], layout))

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
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

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


def abstract(model_state: nnx.State, tx: optax.GradientTransformation, cfg: Config,
             mesh: Mesh) -> tuple[State, State]:
    """(the state as ShapeDtypeStructs carrying their shardings, the shardings) for a model state
    (abstract or concrete) already in the run's layout."""
    params, rest = split(model_state, cfg)
    tree = {"params": params, "rest": rest, "opt": jax.eval_shape(tx.init, params),
            **jax.eval_shape(lambda: _counters(cfg))}
    shardings = meshlib.shardings(tree, mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings), shardings


def create(model_state: nnx.State, tx: optax.GradientTransformation, cfg: Config,
           mesh: Mesh) -> tuple[State, State]:
    """(a fresh run's state, its shardings) around concrete weights already in their shards:
    the optimizer state is created directly in the params' shardings."""
    params, rest = split(model_state, cfg)
    _, shardings = abstract(model_state, tx, cfg, mesh)
    opt = jax.jit(tx.init, out_shardings=shardings["opt"])(params)
    counters = _counters(cfg)
    return {"params": params, "rest": rest, "opt": opt,
            **jax.device_put(counters, {k: shardings[k] for k in counters})}, shardings


def model(graphdef: nnx.GraphDef, state: State, layout: pipeline.Layout | None) -> nnx.Module:
    """The model a train state holds, in model order (the MoE stack gathered out of its slots)."""
    return nnx.merge(graphdef, pipeline.to_layers(state["params"], layout), pipeline.to_layers(state["rest"], layout))

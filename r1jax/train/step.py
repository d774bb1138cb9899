"""The pure train step: (state, batch) -> (state, metrics), jitted with donated, pinned shardings.

State is a plain pytree: {"params": nnx.State of Params (fp32 masters), "rest": the non-trainable
variables (router biases), "opt": optax state, "step": int32}. The model's graphdef is split
once outside and merged inside, so the step is a pure function of arrays.

After the optimizer update, DeepSeek-V3's aux-loss-free balancing moves each router bias by
gamma * sign(mean load - load) using the batch's routed-token counts per expert.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from r1jax.config import Config
from r1jax.model import Transformer
from r1jax.parallel import mesh as meshlib
from r1jax.train.loss import lm_losses, total_loss

State = dict[str, Any]


def split_model(model: Transformer):
    """(graphdef, params, rest): trainable Params and everything else (router biases)."""
    return nnx.split(model, nnx.Param, ...)


def _shardings(tree, mesh: Mesh):
    """NamedShardings from Variables' logical annotations; replicated for plain leaves (counts)."""
    def one(x):
        if isinstance(x, nnx.Variable):
            return x.replace(NamedSharding(mesh, meshlib.logical_spec(*x.get_metadata()["out_sharding"]))) \
                if x.get_metadata().get("out_sharding") else x.replace(meshlib.replicated(mesh))
        return meshlib.replicated(mesh)
    with meshlib.activate(mesh):
        return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def init_state(model: Transformer, tx: optax.GradientTransformation, mesh: Mesh):
    """(graphdef, state, state shardings) with the optimizer state sharded like its params."""
    graphdef, params, rest = split_model(model)
    abstract = {"params": params, "rest": rest, "opt": jax.eval_shape(tx.init, params),
                "step": jax.ShapeDtypeStruct((), jnp.int32)}
    shardings = _shardings(abstract, mesh)
    opt = jax.jit(tx.init, out_shardings=shardings["opt"])(params)
    state = {"params": params, "rest": rest, "opt": opt,
             "step": jax.device_put(jnp.int32(0), shardings["step"])}
    return graphdef, state, shardings


def batch_sharding(mesh: Mesh) -> NamedSharding:
    with meshlib.activate(mesh):
        return NamedSharding(mesh, meshlib.logical_spec("batch", "seq"))


def update_router_bias(rest: nnx.State, aux: dict[str, jax.Array], rate: float) -> nnx.State:
    """b_i += rate * sign(mean_j load_j - load_i), per MoE layer and per MTP block."""
    if rate == 0:
        return rest
    flat = []
    for path, var in nnx.to_flat_state(rest):
        if path[-1] == "router_bias_E":
            load = aux["load"] if path[0] == "moe_layers" else aux["mtp_load"][path[1]]
            bias = var.get_value()
            var = var.replace(bias + rate * jnp.sign(load.mean(-1, keepdims=True) - load))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def make_train_step(graphdef, tx: optax.GradientTransformation, cfg: Config, mesh: Mesh,
                    shardings: State, lr_schedule: Callable) -> Callable[[State, dict], tuple[State, dict]]:
    m = cfg.model
    mtp = m.num_nextn_predict_layers > 0

    def step(state: State, batch: dict[str, jax.Array]):
        ids, seg, pos = batch["ids"], batch["segment_ids"], batch["positions"]

        def loss_fn(params):
            out = nnx.merge(graphdef, params, state["rest"])(ids, pos, seg, mtp=mtp)
            losses = lm_losses(out, ids, seg)
            return total_loss(losses, m.mtp_loss_weight), (losses, out.aux)

        (loss, (losses, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        grads = jax.lax.with_sharding_constraint(grads, shardings["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        rest = update_router_bias(state["rest"], aux, m.bias_update_rate) if "load" in aux else state["rest"]
        metrics = {"loss": loss, "lm_loss": losses["lm"], "mtp_loss": losses["mtp"], "tokens": losses["tokens"],
                   "grad_norm": optax.global_norm(grads), "param_norm": optax.global_norm(params),
                   "lr": lr_schedule(state["step"])}
        if "load" in aux:
            load = aux["load"]
            metrics["expert_imbalance"] = jnp.max(load.max(-1) / jnp.maximum(load.mean(-1), 1e-9))
            metrics["dropped_frac"] = aux["dropped"].sum() / jnp.maximum(aux["idx"].size, 1)
        new = {"params": params, "rest": rest, "opt": opt, "step": state["step"] + 1}
        return new, metrics

    with meshlib.activate(mesh):
        return jax.jit(step, donate_argnums=0,
                       in_shardings=(shardings, batch_sharding(mesh)),
                       out_shardings=(shardings, meshlib.replicated(mesh)))


def make_eval_step(graphdef, cfg: Config, mesh: Mesh, shardings: State):
    """(state, batch) -> (sum of token losses, token count) for the main next-token loss."""
    from r1jax.train.loss import cross_entropy_sum, shifted_targets

    def ev(state, batch):
        out = nnx.merge(graphdef, state["params"], state["rest"])(
            batch["ids"], batch["positions"], batch["segment_ids"])
        return cross_entropy_sum(out.logits, *shifted_targets(batch["ids"], batch["segment_ids"], 1))

    with meshlib.activate(mesh):
        return jax.jit(ev, in_shardings=(shardings, batch_sharding(mesh)),
                       out_shardings=meshlib.replicated(mesh))

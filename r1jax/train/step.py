"""The pure train step: (state, batch) -> (state, metrics), jitted with donated, pinned shardings.

State is a plain pytree:
    params      nnx.State of Params (fp32 masters)
    rest        the non-trainable variables (router biases)
    opt         optax state (sharded like params)
    step        int32
    rng         uint32 key data (folded with the step wherever randomness is needed)
    loss_scale  {"scale": f32, "good_steps": i32}; fixed at 1 unless train.dtype is fp16
The model's graphdef is split once outside and merged inside, so the step is a pure function.

One step: the global batch is split into `train.grad_accum` microbatches (rows a, a+A, ... so
each keeps its data sharding), scanned with gradients summed in fp32; every loss is normalised
by the whole batch's target count, so A microbatches equal one large batch. fp16 multiplies the
loss by the dynamic scale, skips the update when any gradient is not finite (scale x0.5) and
doubles the scale after `loss_scale_growth_interval` good steps, like torch's GradScaler. After
the optimizer, DeepSeek-V3's aux-loss-free balancing moves each router bias by
gamma * sign(mean load - load) using the step's routed-token counts.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from r1jax import model as modellib
from r1jax.config import Config, DType, Schedule
from r1jax.model import Transformer
from r1jax.parallel import mesh as meshlib
from r1jax.parallel import pipeline
from r1jax.train import optim
from r1jax.train.loss import combine, cross_entropy_sum, loss_sums, shifted_targets, target_counts

State = dict[str, Any]


def split_model(model: Transformer):
    """(graphdef, params, rest): trainable Params and everything else (router biases)."""
    return nnx.split(model, nnx.Param, ...)


def _shardings(tree, mesh: Mesh):
    """NamedShardings from Variables' logical annotations; replicated for plain leaves (counts)."""
    def one(x):
        if isinstance(x, nnx.Variable):
            names = x.get_metadata().get("out_sharding")
            spec = meshlib.logical_spec(*names) if names else jax.sharding.PartitionSpec()
            return x.replace(NamedSharding(mesh, spec))
        return meshlib.replicated(mesh)
    with meshlib.activate(mesh):
        return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def init_state(model: Transformer, tx: optax.GradientTransformation, mesh: Mesh, cfg: Config):
    """(graphdef, state, state shardings) with the optimizer state sharded like its params."""
    graphdef, params, rest = split_model(model)
    t = cfg.train
    scale = t.loss_scale_init if t.dtype is DType.fp16 else 1.0
    small = {"step": jnp.int32(0), "rng": jax.random.key_data(jax.random.key(t.seed)),
             "loss_scale": {"scale": jnp.float32(scale), "good_steps": jnp.int32(0)}}
    abstract = {"params": params, "rest": rest, "opt": jax.eval_shape(tx.init, params), **small}
    shardings = _shardings(abstract, mesh)
    opt = jax.jit(tx.init, out_shardings=shardings["opt"])(params)
    state = {"params": params, "rest": rest, "opt": opt,
             **jax.device_put(small, {k: shardings[k] for k in small})}
    return graphdef, state, shardings


def batch_sharding(mesh: Mesh) -> NamedSharding:
    with meshlib.activate(mesh):
        return NamedSharding(mesh, meshlib.logical_spec("batch", "seq"))


def update_router_bias(rest: nnx.State, load: jax.Array, mtp_load: jax.Array | None, rate: float,
                       layout=None) -> nnx.State:
    """b_i += rate * sign(mean_j load_j - load_i), per MoE layer and per MTP block. `load` is in
    model order; with a pipeline `layout` the stack's biases sit in its slots (pads get 0)."""
    if rate == 0:
        return rest
    if layout is not None and not layout.identity:
        load = layout.to_slots(load)
    flat = []
    for path, var in nnx.to_flat_state(rest):
        if path[-1] == "router_bias_E":
            lo = load if path[0] == "moe_layers" else mtp_load[path[1]]
            var = var.replace(var.get_value() + rate * jnp.sign(lo.mean(-1, keepdims=True) - lo))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def _tree_select(pred, new, old):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def make_train_step(graphdef, tx: optax.GradientTransformation, cfg: Config, mesh: Mesh,
                    shardings: State, lr_schedule: Callable) -> Callable[[State, dict], tuple[State, dict]]:
    m, t = cfg.model, cfg.train
    depth = m.num_nextn_predict_layers
    accum = t.grad_accum
    fp16 = t.dtype is DType.fp16
    has_moe = m.num_moe_layers > 0
    msh = shardings["params"]
    layout = pipeline.mesh_layout(cfg, mesh)

    def finish(out, ids, segment_ids, counts, per: int = 1):
        """(loss, stats) of a model output, normalised by the whole batch's counts (so the losses
        of microbatches add); `per`: pipeline microbatches this is one of (balance is a row mean)."""
        sums = loss_sums(out, ids, segment_ids)
        loss = combine(sums, counts, m.mtp_loss_weight)
        balance = sum(out.aux[k].sum() for k in ("balance", "mtp_balance") if k in out.aux) / (accum * per)
        loss = loss + m.seq_aux_loss_alpha * balance
        stats = {"sums": sums, "balance": balance}
        for k in ("load", "dropped", "mtp_load", "mtp_dropped"):
            if k in out.aux:
                stats[k] = out.aux[k].astype(jnp.float32)
        return loss, stats

    def micro_loss(params, rest, mb, counts, scale):
        model = nnx.merge(graphdef, params, rest)
        if layout is None:
            out = model(mb["ids"], mb["positions"], mb["segment_ids"], mtp=depth > 0)
        else:
            out = pipeline.forward(model, mb["ids"], mb["positions"], mb["segment_ids"], layout=layout,
                                   microbatches=t.microbatches, mtp=depth > 0)
        loss, stats = finish(out, mb["ids"], mb["segment_ids"], counts)
        return loss * scale, stats

    if layout is not None and cfg.pipeline.schedule is Schedule.onefoneb:
        def post_loss(model, y, ids, positions, segment_ids, counts, shards):
            out = model.epilogue(y, ids, positions, segment_ids, mtp=depth > 0)
            return finish(out, ids, segment_ids, counts, per=shards)

        def grad_fn(params, rest, mb, counts, scale):
            (loss, stats), grads = pipeline.loss_and_grads_1f1b(
                graphdef, params, rest, mb, cfg=cfg, layout=layout, post_loss=post_loss, counts=counts,
                scale=scale, balance_weight=m.seq_aux_loss_alpha / accum)
            stage_balance = stats.pop("balance_stack").sum() / accum
            stats["balance"] = stats["balance"] + stage_balance
            return (loss, stats), grads
    else:
        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state: State, batch: dict[str, jax.Array]):
        scale = state["loss_scale"]["scale"]
        counts = target_counts(batch["segment_ids"], depth)
        if accum == 1:
            (loss, stats), grads = grad_fn(state["params"], state["rest"], batch, counts, scale)
        else:
            # microbatch a = rows a, a+A, ...: every device keeps the rows it already holds
            micro = jax.tree.map(lambda x: x.reshape(-1, accum, *x.shape[1:]).swapaxes(0, 1), batch)

            def body(carry, mb):
                out, g = grad_fn(state["params"], state["rest"], mb, counts, scale)
                g = jax.lax.with_sharding_constraint(g, msh)
                return jax.tree.map(jnp.add, carry, (out, g)), None

            first = jax.tree.map(lambda x: x[0], micro)
            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(
                grad_fn, state["params"], state["rest"], first, counts, scale))
            ((loss, stats), grads), _ = jax.lax.scan(body, zeros, micro)
        grads = jax.lax.with_sharding_constraint(jax.tree.map(lambda g: g / scale, grads), msh)
        loss = loss / scale
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        rest = state["rest"]
        if has_moe:
            rest = update_router_bias(rest, stats["load"], stats.get("mtp_load"), m.bias_update_rate, layout)
        new = {"params": params, "rest": rest, "opt": opt}
        ls = state["loss_scale"]
        if fp16:
            new = _tree_select(finite, new, {k: state[k] for k in new})
            good = jnp.where(finite, ls["good_steps"] + 1, 0)
            grow = good >= t.loss_scale_growth_interval
            ls = {"scale": jnp.where(finite, jnp.where(grow, ls["scale"] * 2, ls["scale"]), ls["scale"] * 0.5),
                  "good_steps": jnp.where(grow, 0, good)}
        means = stats["sums"] / jnp.maximum(counts, 1.0)
        metrics = {"loss": loss, "lm_loss": means[0], "mtp_loss": jnp.mean(means[1:]) if depth else 0.0,
                   "balance_loss": stats["balance"] * accum, "tokens": counts[0],
                   "grad_norm": optax.tree.norm(grads), "param_norm": optax.tree.norm(new["params"]),
                   "lr": lr_schedule(state["step"]), "loss_scale": ls["scale"],
                   "skipped": (~finite).astype(jnp.float32)}
        if has_moe:
            load = stats["load"]
            metrics["expert_imbalance"] = load.max(-1) / jnp.maximum(load.mean(-1), 1e-9)     # [L]
            metrics["dropped_frac"] = stats["dropped"].sum() / jnp.maximum(load.sum(), 1.0)
        new.update(step=state["step"] + 1, rng=state["rng"], loss_scale=ls)
        return new, metrics

    with meshlib.activate(mesh):
        return meshlib.MeshedJit(jax.jit(step, donate_argnums=0, in_shardings=(shardings, batch_sharding(mesh)),
                                         out_shardings=(shardings, meshlib.replicated(mesh))), mesh)


def make_eval_step(graphdef, cfg: Config, mesh: Mesh, shardings: State):
    """(state, batch) -> (sum of token losses, token count) for the main next-token loss."""
    def ev(state, batch):
        out = nnx.merge(graphdef, state["params"], state["rest"])(
            batch["ids"], batch["positions"], batch["segment_ids"])
        return cross_entropy_sum(out.logits, *shifted_targets(batch["ids"], batch["segment_ids"], 1))

    with meshlib.activate(mesh):
        return meshlib.MeshedJit(jax.jit(ev, in_shardings=(shardings, batch_sharding(mesh)),
                                         out_shardings=meshlib.replicated(mesh)), mesh)


class Setup(NamedTuple):
    """What `build` returns: a fresh run's state and its jitted train step."""
    mesh: Mesh
    graphdef: Any
    state: State
    shardings: State
    tx: optax.GradientTransformation
    step: Callable


def build(cfg: Config, mesh: Mesh | None = None, model: Transformer | None = None) -> Setup:
    """A fresh run's model, state and train step, built as the trainer builds them: parameters
    born in their shards on `mesh` (default: `cfg.mesh` over all devices) with the config's seed,
    compute dtype, remat policy and pipeline layout, AdamW state sharded like them. For the
    benchmarks, the planner's check and the tests; `model` replaces the freshly built one."""
    t = cfg.train
    mesh = meshlib.make_mesh(cfg.mesh) if mesh is None else mesh
    if model is None:
        model = modellib.build(cfg.model, mesh, seed=t.seed, dtype=modellib.COMPUTE_DTYPES[t.dtype], remat=t.remat,
                               layout=pipeline.mesh_layout(cfg, mesh))
    tx = optim.make(cfg.optim, t.steps)
    graphdef, state, shardings = init_state(model, tx, mesh, cfg)
    step = make_train_step(graphdef, tx, cfg, mesh, shardings, optim.schedule(cfg.optim, t.steps))
    return Setup(mesh, graphdef, state, shardings, tx, step)

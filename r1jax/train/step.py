"""The pure train step: (state, batch) -> (state, metrics), jitted with donated, pinned shardings;
and the eval step beside it. State is r1jax/train/state.py's pytree; the model's graphdef is
split once outside and merged inside, so both steps are pure functions.

One step: the global batch is split into `train.grad_accum` microbatches (rows a, a+A, ... so
each keeps its data sharding), scanned with gradients summed in fp32 (the stacks' backward
adds into the running sum itself, under every remat policy: `into_sums`); within each, the trunk
(prologue and MoE stack, pipelined when the run is) and then the epilogue (final norm, head,
MTP) and the objective in `train.epilogue_chunks` checkpointed row chunks. The loss is the
objective's (r1jax/train/objectives.py) summed loss over the whole batch's `objective.tokens`,
plus the objective's `balance_weight` (`loss.seq_aux_loss_alpha`) times the MoE balance loss
summed over layers and averaged over rows; both denominators come from the batch alone, so A microbatches (and every pipeline
schedule) equal one large batch. A step whose loss or any gradient is not finite changes nothing
but the step counter (metric `skipped`). fp16 multiplies the loss by the dynamic scale, halves it on
such a step and doubles the scale after
`loss_scale_growth_interval` good steps, like torch's GradScaler. After the optimizer,
DeepSeek-V3's aux-loss-free balancing moves each router bias by
gamma * sign(mean load - load) using the step's routed-token counts (`optim.bias_update_rate`).

With ZeRO-1 (`optim.zero1`, r1jax/train/state.py) the state's masters and moments are split over
`data` (and `expert`) beyond the model's sharding: the step first gathers the masters to the
model's sharding (an all-gather, once per step, before any microbatch), computes the gradients
there as without ZeRO-1, then constrains them to the masters' sharding (a reduce-scatter; XLA:CPU
all-reduces and keeps each device's slice), so the optimizer update, the moments and the new
masters stay split: the step's state arguments shrink by the same factor (tests/test_zero1.py).
In bf16/fp16 runs the gather is of a compute-dtype copy (`gathered`), except the leaves the model
reads in fp32 (FP32_LEAVES: the router, the embedding); the model casts every other weight to
that dtype at its use anyway. The gradients are taken with respect to fp32 zeros tapped into the
copy (`layers.tap`), and the loops that read it as a constant (the pipeline's ticks, the
epilogue's chunks) tap inside their bodies, so every gradient sum is fp32 as with fp32 masters.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from r1jax import logical, weights
from r1jax.model import COMPUTE_DTYPES
from r1jax.model import accumulate
from r1jax.model import lora as loralib
from r1jax.model.layers import tap
from r1jax.model.transformer import MOE_STACK
from r1jax.config import Config, DType, Schedule
from r1jax.parallel import mesh as meshlib
from r1jax.parallel import pipeline
from r1jax.train import objectives, optim
from r1jax.train import state as statelib
from r1jax.train.objectives import Objective

State = dict[str, Any]
EPILOGUE = ("final_norm", "lm_head_DW", "mtp", "embed")     # Transformer.epilogue's parts (the MTP blocks read embed)
# read in fp32 by the model: the router (expert choice in fp32) and the embedding (its gradient is a
# scatter-add over every token, which a bf16 table would sum in bf16)
FP32_LEAVES = ("router_DE", "embedding_WD")
# the scanned stacks by their numbers in the model (`Transformer`: the dense prefix 0, the MoE stack 1)
STACKS = {"dense_layers": 0, "moe_layers": MOE_STACK}
AUX = ("load", "dropped", "balance", "mtp_load", "mtp_dropped", "mtp_balance")   # summed over rows


def trunk(model, batch: dict, cfg: Config, layout: pipeline.Layout | None, taps=None):
    """The prologue and MoE stack on `batch`, through the run's pipeline when it has one (GPipe
    or circular; 1F1B interleaves the backward and is the step's own): (x, positions,
    segment_ids, the stack's aux). A batch with "routing" (GRPO's Rollout Routing Replay)
    replays those expert choices. Run it under `loralib.dropout` for training's LoRA dropout.
    `taps` (`model_loss`): the pipeline's ticks sum the stack's gradients through them."""
    if layout is None:
        return model.trunk(batch["ids"], batch["positions"], batch["segment_ids"], routing=batch.get("routing"))
    return pipeline.trunk(model, batch, layout=layout, microbatches=cfg.train.microbatches,
                          stage_remat=cfg.pipeline.stage_remat, taps=taps)


def epilogue_loss(model, x, positions, segment_ids, batch: dict, objective: Objective, tokens, rows: int,
                  chunks: int = 1, taps=None):
    """(loss, stats) of the epilogue (final norm, head, MTP modules) and the objective on the
    trunk's output, as `head_loss` sums them. With `chunks` > 1 the rows run in that many
    sequential chunks (rows c, c+chunks, ...: every device keeps its own rows), each recomputed
    in the backward: the logits, the MTP blocks' working set and their saved activations are a
    chunk's, not the whole batch's, for one more forward of the head and MTP blocks
    (train.epilogue_chunks). Dropout masks follow each row's number (batch["row"])."""
    def piece_loss(model, x, pos, seg, piece):
        with loralib.rows(piece.get("row")):
            out = model.epilogue(x, piece["ids"], pos, seg, mtp=objective.mtp)
        return head_loss(out, piece, objective, tokens, rows)

    if chunks == 1:
        return piece_loss(model, x, positions, segment_ids, batch)
    # only the epilogue's parts go through the chunk loop as arguments: autodiff carries a
    # gradient sum through the loop for each of them (in fp32 through `taps`, `model_loss`)
    is_epilogue = lambda path, _: path[0] in EPILOGUE
    graphdef, state, others = nnx.split(model, is_epilogue, ...)
    zs = None
    if taps is not None:
        zs, state = nnx.split(taps, is_epilogue, ...)[1], jax.lax.stop_gradient(state)
    split = lambda a: a.reshape(-1, chunks, *a.shape[1:]).swapaxes(0, 1)

    def run(state, zs, x, pos, seg, piece):
        x = logical.constrain(x, "batch", "seq", "act_embed")
        return piece_loss(nnx.merge(graphdef, state if zs is None else tap(state, zs), others), x, pos, seg, piece)

    run = jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
    xs = (split(x), split(positions), split(segment_ids), jax.tree.map(split, batch))
    first = jax.tree.map(lambda a: a[0], xs)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(run, state, zs, *first))

    def body(carry, xs):
        return jax.tree.map(jnp.add, carry, run(state, zs, *xs)), None

    return jax.lax.scan(body, zeros, xs)[0]


def model_loss(model, batch: dict, cfg: Config, layout: pipeline.Layout | None, objective: Objective, tokens,
               rows: int, dropout_key=None, taps=None):
    """(loss, stats) of `objective` on `batch`: the trunk (`trunk`), then the epilogue and the
    objective in train.epilogue_chunks chunks (`epilogue_loss`), plus the stack's balance loss.
    `dropout_key`: training's LoRA dropout (lora.dropout) draws from it, each row by its number
    in the step's batch (batch["row"]); None: none (eval). `taps`: with a `model` of
    compute-dtype weights (ZeRO-1's gather), the same model holding fp32 zeros (`layers.tap`),
    through which the pipeline's ticks and the epilogue's chunks route their weights' gradients
    so that those loops sum them in fp32."""
    with loralib.dropout(dropout_key, cfg.lora.dropout if cfg.lora.rank else 0.0, batch.get("row")):
        x, positions, segment_ids, aux = trunk(model, batch, cfg, layout, taps)
        loss, stats = epilogue_loss(model, x, positions, segment_ids, batch, objective, tokens, rows,
                                    cfg.train.epilogue_chunks, taps)
    stack = {k: aux[k].astype(jnp.float32) for k in AUX if k in aux}
    return loss + objective.balance_weight * _balance(stack) / rows, {**stats, **stack}


def dropout_key(cfg: Config, step: jax.Array) -> jax.Array | None:
    """The step's LoRA dropout key (a function of train.seed and the step, so a resumed run
    draws the masks the uninterrupted one would), or None when the run has no dropout."""
    if not (cfg.lora.rank and cfg.lora.dropout):
        return None
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.train.seed), 0x10DA), step)


def head_loss(out, batch: dict, objective: Objective, tokens, rows: int):
    """(loss, stats) of an output over (part of) the step's batch: the objective's loss sum over
    the whole step's `tokens`, plus its balance weight x the balance losses it carries over the
    step's `rows`.
    Stats are sums, so the parts of a step add."""
    loss_sum, n, metrics = objective(out, batch)
    stats = {"metrics": metrics, "tokens": n, **{k: out.aux[k].astype(jnp.float32) for k in AUX if k in out.aux}}
    return loss_sum / tokens + objective.balance_weight * _balance(stats) / rows, stats


def _balance(stats: dict):
    return sum(stats[k].sum() for k in ("balance", "mtp_balance") if k in stats)


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
        if path[-1] == "router_bias_E" and (path[0] == "moe_layers" or mtp_load is not None):
            # (an objective that does not run the MTP modules leaves their biases where they are)
            lo = load if path[0] == "moe_layers" else mtp_load[path[1]]
            var = var.replace(var.get_value() + rate * jnp.sign(lo.mean(-1, keepdims=True) - lo))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def compute_gather(cfg: Config):
    """The dtype ZeRO-1 gathers the masters in for the step: the compute dtype (bf16/fp16 runs),
    or None for fp32 masters (fp32 runs; 1F1B, whose tick loop sums its gradients itself)."""
    onefoneb = cfg.mesh.pipeline != 1 and cfg.pipeline.schedule is Schedule.onefoneb
    return None if cfg.train.dtype is DType.fp32 or onefoneb else COMPUTE_DTYPES[cfg.train.dtype]


def gathered(params: nnx.State, shardings, dtype) -> nnx.State:
    """ZeRO-1's masters gathered to the model's `shardings`: with a `dtype`, a copy in it except
    the leaves the model reads in fp32 (FP32_LEAVES), half the bytes in bf16."""
    if dtype is not None:
        params = nnx.from_flat_state([(p, v if p[-1] in FP32_LEAVES else v.replace(v.get_value().astype(dtype)))
                                      for p, v in nnx.to_flat_state(params)])
    return jax.lax.with_sharding_constraint(params, shardings)


def make_train_step(graphdef, tx: optax.GradientTransformation, cfg: Config, mesh: Mesh, shardings: State,
                    objective: Objective | None = None) -> Callable[[State, dict], tuple[State, dict]]:
    """The jitted step for `objective` (default: the one `loss.objective` names)."""
    objective = objective or objectives.make(cfg)
    tx = optax.with_extra_args_support(tx)                 # the clip takes the step's grad_norm
    t = cfg.train
    accum = t.grad_accum
    fp16 = t.dtype is DType.fp16
    has_moe = cfg.model.num_moe_layers > 0
    zsh = shardings["params"]                              # the masters' (ZeRO-1 or the model's)
    table = meshlib.rules(cfg.mesh)
    msh = statelib.model_shardings(zsh, mesh, table)       # the model's: forward, backward, gradients
    gather = jax.tree.leaves(zsh) != jax.tree.leaves(msh)  # ZeRO-1 on a mesh where it splits something
    layout = pipeline.mesh_layout(cfg, mesh)
    lr_schedule = optim.schedule(cfg.optim, t.steps)
    low = compute_gather(cfg) if gather else None          # ZeRO-1 gathers a compute-dtype copy

    def micro_loss(params, rest, mb, tokens, scale, key, *, rows, taps=None):
        model = nnx.merge(graphdef, params, rest)
        if taps is not None:        # the same model holding fp32 zeros (the router biases' too)
            taps = nnx.merge(graphdef, taps, jax.tree.map(jnp.zeros_like, rest))
        loss, stats = model_loss(model, mb, cfg, layout, objective, tokens, rows, key, taps)
        return loss * scale, stats

    onefoneb = layout is not None and cfg.pipeline.schedule is Schedule.onefoneb

    def onefoneb_grads(params, rest, mb, tokens, scale, key, sums, *, rows):
        """1F1B's ((loss * scale, stats), sums + gradients): its tick loop starts its own
        gradient sums from `sums` (None: zeros)."""
        def piece_loss(model, y, piece):
            return epilogue_loss(model, y, piece["positions"], piece["segment_ids"], piece, objective, tokens, rows)
        with loralib.dropout(key, cfg.lora.dropout if cfg.lora.rank else 0.0, mb.get("row")):
            return pipeline.loss_and_grads_1f1b(graphdef, params, rest, mb, layout=layout,
                                                microbatches=t.microbatches, head_loss=piece_loss,
                                                balance_ct=objective.balance_weight / rows, scale=scale,
                                                mtp=objective.mtp, sums=sums)

    # Otherwise the running gradient sum is added to in place (one fp32 buffer) by the backward
    # of each stack, unpipelined (r1jax/model/accumulate.py) or pipelined by GPipe or circular
    # ticks (their carry, r1jax/parallel/pipeline.py), under every remat policy. One microbatch
    # goes this way too, into zeros: autodiff of the ticks would keep a tick's stage gradients
    # beside the loop's sum of them (circular 2 x 2 stages, remat full, tests/test_step.py's
    # shape: XLA temp 308.5 -> 285.1 MiB), and without remat autodiff keeps each layer's
    # weight-derived arrays, which the stacks' backward derives again (accumulate.py; hidden 256,
    # 16 experts, one device: 698.9 -> 640.8 MiB).
    in_sums = set(STACKS)

    def into_sums(params, rest, mb, tokens, scale, key, sums, *, rows):
        """One microbatch's ((loss * scale, stats), sums + its gradients) with the stacks'
        gradients added into `sums` by their backward (`in_sums`): the other parts get theirs
        through fp32 zeros tapped into them (`layers.tap`)."""
        flat = list(nnx.to_flat_state(params))
        have = dict(nnx.to_flat_state(sums))
        outside = {p: jnp.zeros(v.shape, jnp.float32) for p, v in flat if p[0] not in in_sums}
        stack_sums = {}
        for p, v in have.items():
            if p[0] in in_sums:
                stack_sums.setdefault(STACKS[p[0]], {})[p[2:]] = v.get_value()

        def f(z_out, stack_sums):
            z = nnx.from_flat_state([(p, v.replace(z_out[p] if p in z_out else jnp.zeros(v.shape, jnp.float32)))
                                     for p, v in flat])
            used = nnx.from_flat_state([(p, v.replace(jax.lax.stop_gradient(v.get_value()))) if p[0] in in_sums
                                        else (p, v.replace(tap(v.get_value(), z_out[p]))) for p, v in flat])
            with accumulate.into(stack_sums) as box:
                loss, stats = micro_loss(used, rest, mb, tokens, scale, key, rows=rows, taps=z)
            return (loss, box.out), stats

        (loss, _), back, stats = jax.vjp(f, outside, stack_sums, has_aux=True)
        g_out, g_stacks = back((jnp.ones_like(loss), stack_sums))
        new = [(p, v.replace(g_stacks[STACKS[p[0]]][p[2:]] if p[0] in in_sums else v.get_value() + g_out[p]))
               for p, v in have.items()]
        return (loss, stats), nnx.from_flat_state(new)

    def train_step(state: State, batch: dict[str, jax.Array]):
        scale = state["loss_scale"]["scale"]
        rows = batch["ids"].shape[0]
        tokens = jnp.maximum(objective.tokens(batch), 1.0)
        key = dropout_key(cfg, state["step"])
        if key is not None:
            # every row's number in the step's batch: its dropout masks follow it through any split
            batch = {**batch, "row": logical.constrain(jnp.arange(rows, dtype=jnp.int32), "batch")}
        # ZeRO-1: the masters gathered to the model's sharding once, for every microbatch
        model_params = gathered(state["params"], msh, low) if gather else state["params"]
        fp32_zeros = lambda: jax.lax.with_sharding_constraint(
            jax.tree.map(lambda v: jnp.zeros(v.shape, jnp.float32), model_params), msh)

        def micro_grads(mb, sums):
            """One microbatch's ((loss * scale, stats), sums + its gradients)."""
            if onefoneb:
                return onefoneb_grads(model_params, state["rest"], mb, tokens, scale, key, sums, rows=rows)
            return into_sums(model_params, state["rest"], mb, tokens, scale, key,
                             fp32_zeros() if sums is None else sums, rows=rows)

        if accum == 1:
            (loss, stats), grads = micro_grads(batch, None)
        else:
            # microbatch a = rows a, a+A, ...: every device keeps the rows it already holds
            micro = jax.tree.map(lambda x: x.reshape(-1, accum, *x.shape[1:]).swapaxes(0, 1), batch)

            def body(carry, mb):         # masks follow mb["row"]
                out, g = micro_grads(mb, carry[1])
                return (jax.tree.map(jnp.add, carry[0], out), jax.lax.with_sharding_constraint(g, msh)), None

            first = jax.tree.map(lambda x: x[0], micro)
            out0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                jax.eval_shape(lambda mb: micro_grads(mb, None)[0], first))
            ((loss, stats), grads), _ = jax.lax.scan(body, (out0, fp32_zeros()), micro)
        grads = jax.lax.with_sharding_constraint(jax.tree.map(lambda g: g / scale, grads), msh)
        if gather:                                         # ZeRO-1: reduce-scattered to the masters' shards
            grads = jax.lax.with_sharding_constraint(grads, zsh)
        loss = loss / scale
        finite = jnp.isfinite(loss) & jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        kept = {k: state[k] for k in ("params", "rest", "opt")}
        grad_norm = optax.tree.norm(grads)                 # the metric's, and the clip's (optim.py)

        def update(_):
            updates, opt = tx.update(grads, state["opt"], state["params"], grad_norm=grad_norm)
            rest = state["rest"]
            if has_moe:
                rest = update_router_bias(rest, stats["load"], stats.get("mtp_load"), cfg.optim.bias_update_rate,
                                          layout)
            return {"params": optax.apply_updates(state["params"], updates), "rest": rest, "opt": opt}

        # A non-finite loss or gradient, in any dtype, leaves params, moments and router biases as
        # they were (the loop counts it: r1jax/train/guard.py). A branch, not a select of the new
        # state against the old: XLA scheduled every leaf's update before the selects, which
        # need the old values too, so the updated params and moments were all live beside the
        # old ones (hidden 256, 16 experts, remat full, AdamW: XLA temp 238.9 -> 164.8 MiB for
        # 82.4 MiB of params, 150.7 with optim.clip_by_global_norm; demo.yaml 652.3 -> 644.7
        # MiB). Every device takes the same branch (`finite` is global), so the clip's norm
        # all-reduce inside it is safe.
        new = jax.lax.cond(finite, update, lambda _: kept, None)
        ls = state["loss_scale"]
        if fp16:
            good = jnp.where(finite, ls["good_steps"] + 1, 0)
            grow = good >= t.loss_scale_growth_interval
            ls = {"scale": jnp.where(finite, jnp.where(grow, ls["scale"] * 2, ls["scale"]), ls["scale"] * 0.5),
                  "good_steps": jnp.where(grow, 0, good)}
        balance = sum(stats[k].sum() for k in ("balance", "mtp_balance") if k in stats)
        metrics = {"loss": loss, **{k: s / jnp.maximum(c, 1.0) for k, (s, c) in stats["metrics"].items()},
                   "balance_loss": balance / rows, "tokens": stats["tokens"],
                   "grad_norm": grad_norm, "param_norm": optax.tree.norm(new["params"]),
                   "lr": lr_schedule(state["step"]), "loss_scale": ls["scale"],
                   "skipped": (~finite).astype(jnp.float32)}
        if has_moe:
            load = stats["load"]
            metrics["expert_imbalance"] = load.max(-1) / jnp.maximum(load.mean(-1), 1e-9)     # [L]
            metrics["dropped_frac"] = stats["dropped"].sum() / jnp.maximum(load.sum(), 1.0)
        new.update(step=state["step"] + 1, loss_scale=ls)
        return new, metrics

    with meshlib.activate(mesh, table):
        return meshlib.MeshedJit(jax.jit(train_step, donate_argnums=0, in_shardings=(shardings, meshlib.batch_sharding(mesh)),
                                         out_shardings=(shardings, meshlib.replicated(mesh))), mesh, table)


def make_eval_step(graphdef, cfg: Config, mesh: Mesh, shardings: State, objective: Objective | None = None):
    """(state, batch) -> the objective's metrics {name: (sum, count)} on the batch, through the
    same forward as training (pipelined when the run is). Build it once per run."""
    objective = objective or objectives.make(cfg)
    layout = pipeline.mesh_layout(cfg, mesh)
    table = meshlib.rules(cfg.mesh)
    msh = statelib.model_shardings(shardings["params"], mesh, table)
    gather = jax.tree.leaves(shardings["params"]) != jax.tree.leaves(msh)

    def eval_step(state, batch):
        params = gathered(state["params"], msh, compute_gather(cfg)) if gather else state["params"]   # ZeRO-1
        model = nnx.merge(graphdef, params, state["rest"])
        return model_loss(model, batch, cfg, layout, objective, 1.0, batch["ids"].shape[0])[1]["metrics"]

    with meshlib.activate(mesh, table):
        return meshlib.MeshedJit(jax.jit(eval_step, in_shardings=(shardings, meshlib.batch_sharding(mesh)),
                                         out_shardings=meshlib.replicated(mesh)), mesh, table)


class Setup(NamedTuple):
    """What `build` returns: a fresh run's state and its jitted train step."""
    mesh: Mesh
    graphdef: Any
    state: State
    shardings: State
    tx: optax.GradientTransformation
    step: Callable
    layout: pipeline.Layout | None


def build(cfg: Config, mesh: Mesh | None = None, model: nnx.Module | None = None,
          tx: optax.GradientTransformation | None = None) -> Setup:
    """A fresh run's state and train step, built as the trainer builds them: parameters born in
    their shards on `mesh` (default: `cfg.mesh` over all devices) in the run's pipeline layout,
    from the config's seed (or from `model`, a model-order model), the optimizer state (`tx`,
    default the config's AdamW) sharded like them. For the benchmarks, the planner's check and
    the tests."""
    mesh = meshlib.make_mesh(cfg.mesh) if mesh is None else mesh
    layout = pipeline.mesh_layout(cfg, mesh)
    graphdef, target = weights.target(cfg, mesh, layout)
    if model is None:
        model_state = weights.fresh(cfg, mesh, layout)
    else:
        model_state = weights.place(target, weights.leaf_getter(nnx.state(model)), layout)
    tx = tx or optim.make(cfg.optim, cfg.train.steps)
    state, shardings = statelib.create(model_state, tx, cfg, mesh)
    return Setup(mesh, graphdef, state, shardings, tx, make_train_step(graphdef, tx, cfg, mesh, shardings), layout)

"""Pipeline parallelism: the MoE stack split into `mesh.pipeline` stages.

What is pipelined: the MoE layers only. The embedding and dense prefix (`Transformer.prologue`)
and the final norm, head, MTP and loss (`epilogue`) run outside the stages, under GSPMD, with
the batch sharded over `pipeline` as well as the batch axes (the `batch` rule, MaxText's way):
each stage computes them for its own 1/P of the rows, not all of them, and each process reads
only the rows its devices hold, so stages may sit in different processes (nodes). Inside the
shard_map the batch is whole over `pipeline` (`logical.spec` leaves manual axes out): stage 0
assembles each microbatch's input at its tick from the stages holding its rows, and (gpipe,
circular) the last stage sends each microbatch's output to them at its tick (`_assemble`,
`_give_back`; under 1f1b the input gradient goes back the same way), so no stage holds all M
microbatches' inputs or outputs, and nothing moves the whole to every stage. Their parameters
are sharded over `pipeline` as over fsdp (the `embed` rules in parallel/mesh.py), so no stage
holds them whole: GSPMD gathers a layer's weights where it runs, as fsdp's.

Layout. The model is always in model order; the layout belongs to the train state. There, the
stack's parameters (and router biases, and their optimizer moments) live in `Layout.slots`
slots along an axis named `stages`, sharded over `pipeline`: `repeats` chunks of `chunk` slots
per device. Virtual stage v = r*P + s (repeat r on device s) holds layers v*chunk ...
v*chunk+chunk-1; slots past the last layer are padding: zero parameters that pass their input
through, so layer counts that do not divide (DeepSeek-V3's 58 MoE layers on 4 stages:
15+15+15+13) need no other handling. Pads get exactly zero gradient and stay zero. `to_slots`
and `to_layers` move a state between the model's order and a layout (at the weights and
checkpoint boundaries); checkpoints hold the slots as they are and record the layout, and
restoring onto another layout reorders (r1jax/checkpoint/).

Schedules (all inside `jax.shard_map`, manual over `pipeline` (1f1b: and `data`); the other axes
stay GSPMD inside each stage):
- gpipe: M microbatches flow through P stages in M+P-1 ticks; autodiff gives the backward.
- circular: R virtual stages per device; stage P-1's output wraps round to stage 0 for the next
  repeat (M >= P). M*R+P-1 ticks of 1/R the work: the bubble shrinks R-fold.
- 1f1b: lock-step, pipeline and data manual: at tick t stage s runs the forward of microbatch
  t-s and the backward of microbatch t-(2P-2-s), each masked when it has none, so every device
  runs the same collectives (a per-stage branch holding GSPMD's fsdp/tensor collectives deadlocks
  on XLA:CPU, whose collectives wait for every device). The backward of a stage is its explicit
  `jax.vjp`, recomputed from the stage input it kept (a ring of 2P-1 inputs, not the residuals
  of all M). The last stage's output is scattered over the stages by rows; each runs the
  epilogue and loss on 1/P of them and the rows' gradients go back to the last stage, which runs
  that microbatch's backward in the same tick, gathering the epilogue's parameters (1/P a stage
  in the loop) for it; the 2P-2 ticks with no microbatch at the last stage skip the epilogue.
  M+2P-2 ticks of one forward and one backward.
Bubble fraction (P-1)/(M*R+P-1) for gpipe and circular (R=1 except circular), (2P-2)/(M+2P-2)
for 1f1b: `bubble()`.

Under `train.grad_accum` the ticks add the stack's gradients into the step's running fp32 sum,
not into a buffer of their own: gpipe and circular carry the sum through the tick loop, whose
transpose then starts its gradient carry from the sum the step seeds; 1f1b starts its tick
loop's gradient sums from it. A tick's stage backward adds each layer's gradients into that
sum itself (`accumulate.scan_into`, under every remat policy), so no tick writes its stage's
gradients out beside the sum (gpipe and circular at grad_accum 1 too, into zeros).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from r1jax import logical
from r1jax.config import Config, Schedule
from r1jax.model import accumulate
from r1jax.model import lora as loralib
from r1jax.model import rope
from r1jax.model.layers import tap
from r1jax.model.transformer import MOE_STACK, scan_blocks
from r1jax.parallel import jax_fixes

jax_fixes.apply()          # expert parallelism inside the stages nests shard_maps (jax_fixes says why)

AXIS = "pipeline"
STACK = "moe_layers"            # the state's top-level key of the pipelined stack
SLOT_AXIS = "stages"            # the logical name of the stack's leading axis in a layout
STAGE_AUX = ("load", "dropped", "balance")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the MoE stack's layers live: `stages` x `repeats` chunks of `chunk` slots."""
    layers: int
    stages: int = 1
    repeats: int = 1

    @property
    def chunk(self) -> int:
        return math.ceil(self.layers / (self.stages * self.repeats))

    @property
    def slots(self) -> int:
        return self.chunk * self.stages * self.repeats

    @functools.cached_property
    def order(self) -> np.ndarray:
        """[slots] the layer each slot holds, -1 for padding."""
        i = np.arange(self.slots)
        s, r, j = i // (self.repeats * self.chunk), (i // self.chunk) % self.repeats, i % self.chunk
        layer = (r * self.stages + s) * self.chunk + j
        return np.where(layer < self.layers, layer, -1)

    @functools.cached_property
    def slot_of(self) -> np.ndarray:
        """[layers] the slot holding each layer."""
        out = np.zeros(self.layers, np.int64)
        out[self.order[self.order >= 0]] = np.flatnonzero(self.order >= 0)
        return out

    @property
    def valid(self) -> np.ndarray:
        return self.order >= 0

    @property
    def identity(self) -> bool:
        return self.slots == self.layers and bool(np.all(self.order == np.arange(self.layers)))

    def to_slots(self, a):
        """[layers, ...] in model order -> [slots, ...] (padding zero)."""
        xp = jnp if isinstance(a, jax.Array) else np
        taken = a[np.maximum(self.order, 0)]
        return xp.where(self.valid.reshape(-1, *[1] * (a.ndim - 1)), taken, xp.zeros_like(taken))

    def to_layers(self, a):
        """[slots, ...] -> [layers, ...] in model order."""
        return a[self.slot_of]

    def meta(self) -> dict:
        return {"layers": self.layers, "stages": self.stages, "repeats": self.repeats}

    @classmethod
    def from_meta(cls, meta: dict) -> "Layout":
        return cls(int(meta["layers"]), int(meta["stages"]), int(meta["repeats"]))


def _is_stack(path: tuple) -> bool:
    return bool(path) and str(getattr(path[0], "key", path[0])) == STACK


def _moved(value, fn, leading: int):
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((leading, *value.shape[1:]), value.dtype)
    return fn(value)


def to_slots(state: nnx.State, layout: Layout | None) -> nnx.State:
    """A model-order state (parameters, router biases, or anything shaped like them; abstract or
    concrete) with the MoE stack's leaves in `layout`'s slots and their leading axis named
    `stages`, so it is sharded over `pipeline`. None: the state as it is."""
    if layout is None:
        return state

    def move(path, v):
        if not _is_stack(path):
            return v
        names = (SLOT_AXIS, *logical.names_of(v)[1:])
        return v.replace(_moved(v.get_value(), layout.to_slots, layout.slots), out_sharding=names)
    return nnx.from_flat_state([(p, move(p, v)) for p, v in nnx.to_flat_state(state)])


def to_layers(state: nnx.State, layout: Layout | None) -> nnx.State:
    """The inverse of `to_slots`: the MoE stack back in model order under its `layers` name."""
    if layout is None:
        return state

    def move(path, v):
        if not _is_stack(path):
            return v
        names = ("layers", *logical.names_of(v)[1:])
        return v.replace(_moved(v.get_value(), layout.to_layers, layout.layers), out_sharding=names)
    return nnx.from_flat_state([(p, move(p, v)) for p, v in nnx.to_flat_state(state)])


def layout_for(cfg: Config, stages: int) -> Layout | None:
    """The MoE stack's layout for `stages` pipeline stages (None: the model has no MoE stack)."""
    if cfg.model.num_moe_layers == 0:
        return None
    repeats = cfg.pipeline.repeats if cfg.pipeline.schedule is Schedule.circular else 1
    return Layout(cfg.model.num_moe_layers, stages, repeats if stages > 1 else 1)


def mesh_layout(cfg: Config, mesh) -> Layout | None:
    """The layout a run on `mesh` keeps the MoE stack in; None without pipeline parallelism."""
    stages = mesh.shape[AXIS]
    return layout_for(cfg, stages) if stages > 1 else None


def bubble(stages: int, microbatches: int, repeats: int = 1, schedule: Schedule = Schedule.gpipe) -> float:
    """Idle fraction of a lockstep schedule: (P-1)/(M*R+P-1) for gpipe and circular; (2P-2)/(M+2P-2)
    for 1f1b, whose every tick costs a forward and a backward (`ticks_1f1b`)."""
    if schedule is Schedule.onefoneb:
        ticks, _ = ticks_1f1b(stages, microbatches)
        return 1 - microbatches / ticks
    return (stages - 1) / (microbatches * repeats + stages - 1)


# ------------------------------------------------------------------------------ helpers
def _vary(x, axes: tuple[str, ...] = (AXIS,)):
    """x marked as varying over the manual `axes` (those it already varies over are skipped)."""
    def one(a):
        missing = tuple(ax for ax in axes if ax not in jax.typeof(a).manual_axis_type.varying)
        return lax.pcast(a, missing, to="varying") if missing else a
    return jax.tree.map(one, x)


def _cpu_sum_dtype(dt):
    """The dtype a sum over the stages runs in: on XLA:CPU fp32 for 16-bit floats, whose
    all-reduce promotion cannot compile them ("Invalid binary instruction opcode copy"). The
    stage sums here add one stage's rows to zeros, exact in any dtype, so GPUs keep `dt`'s bytes."""
    low = jnp.issubdtype(dt, jnp.floating) and jnp.finfo(dt).bits < 32
    return jnp.float32 if low and jax.default_backend() == "cpu" else dt


def _stage_sum(a: jax.Array) -> jax.Array:
    """psum of `a` over the stages, marked varying over them again (its uses are per stage; the
    mark's transpose sums the gradient over the stages), both in `_cpu_sum_dtype`."""
    return _vary(lax.psum(a.astype(_cpu_sum_dtype(a.dtype)), AXIS)).astype(a.dtype)


def _stage_scatter(a: jax.Array) -> jax.Array:
    """psum_scatter of `a` over the stages (rows split), in `_cpu_sum_dtype`."""
    return lax.psum_scatter(a.astype(_cpu_sum_dtype(a.dtype)), AXIS, scatter_dimension=0, tiled=True).astype(a.dtype)


def _split(a: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...], microbatch i = rows i, i+M, ... (each keeps its data shard)."""
    return a.reshape(-1, m, *a.shape[1:]).swapaxes(0, 1)


def _by_stage(x: jax.Array) -> jax.Array:
    """Outside the stages: [B, ...] -> [S, P, B/(S P), ...] (S: the other batch axes), the same
    rows in the same shards as the `batch` rule puts them, with `pipeline` on its own dimension
    for a shard_map to take by stage."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in logical.mesh_axes("batch") if a != AXIS)
    y = x.reshape(math.prod(mesh.shape[a] for a in axes), mesh.shape[AXIS], -1, *x.shape[1:])
    return lax.with_sharding_constraint(y, P(axes or None, AXIS))


def _mb_slots(f, n: int, M: int, r: int):
    """Where microbatch f's rows live outside the stages: (stage, row) of each of its n rows per
    block of the batch axes. Each stage holds r rows [S, r, ...] of the stack's input; microbatch
    f is rows g = f, f+M, ... of a data shard (g = stage r + row), so its slot i is row
    (i M + f) mod r of stage (i M + f) div r. Which stages hold a microbatch's rows depends on f
    (DeepSeek's layout, r = 1 and M = P: microbatch f is stage f's row), so they move as a sum
    over the stages, not by fixed point-to-point pairs."""
    o = jnp.arange(n) * M + f
    return o // r, o % r


def _assemble(own: jax.Array, f, M: int) -> jax.Array:
    """Microbatch f [S n, ...] on every stage, from the rows `own` [S, r, ...] each stage holds:
    a psum of each stage's slots of it (one microbatch over the stages, at the tick that needs
    it, so no stage holds the inputs of all M; not an all_gather, around which XLA's SPMD
    partitioner gathers the data shards in GPipe's partly manual region)."""
    s, Ps = lax.axis_index(AXIS), jax.sharding.get_abstract_mesh().shape[AXIS]
    S, r = own.shape[:2]
    n = Ps * r // M
    j, l = _mb_slots(f, n, M, r)
    mask = (j == s).reshape(1, n, *[1] * (own.ndim - 2))
    mine = jnp.where(mask, jnp.take(own, l, axis=1), jnp.zeros((), own.dtype))
    return _stage_sum(mine).reshape(S * n, *own.shape[2:])


def _give_back(own: jax.Array, v: jax.Array, f, M: int, src: int) -> jax.Array:
    """The inverse of `_assemble`: microbatch f's rows `v` [S n, ...] as held by stage `src`,
    added into the rows `own` [S, r, ...] of the stages they belong to (a psum of the one
    microbatch)."""
    s, Ps = lax.axis_index(AXIS), jax.sharding.get_abstract_mesh().shape[AXIS]
    S, r = own.shape[:2]
    n = Ps * r // M
    j, l = _mb_slots(f, n, M, r)
    full = _stage_sum(jnp.where(s == src, v, jnp.zeros_like(v))).reshape(S, n, *v.shape[1:])
    mask = (j == s).reshape(1, n, *[1] * (own.ndim - 2))
    return own.at[:, l].add(jnp.where(mask, full, jnp.zeros((), full.dtype)))


def _stage_fn(model, graphdef, axes: tuple[str, ...] = (AXIS,)):
    """(w [C,...], valid [C], x, positions, segment_ids, keys [C, 2] | None, rows | None) ->
    (y, aux [C,...]): one stage's layers; under LoRA dropout with its layers' keys (as key data)
    and the microbatch's row numbers. With `sums` (the running fp32 gradient sums of
    w's leaves, which the backward adds each layer's gradients into; `scan_blocks`) it returns
    (y, aux, sums), and with `at` w and the sums are [R, C, ...] and the stage is repeat `at`."""
    cfg, dtype, remat = model.cfg, model.dtype, model.remat

    def stage(w, valid, x, pos, seg, keys=None, rows=None, sums=None, at=None):
        cos, sin = rope.cos_sin(cfg, pos, dtype)
        keys = None if keys is None else jax.random.wrap_key_data(keys)
        with loralib.rows(rows):
            out = scan_blocks(graphdef, w, _vary(x, axes), cos, sin, seg, remat, valid, keys=keys, sums=sums, at=at)
        return (out[0], {k: out[1][k].astype(jnp.float32) for k in STAGE_AUX}, *out[2:])
    return stage


def _dropout_inputs(layout: Layout):
    """LoRA dropout's inputs for a shard_map over the stages, or (None, None) without dropout:
    the base key's data (replicated) and every slot's layer key's data [slots, 2] (sharded over
    `pipeline` like the weights), the keys the model-order stack would give its layers. Keys go
    in as data: a shard_map body must not close over the traced key."""
    ctx = loralib.active()
    if ctx is None:
        return None, None
    keys = jax.random.key_data(loralib.layer_keys(layout.layers, MOE_STACK))
    return jax.random.key_data(ctx[0]), layout.to_slots(keys)


def _dropout_scope(base):
    """Inside the shard_map: the dropout context again, from the base key's data."""
    ctx = loralib.active()
    return loralib.dropout(None if base is None else jax.random.wrap_key_data(base), 0.0 if ctx is None else ctx[1])


def _stack_parts(model, layout: Layout):
    graphdef, state = nnx.split(model.moe_layers.layers)
    return graphdef, state, jnp.asarray(layout.valid)


def _stage_aux(acc: dict, layout: Layout) -> dict:
    """Per-slot sums over microbatches -> model-order aux (all three are sums)."""
    return {k: layout.to_layers(acc[k]) for k in STAGE_AUX}


# ------------------------------------------------------------------------ gpipe, circular
def trunk(model, batch: dict, *, layout: Layout, microbatches: int, stage_remat: bool = False, taps=None
          ) -> tuple[jax.Array, jax.Array, jax.Array, dict]:
    """`Transformer.trunk` over `batch` (ids, positions, segment_ids [B, T]) with the MoE stack
    pipelined (GPipe, or circular when layout.repeats > 1) from its slots in `model`:
    (stack output, positions, segment_ids, the stack's aux in model order), the output's rows
    on the stages that hold them, for the epilogue; differentiable. Equals the model-order
    trunk up to fp32 rounding. `stage_remat`: the backward keeps only each tick's stage input
    and recomputes the stage from it. `taps`: the same model holding fp32 zeros, through which
    the stack's gradients flow (`layers.tap`: summed over the ticks in fp32 when `model` holds a
    compute-dtype copy)."""
    M, Ps, R, C = microbatches, layout.stages, layout.repeats, layout.chunk
    input_ids = batch["ids"]
    x, positions, segment_ids = model.prologue(input_ids, batch["positions"], batch["segment_ids"])
    x = logical.constrain(x, "batch", "seq", "act_embed")     # each stage its own rows, gathered entering the stages
    graphdef, state, valid = _stack_parts(model, layout)
    # the step's running sum of the stack's gradients, which the ticks' stage backward adds into
    # in place (their carry, `accumulate.scan_into`: in fp32, so no taps) and hand on (`Sums.out`)
    running = accumulate.running(MOE_STACK)
    sums = zs = None
    if running is not None:
        sums = running.sums[MOE_STACK]
    elif taps is not None:
        zs, state = _stack_parts(taps, layout)[1], jax.lax.stop_gradient(state)
    stage = _stage_fn(model, graphdef)

    def stage_at(w, zw, sw, valid, r, x, pos, seg, keys, rows):
        """(y, aux, sw): the stage's repeat r, its gradients added into the sums `sw` [R, C, ...]."""
        # repeat r's weights are picked inside: under stage_remat the tick then keeps the whole
        # (loop-invariant) stack once, not a copy of its repeat's slice every tick
        pick = functools.partial(jax.tree.map, lambda a: a[r])
        keys = None if keys is None else keys[r]
        if sw is not None:
            # the stage's own backward walks its layers adding each one's gradients into slice
            # r of the sums (model/accumulate.py): no [C, ...] stage gradient beside the sum;
            # it picks repeat r itself, so the backward keeps the whole stack once, not the
            # repeat's slice every tick
            return stage(w, valid[r], x, pos, seg, keys, rows, sums=sw, at=r)
        w = pick(w) if zw is None else tap(pick(w), pick(zw))
        return (*stage(w, valid[r], x, pos, seg, keys, rows), sw)

    # (prevent_cse is for checkpoints outside a loop; inside the tick scan it only costs)
    run_stage = jax.checkpoint(stage_at, policy=jax.checkpoint_policies.nothing_saveable,
                               prevent_cse=False) if stage_remat else stage_at
    ticks = M * R + Ps - 1

    base, slot_keys = _dropout_inputs(layout)
    rowm = _split(batch["row"], M) if base is not None else None

    def per_device(w, zw, sw, valid, xs, posm, segm, base, keys, rowm):
        with _dropout_scope(base):
            return body(w, zw, sw, valid, xs, posm, segm, keys, rowm)

    def body(w, zw, sw, valid, xs, posm, segm, keys, rowm):
        s = lax.axis_index(AXIS)
        # this stage's rows of the stack's input [S, r, T, D]. Stage 0 assembles microbatch m at
        # tick m and the last stage's output of microbatch m goes to the stages holding its rows
        # at its tick (`_assemble`, `_give_back`): no stage holds all M microbatches' inputs or
        # the outputs of every tick
        own = xs[:, 0]
        x_like = jnp.zeros((posm.shape[1], *own.shape[2:]), own.dtype)        # one microbatch
        w, zw, sw = jax.tree.map(lambda a: a.reshape(R, C, *a.shape[1:]), (w, zw, sw))
        keys = None if keys is None else keys.reshape(R, C, *keys.shape[1:])
        valid = valid.reshape(R, C)
        # circular: an output back at stage 0 waits M-P ticks for its microbatch's next repeat,
        # so a ring of M-P+1 slots holds every one in flight (not all M)
        K = M - Ps + 1
        buf0 = _vary(jnp.zeros((K, *x_like.shape), x_like.dtype)) if R > 1 else None
        aux_shapes = jax.eval_shape(
            lambda: stage(jax.tree.map(lambda a: a[0], w), valid[0], x_like, posm[0], segm[0])[1])
        acc0 = _vary(jax.tree.map(lambda a: jnp.zeros((R, *a.shape), a.dtype), aux_shapes))

        def tick(c, t):
            state, buf, out, acc, sw = c
            k = t - s                                   # the item this stage works on
            active = (k >= 0) & (k < M * R)
            k = jnp.clip(k, 0, M * R - 1)
            m, r = k % M, k // M
            # microbatch t's input, on the M ticks t < M (a function of the tick alone: every
            # device takes the same branch and runs the same collective)
            fresh = lax.cond(t < M, lambda: _vary(_assemble(own, jnp.minimum(t, M - 1), M)),
                             lambda: _vary(jnp.zeros_like(x_like)))
            if R > 1:
                # stage P-1's output of the previous tick (item t-P) is back at stage 0: park it
                # until that microbatch's next repeat, M-P ticks on (stage 0 runs item t, whose
                # previous repeat t-M was parked at tick t-M+P; M = P reads what it just parked)
                slot = (t - Ps) % K
                buf = buf.at[slot].set(jnp.where((s == 0) & (t >= Ps), state, buf[slot]))
                fresh = jnp.where(r == 0, fresh, buf[(t - M) % K])
            x_in = jnp.where(s == 0, fresh, state)
            # the repeat's index. Traced when the stage adds into the sums: with a static one the
            # differentiated step computes the layers' weight-derived arrays once, outside the
            # tick loop (a scan over the stage's layers), and keeps them through it, a copy of
            # the stage's weights (GPipe on pipeline 2 x data 4, hidden 256, 16 experts, batch
            # 16, SGD: XLA temp remat full 141.8 -> 105.8 MiB, remat none 271.1 -> 235.1; the
            # 2-device shape of tests/test_step.py 152.0 -> 116.0). Under plain autodiff (no
            # sums) static, which autodiff keeps once, not a traced slice it keeps every tick.
            at = r if R > 1 or sw is not None else 0
            y, aux, sw = run_stage(w, zw, sw, valid, at, x_in, posm[m], segm[m], keys,
                                   None if rowm is None else rowm[m])
            acc = jax.tree.map(lambda a, b: a.at[r].add(jnp.where(active, b, jnp.zeros_like(b))), acc, aux)
            # the last stage's output of microbatch e (its last repeat), to the stages that hold its rows
            e = t - (Ps - 1) - (R - 1) * M
            out = lax.cond((e >= 0) & (e < M), lambda: _give_back(out, y, jnp.clip(e, 0, M - 1), M, Ps - 1),
                           lambda: out)
            nxt = lax.ppermute(y, AXIS, [(i, (i + 1) % Ps) for i in range(Ps)])
            # (`+ 0`: a carry the body returns as it came in, JAX makes a loop constant, whose
            # gradient starts from zeros)
            return (nxt, buf, out, acc, jax.tree.map(lambda a: a + 0, sw)), None

        (_, _, out, acc, sw), _ = lax.scan(tick, (_vary(x_like), buf0, _vary(jnp.zeros_like(own)), acc0, sw),
                                           jnp.arange(ticks))
        flat = lambda a: a.reshape(R * C, *a.shape[2:])                                 # noqa: E731
        return out[:, None], jax.tree.map(flat, acc), jax.tree.map(flat, sw)

    run = jax.shard_map(per_device, in_specs=(P(AXIS), P(AXIS), P(AXIS), P(AXIS), P(None, AXIS), P(), P(), P(),
                                              P(AXIS), P()),
                        out_specs=(P(None, AXIS), P(AXIS), P(AXIS)), axis_names={AXIS})
    ym, acc, sums = run(state, zs, sums, valid, _by_stage(x), _split(positions, M), _split(segment_ids, M), base,
                        slot_keys, rowm)
    if running is not None:
        running.out[MOE_STACK] = sums
    # each stage goes on with its own rows of the stack's output (the batch over pipeline)
    y = logical.constrain(ym.reshape(-1, *ym.shape[3:]), "batch", "seq", "act_embed")
    return y, positions, segment_ids, _stage_aux(acc, layout)


# ------------------------------------------------------------------------------ 1F1B
def ticks_1f1b(stages: int, microbatches: int) -> tuple[int, int]:
    """(ticks, input ring size) of the lock-step 1F1B: at tick t stage s runs the forward of
    microbatch t-s and the backward of microbatch t-(2P-2-s) (each when it exists), so the last
    stage runs a microbatch's forward, loss and backward in one tick and its gradient reaches
    stage 0 P-1 ticks later: M+2P-2 ticks. Stage s keeps its input of a microbatch from its
    forward to its backward, 2(P-1-s) ticks: a ring of 2P-1 slots is never overwritten early."""
    return microbatches + 2 * stages - 2, 2 * stages - 1


def _key(path: tuple) -> str:
    return "/".join(map(str, path))


def _partition(state: nnx.State):
    """(MoE stack leaves, other leaves) as flat {"a/b/c": array} dicts."""
    flat = {_key(p): v.get_value() for p, v in nnx.to_flat_state(state)}
    return ({k: a for k, a in flat.items() if k.startswith("moe_layers/")},
            {k: a for k, a in flat.items() if not k.startswith("moe_layers/")})


def _pipe_dims(state: nnx.State) -> dict[str, int | None]:
    """{"a/b/c": the dimension the `pipeline` axis splits (None: none)} of each leaf, by its
    logical names under the active rules (outside the stack, `embed` is over fsdp and pipeline)."""
    out = {}
    for p, v in nnx.to_flat_state(state):
        names = logical.names_of(v)
        entries = tuple(logical.spec(*names)) if names and logical.rules_active() else ()
        out[_key(p)] = next((d for d, e in enumerate(entries) if AXIS in logical.axes_of(e)), None)
    return out


def _gather_cast(a: jax.Array, dim: int, dtype) -> jax.Array:
    """A leaf's 1/P share (split over `pipeline` along `dim`) gathered whole in `dtype`; its
    gradient reduce-scattered back in the leaf's own dtype (fp32: the stages' parts summed in
    fp32, as the whole fp32 leaf's gradient was)."""
    @jax.custom_vjp
    def gather(x):
        return lax.all_gather(x.astype(dtype), AXIS, axis=dim, tiled=True)

    def fwd(x):
        return gather(x), None

    def bwd(_, ct):
        return (lax.psum_scatter(ct.astype(a.dtype), AXIS, scatter_dimension=dim, tiled=True),)

    gather.defvjp(fwd, bwd)
    return gather(a)


def _state_of(template: nnx.State, values: dict) -> nnx.State:
    """`template` with its leaves taken from `values` (those it has)."""
    return nnx.from_flat_state([(p, v.replace(values[_key(p)])) for p, v in nnx.to_flat_state(template)
                                if _key(p) in values])


ONEFONEB_MANUAL = (AXIS, "data")


def loss_and_grads_1f1b(graphdef, params: nnx.State, rest: nnx.State, batch: dict, *, layout: Layout,
                        microbatches: int, head_loss, balance_ct: float, scale, mtp: bool = True,
                        sums: nnx.State | None = None):
    """One (grad_accum) microbatch under 1F1B: ((loss * scale, stats), grads of params), or with
    `sums` (grad_accum's running fp32 sum, shaped like params) sums + the grads: the tick loop's
    gradient sums start from it (on one data shard, as the sums over `data` run once, at the
    end), so the stack's gradients are never a second buffer beside it.

    `head_loss(model, y, piece)` -> (loss, stats) is the epilogue and objective of one piece of
    `batch` (some rows of a pipeline microbatch on one data shard; every [B, ...] entry of the
    batch dict is split alike), normalised by whole-step constants so that the pieces' losses
    add; its stats are sums. `balance_ct` is d loss / d(each stack layer's balance sum): the
    balance loss is linear in those sums, so their cotangent is this constant.

    Lock-step (`ticks_1f1b`): every stage runs the same program every tick, one forward, the
    epilogue and one backward, each masked when it has no microbatch, so a collective of the
    axes left to GSPMD inside a stage (fsdp, tensor) is run by every device alike; XLA:CPU's
    in-process collectives wait for every device of the program, and a per-stage branch holding
    one deadlocks. The epilogue (head, MTP, loss) of the last stage's output is shared: the
    output's rows are scattered over the stages, each runs the epilogue's forward and backward
    on 1/P of them, and the rows' gradients are gathered back to the last stage. The parameters
    outside the stack stay 1/P a stage through the ticks (as stored, `embed` over pipeline):
    each tick gathers those its epilogue reads (`mtp`: the MTP blocks and the embedding too) and
    reduce-scatters their gradients into 1/P sums. `pipeline` and `data` are manual; the
    gradient sums over `data` run once, at the end."""
    M, Ps = microbatches, layout.stages
    ticks, ring = ticks_1f1b(Ps, M)
    stack_v, other_v = _partition(params)
    rest_stack, rest_other = _partition(rest)
    model = nnx.merge(graphdef, params, rest)
    # the parts outside the stack enter the ticks as they are stored, 1/P a stage (`embed` over
    # pipeline), and each tick's epilogue gathers those it reads (with `mtp`, the MTP blocks and
    # the embedding too): in the compute dtype where the model casts at use anyway, in fp32 for
    # the router (fp32 routing) and the embedding (its lookup's gradient sums rows in the table's
    # dtype). The memory of one gathered copy at a time, for a gather and a reduce-scatter every
    # tick (plan.py counts both).
    dims = {k: d for k, d in _pipe_dims(params).items() if k in other_v}
    reads = ("final_norm", "lm_head") + (("mtp/", "embed/") if mtp else ())
    gathered = {k for k, d in dims.items() if d is not None and k.startswith(reads)}
    keep = {k for k in other_v if "router" in k or k.startswith("embed")}
    layers_state = nnx.state(model.moe_layers.layers)

    def prologue(other):
        m = nnx.merge(graphdef, _state_of(params, {**stack_v, **other}), rest)
        return m.prologue(batch["ids"], batch["positions"], batch["segment_ids"])[0]

    x, pro_vjp = jax.vjp(prologue, other_v)
    block_gd, _, valid = _stack_parts(model, layout)
    stage = _stage_fn(model, block_gd, ONEFONEB_MANUAL)
    batch_m = {k: _split(v, M) for k, v in batch.items()}

    def block_state(stack, rstack):
        """The stack's per-layer Block state from flat param and bias leaves (local slots)."""
        flat = {k[len("moe_layers/layers/"):]: a for k, a in {**stack, **rstack}.items()}
        return _state_of(layers_state, flat)

    base, slot_keys = _dropout_inputs(layout)

    sum_stack, sum_other = (None, None) if sums is None else _partition(sums)

    def per_device(stack, rstack, other, rother, valid, xs, bm, scale, base, keys, sum_stack, sum_other):
        with _dropout_scope(base):
            return body(stack, rstack, other, rother, valid, xs, bm, scale, keys, sum_stack, sum_other)

    def body(stack, rstack, other, rother, valid, xs, bm, scale, keys, sum_stack, sum_other):
        s = lax.axis_index(AXIS)
        # this stage's rows of the stack's input [S, r, T, D]. Stage 0 assembles microbatch f at
        # tick f and the input gradient goes back to the stages holding its rows at its tick
        # (`_assemble`, `_give_back`): no stage holds all M microbatches' inputs or input gradients.
        own = xs[:, 0]
        mb_rows = own.shape[0] * Ps * own.shape[1] // M

        last = s == Ps - 1
        vary = functools.partial(_vary, axes=ONEFONEB_MANUAL)
        # weights varying over data too: their gradients stay per shard, summed once at the end;
        # the frozen ones too (router biases, LoRA's base weights), which a custom VJP inside
        # (the head's loss) gives a cotangent of the varying rows' type
        stack, other, rstack, rother = vary(stack), vary(other), vary(rstack), vary(rother)
        piece_rows = mb_rows // Ps

        def stage_w(stack_, x, m, sums=None):
            """((y, balance), aux), and the sums (`accumulate.scan_into`) when given."""
            y, aux, *handed = stage(block_state(stack_, rstack), valid, x, bm["positions"][m], bm["segment_ids"][m],
                                    keys, bm["row"][m] if "row" in bm else None, sums=sums)
            return ((y, aux["balance"].sum()), aux, *handed)

        def post(shares, y, m):
            other_ = {k: _gather_cast(a, dims[k], a.dtype if k in keep else model.dtype) if k in gathered else a
                      for k, a in shares.items()}
            mdl = nnx.merge(graphdef, _state_of(params, {**stack, **other_}),
                            _state_of(rest, {**rstack, **rother}))
            piece = {k: lax.dynamic_slice_in_dim(v[m], s * piece_rows, piece_rows) for k, v in bm.items()}
            return head_loss(mdl, y, piece)

        masked = lambda on, t: jax.tree.map(lambda a: jnp.where(on, a, jnp.zeros_like(a)), t)   # noqa: E731
        bal_w = jnp.float32(balance_ct)
        # the stage's backward adds each layer's gradients into the tick loop's sums itself
        # (accumulate.scan_into), instead of writing the stage's [C, ...] gradients out beside
        # them every tick; the recompute is the same (the stage from its input, each layer what
        # the remat policy did not keep). A tick without a microbatch adds zeros: its cotangents
        # are zero and it recomputes a real, kept input (b clipped), so no product is inf or nan
        prefix = "moe_layers/layers/"
        owned = [p for p, _ in nnx.to_flat_state(block_state(stack, rstack)) if prefix + _key(p) in stack]

        def back_into(x, m, ct, dstack):
            def run(xx, sw):
                out, _, sw = stage_w(stack, xx, m, sw)
                return out, sw

            sums = {p: dstack[prefix + _key(p)] for p in owned}
            _, back = jax.vjp(run, x, sums)
            d_x, sums = back((ct, sums))
            return d_x, {**dstack, **{prefix + _key(p): a for p, a in sums.items()}}

        def tick(c, t):
            f, b, e = t - s, t - (2 * Ps - 2 - s), t - (Ps - 1)      # e: the last stage's forward
            on_f, on_b, on_e = (f >= 0) & (f < M), (b >= 0) & (b < M), (e >= 0) & (e < M)
            f, b, e = (jnp.clip(i, 0, M - 1) for i in (f, b, e))
            # forward of microbatch f; its input kept until its backward. Stage 0's input arrives
            # on the M ticks t < M (a function of the tick alone: one branch on every device)
            x0 = lax.cond(t < M, lambda: vary(_assemble(own, jnp.minimum(t, M - 1), M)), lambda: c["recv_f"])
            x_f = jnp.where(s == 0, x0, c["recv_f"])
            # (only a live forward writes the ring: a clipped f past the last microbatch would
            # overwrite microbatch M-1's input before its backward)
            inp = c["inp"].at[f % ring].set(jnp.where(on_f, x_f, c["inp"][f % ring]))
            (y, bal), aux = stage_w(stack, x_f, f)
            def epilogue(_):
                # the epilogue of the last stage's output, 1/P of its rows on each stage
                y_piece = _stage_scatter(jnp.where(last, y, jnp.zeros_like(y)))
                # tied to the tick, so XLA cannot hoist the gathers out of the loop (which would
                # keep the parts whole through every tick)
                shares, _ = lax.optimization_barrier((other, t))
                loss, back, stats = jax.vjp(lambda ot, yy: post(ot, yy, e), shares, y_piece, has_aux=True)
                d_other, d_piece = back(vary(scale))
                return vary((loss, stats, d_other, lax.all_gather(d_piece, AXIS, axis=0, tiled=True)))

            # the 2P-2 ticks without a microbatch at the last stage skip the epilogue (its compute
            # and its gathers): `on_e` is a function of the tick alone, so every device takes the
            # same branch and runs the same collectives
            loss, stats, d_other, dy_last = lax.cond(
                on_e, epilogue, lambda _: vary(zeros(jax.eval_shape(epilogue, None))), None)
            # backward of microbatch b, recomputed from its kept input
            dy = jnp.where(last, dy_last, c["recv_b"])
            acc = c["acc"]
            ct = vary((jnp.where(on_b, dy, jnp.zeros_like(dy)), jnp.where(on_b, bal_w * scale, 0.0)))
            d_x, dstack = back_into(inp[b % ring], b, ct, acc["dstack"])
            acc = {"loss": acc["loss"] + jnp.where(on_e, loss, 0.0) + jnp.where(on_f, bal * bal_w, 0.0),
                   "post": jax.tree.map(jnp.add, acc["post"], masked(on_e, stats)),
                   "aux": jax.tree.map(jnp.add, acc["aux"], masked(on_f, aux)),
                   "dother": jax.tree.map(jnp.add, acc["dother"], masked(on_e, d_other)),
                   "dstack": dstack}
            # stage 0's input gradient of microbatch t-(2P-2), back to the stages that hold its rows
            b0 = t - (2 * Ps - 2)
            dx = lax.cond((b0 >= 0) & (b0 < M), lambda: _give_back(c["dx"], d_x, jnp.clip(b0, 0, M - 1), M, 0),
                          lambda: c["dx"])
            recv_f = lax.ppermute(y, AXIS, [(i, i + 1) for i in range(Ps - 1)])
            recv_b = lax.ppermute(d_x, AXIS, [(i + 1, i) for i in range(Ps - 1)])
            return {"recv_f": recv_f, "recv_b": recv_b, "inp": inp, "dx": dx, "acc": acc}, None

        zeros = lambda shapes: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)   # noqa: E731
        if sum_stack is None:
            d_stack0, d_other0 = jax.tree.map(jnp.zeros_like, stack), jax.tree.map(jnp.zeros_like, other)
        else:
            # a running sum enters once: on data shard 0, and (a leaf summed over the stages too,
            # not split over them) on stage 0
            first = lax.axis_index("data") == 0
            d_stack0 = {k: jnp.where(first, a, jnp.zeros((), a.dtype)) for k, a in sum_stack.items()}
            d_other0 = {k: jnp.where(first & ((s == 0) | (dims[k] is not None)), a, jnp.zeros((), a.dtype))
                        for k, a in sum_other.items()}
        y_like = jnp.zeros((mb_rows, *own.shape[2:]), own.dtype)
        aux_shape = jax.eval_shape(lambda: stage_w(stack, y_like, 0)[1])
        post_shape = jax.eval_shape(lambda: post(other, y_like[:piece_rows], 0)[1])
        carry0 = vary({"recv_f": y_like, "recv_b": y_like, "inp": jnp.zeros((ring, *y_like.shape), y_like.dtype),
                       "dx": jnp.zeros_like(own),
                       "acc": {"loss": jnp.float32(0), "post": zeros(post_shape), "aux": zeros(aux_shape),
                               "dother": d_other0, "dstack": d_stack0}})
        c, _ = lax.scan(tick, carry0, jnp.arange(ticks))
        acc = c["acc"]
        both = ONEFONEB_MANUAL
        # a gathered leaf's gradient is already summed over the stages (its gather's transpose), a
        # share the epilogue does not read has none
        dother = {k: lax.psum(g, "data" if dims[k] is not None else both) for k, g in acc["dother"].items()}
        return (lax.psum(acc["loss"], both), lax.psum(acc["post"], both), lax.psum(acc["aux"], "data"),
                lax.psum(acc["dstack"], "data"), dother, c["dx"][:, None])

    row_spec = P(None, "data")
    share = {k: P(*[AXIS if i == d else None for i in range(d + 1)]) if d is not None else P() for k, d in dims.items()}
    run = jax.shard_map(per_device, in_specs=(P(AXIS), P(AXIS), share, P(), P(AXIS), P("data", AXIS), row_spec, P(),
                                              P(), P(AXIS), P(AXIS), P() if sums is None else share),
                        out_specs=(P(), P(), P(AXIS), P(AXIS), share, P("data", AXIS)), axis_names=set(ONEFONEB_MANUAL))
    loss, post_stats, aux, d_stack, d_other_post, dxs = run(
        stack_v, rest_stack, other_v, rest_other, valid, _by_stage(x), batch_m, scale, base, slot_keys,
        sum_stack, sum_other)
    (d_other_pro,) = pro_vjp(dxs.reshape(-1, *dxs.shape[3:]))
    grads = {**d_stack, **jax.tree.map(jnp.add, d_other_post, d_other_pro)}
    return (loss * scale, {**post_stats, **_stage_aux(aux, layout)}), _state_of(params, grads)

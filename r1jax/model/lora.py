"""LoRA: low-rank adapters beside frozen projections, unmerged in training, merged for export.

An adapter belongs to one HF module (PEFT's unit: `q_a_proj`, `kv_b_proj`, ...) and holds
    a  [*in, r]           the down-projection, on the module's input dims
    b  {weight: [r, *out]} one up-projection per r1jax weight the HF module is made of
so that weight W's update is  dW = scale * a @ b[W]  with scale = alpha / r (alpha / sqrt(r)
with rsLoRA). HF fuses what r1jax keeps apart in two places, and one adapter then serves both
r1jax weights with a shared `a`: `kv_a_proj_with_mqa` (the latent's down-projection `wkv_a_DC`
and the rope key `wk_rope_DR`) and `kv_b_proj` (`wk_b_CNK`, `wv_b_CNV`). That is exactly PEFT's
adapter on the fused module (lora_A [r, in], lora_B [out_1 + out_2, r]), so export is a relayout.

In training the update is never formed: y = x W + scale * (x a) b[W] (`delta`), so the frozen
W gets no weight-gradient matmul at all (XLA drops it: ../shared/notes/posttraining.md measured
2.42e9 against 4.35e9 FLOPs for a merged form). Routed experts are the exception: their
weights feed the dispatch kernels whole, so each expert's W + scale * a_e b_e is formed per
layer (`merged`), one weight-sized temporary, the size of the compute-dtype cast made anyway.

Dropout (`lora.dropout`, training only) is PEFT's: on the adapter's input, y = x W + scale *
(drop(x) a) b[W], one mask per HF module (the fused modules' two r1jax weights share it, as PEFT's
one lora_A sees one dropped input). The train step opens `dropout(key, rate, rows)` around its
forward, with `rows` the batch rows' numbers in the step's batch, and each scanned stack hands
every layer its own key (`layer_keys`): a row's mask is drawn from (step, row, stack, layer,
module) alone, so it does not depend on the mesh (threefry is partitionable), on grad_accum's or
a pipeline's microbatches, or on which stage runs the layer; a pipeline hands its stages the
microbatch's rows (`rows`) and the keys of the layers in their slots.
Routed experts have none: their update is merged into the weights (PEFT's target_parameters
refuse dropout for the same reason).

Parameters are `nnx.LoRAParam`s: the train state's split (r1jax/train/state.py) makes them the
only trainable leaves. `a` starts uniform in +-1/sqrt(fan_in) (PEFT's default) and `b` at zero,
so a fresh adapter leaves the model unchanged. The leaves live under the module that owns the
weights, at `<module>/lora/<target>/a` and `<module>/lora/<target>/b/<weight>`; built inside the
scanned stacks' `nnx.vmap`, they get the `layers` axis like every other leaf.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import zlib
from typing import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from r1jax.config import LoraConfig
from r1jax.logical import variable

RANK = "lora_rank"          # the adapters' rank dimension: never sharded

# (key, rate, rows) while a train step traces its forward; None: no dropout (eval, generation,
# export). rows: the int32 numbers of the batch rows the forward runs on (None: one mask for x)
_DROPOUT: contextvars.ContextVar[tuple[jax.Array, float, jax.Array | None] | None] = contextvars.ContextVar(
    "lora_dropout", default=None)


@contextlib.contextmanager
def dropout(key: jax.Array | None, rate: float, rows: jax.Array | None = None) -> Iterator[None]:
    """Adapter-input dropout at `rate` for the forwards traced inside (no-op for key None or rate
    0); with `rows`, each row of an adapter's input draws its own mask from its number."""
    token = _DROPOUT.set(None if key is None or rate == 0 else (key, rate, rows))
    try:
        yield
    finally:
        _DROPOUT.reset(token)


def active() -> tuple[jax.Array, float] | None:
    """(key, rate) of the dropout the forward being traced runs under, or None."""
    ctx = _DROPOUT.get()
    return None if ctx is None else ctx[:2]


def context() -> tuple[jax.Array, float, jax.Array | None] | None:
    """(key, rate, rows) of the dropout the forward being traced runs under, or None: what
    `dropout(*context())` opens again for a backward traced after the forward's `with` closed."""
    return _DROPOUT.get()


@contextlib.contextmanager
def rows(numbers: jax.Array | None) -> Iterator[None]:
    """The batch rows (their numbers in the step's batch) the forwards inside run on: a pipeline's
    microbatch or piece. A no-op without dropout or without `numbers`."""
    ctx = _DROPOUT.get()
    if ctx is None or numbers is None:
        yield
        return
    with dropout(ctx[0], ctx[1], numbers):
        yield


def layer_keys(n: int, stack: int) -> jax.Array | None:
    """n per-layer dropout keys for stack number `stack` (scanned as xs), or None without dropout."""
    ctx = _DROPOUT.get()
    return None if ctx is None else jax.random.split(jax.random.fold_in(ctx[0], stack), n)


@contextlib.contextmanager
def layer_key(key: jax.Array | None) -> Iterator[None]:
    """Inside a scanned layer: its own key from `layer_keys` (None: leave the context as it is)."""
    if key is None:
        yield
        return
    _, rate, numbers = _DROPOUT.get()
    with dropout(key, rate, numbers):
        yield


def drop_input(x, target: str):
    """x as adapter `target` sees it: dropped with the context's key and rate (x itself outside
    one). With the context's row numbers, row i of x (its leading dimension, or a block of it when
    the rows' tokens are flattened) draws from fold_in(key, its number)."""
    ctx = _DROPOUT.get()
    if ctx is None:
        return x
    key, rate, numbers = ctx
    key = jax.random.fold_in(key, zlib.crc32(target.encode()) & 0x7FFFFFFF)
    if numbers is None:
        keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    else:
        n = numbers.shape[0]
        keep = jax.vmap(lambda r: jax.random.bernoulli(jax.random.fold_in(key, r), 1.0 - rate, (x.size // n,)))(numbers)
        keep = keep.reshape(x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


class Adapter(nnx.Module):
    """One HF module's adapter: `a` over input dims `ins`, a `b` for each output weight."""

    def __init__(self, ins: Sequence[tuple[int, str | None]], outs: Mapping[str, Sequence[tuple[int, str | None]]],
                 lo: LoraConfig, *, rngs: nnx.Rngs, lead: Sequence[tuple[int, str]] = ()):
        r = lo.rank
        fan_in = math.prod(n for n, _ in ins)
        lead_shape, lead_names = tuple(n for n, _ in lead), tuple(k for _, k in lead)
        bound = 1.0 / math.sqrt(fan_in)
        # its own stream (weights.py seeds one), so adding adapters leaves the base weights' draws alone
        self.a = variable(nnx.LoRAParam, jax.random.uniform(
            rngs.lora(), (*lead_shape, *(n for n, _ in ins), r), jnp.float32, -bound, bound),
            (*lead_names, *(k for _, k in ins), RANK))
        self.b = nnx.Dict({w: variable(nnx.LoRAParam, jnp.zeros((*lead_shape, r, *(n for n, _ in o)), jnp.float32),
                                       (*lead_names, RANK, *(k for _, k in o))) for w, o in outs.items()})
        self.scale = lo.scale

    def delta(self, x, weight: str, dense: Callable, dtype, n_in: int = 1):
        """scale * (x a) b[weight]: the adapter's addition to x W, without forming a b."""
        h = dense(x, self.a[...].astype(dtype), n_in)
        return dense(h, self.b[weight][...].astype(dtype)) * jnp.asarray(self.scale, dtype)

    def merged(self, w, weight: str):
        """W + scale * a b[weight] over the leading (expert) dims, in fp32: the weight the kernels
        read (a bf16 base plus an update rounded to bf16 would lose most of a small update)."""
        return w.astype(jnp.float32) + update(self.a[...], self.b[weight][...], w.ndim, self.scale)


def update(a, b, w_ndim: int, scale: float):
    """dW = scale * a @ b for a [*lead, *in, r], b [*lead, r, *out] and W [*lead, *in, *out] (numpy or
    jax arrays alike; the lead dims are stacked layers and experts)."""
    lead = a.ndim + b.ndim - 2 - w_ndim
    r = a.shape[-1]
    A = a.reshape(*a.shape[:lead], -1, r)
    B = b.reshape(*b.shape[:lead], r, -1)
    return (scale * (A @ B)).reshape(*a.shape[:-1], *b.shape[lead + 1:])


def adapters(lo: LoraConfig | None, specs: Mapping[str, tuple], *, rngs: nnx.Rngs, group: str | None = None,
             lead: Sequence[tuple[int, str]] = ()) -> nnx.Dict | None:
    """The `lora` attribute of a module: an Adapter per target in `specs` (target -> (ins, outs))
    that `lo.targets` selects (all of them when it names their `group`: mlp, shared_experts,
    experts); None without LoRA or when none is selected."""
    if lo is None or lo.rank == 0:
        return None
    chosen = {t: s for t, s in specs.items() if (group in lo.targets if group else selected(lo, t))}
    if not chosen:
        return None
    return nnx.Dict({t: Adapter(ins, outs, lo, rngs=rngs, lead=lead) for t, (ins, outs) in chosen.items()})


def selected(lo: LoraConfig, target: str) -> bool:
    """Whether `lo.targets` names `target`. A q_lora_rank=null model has one `q_proj`; the
    default targets' q_a_proj / q_b_proj stand for it there."""
    if target == "q_proj":
        return bool({"q_proj", "q_a_proj", "q_b_proj"} & set(lo.targets))
    return target in lo.targets


def project(module, x, weight: str, dense: Callable, cast: Callable, n_in: int = 1, target: str | None = None):
    """x W for the module's weight `weight`, plus its adapter's update when `target` has one."""
    w = getattr(module, weight)
    y = dense(x, cast(w, module.dtype), n_in)
    lora = getattr(module, "lora", None)
    if lora is not None and target in lora:
        y = y + lora[target].delta(drop_input(x, target), weight, dense, module.dtype, n_in)
    return y


# ------------------------------------------------------------------------- leaves (merge, export)
def is_lora(path: tuple) -> bool:
    return "lora" in tuple(str(p) for p in path)


def base_of(path: tuple) -> tuple | None:
    """The base weight's path of a `b` leaf (<module>/lora/<target>/b/<weight> -> <module>/<weight>)."""
    p = tuple(str(k) for k in path)
    if "lora" not in p or p[-2] != "b":
        return None
    i = p.index("lora")
    return p[:i] + (p[-1],)


def a_of(path: tuple) -> tuple:
    """The `a` leaf's path beside a `b` leaf."""
    p = tuple(str(k) for k in path)
    return p[:-2] + ("a",)


def updates(keys: Sequence[tuple]) -> dict[tuple, tuple[tuple, tuple]]:
    """{base weight path: (a path, b path)} for the LoRA leaves among `keys` (string paths)."""
    out = {}
    for k in keys:
        base = base_of(k)
        if base is not None:
            out[base] = (a_of(k), tuple(str(p) for p in k))
    return out


def merged_getter(get: Callable[[tuple], object], keys: Sequence[tuple], scale: float) -> Callable[[tuple], object]:
    """`get` (by string path) with every adapted weight returned as W + scale * a b: what a LoRA
    checkpoint is as a plain model (orbax-to-hf, init_from, generation). Computed and returned in
    fp32, whatever the base's storage dtype."""
    import numpy as np
    ups = updates(keys)

    def read(path):
        key = tuple(str(p) for p in path)
        w = get(path)
        if key not in ups:
            return w
        a_key, b_key = ups[key]
        w = np.asarray(w)
        d = update(np.asarray(get(a_key), np.float32), np.asarray(get(b_key), np.float32), w.ndim, scale)
        return w.astype(np.float32) + d
    return read


def merged_state(state: nnx.State, scale: float) -> nnx.State:
    """A model state without adapters: each adapted weight replaced by W + scale * a b (fp32), on
    device (GRPO's rollouts run the plain model on a LoRA policy's current weights)."""
    flat = dict(nnx.to_flat_state(state))
    by_key = {tuple(str(k) for k in p): p for p in flat}
    ups = updates(list(by_key))
    out = []
    for p, var in flat.items():
        if is_lora(p):
            continue
        key = tuple(str(k) for k in p)
        if key in ups:
            a, b = (flat[by_key[k]].get_value() for k in ups[key])
            w = var.get_value()
            var = var.replace(w.astype(jnp.float32) + update(a, b, w.ndim, scale))
        out.append((p, var))
    return nnx.from_flat_state(out)

"""Gradient accumulation into one fp32 buffer through the scanned stacks (`train.grad_accum`).

The step keeps a running fp32 sum of the gradients over its microbatches. Autodiff of a scanned
stack would first write a microbatch's weight gradients into a fresh [layers, ...] buffer (JAX's
scan transpose emits them as the loop's outputs, and starts a loop constant's gradient sum from
zeros), and only then add it to the sum: two fp32 copies of the stack's gradients at the end of
every microbatch's backward. Here the stack's backward is written out instead: the forward
takes each layer's VJP under the remat policy (`jax.vjp` of the checkpointed layer: its pullback
holds what the policy keeps, for `remat: full` the layer's input alone) and keeps the pullback's
arrays stacked over the layers, except those computed without the layer's activation (its
weights as they are, or cast, constrained, gathered; its per-layer inputs; the rope tables: read
off a jaxpr of the layer's VJP, `_Derived`), which the backward derives again rather than keeping
a copy per layer, or per pipeline tick. The backward walks the layers in reverse with the
running sum in its carry, calls each layer's pullback (recomputing what the policy did not
keep) and adds that layer's weight gradients into the sum's slice in place. Besides the sum,
one layer's gradients are live at a time, under every remat policy; the train step takes this
path at grad_accum 1 too (into zeros), since autodiff would keep the weight-derived arrays.

The train step (r1jax/train/step.py) opens `into(sums)` around one microbatch's forward: a stack
whose number (`Stack.__call__`'s `stack`) has a sum there runs `scan`, which hands the sum on as
an output (`Sums.out`); the step seeds that output's cotangent with the sum itself, so the
gradient that comes back for it is the sum plus this microbatch's gradients.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from r1jax.model import lora as loralib


class Sums:
    """A microbatch's running sums by stack number ({path in the stack: fp32 [n, ...]}), and the
    sums each stack handed on (`out`)."""

    def __init__(self, sums: dict[int, dict[tuple, jax.Array]]):
        self.sums, self.out = sums, {}


_SUMS: contextvars.ContextVar[Sums | None] = contextvars.ContextVar("r1jax_accumulate", default=None)


@contextlib.contextmanager
def into(sums: dict[int, dict[tuple, jax.Array]]) -> Iterator[Sums]:
    token = _SUMS.set(Sums(sums))
    try:
        yield _SUMS.get()
    finally:
        _SUMS.reset(token)


def running(stack: int) -> Sums | None:
    """The open `into`, when it holds a sum for stack number `stack`."""
    box = _SUMS.get()
    return box if box is not None and stack in box.sums else None


def scan(layer: Callable, flat: dict[tuple, jax.Array], x: jax.Array, xs: Any, env: Any, stack: int,
         checkpoint: Callable = lambda f: f):
    """The stack's forward (x, aux stacked over layers) like `transformer.scan_blocks`, with the
    gradients of the leaves of `flat` ({path in the stack: [n, ...]}, the stack's state) that
    have a sum in the open `into` added to it. `layer(flat_layer, h, xs_i, env) -> (y, aux)`
    runs one layer from its flat state; `checkpoint` wraps it in the remat policy (what each
    layer's backward keeps and what it recomputes); `xs` (integer or otherwise constant
    per-layer inputs) and `env` (arrays every layer reads, e.g. the rope tables: passed, not
    closed over, since the backward is traced after a loop body around the stack has closed)
    get no gradient, nor do the leaves without a sum. Of aux only `balance` (the MoE balance
    loss) carries a gradient."""
    box = _SUMS.get()
    x, aux, box.out[stack] = scan_into(layer, flat, x, xs, env, box.sums[stack], checkpoint=checkpoint)
    return x, aux


def scan_into(layer: Callable, flat: dict[tuple, jax.Array], x: jax.Array, xs: Any, env: Any,
              sums: dict[tuple, jax.Array], at: jax.Array | None = None, checkpoint: Callable = lambda f: f):
    """`scan` with the sums passed in rather than found in an open `into`: (y, aux, sums), where
    the sums come out as they went in and their cotangent goes back with this stack's gradients
    added into it in place. A loop that carries the sums through this (the pipeline's ticks,
    r1jax/parallel/pipeline.py) then adds every run's layer gradients into its one carried sum.
    `at`: `flat` and the sums are [R, n, ...] and this stack's layers are slice `at` of them (a
    circular pipeline's repeat). The slice is taken inside, forward and backward, so what the
    backward keeps is the whole (loop-invariant) `flat`, which a loop around this keeps once,
    not a copy of a traced slice of it every iteration."""
    live = {k: v for k, v in flat.items() if k in sums}
    const = {k: v for k, v in flat.items() if k not in sums}
    # LoRA dropout's context is opened again when the backward is traced, after the forward's
    # `with` has closed: its arrays travel with the inputs (key None: no dropout)
    key, rate, rows = loralib.context() or (None, 0.0, None)
    return _stack(layer, rate, checkpoint, _Kept(), live, const, x, (xs, env), sums, at, (key, rows))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _stack(layer, rate, checkpoint, kept, live, const, x, xs, sums, at, ctx):
    return _forward(layer, rate, live, const, x, xs, at, ctx) + (sums,)


def _slice(at, *trees):
    return trees if at is None else jax.tree.map(lambda a: a[at], trees)


def _forward(layer, rate, live, const, x, xs, at, ctx):
    live, const = _slice(at, live, const)

    def body(h, inp):
        with loralib.dropout(ctx[0], rate, ctx[1]):
            y, aux = layer({**inp[1], **inp[0]}, h, inp[2], xs[1])
        return y, aux

    return jax.lax.scan(body, x, (live, const, xs[0]))


def _layer_vjp(layer, rate, checkpoint, w, cv, h, xi, env, ctx):
    """One layer's ((y, balance), pullback, aux), differentiated in w (its leaves with a sum) and
    h, under the remat policy `checkpoint`: the pullback holds what the policy keeps."""
    def one(w, hh):
        with loralib.dropout(ctx[0], rate, ctx[1]):
            y, aux = layer({**cv, **w}, hh, xi, env)
        return (y, aux["balance"] if "balance" in aux else jnp.float32(0)), aux

    return jax.vjp(checkpoint(one), w, h, has_aux=True)


class _Kept:
    """(One per stack call, passed as a static argument: the custom VJP's residuals must be arrays.)
    Filled in when the forward is traced: the pullback's tree, and which of its arrays the
    backward derives again from the layer's inputs other than its activation (`derive`: the
    weights as they are, or cast, constrained, gathered), so that only the arrays computed from
    the activation are kept per layer. A weight-derived array kept per layer would be a copy of
    the stack's weights, and per pipeline tick one a tick."""
    tree: Any = None
    derive: "_Derived | None" = None


class _Derived:
    """Which leaves of a layer's pullback do not depend on its activation `h` (nor on a traced
    value from outside the layer, nor on an effect), read off a jaxpr of the layer's VJP, and
    that jaxpr cut down to them (dead code removed), which recomputes them from the other inputs.
    A leaf's dependencies are the inputs left after cutting the jaxpr down to that leaf alone:
    the cut goes inside nested jaxprs (the MoE dispatch's shard_map), where a leaf taken from
    every output of an equation that reads `h` anywhere would count the dispatch's weight
    gathers, whose tiles are fixed, as activations and keep them per layer (and per pipeline
    tick: GPipe on pipeline 2 x data 4, hidden 256, 16 experts, batch 16, remat none, the
    stage's index traced: XLA temp 379.4 -> 235.1 MiB)."""

    def __init__(self, fn: Callable, args: tuple, h_at: int, leaves: list):
        from jax._src.interpreters import partial_eval as pe

        closed = jax.make_jaxpr(fn)(*jax.tree.leaves(args))
        self.consts = list(closed.consts)
        outs = closed.jaxpr.outvars
        jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)          # the consts, then the arguments
        dyn = [isinstance(c, jax.core.Tracer) for c in self.consts]
        dyn += [i == h_at for i in range(len(jaxpr.invars) - len(dyn))]
        same = len(outs) == len(leaves) and all(
            v.aval.shape == l.shape and v.aval.dtype == l.dtype for v, l in zip(outs, leaves))

        def derivable(k: int) -> bool:
            cut, used = pe.dce_jaxpr(jaxpr, [j == k for j in range(len(outs))])
            return not cut.effects and not any(u and d for u, d in zip(used, dyn))

        self.mask = [same and derivable(k) for k in range(len(outs))]
        self.jaxpr, self.used = pe.dce_jaxpr(jaxpr, self.mask)

    def __call__(self, args: tuple) -> list:
        flat = [*self.consts, *jax.tree.leaves(args)]
        return jax.core.eval_jaxpr(self.jaxpr, [], *[a for a, u in zip(flat, self.used) if u])


def _stack_fwd(layer, rate, checkpoint, kept, live, const, x, xs, sums, at, ctx):
    xs_, env = xs

    def body(h, inp):
        lv, cv, xi = inp
        (y, _), back, aux = _layer_vjp(layer, rate, checkpoint, lv, cv, h, xi, env, ctx)
        leaves, kept.tree = jax.tree.flatten(back)
        if kept.derive is None:
            args = (lv, cv, h, xi, env, ctx)
            tree = jax.tree.structure(args)

            def leaves_of(*flat):
                return jax.tree.leaves(_layer_vjp(layer, rate, checkpoint, *jax.tree.unflatten(tree, flat))[1])
            kept.derive = _Derived(leaves_of, args, len(jax.tree.leaves((lv, cv))), leaves)
        return y, (aux, [l for l, d in zip(leaves, kept.derive.mask) if not d])

    live_s, const_s = _slice(at, live, const)
    y, (aux, stacked) = jax.lax.scan(body, x, (live_s, const_s, xs_))
    return (y, aux, sums), (live, const, xs, stacked, at, ctx)


def _stack_bwd(layer, rate, checkpoint, kept, res, cts):
    live, const, xs, stacked, at, ctx = res
    live, const = _slice(at, live, const)
    ct_y, ct_aux, ct_sums = cts
    xs_, env = xs
    n = jax.tree.leaves(live)[0].shape[0]

    def body(carry, inp):
        ct_h, acc = carry
        i, lv, cv, xi, st, ct_bal = inp
        # the activation's place is filled by its cotangent (same shape; nothing derived reads it)
        derived, kept_ = iter(kept.derive((lv, cv, ct_h, xi, env, ctx))), iter(st)
        leaves = [next(derived) if d else next(kept_) for d in kept.derive.mask]
        # (a compute-dtype copy's gradient, summed over its uses inside the layer in that dtype as
        # a tapped one's is, `layers.tap`, joins the fp32 sum here)
        g, ct_in = jax.tree.unflatten(kept.tree, leaves)((ct_h, ct_bal))
        acc = {k: _add_at(a, g[k], i if at is None else (at, i)) for k, a in acc.items()}
        return (ct_in, acc), None

    ct_bal = ct_aux["balance"] if "balance" in ct_aux else jnp.zeros((n,), jnp.float32)
    (ct_x, acc), _ = jax.lax.scan(body, (ct_y, ct_sums), (jnp.arange(n), live, const, xs_, stacked, ct_bal),
                                  reverse=True)
    return None, None, ct_x, None, acc, None, None


_stack.defvjp(_stack_fwd, _stack_bwd)


def _add_at(a: jax.Array, g: jax.Array, index) -> jax.Array:
    """`a` with `g` added to its slice at the leading `index` (an int, or a tuple of them), in
    place: a slice read and written back, which XLA does inside the loop's carry."""
    index = index if isinstance(index, tuple) else (index,)
    start = (*index, *(0,) * (a.ndim - len(index)))
    shape = (*(1,) * len(index), *a.shape[len(index):])
    piece = jax.lax.dynamic_slice(a, start, shape) + g.astype(a.dtype).reshape(shape)
    return jax.lax.dynamic_update_slice(a, piece, start)

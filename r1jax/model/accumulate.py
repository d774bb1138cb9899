"""Gradient accumulation into one fp32 buffer through the scanned stacks (`train.grad_accum`).

The step keeps a running fp32 sum of the gradients over its microbatches. Autodiff of a scanned
stack would first write a microbatch's weight gradients into a fresh [layers, ...] buffer (JAX's
scan transpose emits them as the loop's outputs, and starts a loop constant's gradient sum from
zeros), and only then add it to the sum: two fp32 copies of the stack's gradients at the end of
every microbatch's backward. Here the stack's backward is written out instead: it walks the
layers in reverse with the running sum in its carry, recomputes each layer from its saved input
(what `remat: full` saves and recomputes anyway) and adds that layer's weight gradients into
the sum's slice in place. Besides the sum, one layer's gradients are live at a time.

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
from flax import nnx

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


def scan(layer: Callable, flat: dict[tuple, jax.Array], x: jax.Array, xs: Any, env: Any, stack: int):
    """The stack's forward (x, aux stacked over layers) like `transformer.scan_blocks` under
    remat full, with the gradients of the leaves of `flat` ({path in the stack: [n, ...]}, the
    stack's state) that have a sum in the open `into` added to it. `layer(flat_layer, h, xs_i,
    env) -> (y, aux)` runs one layer from its flat state; `xs` (integer or otherwise constant
    per-layer inputs) and `env` (arrays every layer reads, e.g. the rope tables: passed, not
    closed over, since the backward is traced after a loop body around the stack has closed) get
    no gradient, nor do the leaves without a sum. Of aux only `balance` (the MoE balance loss)
    carries a gradient."""
    box = _SUMS.get()
    x, aux, box.out[stack] = scan_into(layer, flat, x, xs, env, box.sums[stack])
    return x, aux


def scan_into(layer: Callable, flat: dict[tuple, jax.Array], x: jax.Array, xs: Any, env: Any,
              sums: dict[tuple, jax.Array], at: jax.Array | None = None):
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
    return _stack(layer, rate, live, const, x, (xs, env), sums, at, (key, rows))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _stack(layer, rate, live, const, x, xs, sums, at, ctx):
    return _forward(layer, rate, live, const, x, xs, at, ctx)[:2] + (sums,)


def _slice(at, *trees):
    return trees if at is None else jax.tree.map(lambda a: a[at], trees)


def _forward(layer, rate, live, const, x, xs, at, ctx):
    live, const = _slice(at, live, const)
    def body(h, inp):
        with loralib.dropout(ctx[0], rate, ctx[1]):
            y, aux = layer({**inp[1], **inp[0]}, h, inp[2], xs[1])
        return y, (h, aux)

    y, (hs, aux) = jax.lax.scan(body, x, (live, const, xs[0]))
    return y, aux, hs


def _stack_fwd(layer, rate, live, const, x, xs, sums, at, ctx):
    y, aux, hs = _forward(layer, rate, live, const, x, xs, at, ctx)
    return (y, aux, sums), (live, const, xs, hs, at, ctx)


def _stack_bwd(layer, rate, res, cts):
    live, const, xs, hs, at, ctx = res
    live, const = _slice(at, live, const)
    ct_y, ct_aux, ct_sums = cts
    n = hs.shape[0]

    def body(carry, inp):
        ct_h, acc = carry
        i, lv, cv, xi, h, ct_bal = inp

        def one(w, hh):
            with loralib.dropout(ctx[0], rate, ctx[1]):
                y, aux = layer({**cv, **w}, hh, xi, env)
            return (y, aux["balance"] if "balance" in aux else jnp.float32(0)), None

        # (a compute-dtype copy's gradient, summed over its uses inside the layer in that dtype as
        # a tapped one's is, `layers.tap`, joins the fp32 sum here)
        _, back, _ = jax.vjp(one, lv, h, has_aux=True)
        g, ct_in = back((ct_h, ct_bal))
        acc = {k: _add_at(a, g[k], i if at is None else (at, i)) for k, a in acc.items()}
        return (ct_in, acc), None

    ct_bal = ct_aux["balance"] if "balance" in ct_aux else jnp.zeros((n,), jnp.float32)
    xs, env = xs
    (ct_x, acc), _ = jax.lax.scan(body, (ct_y, ct_sums), (jnp.arange(n), live, const, xs, hs, ct_bal), reverse=True)
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


def routed(state, sums: dict[tuple, jax.Array]):
    """`state` (an nnx.State) with the gradient of each leaf that has a sum in `sums` ({path in
    the state: array}) handed to that sum instead, cast to its dtype (`_route`). A loop that
    carries the sums (the pipeline's ticks, r1jax/parallel/pipeline.py) then adds every tick's
    gradients into them in place: the transposed loop's carry starts from the sums' cotangent,
    which the step seeds with the running sum, where a loop constant's gradient starts from
    zeros. The values are `state`'s: the forward never reads a sum."""
    return nnx.from_flat_state([(p, v.replace(_route(v.get_value(), sums[p])) if p in sums else v)
                                for p, v in nnx.to_flat_state(state)])


@jax.custom_jvp
def _route(w, s):
    return w


@_route.defjvp
def _route_jvp(primals, tangents):
    # the primal out is `w` itself; the tangent is the sum's alone (linear), so the transpose
    # hands `w`'s cotangent to the sum, in the sum's dtype
    w, s = primals
    return w, tangents[1].astype(w.dtype)

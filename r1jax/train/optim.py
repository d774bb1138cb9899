"""AdamW with linear warmup then cosine decay to a floor, global-norm clipping (a multiply by
one scalar: `clip_by_global_norm`), and a weight decay mask that leaves norms and biases alone.

`optim.moment_dtype=bf16` stores both Adam moments in bf16, as DeepSeek-V3 trained: each step
reads them, updates them and computes the step in fp32, and rounds them back to bf16 (optax
keeps mu in `mu_dtype` and nu in the dtype its state was created with). The state keeps its
structure, so checkpoints of either kind have the same tree."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from r1jax.config import DType, OptimConfig

MOMENT_DTYPES = {DType.fp32: jnp.float32, DType.bf16: jnp.bfloat16}

# module names whose `weight` is an RMSNorm scale, and the attention biases: never decayed
NORMS = {"input_norm", "post_attn_norm", "final_norm", "q_norm", "kv_norm", "enorm", "hnorm"}
BIASES = {"bq_a_Q", "bkv_a_C", "bk_rope_R", "bo_D"}


def schedule(o: OptimConfig, steps: int) -> optax.Schedule:
    warmup = int(round(o.warmup_ratio * steps))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1),
        end_value=o.lr * o.min_lr_ratio)


def decays(path: tuple) -> bool:
    """Decay weight matrices; not norm scales (stacked ones are 2-D, so decide by name) or biases."""
    names = {str(getattr(k, "key", getattr(k, "name", k))) for k in path}
    return not (names & NORMS or names & BIASES)


def decay_mask(params):
    return jax.tree_util.tree_map_with_path(lambda p, _: decays(p), params)


def _moments_in(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`tx` whose Adam second moment starts (and so stays) in `dtype`."""
    def init(params):
        def cast(s):
            if isinstance(s, optax.ScaleByAdamState):
                return s._replace(nu=jax.tree.map(lambda a: a.astype(dtype), s.nu))
            return s
        return jax.tree.map(cast, tx.init(params), is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
    return optax.GradientTransformation(init, tx.update)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm as a multiply by one scalar (max_norm / norm when the norm is
    larger). optax divides every gradient by the norm; XLA counts a divide as expensive and will
    not recompute it inside each of its consumers (Adam's mu and nu updates), so the clipped
    gradients of every leaf were written out whole before any moment was updated: a second
    gradient-sized buffer at the step's update (hidden 256, 16 experts, remat full, 1 device:
    XLA temp 164.8 -> 150.7 MiB; tests/test_step.py). Rounding differs from optax's by an ulp;
    torch's clip_grad_norm_ multiplies too. `grad_norm` (optax's extra arguments, passed through
    `optax.chain`): the updates' norm when the caller has it already; the train step computes it
    once for its metric, and a second reduction over every gradient would read them all again."""
    def update(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda t: t * factor.astype(t.dtype), updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def make(o: OptimConfig, steps: int) -> optax.GradientTransformation:
    dtype = MOMENT_DTYPES[o.moment_dtype]
    adamw = optax.adamw(schedule(o, steps), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                        mask=decay_mask, mu_dtype=None if dtype == jnp.float32 else dtype)
    if dtype != jnp.float32:
        adamw = _moments_in(adamw, dtype)
    return optax.chain(clip_by_global_norm(o.clip_norm), adamw) if o.clip_norm > 0 else adamw

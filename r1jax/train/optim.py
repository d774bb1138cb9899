"""AdamW with linear warmup then cosine decay to a floor, global-norm clipping, and a weight
decay mask that leaves norms and biases alone."""
from __future__ import annotations

import jax
import optax

from r1jax.config import OptimConfig

# module names whose `weight` is an RMSNorm scale, and the attention biases: never decayed
NORMS = {"input_norm", "post_attn_norm", "final_norm", "q_norm", "kv_norm", "enorm", "hnorm"}
BIASES = {"bq_a_Q", "bkv_a_C", "bo_D"}


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


def make(o: OptimConfig, steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(schedule(o, steps), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                        mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw) if o.clip_norm > 0 else adamw

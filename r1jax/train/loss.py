"""Language-model losses over packed rows: next-token cross-entropy, the MTP losses and the
sequence-wise MoE balance loss.

Targets never cross a document boundary: position t predicts token t+s only when both lie in
the same non-zero segment (segment 0 is padding). With one segment per row this is HF's
`ForCausalLMLoss` (mean over B*(T-1) positions). Logits and losses are float32.

Losses are kept as (sum, count) pairs so that microbatches (gradient accumulation) can be
normalised by the whole batch's token counts, which makes A microbatches equal one big batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from r1jax.model import Output


def shifted_targets(ids_BT: jax.Array, segment_ids_BT: jax.Array, shift: int):
    """(targets, valid): targets[t] = ids[t+shift], valid where that token exists in t's segment."""
    T = ids_BT.shape[1]
    targets = jnp.roll(ids_BT, -shift, axis=1)
    same = jnp.roll(segment_ids_BT, -shift, axis=1) == segment_ids_BT
    valid = (jnp.arange(T) < T - shift)[None, :] & same & (segment_ids_BT != 0)
    return targets, valid


def cross_entropy_sum(logits_BTV: jax.Array, targets_BT: jax.Array, valid_BT: jax.Array):
    """(sum of -log p(target) over valid positions, number of valid positions), both float32."""
    logits = logits_BTV.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
    w = valid_BT.astype(jnp.float32)
    return jnp.sum((logz - picked) * w), jnp.sum(w)


def target_counts(segment_ids_BT: jax.Array, mtp_depth: int) -> jax.Array:
    """Valid targets per loss: [1 + D] float32 (main, then MTP depth 1..D); no model needed."""
    dummy = jnp.zeros_like(segment_ids_BT)
    return jnp.stack([shifted_targets(dummy, segment_ids_BT, s)[1].sum().astype(jnp.float32)
                      for s in range(1, mtp_depth + 2)])


def loss_sums(out: Output, ids_BT: jax.Array, segment_ids_BT: jax.Array) -> jax.Array:
    """Summed cross-entropies [1 + D]: main next-token loss, then MTP depth k (predicts t+k+1)."""
    sums = [cross_entropy_sum(out.logits, *shifted_targets(ids_BT, segment_ids_BT, 1))[0]]
    if out.mtp_logits is not None:
        for k in range(out.mtp_logits.shape[0]):
            sums.append(cross_entropy_sum(out.mtp_logits[k], *shifted_targets(ids_BT, segment_ids_BT, k + 2))[0])
    return jnp.stack(sums)


def combine(sums: jax.Array, counts: jax.Array, mtp_weight: float) -> jax.Array:
    """L = L_main + lambda * mean_k L_mtp^k (DeepSeek-V3 eq. 25) from per-loss sums and counts."""
    means = sums / jnp.maximum(counts, 1.0)
    return means[0] + (mtp_weight * jnp.mean(means[1:]) if means.shape[0] > 1 else 0.0)


def lm_losses(out: Output, ids_BT: jax.Array, segment_ids_BT: jax.Array) -> dict[str, jax.Array]:
    """{'lm': main loss, 'mtp': mean over depths (0 without MTP), 'mtp_k': per depth, 'tokens'}."""
    depth = 0 if out.mtp_logits is None else out.mtp_logits.shape[0]
    sums, counts = loss_sums(out, ids_BT, segment_ids_BT), target_counts(segment_ids_BT, depth)
    means = sums / jnp.maximum(counts, 1.0)
    losses = {"lm": means[0], "tokens": counts[0], "mtp": jnp.mean(means[1:]) if depth else jnp.float32(0.0)}
    losses.update({f"mtp_{k}": means[k] for k in range(1, depth + 1)})
    return losses


def total_loss(losses: dict[str, jax.Array], mtp_weight: float) -> jax.Array:
    return losses["lm"] + mtp_weight * losses["mtp"]

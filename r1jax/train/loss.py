"""Language-model losses over packed rows: next-token cross-entropy and the MTP losses.

Targets never cross a document boundary: position t predicts token t+s only when both lie in
the same non-zero segment (segment 0 is padding). With one segment per row this is HF's
`ForCausalLMLoss` (mean over B*(T-1) positions). Logits and the loss are float32.
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


def lm_losses(out: Output, ids_BT: jax.Array, segment_ids_BT: jax.Array) -> dict[str, jax.Array]:
    """{'lm': main next-token loss, 'mtp': mean over depths (0 without MTP), 'mtp_k': per depth}."""
    total, count = cross_entropy_sum(out.logits, *shifted_targets(ids_BT, segment_ids_BT, 1))
    losses = {"lm": total / jnp.maximum(count, 1.0), "tokens": count}
    mtp = []
    if out.mtp_logits is not None:
        for k in range(out.mtp_logits.shape[0]):      # depth k+1 predicts token t+k+2
            s, n = cross_entropy_sum(out.mtp_logits[k], *shifted_targets(ids_BT, segment_ids_BT, k + 2))
            mtp.append(s / jnp.maximum(n, 1.0))
            losses[f"mtp_{k + 1}"] = mtp[-1]
    losses["mtp"] = jnp.mean(jnp.stack(mtp)) if mtp else jnp.float32(0.0)
    return losses


def total_loss(losses: dict[str, jax.Array], mtp_weight: float) -> jax.Array:
    """L = L_main + lambda * mean_k L_mtp^k (DeepSeek-V3 eq. 25)."""
    return losses["lm"] + mtp_weight * losses["mtp"]

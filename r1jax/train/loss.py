"""Cross-entropy over packed rows, the building block of the objectives (objectives.py).

Targets never cross a document boundary: position t predicts token t+s only when both lie in
the same non-zero segment (segment 0 is padding). With one segment per row this is HF's
`ForCausalLMLoss` (mean over B*(T-1) positions). Logits and losses are float32, and kept as
(sum, count) so that microbatches and shards add before the one division.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def shifted_targets(ids_BT: jax.Array, segment_ids_BT: jax.Array, shift: int):
    """(targets, valid): targets[t] = ids[t+shift], valid where that token exists in t's segment."""
    T = ids_BT.shape[1]
    targets = jnp.roll(ids_BT, -shift, axis=1)
    same = jnp.roll(segment_ids_BT, -shift, axis=1) == segment_ids_BT
    valid = (jnp.arange(T) < T - shift)[None, :] & same & (segment_ids_BT != 0)
    return targets, valid


def cross_entropy_sum(logits_BTW: jax.Array, targets_BT: jax.Array, valid_BT: jax.Array):
    """(sum of -log p(target) over valid positions, number of valid positions), both float32."""
    logits = logits_BTW.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
    w = valid_BT.astype(jnp.float32)
    return jnp.sum((logz - picked) * w), jnp.sum(w)

"""The objectives the train step runs, against cross-entropy written out in NumPy: next-token +
MTP (every depth over the main loss's target count, as DeepSeek-V3's 1/T), and the masked
variant (only targets where batch["loss_mask"] is set); `tokens(batch)` is the denominator the
objective itself reports, from the batch alone."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from r1jax.model import Output
from r1jax.train.objectives import NextToken

B, T, W, D = 3, 12, 17, 2


def _case(seed=0):
    r = np.random.default_rng(seed)
    ids = r.integers(0, W, (B, T)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    seg[0, 7:] = 2                       # two documents in row 0
    seg[2, 9:] = 0                       # padding at the end of row 2
    mask = (r.random((B, T)) < 0.6).astype(np.int32)
    out = Output(jnp.asarray(r.normal(size=(B, T, W)), jnp.float32),
                 jnp.asarray(r.normal(size=(D, B, T, W)), jnp.float32), {})
    return ids, seg, mask, out


def _ce(logits, ids, seg, shift, mask=None):
    """(sum, count) of -log softmax(logits[t])[ids[t+shift]] over t whose target is in t's segment."""
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    s = n = 0.0
    for b in range(B):
        for t in range(T - shift):
            if seg[b, t] == 0 or seg[b, t + shift] != seg[b, t] or (mask is not None and not mask[b, t + shift]):
                continue
            s -= logp[b, t, ids[b, t + shift]]
            n += 1
    return s, n


@pytest.mark.parametrize("masked", [False, True])
def test_next_token_and_mtp_equal_numpy(masked):
    ids, seg, mask, out = _case()
    batch = {"ids": jnp.asarray(ids), "segment_ids": jnp.asarray(seg), "loss_mask": jnp.asarray(mask)}
    obj = NextToken(mtp_weight=0.3, mtp_depth=D, masked=masked)
    loss_sum, tokens, metrics = obj(out, batch)
    m = mask if masked else None
    main = _ce(np.asarray(out.logits), ids, seg, 1, m)
    depths = [_ce(np.asarray(out.mtp_logits[k]), ids, seg, k + 2, m) for k in range(D)]
    want = main[0] + 0.3 / D * sum(s for s, _ in depths)
    assert float(tokens) == main[1] == float(obj.tokens(batch))
    np.testing.assert_allclose(float(loss_sum), want, rtol=1e-6)
    np.testing.assert_allclose([float(x) for x in metrics["lm_loss"]], main, rtol=1e-6)
    np.testing.assert_allclose([float(x) for x in metrics["mtp_loss"]],
                               [sum(s for s, _ in depths), sum(n for _, n in depths)], rtol=1e-6)
    if masked:
        assert main[1] < _ce(np.asarray(out.logits), ids, seg, 1)[1]      # the mask removed targets


def test_an_all_ones_mask_is_the_plain_objective():
    ids, seg, _, out = _case(1)
    batch = {"ids": jnp.asarray(ids), "segment_ids": jnp.asarray(seg), "loss_mask": jnp.ones((B, T), jnp.int32)}
    plain = NextToken(mtp_depth=D)(out, batch)
    masked = NextToken(mtp_depth=D, masked=True)(out, batch)
    assert float(plain[0]) == float(masked[0]) and float(plain[1]) == float(masked[1])
    assert NextToken(mtp_depth=0).mtp is False and NextToken(masked=True).needs == ("loss_mask",)

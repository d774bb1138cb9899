"""Sampling: the filters keep exactly the tokens transformers' warpers keep, draws follow the
softmax (chi-square), excluded tokens never appear, parameters are per-row arrays (no
recompile for new values), and a draw depends only on (seed, token index)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from jax.extend.random import threefry_2x32

from r1jax.infer.sampling import Sampling, argmax, filtered_logits, logprobs, sample, threefry2x32

W = 50


def _rows(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None):
    full = lambda v, dt: jnp.full((n,), v, dt)
    seeds = jnp.arange(n, dtype=jnp.uint32) if seed is None else full(seed, jnp.uint32)
    return Sampling(full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                    full(min_p, jnp.float32), seeds)


def _hf_kept(logits, temperature, top_k, top_p, min_p):
    scores = torch.as_tensor(logits)
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    for make, on in ((lambda: TemperatureLogitsWarper(temperature), temperature != 1.0),
                     (lambda: TopKLogitsWarper(top_k), top_k > 0), (lambda: TopPLogitsWarper(top_p), top_p < 1.0),
                     (lambda: MinPLogitsWarper(min_p), min_p > 0)):
        if on:
            scores = make()(ids, scores)
    return np.isfinite(scores.numpy())


@pytest.mark.parametrize("params", [dict(temperature=0.7, top_k=5), dict(top_p=0.8), dict(temperature=1.3, top_p=0.5),
                                    dict(min_p=0.1), dict(temperature=0.6, top_k=20, top_p=0.9, min_p=0.05)])
def test_filters_keep_what_transformers_keeps(params):
    logits = np.random.default_rng(0).normal(size=(64, W)).astype(np.float32) * 2
    full = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | params
    ours = np.isfinite(np.asarray(filtered_logits(jnp.asarray(logits), _rows(64, **full))))
    np.testing.assert_array_equal(ours, _hf_kept(logits, **full))


def test_draws_follow_the_softmax():
    """5,000 first-token draws at temperature 1, one seed each, against softmax(logits)."""
    n = 6000
    logits = np.linspace(-1.5, 1.5, 12).astype(np.float32)
    draws = np.asarray(jax.jit(sample)(jnp.asarray(np.tile(logits, (n, 1))), _rows(n), jnp.zeros(n, jnp.int32)))
    counts = np.bincount(draws, minlength=12)
    p = np.exp(logits) / np.exp(logits).sum()
    chi = stats.chisquare(counts, p * n)
    print(f"chi-square over {n} draws: p = {chi.pvalue:.3f}")
    assert chi.pvalue > 0.01


@pytest.mark.parametrize("params", [dict(top_k=3), dict(top_p=0.6), dict(min_p=0.3), dict(top_k=8, top_p=0.7)])
def test_filtered_draws_never_leave_the_kept_set(params):
    n = 4000
    logits = np.random.default_rng(1).normal(size=(1, W)).astype(np.float32) * 1.5
    full = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | params
    kept = _hf_kept(logits, **full)[0]
    draws = np.asarray(jax.jit(sample)(jnp.asarray(np.tile(logits, (n, 1))), _rows(n, **full), jnp.zeros(n, jnp.int32)))
    assert kept[draws].all()
    assert len(set(draws.tolist())) == kept.sum()           # and every kept token does appear


def test_parameters_are_arrays_and_draws_are_keyed_by_seed_and_index():
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda ev, d, **kw: compiles.append(ev) if ev == "/jax/core/compile/backend_compile_duration" else None)
    f = jax.jit(sample)
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(4, W)), jnp.float32)
    rows = [_rows(4, temperature=0.8, top_p=0.9, seed=7), _rows(4, temperature=1.7, top_k=4, min_p=0.2, seed=7),
            _rows(4, temperature=0.0)]
    index = [jnp.full(4, 3, jnp.int32), jnp.full(4, 4, jnp.int32), jnp.zeros(4, jnp.int32)]
    a = f(logits, rows[0], index[0])
    n0 = len(compiles)
    b = f(logits, rows[1], index[0])
    same = f(logits, rows[0], index[0])
    other = f(logits, rows[0], index[1])
    greedy = f(logits, rows[2], index[2])
    assert len(compiles) == n0, "a new sampling value recompiled"
    assert (np.asarray(a) == np.asarray(same)).all()
    assert not (np.asarray(a) == np.asarray(other)).all() or not (np.asarray(a) == np.asarray(b)).all()
    np.testing.assert_array_equal(np.asarray(greedy), np.argmax(np.asarray(logits), -1))


def test_logprobs_are_the_raw_log_softmax():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(3, W)), jnp.float32)
    tok = jnp.asarray([4, 9, 0], jnp.int32)
    chosen, top_ids, top_lp = logprobs(logits, tok, 5)
    ref = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose(np.asarray(chosen), np.asarray(ref)[np.arange(3), [4, 9, 0]], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(top_ids), np.argsort(-np.asarray(ref), -1)[:, :5])
    assert (np.diff(np.asarray(top_lp), axis=-1) <= 0).all()


@pytest.mark.parametrize("width,chunk", [(50, 256), (1000, 256), (1024, 256), (1000, 7), (32000, 256)])
def test_chunked_argmax_is_jnp_argmax(width, chunk):
    """The first index of the maximum, as jnp.argmax: ties (placed in different chunks and in one
    chunk), rows of -inf, and widths that are no multiple of the chunk."""
    r = np.random.default_rng(width)
    z = r.normal(size=(6, width)).astype(np.float32)
    z[1, [width - 1, 3]] = 9.0                      # a tie across chunks: the first wins
    z[2, [width // 2, width // 2 + 1]] = 9.0        # a tie inside one chunk
    z[3] = -np.inf
    z[4, width - 1] = 50.0                          # the maximum in the last, partial chunk
    z = z.astype(np.float32)
    got = jax.jit(lambda z: argmax(z, chunk))(jnp.asarray(z))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(z), -1)))
    assert got.dtype == jnp.int32


def test_threefry_is_jax_threefry():
    """The sampler's written-out Threefry-2x32 gives jax's own threefry words bit for bit."""
    r = np.random.default_rng(5)
    for _ in range(4):
        key = r.integers(0, 2 ** 32, 2, dtype=np.uint32)
        count = r.integers(0, 2 ** 32, 256, dtype=np.uint32)
        want = np.asarray(threefry_2x32(jnp.asarray(key), jnp.asarray(count)))   # halves as (x0, x1)
        x0, x1 = jax.jit(threefry2x32)(key[0], key[1], count[:128], count[128:])
        np.testing.assert_array_equal(np.concatenate([np.asarray(x0), np.asarray(x1)]), want)


def test_two_stage_draws_follow_the_filtered_softmax():
    """Chunk, then token inside it: the draws over 700 logits (22 chunks of 32, the last one
    partial) at temperature 0.8 and top-p 0.9 follow softmax of the filtered logits (chi-square
    over the tokens expected 5+ times, the rest pooled) and stay in the kept set."""
    n, width = 60000, 700
    logits = np.random.default_rng(6).normal(size=(1, width)).astype(np.float32) * 1.5
    rows = _rows(n, temperature=0.8, top_p=0.9)
    z = np.asarray(filtered_logits(jnp.asarray(logits), _rows(1, temperature=0.8, top_p=0.9)))[0]
    draws = np.asarray(jax.jit(sample)(jnp.asarray(np.tile(logits, (n, 1))), rows, jnp.full(n, 3, jnp.int32)))
    assert np.isfinite(z[draws]).all()
    p = np.exp(z.astype(np.float64) - z.max())
    p /= p.sum()
    counts = np.bincount(draws, minlength=width)
    big = p * n >= 5
    small = (p > 0) & ~big
    obs = np.append(counts[big], counts[small].sum()) if small.any() else counts[big]
    exp = (np.append(p[big], p[small].sum()) if small.any() else p[big]) * n
    exp *= obs.sum() / exp.sum()
    chi = stats.chisquare(obs, exp)
    print(f"chi-square over {n} draws, {big.sum()} tokens{' + pooled' if small.any() else ''}: p = {chi.pvalue:.3f}")
    assert chi.pvalue > 0.01

"""The generator's behaviour on tiny.yaml: batching never changes a row's output, finished rows
stop, steady-state generation does not recompile, speculative decoding gives the same tokens,
log-probs are the model's, stop strings cut on whole characters and streaming equals the final
text, and sharded meshes give the one-device tokens."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from r1jax import config as configlib
from r1jax import weights
from r1jax.config import DType, InferConfig
from r1jax.data import tokenizer as toklib
from r1jax.infer.generator import Generator, Request, Stream
from r1jax.parallel import mesh as meshlib

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# one cache length for every test, so the tests share compiled steps
FP32 = InferConfig(cache_dtype=DType.fp32, batch_size=4, decode_chunk=4, max_len=64)


@pytest.fixture(scope="module")
def tiny():
    m = configlib.load(ROOT / "configs" / "tiny.yaml", ["mesh.data=1"]).model
    model = weights.create(m, seed=3)
    return m, model, nnx.state(model)


@pytest.fixture(scope="module")
def gen(tiny):
    m, _, state = tiny
    return Generator(m, state, FP32, eos_id=None)


def _prompts(m, lengths, seed=0):
    r = np.random.default_rng(seed)
    return [tuple(int(t) for t in r.integers(3, m.vocab_size, n)) for n in lengths]


def _compiles():
    seen = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda ev, d, **kw: seen.append(ev) if ev == "/jax/core/compile/backend_compile_duration" else None)
    return seen


def test_a_row_never_depends_on_its_batch_and_finished_rows_stop(tiny, gen):
    m, model, _ = tiny
    prompts = _prompts(m, (5, 16, 2, 11))
    reqs = [Request(prompts[0], max_new_tokens=9), Request(prompts[1], max_new_tokens=3),
            Request(prompts[2], max_new_tokens=9, temperature=0.9, top_p=0.95, seed=11),
            Request(prompts[3], max_new_tokens=6, temperature=1.2, top_k=20, seed=5)]
    together = gen.generate(reqs)
    alone = [gen.generate([r])[0] for r in reqs]
    assert [c.completion_ids for c in together] == [c.completion_ids for c in alone]
    assert [c.completion_tokens for c in together] == [9, 3, 9, 6]
    assert all(c.finish_reason == "length" for c in together)
    # greedy rows are the argmax of the training forward over the growing sequence (right-padded
    # to one length: causal attention keeps the pads out of the positions that count)
    forward = jax.jit(lambda ids: model(ids).logits[0])
    for r, c in zip(reqs[:2], together):
        ids = list(r.prompt_ids)
        for _ in range(r.max_new_tokens):
            ids.append(int(jnp.argmax(forward(jnp.asarray([ids + [0] * (32 - len(ids))], jnp.int32))[len(ids) - 1])))
        assert ids[len(r.prompt_ids):] == c.completion_ids
    # a stop token ends its row only; the row's text so far is kept with the stop token
    stop_at = together[0].completion_ids[4]
    first = together[0].completion_ids.index(stop_at)
    out = gen.generate([dataclasses.replace(reqs[0], stop_token_ids=(stop_at,)), reqs[1]])
    assert out[0].completion_ids == together[0].completion_ids[:first + 1] and out[0].finish_reason == "stop"
    assert out[1].completion_ids == together[1].completion_ids


def test_steady_state_generation_does_not_recompile(tiny, gen):
    m, _, _ = tiny
    for lengths in ((9, 4, 12), (2, 3)):                                    # warm the row buckets 4 and 2
        gen.generate([Request(p, max_new_tokens=8) for p in _prompts(m, lengths)])
    seen = _compiles()
    for seed, lengths in enumerate([(3, 10, 7), (16, 1), (5, 6, 7, 8)]):
        reqs = [Request(p, max_new_tokens=4 + i, temperature=0.5 * i, top_k=i, seed=seed)
                for i, p in enumerate(_prompts(m, lengths, seed))]
        gen.generate(reqs)
    assert seen == [], f"{len(seen)} compiles in steady state"


def test_speculative_decoding_gives_the_same_tokens(tiny, gen):
    m, _, _ = tiny
    reqs = [Request(p, max_new_tokens=10) for p in _prompts(m, (6, 13, 3))]
    reqs.append(Request(_prompts(m, (8,), 1)[0], max_new_tokens=10, temperature=1.0, top_p=0.9, seed=4))
    plain = gen.generate(reqs)
    before = dict(gen.stats)
    spec = gen.generate(reqs, speculative=True)
    assert [c.completion_ids for c in spec] == [c.completion_ids for c in plain]
    assert gen.stats["drafted"] > before["drafted"]


def test_a_right_draft_is_accepted_and_yields_two_tokens(tiny):
    """Zero final norms make the main model's and the drafter's logits all equal, so both always
    pick token 0: every draft is right, and each verify pass emits two tokens."""
    m, _, state = tiny
    flat = dict(nnx.to_flat_state(state))
    for path in [p for p in flat if p[-2:] == ("final_norm", "weight")]:
        flat[path] = flat[path].replace(jnp.zeros_like(flat[path].get_value()))
    gen = Generator(m, nnx.from_flat_state(list(flat.items())), FP32, eos_id=None)
    c = gen.generate([Request(_prompts(m, (5,))[0], max_new_tokens=13)], speculative=True)[0]
    assert c.completion_ids == [0] * 13
    assert gen.stats["accepted"] == gen.stats["drafted"] == 6      # 1 from prefill + 6 x 2


def test_logprobs_are_the_models(tiny, gen):
    m, model, _ = tiny
    p = _prompts(m, (7,))[0]
    c = gen.generate([Request(p, max_new_tokens=5, temperature=1.0, seed=2, logprobs=3)])[0]
    ids = list(p) + c.completion_ids
    lp = np.asarray(jax.nn.log_softmax(jax.jit(lambda x: model(x).logits[0])(jnp.asarray([ids], jnp.int32)), -1))
    for j, t in enumerate(c.completion_ids):
        row = lp[len(p) - 1 + j]
        assert abs(c.logprobs[j] - row[t]) < 1e-4
        assert list(c.top_logprobs[j]) == list(np.argsort(-row)[:3])


@pytest.fixture(scope="module")
def unicode_tok():
    texts = ["héllo wörld ünïcode ça va", "日本語のテキストと中文字符", "emoji 🙂🚀🎉 and ✓ marks", "plain ascii words"] * 50
    return toklib.train(texts, 512)


def test_stop_strings_and_streaming_keep_whole_characters(tiny, unicode_tok):
    m, _, state = tiny
    gen = Generator(m, state, FP32, eos_id=None, tokenizer=unicode_tok)
    prompt = tuple(unicode_tok.encode("日本語 🙂 héllo").ids)
    free = gen.generate([Request(prompt, max_new_tokens=24, temperature=1.0, seed=1)])[0]
    assert free.completion == unicode_tok.decode(free.completion_ids, skip_special_tokens=True)
    text = free.completion
    assert len(text) > 6
    stop = text[3:5]
    streamed = []
    out = gen.generate([Request(prompt, max_new_tokens=24, temperature=1.0, seed=1, stop=(stop,))],
                       on_text=lambda i, d: streamed.append(d))[0]
    assert out.completion == text[:text.find(stop)] and out.finish_reason == "stop"
    assert "".join(streamed) == out.completion and all(streamed)
    assert "\ufffd" not in out.completion or "\ufffd" in text[:text.find(stop)]
    # streaming without stop strings equals the final text too
    streamed = []
    again = gen.generate([Request(prompt, max_new_tokens=24, temperature=1.0, seed=1)],
                         on_text=lambda i, d: streamed.append(d))[0]
    assert "".join(streamed) == again.completion == text



def test_a_completion_cut_inside_a_character_ends_as_its_whole_decode(unicode_tok):
    """A completion whose last tokens are the first 3 bytes of a 4-byte character: the stream
    held them back waiting for the 4th; the final text (and what was streamed) is the whole
    decode, U+FFFD for the bytes, as transformers' decode gives it."""
    ids = unicode_tok.encode("va \U0001D11E").ids[:-1]          # G clef, cut before its last byte
    streamed = []
    st = Stream(Request((1,), max_new_tokens=8), unicode_tok, streamed.append)
    st.push(ids, [0.0] * len(ids), [[]] * len(ids), [[]] * len(ids))
    held = st.text
    c = st.finish(stopped=False)
    assert c.completion == unicode_tok.decode(ids, skip_special_tokens=True) != held
    assert "".join(streamed) == c.completion and c.completion.endswith("\ufffd")

@pytest.mark.slow
@pytest.mark.parametrize("axes", [dict(data=2, tensor=4), dict(expert=4, data=2)])
def test_sharded_meshes_give_the_one_device_tokens(tiny, gen, axes):
    m, _, state = tiny
    reqs = [Request(p, max_new_tokens=8) for p in _prompts(m, (5, 9, 3))]
    want = [c.completion_ids for c in gen.generate(reqs)]
    mesh = meshlib.make_mesh(configlib.MeshConfig(**{"data": 1, **axes}))
    sharded = Generator(m, weights.onto(state, mesh), FP32, mesh=mesh, eos_id=None)
    assert sharded.batch_shards == (2 if "tensor" in axes else 8)
    assert [c.completion_ids for c in sharded.generate(reqs)] == want


def test_slots_take_requests_anywhere_and_attend_only_as_far_as_needed(tiny, gen):
    """The serving engine's interface: requests prefilled into scattered slots of a larger cache,
    decoded over a bucket of the first slots, with attention cut to the first 64 positions, give
    the tokens of a batch of their own; a request joining mid-way does not disturb them."""
    m, _, _ = tiny
    reqs = [Request(p, max_new_tokens=8) for p in _prompts(m, (5, 11, 3), seed=7)]
    want = [c.completion_ids for c in gen.generate(reqs)]
    slots = gen.new_slots(8, 256)
    slots, first = gen.insert(slots, reqs[:2], [3, 1])
    got = {3: [int(first[0][0])], 1: [int(first[1][0])]}
    for call in range(5):
        if call == 1:                                   # joins at a step boundary, in slot 0
            slots, f = gen.insert(slots, reqs[2:], [0])
            got[0] = [int(f[0][0])]
        slots, em, done, _ = gen.step(slots, 4, 2, attend=64)
        for s in got:
            got[s] += [int(t) for t in em.tokens[s, :em.count[s]]]
    assert [got[3], got[1], got[0]] == want
    assert done.all()                                   # slot 2 was never filled: done from the start


@pytest.mark.parametrize("speculative", [False, True])
def test_a_batch_attends_only_as_far_as_its_rows_reach(tiny, monkeypatch, speculative):
    """generate() cuts each decode chunk's attention to a power of two past the furthest position
    a live row can write in it; on a 512-position cache, rows growing past 64 and 128 positions
    give the tokens and log-probs of attention over the whole cache."""
    from r1jax.infer import generator as genlib
    m, _, state = tiny
    g = Generator(m, state, dataclasses.replace(FP32, max_len=512), eos_id=None)
    reqs = [Request(p, max_new_tokens=n, temperature=t, top_p=0.9, seed=3, logprobs=2, ignore_eos=True)
            for p, n, t in zip(_prompts(m, (40, 5, 20), seed=9), (60, 30, 70), (0.0, 1.0, 0.0))]
    cut = g.generate(reqs, speculative=speculative)
    assert {k[5] for k in g._steps if k[0] == "decode"} == {64, 128}      # the attention lengths run
    monkeypatch.setattr(genlib, "attend_bucket", lambda *a, **kw: None)
    whole = g.generate(reqs, speculative=speculative)
    assert [c.completion_ids for c in cut] == [c.completion_ids for c in whole]
    assert [c.completion_tokens for c in cut] == [60, 30, 70]
    np.testing.assert_allclose(sum((c.logprobs for c in cut), []), sum((c.logprobs for c in whole), []),
                               rtol=0, atol=2e-6)       # 4.8e-7 measured: fp32 sums over more zeros


def test_recorded_routing_is_the_models_and_replaying_it_forces_the_experts(tiny, gen):
    """Request.routing: the expert ids of every fed position (prompt, then each completion token
    but the last) equal the training forward's own choices on the same tokens, and recording
    changes no token or log-prob. The model's `routing` replays given ids (aux idx equals them,
    -1 keeps the router's choice) and leaves the output unchanged when they are its own."""
    m, model, _ = tiny
    prompts = _prompts(m, (7, 3))
    reqs = [Request(p, max_new_tokens=6, temperature=1.0, seed=4, logprobs=0) for p in prompts]
    plain = gen.generate(reqs)
    recorded = gen.generate([dataclasses.replace(r, routing=True) for r in reqs])
    fwd = jax.jit(lambda x, r: model(x, routing=r))
    L, k = m.num_moe_layers, m.num_experts_per_tok
    for p, a, b in zip(prompts, plain, recorded):
        assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs and a.routing is None
        ids = jnp.asarray([list(p) + b.completion_ids], jnp.int32)
        n = ids.shape[1]
        assert b.routing.shape == (n - 1, L, k) and b.routing.dtype == np.int32
        own = fwd(ids, None)
        idx = np.asarray(own.aux["idx"]).reshape(L, n, k).transpose(1, 0, 2)        # [n, L, k]
        assert np.array_equal(np.sort(b.routing, -1), np.sort(idx[:n - 1], -1))
        replay = np.full((1, n, L, k), -1, np.int32)
        replay[0, :n - 1] = b.routing
        same = fwd(ids, jnp.asarray(replay))
        np.testing.assert_allclose(np.asarray(same.logits), np.asarray(own.logits), rtol=0, atol=1e-6)
        forced = replay.copy()
        forced[0, :n - 1] = (b.routing + 1) % m.n_routed_experts       # other experts, still k distinct
        other = fwd(ids, jnp.asarray(forced))
        got = np.asarray(other.aux["idx"]).reshape(L, n, k).transpose(1, 0, 2)
        assert np.array_equal(got[:n - 1], forced[0, :n - 1]) and np.array_equal(got[n - 1], idx[n - 1])
        assert np.abs(np.asarray(other.logits) - np.asarray(own.logits)).max() > 1e-3


def test_gate_and_up_are_joined_and_every_dispatch_reads_them(tiny, gen):
    """The generator keeps every SwiGLU's gate and up side by side in one [D, 2F] array under the
    gate's name (the up leaf None): each routed expert's, the shared experts' and the dense
    layers', in the layers and the MTP block alike. A quantised generator keeps them apart. A
    named stacked dispatch (`dense`) splits the routed experts again and gives `grouped`'s
    tokens and log-probs."""
    from r1jax.config import MoEDispatch
    from r1jax.infer import quant
    m, _, state = tiny
    D, F, E = m.hidden_size, m.moe_intermediate_size, m.n_routed_experts

    def pairs(g):
        """{path of the gate: (gate, up)} over every layer's state and the rest."""
        rest, layers = g.params
        found = {}
        for name, states in [("rest", [rest])] + sorted(layers.items()):
            for i, st in enumerate(states):
                flat = {p: v.get_value() for p, v in nnx.to_flat_state(st)}
                for p, v in flat.items():
                    if p[-1] in ("gate_EDF", "gate_DF"):
                        found[(name, i) + p] = (v, flat[p[:-1] + ("up" + p[-1][4:],)])
        return found

    found = pairs(gen)
    routed = [k for k in found if k[-1] == "gate_EDF"]
    assert len(routed) == m.num_moe_layers + m.num_nextn_predict_layers >= 2
    assert len(found) - len(routed) == m.num_hidden_layers + m.num_nextn_predict_layers    # dense + shared
    for key, (g, u) in found.items():
        assert u is None, key
        if key[-1] == "gate_EDF":
            assert len(g) == E and all(e.shape == (D, 2 * F) for e in g)
        else:
            assert g.shape[0] == D and g.shape[1] in (2 * m.intermediate_size, 2 * F * m.n_shared_experts)
    q = Generator(m, state, FP32, eos_id=None, quantize="int8")
    for g, u in pairs(q).values():
        assert all(isinstance(w, quant.QArray) for w in (u if isinstance(u, tuple) else (g, u)))
    reqs = [Request(p, max_new_tokens=6, logprobs=0) for p in _prompts(m, (5, 9))]
    dense = Generator(m, state, dataclasses.replace(FP32, moe_decode=MoEDispatch.dense), eos_id=None)
    for a, b in zip(gen.generate(reqs), dense.generate(reqs)):
        assert a.completion_ids == b.completion_ids
        # fp32 parity's 1e-5 (the two sum the experts in different orders: 4.8e-7 measured)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_up_projections_are_held_heads_major(tiny, gen):
    """Every MLA's up-projections (the layers' and the MTP block's) are held heads first, as
    absorbed decode's per-head products read them ([N, K, C] and [N, C, V], no transpose at each
    step), and read back as the model's own weights; a quantised generator keeps its QArrays.
    (Decode with them equals the training forward: test_logprobs_are_the_models, test_generate.)"""
    from r1jax.infer import quant
    from r1jax.infer.generator import STACKS
    from r1jax.model.mla import HeadsMajor
    m, _, state = tiny
    C, N, K, V = m.kv_lora_rank, m.num_attention_heads, m.qk_nope_head_dim, m.v_head_dim
    want = {}                                        # (stack or "rest", layer, path) -> the model's weight
    for p, v in nnx.to_flat_state(state):
        if p[-1] in ("wk_b_CNK", "wv_b_CNV"):
            a = np.asarray(v.get_value())
            if p[0] in STACKS and p[1] == "layers":
                want.update({(STACKS[p[0]], i, p[2:]): a[i] for i in range(a.shape[0])})
            else:
                want[("rest", 0, p)] = a

    def held(g):
        rest, layers = g.params
        return {(name, i, p): v.get_value() for name, states in [("rest", [rest])] + sorted(layers.items())
                for i, st in enumerate(states) for p, v in nnx.to_flat_state(st) if p[-1] in ("wk_b_CNK", "wv_b_CNV")}

    got = held(gen)
    assert set(got) == set(want) and len(want) == 2 * (m.num_hidden_layers + m.num_nextn_predict_layers)
    for key, w in got.items():
        assert isinstance(w, HeadsMajor), key
        assert w.hm.shape == ((N, K, C) if key[-1][-1] == "wk_b_CNK" else (N, C, V))
        np.testing.assert_array_equal(np.asarray(w[...]), want[key])
    q = Generator(m, state, FP32, eos_id=None, quantize="int8")
    assert all(isinstance(w, quant.QArray) for w in held(q).values())

"""The continuous-batching engine's policy against its own fake model (no compiles): decode
buckets, requests joining a running batch at step boundaries without changing its tokens, an
idle engine gathering a burst for max_queue_delay_ms, the queue limit, and cancelled requests
freeing their slots. tests/test_serve.py runs the same engine on the real model."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from r1jax.infer.generator import Request
from r1jax.serve.engine import Engine, EngineConfig, QueueFull


class FakeGen:
    """The Generator's slot interface over a deterministic 'model': a request's token k is
    (sum(prompt) + k) % 97 + 3; it is done after max_new_tokens. Records every call."""

    def __init__(self, step_s: float = 0.0):
        self.m = SimpleNamespace(num_nextn_predict_layers=0)
        self.tokenizer = None
        self.batch_shards = 1
        self.step_s = step_s
        self.calls: list[tuple] = []
        self.lock = threading.Lock()

    @staticmethod
    def token(req: Request, k: int) -> int:
        return (sum(req.prompt_ids) + k) % 97 + 3

    def new_slots(self, n, max_len, speculative=False):
        return SimpleNamespace(size=n, max_len=max_len, req=[None] * n, k=[0] * n, done=np.ones(n, bool))

    def insert(self, slots, reqs, at, top=None):
        self.calls.append(("insert", tuple(at), time.monotonic()))
        first = []
        for r, s in zip(reqs, at):
            slots.req[s], slots.k[s] = r, 1
            slots.done[s] = r.max_new_tokens <= 1
            first.append((self.token(r, 0), 0.0, np.zeros(0), np.zeros(0)))
        return slots, first

    def step(self, slots, rows, steps, top=None, attend=None):
        live = tuple(s for s in range(rows) if not slots.done[s])
        # the attention length must cover every position a live row reaches in this call
        reach = max([len(slots.req[s].prompt_ids) + slots.k[s] - 1 + steps for s in live], default=0)
        assert attend is None or reach < attend <= slots.max_len, (reach, attend)
        self.calls.append(("step", rows, live, attend))
        time.sleep(self.step_s)
        tokens = np.zeros((rows, steps), np.int32)
        count = np.zeros(rows, np.int32)
        for s in range(rows):
            for _ in range(steps):
                if slots.done[s]:
                    break
                r = slots.req[s]
                tokens[s, count[s]] = self.token(r, slots.k[s])
                count[s] += 1
                slots.k[s] += 1
                slots.done[s] = slots.k[s] >= r.max_new_tokens
        z = np.zeros((rows, steps))
        em = SimpleNamespace(tokens=tokens, count=count, lp=z, top_ids=z[..., None], top_lp=z[..., None])
        return slots, em, slots.done[:rows].copy(), np.zeros(rows, bool)

    def finish(self, slots, which):
        self.calls.append(("finish", tuple(which)))
        for s in which:
            slots.done[s] = True
        return slots


class Collect:
    def __init__(self):
        self.done = threading.Event()
        self.completion = None
        self.events = []

    def __call__(self, kind, payload):
        self.events.append(kind)
        if kind == "done":
            self.completion = payload
            self.done.set()


def _engine(gen, **kw):
    cfg = EngineConfig(**{"max_batch_size": 8, "preferred_batch_sizes": (4, 8), "max_queue_delay_ms": 0,
                          "max_model_len": 256, "decode_steps": 2, **kw})
    e = Engine(gen, cfg)
    e.start(warmup=False)
    assert e.ready.wait(5)
    return e


def _expected(req):
    return [FakeGen.token(req, k) for k in range(req.max_new_tokens)]


def test_buckets_are_the_preferred_sizes_and_the_powers_of_two_below():
    assert EngineConfig().buckets() == [1, 2, 4, 8, 16, 32, 64]
    assert EngineConfig(max_batch_size=48, preferred_batch_sizes=(16, 32, 64)).buckets() == [1, 2, 4, 8, 16, 32, 48]
    assert EngineConfig(max_batch_size=1).buckets() == [1]
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineConfig(max_batch_size=0)


def test_requests_join_a_running_batch_at_step_boundaries():
    gen = FakeGen(step_s=0.01)
    e = _engine(gen)
    try:
        long = Request((5, 6, 7), max_new_tokens=100)
        a = Collect()
        e.submit(long, a)
        while not any(c[0] == "step" for c in gen.calls):
            time.sleep(0.001)
        shorts = [Request((i, 2), max_new_tokens=5) for i in range(3)]
        cs = [Collect() for _ in shorts]
        for r, c in zip(shorts, cs):
            e.submit(r, c)
        for c in cs + [a]:
            assert c.done.wait(10)
    finally:
        e.stop()
    # every request got exactly its own tokens, whatever ran beside it
    assert a.completion.completion_ids == _expected(long) and a.completion.finish_reason == "length"
    for r, c in zip(shorts, cs):
        assert c.completion.completion_ids == _expected(r)
    inserts = [c for c in gen.calls if c[0] == "insert"]
    assert inserts[0][1] == (0,) and sorted(s for c in inserts[1:] for s in c[1]) == [1, 2, 3]
    # the newcomers decoded in the same steps as the running request, in the 4-slot bucket
    shared = [c for c in gen.calls if c[0] == "step" and 0 in c[2] and len(c[2]) > 1]
    assert shared and all(c[1] == 4 for c in shared)
    # once they left, the long request went back to the 1-slot bucket
    steps = [c for c in gen.calls if c[0] == "step"]
    assert steps[-1][1] == 1 and steps[-1][2] == (0,)
    # attention grew with the furthest row: 64 positions, then 256 (of max_model_len 256: all)
    assert steps[0][3] == 64 and steps[-1][3] is None


def test_an_idle_engine_gathers_a_burst_for_the_queue_delay():
    gen = FakeGen()
    e = _engine(gen, max_queue_delay_ms=300)
    try:
        c = Collect()
        t = time.monotonic()
        e.submit(Request((1,), max_new_tokens=2), c)
        assert c.done.wait(5)
        waited = [x for x in gen.calls if x[0] == "insert"][0][2] - t
        assert 0.25 < waited < 2.0, waited        # held for the delay, then prefilled alone
        # a burst as large as the smallest preferred size (4) goes at once, in one prefill
        gen.calls.clear()
        cs = [Collect() for _ in range(4)]
        t = time.monotonic()
        with e._cv:                               # all four are queued before the engine looks
            for i, c in enumerate(cs):
                e.waiting.append(_job(e, Request((i + 1,), max_new_tokens=3), c))
            e._cv.notify()
        for c in cs:
            assert c.done.wait(5)
        inserts = [x for x in gen.calls if x[0] == "insert"]
        assert len(inserts) == 1 and inserts[0][1] == (0, 1, 2, 3) and inserts[0][2] - t < 0.2
    finally:
        e.stop()


def _job(e, req, on_event):
    from r1jax.serve.engine import Job
    return Job(req, on_event)


def test_a_full_queue_refuses_and_a_too_long_prompt_is_refused():
    gen = FakeGen()
    e = Engine(gen, EngineConfig(max_batch_size=2, preferred_batch_sizes=(2,), max_queue=2, max_model_len=16))
    e.submit(Request((1,), max_new_tokens=2), Collect())       # not started: they wait
    e.submit(Request((2,), max_new_tokens=2), Collect())
    with pytest.raises(QueueFull, match="max_queue 2"):
        e.submit(Request((3,), max_new_tokens=2), Collect())
    with pytest.raises(ValueError, match="max_model_len is 16"):
        e.submit(Request(tuple(range(16)), max_new_tokens=2), Collect())


def test_a_cancelled_request_frees_its_slot_and_sends_nothing_more():
    gen = FakeGen(step_s=0.01)
    e = _engine(gen, max_batch_size=2, preferred_batch_sizes=(2,))
    try:
        c = Collect()
        job = e.submit(Request((9,), max_new_tokens=10_000), c)
        while len([x for x in gen.calls if x[0] == "step"]) < 3:
            time.sleep(0.002)
        e.cancel(job)
        deadline = time.monotonic() + 5
        while e.running and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not e.running and ("finish", (0,)) in gen.calls
        assert "done" not in c.events
        # the slot is reused by the next request
        c2 = Collect()
        e.submit(Request((4,), max_new_tokens=3), c2)
        assert c2.done.wait(5) and c2.completion.completion_ids == _expected(Request((4,), max_new_tokens=3))
        # a waiting request that is cancelled never reaches a slot
        e2 = Engine(FakeGen(), EngineConfig(max_batch_size=1, preferred_batch_sizes=(1,)))
        j = e2.submit(Request((1,), max_new_tokens=2), Collect())
        e2.cancel(j)
        assert not e2.waiting
    finally:
        e.stop()

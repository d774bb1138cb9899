"""Continuous batching over the generator's decode slots.

One engine thread owns the device state: `max_batch_size` slots of the latent cache
(`Generator.new_slots`). Each turn of its loop
1. stops the slots of cancelled requests and of requests a stop string ended;
2. admits waiting requests into the lowest free slots, in one prefill (`Generator.insert`);
3. runs one decode call of `decode_steps` steps over the smallest compiled bucket of slots that
   covers every occupied slot (`Generator.step`), attending over the shortest compiled length
   (64, 256, 1024, ... positions) that the furthest row can reach in the call, and hands each
   request its new tokens.
Requests join at these step boundaries and leave when done; nothing waits for a whole batch.

Admission follows Triton's dynamic batcher, applied to prefills only: while decodes run, the
waiting requests join at the next boundary; an idle engine with fewer waiters than the smallest
preferred batch size holds them until the oldest has waited `max_queue_delay_ms`, so a burst is
prefilled together. A running decode is never delayed. The decode buckets are the preferred batch
sizes and, below the smallest, the powers of two (a step costs what its bucket costs: a lone
request on a 16-row step would pay for 16).

Requests and their events cross threads: `submit` and `cancel` come from any thread (the HTTP
server's event loop); events (`on_event(kind, payload)`: "text" with a Delta, then "done" with
the Completion, or "error" with a message) are called from the engine thread.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable

from r1jax.infer.generator import (MAX_TOP_LOGPROBS, Completion, Generator, Request, Stream, attend_bucket,
                                   attend_reach)

log = logging.getLogger("r1jax.serve")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 64                     # decode slots
    preferred_batch_sizes: tuple[int, ...] = (16, 32, 64)
    max_queue_delay_ms: float = 10.0             # an idle engine gathers prefills this long
    max_queue: int = 256                         # waiting requests beyond this: QueueFull (429)
    max_model_len: int = 1024                    # prompt + completion tokens per request
    decode_steps: int = 4                        # decode steps per call (requests join between calls)
    max_prefill_batch: int = 16                  # requests prefilled together
    speculative: bool = False                    # MTP drafts (the model needs an MTP module)
    warmup_prompt_len: int = 128                 # prefills compiled at start for prompts up to this long

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, not {self.max_batch_size}")
        if any(b < 1 for b in self.preferred_batch_sizes):
            raise ValueError(f"preferred_batch_sizes must be >= 1: {self.preferred_batch_sizes}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, not {self.max_model_len}")
        if (self.decode_steps < 1 or self.max_prefill_batch < 1 or self.warmup_prompt_len < 1 or self.max_queue < 0
                or self.max_queue_delay_ms < 0):
            raise ValueError("decode_steps, max_prefill_batch and warmup_prompt_len must be >= 1, "
                             "max_queue and max_queue_delay_ms >= 0")

    def buckets(self) -> list[int]:
        """Decode buckets: the preferred sizes up to max_batch_size, the powers of two below the
        smallest of them, and max_batch_size itself."""
        pref = sorted({b for b in self.preferred_batch_sizes if b <= self.max_batch_size} | {self.max_batch_size})
        small = [1 << i for i in range(16) if (1 << i) < pref[0]]
        return sorted(set(small) | set(pref))


class QueueFull(Exception):
    """The waiting queue is at max_queue: the client should retry later (HTTP 429)."""


@dataclasses.dataclass
class Delta:
    """A piece of a request's stream: new text and the tokens produced since the previous piece
    (with their log-probs when the request asked for them)."""
    text: str
    ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict] | None = None


class Job:
    """A request in the engine: its completion stream, timing and slot."""

    def __init__(self, req: Request, on_event: Callable[[str, object], None], tokenizer=None):
        self.req, self.on_event = req, on_event
        self.stream = Stream(req, tokenizer, lambda text: on_event("text", self.delta(text)), req.logprobs is not None)
        self.sent_ids = 0                        # tokens already sent with a Delta
        self.arrived = time.monotonic()
        self.started: float | None = None        # prefill began
        self.first: float | None = None          # first token on the host
        self.last: float | None = None
        self.slot: int | None = None
        self.cancelled = False
        self.finished = False

    def delta(self, text: str) -> Delta:
        s, i = self.stream, self.sent_ids
        self.sent_ids = len(s.ids)
        return Delta(text, s.ids[i:], s.lps[i:] if self.req.logprobs is not None else None,
                     s.tops[i:] if self.req.logprobs else None)


class Engine:
    """Continuous batching of `Request`s over a Generator's slots (module docstring)."""

    def __init__(self, gen: Generator, cfg: EngineConfig = EngineConfig(), metrics=None):
        if cfg.speculative and gen.m.num_nextn_predict_layers < 1:
            raise ValueError("speculative decoding needs an MTP module (num_nextn_predict_layers >= 1)")
        self.gen, self.cfg, self.metrics = gen, cfg, metrics
        self.slots = gen.new_slots(cfg.max_batch_size, cfg.max_model_len, cfg.speculative)
        self.n_slots = self.slots.size
        self.buckets = [b for b in cfg.buckets() if b % gen.batch_shards == 0] or [self.n_slots]
        if self.buckets[-1] < self.n_slots:
            self.buckets.append(self.n_slots)
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: dict[int, Job] = {}        # slot -> job
        self._cancel: list[Job] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.steps = 0

    # ------------------------------------------------------------------ any thread
    def submit(self, req: Request, on_event: Callable[[str, object], None]) -> Job:
        """Queue a request; QueueFull when max_queue requests already wait."""
        if len(req.prompt_ids) + 1 > self.cfg.max_model_len:
            raise ValueError(f"the prompt has {len(req.prompt_ids)} tokens; this server's max_model_len is "
                             f"{self.cfg.max_model_len}")
        job = Job(req, on_event, self.gen.tokenizer)
        with self._cv:
            if len(self.waiting) >= self.cfg.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (max_queue {self.cfg.max_queue})")
            self.waiting.append(job)
            self._gauges()
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Drop a request (its client went away): a waiting one leaves the queue, a running one
        frees its slot at the next step boundary. No event follows."""
        with self._cv:
            if job.finished or job.cancelled:
                return
            job.cancelled = True
            if job in self.waiting:
                self.waiting.remove(job)
                job.finished = True
                self._count_finished(job, "abort")
            else:
                self._cancel.append(job)
            self._gauges()
            self._cv.notify()

    def start(self, warmup: bool = True) -> None:
        self._thread = threading.Thread(target=self._main, args=(warmup,), name="r1jax-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def warmup(self) -> None:
        """Compile what steady serving runs: every decode bucket, and prefills of 1 to
        max_prefill_batch rows for each prompt bucket up to warmup_prompt_len (a longer prompt
        compiles on first use: a compile inside a loaded engine stalls every running request)."""
        longest = min(self.cfg.warmup_prompt_len, self.cfg.max_model_len - 1)
        T = 16
        while True:
            pad = Request(prompt_ids=(1,) * min(T, longest), max_new_tokens=2, ignore_eos=True)
            n = 1
            while n <= min(self.cfg.max_prefill_batch, self.n_slots):
                self.slots, _ = self.gen.insert(self.slots, [pad] * n, list(range(n)))
                n *= 2
            if T >= longest:
                break
            T *= 2
        self.slots = self.gen.finish(self.slots, list(range(self.n_slots)))
        for b in self.buckets:
            for attend in self._attend_lengths():
                self.slots, *_ = self.gen.step(self.slots, b, self.cfg.decode_steps, attend=attend)

    def _attend_lengths(self) -> list[int | None]:
        out, n = [], 1
        while True:
            a = attend_bucket(n, self.slots.max_len)
            if a in out:
                return out
            out.append(a)
            if a is None:
                return out
            n = a + 1

    def _main(self, warmup: bool) -> None:
        try:
            if warmup:
                self.warmup()
        except Exception as e:                  # the server must not report ready
            log.exception("warm-up failed")
            self.error = e
            return
        self.ready.set()
        while True:
            with self._cv:
                if self._stop:
                    break
                cancelled, self._cancel = self._cancel, []
                admit = self._admissible()
                if not admit and not self.running and not cancelled:
                    self._cv.wait(self._idle_wait())
                    continue
            try:
                self._turn(cancelled, admit)
            except Exception as e:              # fail what ran; keep serving the next requests
                log.exception("engine step failed")
                self._fail_all(f"engine error: {type(e).__name__}: {e}")

    def _idle_wait(self) -> float | None:
        if not self.waiting:
            return None
        age = time.monotonic() - self.waiting[0].arrived
        return max(0.0, self.cfg.max_queue_delay_ms / 1000 - age) + 1e-4

    def _admissible(self) -> list[Job]:
        """Waiting jobs to prefill now (called under the lock)."""
        free = self.n_slots - len(self.running)
        if not self.waiting or free <= 0:
            return []
        n = min(free, len(self.waiting), self.cfg.max_prefill_batch)
        if not self.running:
            # an idle engine gathers a burst: wait for a preferred batch or the queue delay
            target = min(min(self.cfg.preferred_batch_sizes), free, self.cfg.max_prefill_batch)
            age = time.monotonic() - self.waiting[0].arrived
            if len(self.waiting) < target and age < self.cfg.max_queue_delay_ms / 1000:
                return []
        return [self.waiting.popleft() for _ in range(n)]

    def _turn(self, cancelled: list[Job], admit: list[Job]) -> None:
        # 1. slots to stop: cancelled requests and those a stop string ended
        stop = [j for j in cancelled if j.slot is not None and self.running.get(j.slot) is j]
        for j in stop:
            self._release(j, "abort", event=False)
        if stop:
            self.slots = self.gen.finish(self.slots, [j.slot for j in stop])
        # 2. admissions
        if admit:
            self._prefill(admit)
        # 3. one decode call
        if self.running:
            self._decode()
        self._gauges()

    def _free_slots(self, n: int) -> list[int]:
        return [s for s in range(self.n_slots) if s not in self.running][:n]

    def _top(self) -> int | None:
        return MAX_TOP_LOGPROBS if any(j.req.logprobs for j in self.running.values()) else (
            0 if any(j.req.logprobs is not None for j in self.running.values()) else None)

    def _prefill(self, jobs: list[Job]) -> None:
        now = time.monotonic()
        at = self._free_slots(len(jobs))
        for j, s in zip(jobs, at):
            j.started, j.slot = now, s
            self.running[s] = j
            if self.metrics:
                self.metrics.queue_time(now - j.arrived)
        top = MAX_TOP_LOGPROBS if any(j.req.logprobs for j in jobs) else (
            0 if any(j.req.logprobs is not None for j in jobs) else None)
        self.slots, first = self.gen.insert(self.slots, [j.req for j in jobs], at, top)
        t = time.monotonic()
        for j, f in zip(jobs, first):
            j.first = j.last = t
            j.stream.push([f[0]], [f[1]], [f[2]], [f[3]])
            if self.metrics:
                self.metrics.first_token(t - j.arrived, len(j.req.prompt_ids))
        self._gauges()

    def _decode(self) -> None:
        top_slot = max(self.running)
        bucket = next(b for b in self.buckets if b > top_slot)
        # a request a stop string ended on the host stops on the device first
        ended = [s for s, j in self.running.items() if j.stream.cut is not None]
        if ended:
            self.slots = self.gen.finish(self.slots, ended)
        # attention reads only as far as the furthest row can write in this call
        reach = max(attend_reach(j.req, len(j.stream.ids), self.cfg.decode_steps, self.cfg.speculative)
                    for j in self.running.values())
        attend = attend_bucket(reach, self.slots.max_len)
        self.slots, em, done, stopped = self.gen.step(self.slots, bucket, self.cfg.decode_steps, self._top(), attend)
        self.steps += 1
        if self.metrics:
            self.metrics.iteration(int(em.count.sum()))
        t = time.monotonic()
        for s, j in list(self.running.items()):
            before = len(j.stream.ids)
            j.stream.push_emitted(em, s)
            got = len(j.stream.ids) - before
            if got and self.metrics:
                self.metrics.inter_token((t - j.last) / got, got)
            if got:
                j.last = t
            if done[s] or j.stream.cut is not None:
                self._release(j, None, stopped=bool(stopped[s]))
        self._gauges()

    def _release(self, job: Job, reason: str | None, *, stopped: bool = False, event: bool = True) -> None:
        """Free a job's slot; with an event, its Completion goes to the client."""
        self.running.pop(job.slot, None)
        job.finished = True
        if not event:
            self._count_finished(job, reason or "abort")
            return
        c: Completion = job.stream.finish(stopped)
        if job.req.logprobs is not None and job.sent_ids < len(job.stream.ids):
            job.on_event("text", job.delta(""))     # tokens without text (EOS): their log-probs
        self._count_finished(job, c.finish_reason, c)
        job.on_event("done", c)

    def _count_finished(self, job: Job, reason: str, c: Completion | None = None) -> None:
        if self.metrics:
            self.metrics.finished(job, reason, c)

    def _fail_all(self, msg: str) -> None:
        with self._cv:
            jobs = list(self.running.values())
            self.running.clear()
        for j in jobs:
            j.finished = True
            self._count_finished(j, "abort")
            j.on_event("error", msg)
        # the device state may be half-updated: start from empty slots
        self.slots = self.gen.new_slots(self.cfg.max_batch_size, self.cfg.max_model_len, self.cfg.speculative)

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.load(len(self.running), len(self.waiting), len(self.running) / self.n_slots)

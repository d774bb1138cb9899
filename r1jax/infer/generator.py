"""Batched generation over the MLA latent cache: prefill, absorbed decode, MTP speculation.

A batch of requests (prompts of any lengths, each with its own sampling parameters, stops and
budget) runs as: one prefill over the right-padded prompts (the training forward, writing the
cache, logits only at each row's last token), then decode chunks of `infer.decode_chunk` steps,
each one compiled `lax.while_loop` over the donated cache that stops early once every row is
done. Finished rows stop: they emit nothing more, and their positions stay put.

Shapes are bucketed (rows to a power of two and a multiple of the mesh's batch shards, prompt
length to a power of two >= 16, cache length to a power of two), and every per-row value
(lengths, positions, sampling parameters, stop ids) is a traced array, so a steady stream of
requests reuses a handful of executables.

Speculative decoding (`speculative=True`) drafts one token with the first MTP module and
verifies it with the main model in the same two-token step (DeepSeek-V3 report, 5.4.3). The
completion token at each index is still drawn from the main model's distribution with the same
key as without speculation, and the draft is only used when it equals that draw, so outputs
are those of plain decoding (greedy: token for token); an accepted draft yields two tokens for
one main-model pass.

Stop strings are matched on the detokenized text on the host, with the last len(stop)-1
characters held back from streaming until they cannot begin a stop string; text streams
through `tokenizers`' DecodeStream, which never splits a UTF-8 character.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from r1jax import model as modellib
from r1jax.config import InferConfig, KernelConfig, ModelConfig, MoEDispatch
from r1jax.infer import cache as cachelib
from r1jax.infer import quant
from r1jax.infer.sampling import Sampling, argmax, logprobs, sample
from r1jax.kernels import dispatch
from r1jax.model.kv import KV
from r1jax.model.mla import HEADS_MAJOR, HeadsMajor
from r1jax.parallel import mesh as meshlib

MAX_STOP_IDS = 8          # stop token ids per request (EOS included), padded with -1
MAX_TOP_LOGPROBS = 20     # OpenAI's limit


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None      # None: none; N: the chosen token's and the top N alternatives'
    routing: bool = False            # record the MoE layers' expert ids per position (Completion.routing)


@dataclasses.dataclass
class Completion:
    completion_ids: list[int]
    completion: str | None
    finish_reason: str               # "stop" (a stop token or string) or "length"
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    # with Request.routing: [positions, moe layers, k] int32, the expert ids each position's token
    # was routed to, for the prompt and every completion token but the last (never fed back)
    routing: np.ndarray | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
    """Per-row decode state, every leaf [B, ...]. `tok` is the last sampled token, not yet fed;
    it goes in at position `pos`; `n` completion tokens exist so far."""
    tok: jax.Array
    pos: jax.Array
    n: jax.Array
    done: jax.Array
    stopped: jax.Array               # done because of a stop token (else: length)
    max_new: jax.Array
    stop_ids: jax.Array              # [B, MAX_STOP_IDS]
    sampling: Sampling
    draft: jax.Array                 # speculative: the MTP module's guess for the token after tok
    h_prev: jax.Array                # speculative: the main model's final hidden state at pos-1 [B, D]


def bucket(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def grouped_tile(pairs: int, experts: int, cap: int) -> int:
    """The `grouped` tile for a step of `pairs` (token, expert) pairs: about twice the pairs an
    expert gets (a power of two, at most `cap`). moe_small decode on a quiet 2-core EPYC, ms a
    step by tile: batch 1 (2 pairs) tile 1 2.84, 2 3.65, 4 4.07 (one after another, best of 4);
    batch 8 (16 pairs) 2 10.46, 4 8.70, 8 10.29 and batch 32 (64 pairs) 8 19.25, 16 17.31,
    32 19.05 (best of 4 alternating rounds)."""
    return min(cap, bucket(-(-2 * pairs // experts)))


def decode_kernels(kernels: KernelConfig, infer: InferConfig, m: ModelConfig, tokens: int,
                   split_experts: bool = True) -> KernelConfig:
    """How a step of `tokens` tokens (per batch shard) computes the routed experts. `auto` with
    the experts as separate arrays (`split_experts`, no expert parallelism): `grouped` with
    `grouped_tile` rows a tile, so each selected expert's weights are read in place about once
    (a named `infer.moe_decode` tiles by `infer.decode_tile`; from 4 to 32 pairs an expert
    `grouped` runs static slots per expert instead, r1jax/kernels/dispatch.py); bench/moe_decode.py measures it
    against the stacked dispatches. With the experts sharded over `expert` (stacked): `gather`
    while P <= E/2, `dense` while P <= 2E, then `dropless`."""
    kind = infer.moe_decode
    pairs, E = tokens * m.num_experts_per_tok, m.n_routed_experts
    if kind is MoEDispatch.auto:
        kind = (MoEDispatch.grouped if split_experts else
                MoEDispatch.gather if 2 * pairs <= E else
                MoEDispatch.dense if pairs <= 2 * E else MoEDispatch.dropless)
    tile = infer.decode_tile
    if infer.moe_decode is MoEDispatch.auto and kind is MoEDispatch.grouped:
        tile = grouped_tile(pairs, E, kernels.moe_tile_size)
    return dataclasses.replace(kernels, moe_dispatch=kind, moe_tile_size=tile)


class Generator:
    """Generation from a model-order model state on a mesh (default: one device)."""

    def __init__(self, m: ModelConfig, state: nnx.State, infer: InferConfig = InferConfig(), *,
                 mesh: Mesh | None = None, kernels: KernelConfig = KernelConfig(), eos_id: int | None = None,
                 tokenizer=None, split_experts: bool | None = None, quantize: str = "none"):
        self.m, self.infer, self.kernels = m, infer, kernels
        self.mesh = mesh if mesh is not None else meshlib.single_device_mesh()
        self.dtype = modellib.COMPUTE_DTYPES[infer.dtype]
        self.cache_dtype = modellib.COMPUTE_DTYPES[infer.cache_dtype]
        self.eos_id = m.eos_token_id if eos_id is None else eos_id
        self.tokenizer = tokenizer
        # experts sharded over a mesh axis stay stacked (expert parallelism exchanges tokens
        # over the stack); otherwise each expert is its own array, read in place by `grouped`
        # (`split_experts=False` keeps them stacked: bench/moe_decode.py compares the two)
        ep = self.mesh.shape.get("expert", 1) > 1
        if split_experts and ep:
            raise ValueError("split_experts: experts sharded over the expert axis stay stacked")
        self.split_experts = (not ep) if split_experts is None else split_experts
        # matmul weights int8/fp8 (r1jax/infer/quant.py), quantised from the fp32 masters; kept
        # quantised in memory and dequantised where a step's layer reads them
        self.quantize = quant.check_kind(quantize)
        state = quant.quantize_state(state, quantize)
        self.params, self._abstract_stacks = _unstacked(state, self.split_experts, self.dtype)
        self._steps: dict = {}
        self._graphdefs: dict = {}
        self._caches: dict = {}
        spec = meshlib.batch_sharding(self.mesh).spec
        axes = spec[0] if len(spec) else None
        axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        self.batch_shards = math.prod(self.mesh.shape[a] for a in axes)
        self.stats = {"drafted": 0, "accepted": 0}

    def load(self, state: nnx.State) -> None:
        """New weights of the same shapes and shardings (GRPO's policy after each update): the
        compiled steps take them as arguments, so nothing recompiles."""
        state = quant.quantize_state(state, self.quantize)
        self.params, self._abstract_stacks = _unstacked(state, self.split_experts, self.dtype)

    # ------------------------------------------------------------------ compiled steps
    def _graphdef(self, kernels: KernelConfig):
        if kernels not in self._graphdefs:
            self._graphdefs[kernels] = modellib.abstract(self.m, kernels, self.dtype)[0]
        return self._graphdefs[kernels]

    def _jit(self, key, build, donate):
        if key not in self._steps:
            fn = jax.jit(build(), donate_argnums=donate)
            self._steps[key] = meshlib.MeshedJit(fn, self.mesh)
        return self._steps[key]

    def _prefill_step(self, speculative: bool, top: int | None, routes: bool = False):
        return self._jit(("prefill", speculative, top, routes), lambda: self._prefill_fn(speculative, top, routes),
                         (5, 6))

    def _decode_step(self, rows_bucket: int, steps: int, speculative: bool, top: int | None,
                     attend: int | None = None, routes: bool = False):
        return self._jit(("decode", rows_bucket, steps, speculative, top, attend, routes),
                         lambda: self._decode_fn(rows_bucket, steps, speculative, top, attend, routes), (1, 2))

    def _model(self, kernels: KernelConfig, params):
        """The model over (rest, per-layer states) `params`; its stacks' own leaves stay abstract."""
        rest, layers = quant.for_step(params, kernels)     # QArrays dequantise where read
        return nnx.merge(self._graphdef(kernels), rest, self._abstract_stacks), layers

    def _prefill_fn(self, speculative: bool, top: int | None, routes: bool = False):
        def prefill(params, ids, lengths, new: Rows, at, rows: Rows, kv: KV):
            """The prompts `ids` [P, T] into slots `at` [P] (past the slots: a padding row, whose
            writes are dropped) of the cache and of the slot state `rows` [n]."""
            B, T = ids.shape
            kernels = self.kernels
            if self.split_experts and kernels.moe_dispatch is MoEDispatch.auto:
                # the prompt's experts read in place, in tiles of up to kernels.moe_tile_size
                pairs = B * T // self.batch_shards * self.m.num_experts_per_tok
                kernels = dataclasses.replace(kernels, moe_dispatch=MoEDispatch.grouped, moe_tile_size=grouped_tile(
                    pairs, self.m.n_routed_experts, kernels.moe_tile_size))
            model, layers = self._model(kernels, params)
            t = jnp.arange(T, dtype=jnp.int32)[None]
            seg = (t < lengths[:, None]).astype(jnp.int32)
            last = (lengths - 1)[:, None]
            kv = dataclasses.replace(kv, slots=at, absorbed=False)
            out = model(ids, jnp.broadcast_to(t, (B, T)), seg, kv=kv, at=last, layers=layers)
            logits = out.logits[:, 0]
            tok = sample(logits, new.sampling, jnp.zeros((B,), jnp.int32))
            lp = logprobs(logits, tok, top)
            stop = _is_stop(tok, new.stop_ids)
            new = dataclasses.replace(new, tok=tok, pos=lengths, n=jnp.ones_like(lengths),
                                      done=stop | (new.max_new <= 1) | (lengths >= kv_len(kv)), stopped=stop)
            kv = out.kv
            if speculative:
                # the MTP module's cache for indices 0..len-1 (h_t with token t+1; the last
                # index pairs with the token just sampled) and its draft for the next token
                nxt = jnp.where(t == last, tok[:, None], jnp.roll(ids, -1, axis=1))
                d = model.draft(out.hidden, nxt, jnp.broadcast_to(t, (B, T)), kv, at=last)
                h_prev = jnp.take_along_axis(out.hidden, last[:, :, None], axis=1)[:, 0]
                new = dataclasses.replace(new, draft=argmax(d.logits[:, 0]), h_prev=h_prev.astype(new.h_prev.dtype))
                kv = d.kv
            rows = jax.tree.map(lambda a, x: a.at[at].set(x, mode="drop"), rows, new)
            route = _routes(out.aux, B) if routes else None                   # [B, T, L, k]
            return rows, dataclasses.replace(kv, slots=None, absorbed=True), (tok, lp, route)

        return prefill

    def _decode_fn(self, rows_bucket: int, steps: int, speculative: bool, top: int | None,
                   attend: int | None = None, routes: bool = False):
        per_iter = 2 if speculative else 1
        kernels = decode_kernels(self.kernels, self.infer, self.m, rows_bucket * per_iter // self.batch_shards,
                                 self.split_experts)

        def decode(params, slots: Rows, kv: KV):
            """`steps` steps of the first `rows_bucket` slots (the cache keeps every slot's rows;
            the model reads the first rows_bucket of them, and only `attend` positions when set)."""
            model, layers = self._model(kernels, params)
            kv = dataclasses.replace(kv, attend=attend)
            rows = jax.tree.map(lambda a: a[:rows_bucket], slots)
            B = rows_bucket
            S = kv_len(kv)
            out = Emitted.empty(B, steps * per_iter, top or 0, self._route_shape if routes else (0, 0))

            def plain(i, rows, kv, out):
                o = model(rows.tok[:, None], rows.pos[:, None], kv=kv, layers=layers)
                logits = o.logits[:, 0]
                tok = sample(logits, rows.sampling, rows.n)
                live = ~rows.done
                # the fed token's expert ids (position pos) go with the token it produced
                out = out.put(live, tok, logprobs(logits, tok, top), _routes(o.aux, B)[:, 0] if routes else None)
                return _advance(rows, live, tok, S), o.kv, out

            def spec(i, rows, kv, out):
                # verify: tok and the draft at pos, pos+1 in one pass
                ids = jnp.stack([rows.tok, rows.draft], 1)
                pos = rows.pos[:, None] + jnp.arange(2, dtype=jnp.int32)[None]
                o = model(ids, pos, kv=kv, layers=layers)
                live = ~rows.done
                first = sample(o.logits[:, 0], rows.sampling, rows.n)
                out = out.put(live, first, logprobs(o.logits[:, 0], first, top))
                rows1 = _advance(rows, live, first, S)
                accept = live & ~rows1.done & (first == rows.draft)
                second = sample(o.logits[:, 1], rows.sampling, rows1.n)
                out = out.put(accept, second, logprobs(o.logits[:, 1], second, top))
                rows2 = _advance(rows1, accept, second, S)
                # the MTP module fills its cache at the last two indices (accepted: h_p with
                # token p+1, h_p+1 with p+2; rejected: h_p-1 with p, h_p with p+1; an index it
                # already holds gets the same entry again) and drafts from the last
                h = jnp.where(accept[:, None, None], o.hidden,
                              jnp.stack([rows.h_prev.astype(o.hidden.dtype), o.hidden[:, 0]], 1))
                x = jnp.where(accept[:, None], jnp.stack([first, second], 1), jnp.stack([rows.tok, first], 1))
                idx = jnp.maximum(rows2.pos[:, None] - 2 + jnp.arange(2, dtype=jnp.int32)[None], 0)
                d = model.draft(h, x, idx, o.kv, at=jnp.ones((B, 1), jnp.int32))
                draft = argmax(d.logits[:, 0])
                rows2 = dataclasses.replace(rows2, draft=jnp.where(live, draft, rows.draft),
                                            h_prev=jnp.where(live[:, None], h[:, 1].astype(rows.h_prev.dtype), rows.h_prev))
                out = out.count_draft(live, accept)
                return rows2, d.kv, out

            body = spec if speculative else plain

            def cond(c):
                i, rows, _, _ = c
                return (i < steps) & ~jnp.all(rows.done)

            def step(c):
                i, rows, kv, out = c
                return (i + 1, *body(i, rows, kv, out))

            _, rows, kv, out = jax.lax.while_loop(cond, step, (jnp.int32(0), rows, kv, out))
            kv = dataclasses.replace(kv, attend=None)
            return jax.tree.map(lambda a, x: a.at[:rows_bucket].set(x), slots, rows), kv, out

        return decode

    # ------------------------------------------------------------------ host side
    def cache_line(self, rows: int, max_len: int) -> str:
        return cachelib.describe(self.m, self.cache_dtype, rows, max_len)

    # ------------------------------------------------------------------ slots
    def new_slots(self, n: int, max_len: int, speculative: bool = False) -> "Slots":
        """`n` empty decode slots (rounded up to the mesh's batch shards) of `max_len` positions."""
        n = -(-n // self.batch_shards) * self.batch_shards
        key = (n, max_len, speculative)
        kv = self._caches.pop(key, None)
        if kv is None:
            kv = dataclasses.replace(cachelib.zeros(self.m, n, max_len, self.cache_dtype, self.mesh,
                                                    mtp=speculative, unrolled=True, bits=True), absorbed=True)
        rows = self._rows([], n)
        return Slots(dataclasses.replace(rows, done=self._put(np.ones(n, bool))), kv, speculative)

    def release(self, slots: "Slots") -> None:
        """Keep `slots`' cache for the next `new_slots` of its shape (no new allocation)."""
        self._caches[(slots.size, slots.max_len, slots.speculative)] = slots.kv

    def insert(self, slots: "Slots", reqs: list[Request], at: list[int], top: int | None = None,
               routes: bool = False):
        """Prefill `reqs` into the free slots `at` (one pass over the right-padded prompts):
        (slots, per request (first token, its logprob, top ids, top logprobs, the prompt's expert
        ids [len, L, k] or None)) on the host. `top`: how many alternatives' logprobs the step
        computes (None: none); `routes`: record the expert ids (`Request.routing`)."""
        for r in reqs:
            if not r.prompt_ids:
                raise ValueError("a prompt needs at least one token")
            if len(r.prompt_ids) >= slots.max_len:
                raise ValueError(f"a prompt of {len(r.prompt_ids)} tokens does not fit the cache's "
                                 f"{slots.max_len} positions")
        P = -(-bucket(len(reqs)) // self.batch_shards) * self.batch_shards
        T = min(bucket(max(len(r.prompt_ids) for r in reqs), 16), slots.max_len)
        ids = np.zeros((P, T), np.int32)
        lengths = np.ones((P,), np.int32)
        for i, r in enumerate(reqs):
            ids[i, :len(r.prompt_ids)] = r.prompt_ids
            lengths[i] = len(r.prompt_ids)
        where = np.full((P,), slots.size, np.int32)                   # padding rows: dropped
        where[:len(reqs)] = at
        self._check_routes(routes, slots.speculative)
        step = self._prefill_step(slots.speculative, top, routes)
        rows, kv, (tok, lp, route) = step(self.params, self._put(ids), self._put(lengths), self._rows(reqs, P),
                                          self._put(where), slots.rows, slots.kv)
        tok, (chosen, top_ids, top_lp), route = jax.device_get((tok, lp, route))
        n = len(reqs)
        prompt_routes = [None if route is None else np.asarray(route[i, :lengths[i]]) for i in range(n)]
        return Slots(rows, kv, slots.speculative), list(zip(tok[:n], chosen[:n], top_ids[:n], top_lp[:n],
                                                            prompt_routes))

    @property
    def _route_shape(self) -> tuple[int, int]:
        return (self.m.num_moe_layers, self.m.num_experts_per_tok)

    def _check_routes(self, routes: bool, speculative: bool) -> None:
        if routes and self.m.num_moe_layers == 0:
            raise ValueError("routing: the model has no MoE layer to record expert ids of")
        if routes and speculative:
            raise ValueError("routing is recorded without speculative decoding only")

    def step(self, slots: "Slots", rows: int, steps: int, top: int | None = None, attend: int | None = None,
             routes: bool = False):
        """Decode the first `rows` slots (a multiple of the batch shards) for up to `steps` steps,
        stopping early once all of them are done: (slots, and on the host the Emitted tokens,
        each of those slots' done and stopped-by-a-stop-token flags). `attend`: attention reads
        only the cache's first `attend` positions; the caller guarantees every live row's
        position stays below it through the steps (`attend_bucket`)."""
        if attend is not None and attend >= slots.max_len:
            attend = None
        self._check_routes(routes, slots.speculative)
        decode = self._decode_step(rows, steps, slots.speculative, top, attend, routes)
        r, kv, out = decode(self.params, slots.rows, slots.kv)
        em, done, stopped = jax.device_get((out, r.done[:rows], r.stopped[:rows]))
        self.stats["drafted"] += int(em.drafted)
        self.stats["accepted"] += int(em.accepted)
        return Slots(r, kv, slots.speculative), em, np.asarray(done), np.asarray(stopped)

    def finish(self, slots: "Slots", which: list[int]) -> "Slots":
        """Mark slots done (a stop string matched on the host, a cancelled request)."""
        if not which:
            return slots
        return dataclasses.replace(slots, rows=dataclasses.replace(
            slots.rows, done=slots.rows.done.at[jnp.asarray(which)].set(True)))

    # ------------------------------------------------------------------ whole batches
    def generate(self, requests: list[Request], *, speculative: bool = False,
                 on_text: Callable[[int, str], None] | None = None) -> list[Completion]:
        """Completions in request order. `on_text(i, delta)` receives request i's text as it is
        produced (needs a tokenizer); the deltas concatenate to its final `completion`."""
        if speculative and self.m.num_nextn_predict_layers < 1:
            raise ValueError("speculative decoding needs an MTP module (num_nextn_predict_layers >= 1)")
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].prompt_ids))
        results: list[Completion | None] = [None] * len(requests)
        B = self.infer.batch_size
        for start in range(0, len(order), B):
            group = order[start:start + B]
            for i, c in zip(group, self._run([requests[i] for i in group], speculative,
                                             None if on_text is None else (lambda j, d, g=group: on_text(g[j], d)))):
                results[i] = c
        return results

    def shapes_for(self, requests: list[Request]) -> tuple[int, int, int]:
        """(rows, prompt length, cache length) buckets a batch of requests runs with."""
        rows = bucket(len(requests))
        rows = -(-rows // self.batch_shards) * self.batch_shards
        T = bucket(max(len(r.prompt_ids) for r in requests), 16)
        need = max(len(r.prompt_ids) + r.max_new_tokens for r in requests) + 1
        S = self.infer.max_len or bucket(max(need, T))
        S = max(S, T)
        return rows, T, S

    def _run(self, reqs: list[Request], speculative: bool, on_text) -> list[Completion]:
        """One batch: every request into a slot of its own, decoded until all are done."""
        t0 = time.perf_counter()
        n = len(reqs)
        Bb, T, S = self.shapes_for(reqs)
        if self.infer.max_len and max(len(r.prompt_ids) for r in reqs) >= S:
            raise ValueError(f"a prompt of {max(len(r.prompt_ids) for r in reqs)} tokens does not fit "
                             f"infer.max_len={S}")
        want_lp = any(r.logprobs is not None for r in reqs)
        top = max(r.logprobs or 0 for r in reqs) if want_lp else None
        routes = any(r.routing for r in reqs)
        streams = [Stream(r, self.tokenizer, None if on_text is None else (lambda d, i=i: on_text(i, d)), want_lp)
                   for i, r in enumerate(reqs)]
        slots, first = self.insert(self.new_slots(Bb, S, speculative), reqs, list(range(n)), top, routes)
        self.stats["first_token_s"] = time.perf_counter() - t0
        for st, f in zip(streams, first):
            st.prompt_routes = f[4]
            st.push([f[0]], [f[1]], [f[2]], [f[3]])
        done, stopped = (np.array(a)[:n] for a in jax.device_get((slots.rows.done, slots.rows.stopped)))
        while True:
            stop_now = [i for i, st in enumerate(streams) if st.cut is not None and not done[i]]
            slots = self.finish(slots, stop_now)
            done[stop_now] = True
            if done.all():
                break
            # attention reads only as far as the furthest live row writes in this chunk (moe_small,
            # batch 32, 64 + 64 tokens: 256 positions -> 128, 16.2 -> 13.4 ms a step)
            reach = max(attend_reach(reqs[i], len(streams[i].ids), self.infer.decode_chunk, speculative)
                        for i in range(n) if not done[i])
            attend = attend_bucket(reach, S, factor=2)
            slots, em, done, stopped = self.step(slots, Bb, self.infer.decode_chunk, top, attend, routes)
            done, stopped = done[:n].copy(), stopped[:n]
            for i, st in enumerate(streams):
                st.push_emitted(em, i)
        self.release(slots)
        return [st.finish(bool(stopped[i])) for i, st in enumerate(streams)]

    def _put(self, a):
        return jax.device_put(a, meshlib.batch_sharding(self.mesh))

    def _rows(self, reqs: list[Request], Bb: int) -> Rows:
        pad = Request(prompt_ids=(0,), max_new_tokens=1)
        full = list(reqs) + [pad] * (Bb - len(reqs))
        stop = np.full((Bb, MAX_STOP_IDS), -1, np.int32)
        for i, r in enumerate(full):
            ids = list(r.stop_token_ids) + ([] if r.ignore_eos or self.eos_id is None else [self.eos_id])
            if len(ids) > MAX_STOP_IDS:
                raise ValueError(f"at most {MAX_STOP_IDS} stop token ids per request (EOS included)")
            stop[i, :len(ids)] = ids
        D = self.m.hidden_size
        rows = Rows(tok=np.zeros(Bb, np.int32), pos=np.zeros(Bb, np.int32), n=np.zeros(Bb, np.int32),
                    done=np.zeros(Bb, bool), stopped=np.zeros(Bb, bool),
                    max_new=np.asarray([r.max_new_tokens for r in full], np.int32), stop_ids=stop,
                    sampling=Sampling(np.asarray([r.temperature for r in full], np.float32),
                                      np.asarray([r.top_k for r in full], np.int32),
                                      np.asarray([r.top_p for r in full], np.float32),
                                      np.asarray([r.min_p for r in full], np.float32),
                                      np.asarray([r.seed for r in full], np.uint32)),
                    draft=np.zeros(Bb, np.int32), h_prev=np.zeros((Bb, D), self.dtype))
        return self._put(rows)             # one transfer of the tree (per leaf: twice the host time)


# ---------------------------------------------------------------------- device helpers
def attend_reach(req: Request, generated: int, steps: int, speculative: bool) -> int:
    """The cache positions a decode call of `steps` steps can touch for a row of `req` that has
    `generated` completion tokens: its next token goes in at prompt + generated - 1 and it feeds
    at most its remaining budget, one token a step (speculating: two, and the draft's position
    one further)."""
    per = 2 if speculative else 1
    return len(req.prompt_ids) + generated - 1 + (per - 1) + min(steps * per, req.max_new_tokens - generated)


def attend_bucket(positions: int, max_len: int, lo: int = 64, factor: int = 4) -> int | None:
    """The attention length for a decode call whose rows reach `positions` positions: `lo` times
    a power of `factor` (the server: 4, few executables per slot bucket; a batch: 2, at most
    twice the positions read), None when that is the whole cache."""
    n = lo
    while n < positions:
        n *= factor
    return None if n >= max_len else n


def kv_len(kv: KV) -> int:
    return next(iter(kv.stacks.values())).shape[2]


def _is_stop(tok, stop_ids):
    return jnp.any(tok[:, None] == stop_ids, axis=-1)


def _advance(rows: Rows, live, tok, S: int) -> Rows:
    """Row state after emitting `tok` where `live`: it becomes the token to feed next."""
    stop = live & _is_stop(tok, rows.stop_ids)
    n = rows.n + live
    pos = rows.pos + live
    done = rows.done | stop | (live & ((n >= rows.max_new) | (pos >= S)))
    return dataclasses.replace(rows, tok=jnp.where(live, tok, rows.tok), pos=pos, n=n, done=done,
                               stopped=rows.stopped | stop)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Emitted:
    """Tokens a decode call emitted, per row in order: [B, cap] with `count` [B] filled."""
    tokens: jax.Array
    lp: jax.Array
    top_ids: jax.Array
    top_lp: jax.Array
    route: jax.Array                 # [B, cap, L, k] the fed token's expert ids ([B, cap, 0, 0]: not recorded)
    count: jax.Array
    drafted: jax.Array
    accepted: jax.Array

    @staticmethod
    def empty(B: int, cap: int, top: int, route: tuple[int, int] = (0, 0)) -> "Emitted":
        return Emitted(jnp.zeros((B, cap), jnp.int32), jnp.zeros((B, cap), jnp.float32),
                       jnp.zeros((B, cap, top), jnp.int32), jnp.zeros((B, cap, top), jnp.float32),
                       jnp.zeros((B, cap, *route), jnp.int32), jnp.zeros((B,), jnp.int32), jnp.int32(0), jnp.int32(0))

    def put(self, live, tok, lps, route=None) -> "Emitted":
        chosen, top_ids, top_lp = lps
        B = tok.shape[0]
        col = jnp.where(live, self.count, self.tokens.shape[1])       # out of range: dropped
        rows = jnp.arange(B)
        return dataclasses.replace(
            self, tokens=self.tokens.at[rows, col].set(tok, mode="drop"),
            lp=self.lp.at[rows, col].set(chosen, mode="drop"),
            top_ids=self.top_ids.at[rows, col].set(top_ids, mode="drop"),
            top_lp=self.top_lp.at[rows, col].set(top_lp, mode="drop"),
            route=self.route if route is None else self.route.at[rows, col].set(route, mode="drop"),
            count=self.count + live)

    def count_draft(self, live, accept) -> "Emitted":
        return dataclasses.replace(self, drafted=self.drafted + live.sum(), accepted=self.accepted + accept.sum())


def _routes(aux: dict, B: int) -> jax.Array:
    """The MoE stack's expert ids [L, B*T, k] of a model output as [B, T, L, k]."""
    idx = aux["idx"]
    L, _, k = idx.shape
    return jnp.moveaxis(idx.reshape(L, B, -1, k), 0, 2)


STACKS = {"dense_layers": "dense", "moe_layers": "moe"}


EXPERT_WEIGHTS = ("gate_EDF", "up_EDF", "down_EFD")
JOINED = (("gate_EDF", "up_EDF"), ("gate_DF", "up_DF"))     # (gate, up) leaf names `_unstacked` joins


def _unstacked(state: nnx.State, split_experts: bool, dtype=None):
    """((the state without its layer stacks, {stack: one state per layer}), the stacks' leaves
    as ShapeDtypeStructs). Generation runs the stacks unrolled (`Stack.__call__`); each layer's
    arrays are sliced out once here, and the stacked originals are not kept. With
    `split_experts`, each routed-expert weight becomes a tuple of per-expert arrays (the
    `grouped` dispatch reads a selected expert in place; a slice of a stack would be a copy).
    Unless quantised, every SwiGLU's gate and up (each routed expert's under `split_experts`,
    the shared experts' and dense layers') are joined into one [D, 2F] array under the gate's
    name, the up leaf holding None: a decode step's matrix-vector products stream one 2F-wide
    matrix faster than two F-wide ones (`dispatch.join_gate_up` has the measurements).
    Unless quantised, MLA's up-projections are held heads first (`mla.HeadsMajor`), as absorbed
    decode reads them. With `dtype`, floating weights are cast to it as `_in_compute_dtype` does.

    The slices and casts are one compiled call (`_cut`), not one dispatch each: GRPO reloads the
    generator every step, and tiny.yaml's few thousand eager slices took about 30 ms of an 80 ms
    rollout."""
    flat = list(nnx.to_flat_state(state))
    where = {path: i for i, (path, _) in enumerate(flat)}

    def join(path, var):
        """The index of the `up` leaf a `gate` leaf takes in, -1 for that `up` leaf, else None."""
        names = next((p for p in JOINED if path[-1] in p), None)
        if names is None or (names == JOINED[0] and not split_experts):
            return None
        pair = [where.get(path[:-1] + (name,)) for name in names]
        if None in pair or any(isinstance(flat[i][1].get_value(), quant.QArray) for i in pair):
            return None
        return pair[1] if path[-1] == names[0] else -1

    plan = tuple((_stack_layers(path, var), split_experts and path[-1] in EXPERT_WEIGHTS,
                  None if dtype is None or _keeps_dtype(path, var.get_value()) else jnp.dtype(dtype).name,
                  join(path, var),
                  path[-1] if path[-1] in HEADS_MAJOR and not isinstance(var.get_value(), quant.QArray) else None)
                 for path, var in flat)
    cut = _cut(plan)([var.get_value() for _, var in flat])
    rest, abstract, layers = [], [], {}
    for (path, var), (n, _, cast, *_), value in zip(flat, plan, cut):
        if not n:
            rest.append((path, var.replace(value)))
            continue
        a = var.get_value()
        abstract.append((path, var.replace(jax.ShapeDtypeStruct(a.shape, jnp.dtype(cast or a.dtype)))))
        per = layers.setdefault(STACKS[path[0]], [[] for _ in range(n)])
        for i in range(n):
            per[i].append((path[2:], var.replace(value[i])))
    params = (nnx.from_flat_state(rest), {k: [nnx.from_flat_state(v) for v in per] for k, per in layers.items()})
    return params, nnx.from_flat_state(abstract)


def _stack_layers(path, var) -> int:
    """The number of layers of a stacked leaf (0: not in a layer stack)."""
    return var.get_value().shape[0] if STACKS.get(path[0]) is not None and path[1] == "layers" else 0


@functools.lru_cache(maxsize=8)
def _cut(plan: tuple) -> Callable:
    """The jitted slicing and casting of `_unstacked`'s leaves for one plan: per leaf
    (layers to slice out or 0, split the experts, cast to this dtype or None, join: the `up`
    leaf this `gate` leaf takes in, -1 for that `up` leaf (None after), None; the up-projection
    to hold heads first or None)."""
    def leaf(a, split, cast, heads):
        if cast is not None:
            a = a.astype(cast)
        if heads is not None:
            return HeadsMajor.of(a, heads)
        return tuple(a[e] for e in range(a.shape[0])) if split else a

    def run(values):
        out = [leaf(a, split, cast, heads) if not n else [leaf(a[i], split, cast, heads) for i in range(n)]
               for a, (n, split, cast, _, heads) in zip(values, plan)]
        for i, (n, _, _, j, _) in enumerate(plan):
            if j is not None and j >= 0:
                out[i] = ([dispatch.join_gate_up(g, u) for g, u in zip(out[i], out[j])] if n
                          else dispatch.join_gate_up(out[i], out[j]))
                out[j] = [None] * n if n else None
        return out
    return jax.jit(run)


def _keeps_dtype(path, x) -> bool:
    """Leaves generation keeps as they are: the router (it computes in fp32), quantised weights,
    integer leaves."""
    return (any(str(p).startswith("router") for p in path) or isinstance(x, quant.QArray)
            or not jnp.issubdtype(x.dtype, jnp.floating))


def _in_compute_dtype(state: nnx.State, dtype) -> nnx.State:
    """Parameters stored in the compute dtype (a decode step reads every weight once: casting
    fp32 masters each step would read twice the bytes), the router kept in fp32 as it computes."""
    def one(path, x):
        return x if _keeps_dtype(path, x) else x.astype(dtype)
    return nnx.from_flat_state([(p, v.replace(one(p, v.get_value()))) for p, v in nnx.to_flat_state(state)])


# ---------------------------------------------------------------------- host bookkeeping
@dataclasses.dataclass
class Slots:
    """Decode slots on the device: the per-slot state `rows` [n] and the cache [n, S].
    `Generator.insert` prefills requests into free slots, `Generator.step` decodes the first
    slots, `Generator.finish` stops some; a done slot emits nothing and may be refilled."""
    rows: Rows
    kv: KV
    speculative: bool

    @property
    def size(self) -> int:
        return self.rows.tok.shape[0]

    @property
    def max_len(self) -> int:
        return kv_len(self.kv)


class Stream:
    """One request's completion on the host: ids, logprobs, text through `tokenizers`'
    DecodeStream (never a split UTF-8 character), stop strings, and `on_text(delta)` streaming."""

    def __init__(self, req: Request, tokenizer=None, on_text: Callable[[str], None] | None = None,
                 want_lp: bool = False):
        from tokenizers import decoders
        self.req, self.tok, self.on_text, self.want_lp = req, tokenizer, on_text, want_lp
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.tops: list[dict] = []
        self.routes: list[np.ndarray] = []
        self.prompt_routes: np.ndarray | None = None
        self.text = ""
        self.sent = 0
        self.cut: int | None = None      # token count where a stop string ended
        # special tokens (EOS) stay in the ids but not in the text, as vLLM and the OpenAI API;
        # text token by token only where something reads it so (a stop string, `on_text`): else
        # `finish` decodes the ids once (GRPO's 16 x 64-token rollouts: about 1 ms of host time)
        incremental = tokenizer is not None and (on_text is not None or any(req.stop))
        self.stream = decoders.DecodeStream(skip_special_tokens=True) if incremental else None
        self.hold = max([len(s) for s in req.stop] + [1]) - 1

    def push(self, toks, lps, top_ids, top_lp, routes=None) -> None:
        if self.stream is None:                  # nothing to match or send per token
            n = len(toks)
            self.ids.extend(int(t) for t in toks)
            if routes is not None:
                self.routes.extend(routes[j] for j in range(n))
            if self.want_lp:
                self.lps.extend(float(x) for x in lps[:n])
                self.tops.extend({int(a): float(b) for a, b in zip(top_ids[j], top_lp[j])} for j in range(n))
            return
        for j, t in enumerate(toks):
            if self.cut is not None:
                return
            self.ids.append(int(t))
            if routes is not None:
                self.routes.append(routes[j])
            if self.want_lp:
                self.lps.append(float(lps[j]))
                self.tops.append({int(a): float(b) for a, b in zip(top_ids[j], top_lp[j])})
            if self.stream is not None:
                piece = self.stream.step(self.tok, int(t))
                if piece:
                    before = len(self.text)
                    self.text += piece
                    self._match_stop(max(0, before - self.hold))
            self._send(final=False)

    def push_emitted(self, em: "Emitted", row: int) -> None:
        c = int(em.count[row])
        if c:
            self.push(em.tokens[row, :c], em.lp[row, :c], em.top_ids[row, :c], em.top_lp[row, :c],
                      em.route[row, :c] if self.req.routing else None)

    def _match_stop(self, start: int) -> None:
        """Cut the text at the first stop string that ends in the new piece (one that began
        earlier would have been found earlier: it cannot start before `start`)."""
        hits = [h for h in (self.text.find(s, start) for s in self.req.stop if s) if h >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.cut = len(self.ids)

    def _send(self, final: bool) -> None:
        if self.on_text is None:
            return
        upto = len(self.text) if (final or self.cut is not None) else len(self.text) - self.hold
        if upto > self.sent:
            self.on_text(self.text[self.sent:upto])
            self.sent = upto

    def finish(self, stopped: bool) -> Completion:
        """The completion; `stopped`: the device stopped the row on a stop token."""
        if self.tok is not None and self.cut is None:
            # DecodeStream holds back a character whose bytes have not all come; at the end
            # they never will: the text ends as the whole decode does (U+FFFD for the bytes)
            full = self.tok.decode(self.ids, skip_special_tokens=True)
            if full.startswith(self.text) and len(full) > len(self.text):
                before = len(self.text)
                self.text = full
                self._match_stop(max(0, before - self.hold))
        reason = "stop" if (self.cut is not None or stopped) else "length"
        self._send(final=True)
        r = self.req
        routing = None
        if r.routing:
            # the prompt's positions, then each fed completion token's (all but the last token)
            fed = self.routes[:max(len(self.ids) - 1, 0)]
            routing = np.concatenate([self.prompt_routes, *(x[None] for x in fed)]).astype(np.int32)
        return Completion(self.ids, self.text if self.tok is not None else None, reason, len(r.prompt_ids),
                          len(self.ids), self.lps if r.logprobs is not None else None,
                          self.tops if r.logprobs else None, routing)

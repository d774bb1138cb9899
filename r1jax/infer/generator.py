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
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from r1jax import model as modellib
from r1jax.config import InferConfig, KernelConfig, ModelConfig, MoEDispatch
from r1jax.infer import cache as cachelib
from r1jax.infer.sampling import Sampling, argmax, logprobs, sample
from r1jax.model.kv import KV
from r1jax.parallel import mesh as meshlib

MAX_STOP_IDS = 8          # stop token ids per request (EOS included), padded with -1
MAX_TOP_LOGPROBS = 20     # OpenAI's limit
# XLA:CPU compiles dots into YNNPACK fusions by default; at decode's few-row matmuls its Eigen
# dots are faster (moe_small decode through this Generator, quiet 2-core EPYC: batch 8 22.2 ->
# 17.0 ms a step, batch 32 38.1 -> 32.8). Set per executable, for the decode and prefill steps only.
CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


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


@dataclasses.dataclass
class Completion:
    completion_ids: list[int]
    completion: str | None
    finish_reason: str               # "stop" (a stop token or string) or "length"
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None


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
    (a named `infer.moe_decode` tiles by `infer.decode_tile`); bench/moe_decode.py measures it
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
                 tokenizer=None, split_experts: bool | None = None):
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
        self.params, self._abstract_stacks = _unstacked(_in_compute_dtype(state, self.dtype), self.split_experts)
        self._steps: dict = {}
        self._graphdefs: dict = {}
        self._caches: dict = {}
        spec = meshlib.batch_sharding(self.mesh).spec
        axes = spec[0] if len(spec) else None
        axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        self.batch_shards = math.prod(self.mesh.shape[a] for a in axes)
        self.stats = {"drafted": 0, "accepted": 0}

    # ------------------------------------------------------------------ compiled steps
    def _graphdef(self, kernels: KernelConfig):
        if kernels not in self._graphdefs:
            self._graphdefs[kernels] = modellib.abstract(self.m, kernels, self.dtype)[0]
        return self._graphdefs[kernels]

    def _jit(self, key, build, donate):
        if key not in self._steps:
            cpu = self.mesh.devices.flat[0].platform == "cpu"
            fn = jax.jit(build(), donate_argnums=donate, compiler_options=CPU_OPTIONS if cpu else None)
            self._steps[key] = meshlib.MeshedJit(fn, self.mesh)
        return self._steps[key]

    def _prefill_step(self, speculative: bool, top: int | None):
        return self._jit(("prefill", speculative, top), lambda: self._prefill_fn(speculative, top), (3, 4))

    def _decode_step(self, rows_bucket: int, steps: int, speculative: bool, top: int | None):
        return self._jit(("decode", rows_bucket, steps, speculative, top),
                         lambda: self._decode_fn(rows_bucket, steps, speculative, top), (1, 2))

    def _model(self, kernels: KernelConfig, params):
        """The model over (rest, per-layer states) `params`; its stacks' own leaves stay abstract."""
        rest, layers = params
        return nnx.merge(self._graphdef(kernels), rest, self._abstract_stacks), layers

    def _prefill_fn(self, speculative: bool, top: int | None):
        def prefill(params, ids, lengths, rows: Rows, kv: KV):
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
            out = model(ids, jnp.broadcast_to(t, (B, T)), seg, kv=kv, at=last, layers=layers)
            logits = out.logits[:, 0]
            tok = sample(logits, rows.sampling, jnp.zeros((B,), jnp.int32))
            lp = logprobs(logits, tok, top)
            stop = _is_stop(tok, rows.stop_ids)
            rows = dataclasses.replace(rows, tok=tok, pos=lengths, n=jnp.ones_like(lengths),
                                       done=stop | (rows.max_new <= 1) | (lengths >= kv_len(kv)),
                                       stopped=stop)
            kv = out.kv
            if speculative:
                # the MTP module's cache for indices 0..len-1 (h_t with token t+1; the last
                # index pairs with the token just sampled) and its draft for the next token
                nxt = jnp.where(t == last, tok[:, None], jnp.roll(ids, -1, axis=1))
                d = model.draft(out.hidden, nxt, jnp.broadcast_to(t, (B, T)), kv, at=last)
                h_prev = jnp.take_along_axis(out.hidden, last[:, :, None], axis=1)[:, 0]
                rows = dataclasses.replace(rows, draft=argmax(d.logits[:, 0]),
                                           h_prev=h_prev.astype(rows.h_prev.dtype))
                kv = d.kv
            return rows, dataclasses.replace(kv, absorbed=True), lp

        return prefill

    def _decode_fn(self, rows_bucket: int, steps: int, speculative: bool, top: int | None):
        per_iter = 2 if speculative else 1
        kernels = decode_kernels(self.kernels, self.infer, self.m, rows_bucket * per_iter // self.batch_shards,
                                 self.split_experts)

        def decode(params, rows: Rows, kv: KV):
            model, layers = self._model(kernels, params)
            B = rows.tok.shape[0]
            S = kv_len(kv)
            out = Emitted.empty(B, steps * per_iter, top or 0)

            def plain(i, rows, kv, out):
                o = model(rows.tok[:, None], rows.pos[:, None], kv=kv, layers=layers)
                logits = o.logits[:, 0]
                tok = sample(logits, rows.sampling, rows.n)
                live = ~rows.done
                out = out.put(live, tok, logprobs(logits, tok, top))
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
            return rows, kv, out

        return decode

    # ------------------------------------------------------------------ host side
    def cache_line(self, rows: int, max_len: int) -> str:
        return cachelib.describe(self.m, self.cache_dtype, rows, max_len)

    def _cache(self, rows: int, max_len: int, mtp: bool) -> KV:
        key = (rows, max_len, mtp)
        kv = self._caches.pop(key, None)
        if kv is None:
            kv = cachelib.zeros(self.m, rows, max_len, self.cache_dtype, self.mesh, mtp=mtp, unrolled=True)
        return dataclasses.replace(kv, absorbed=False)

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
        for r in reqs:
            if not r.prompt_ids:
                raise ValueError("a prompt needs at least one token")
        n = len(reqs)
        Bb, T, S = self.shapes_for(reqs)
        if self.infer.max_len and max(len(r.prompt_ids) for r in reqs) >= S:
            raise ValueError(f"a prompt of {max(len(r.prompt_ids) for r in reqs)} tokens does not fit "
                             f"infer.max_len={S}")
        want_lp = any(r.logprobs is not None for r in reqs)
        top = max(r.logprobs or 0 for r in reqs) if want_lp else None
        ids = np.zeros((Bb, T), np.int32)
        lengths = np.ones((Bb,), np.int32)
        for i, r in enumerate(reqs):
            ids[i, :len(r.prompt_ids)] = r.prompt_ids
            lengths[i] = len(r.prompt_ids)
        rows = self._rows(reqs, Bb)
        kv = self._cache(Bb, S, speculative)
        prefill = self._prefill_step(speculative, top)
        rows, kv, first = prefill(self.params, self._put(ids), self._put(lengths), rows, kv)
        host = _HostRows(reqs, self.tokenizer, on_text, want_lp)
        host.add_first(*jax.device_get((first, rows.tok)))
        decode = self._decode_step(Bb, self.infer.decode_chunk, speculative, top)
        while True:
            done = np.array(jax.device_get(rows.done))[:n]
            stop_now = host.check_stops()
            if stop_now:
                rows = dataclasses.replace(rows, done=rows.done.at[jnp.asarray(stop_now)].set(True))
                done[stop_now] = True
            if done.all():
                break
            rows, kv, out = decode(self.params, rows, kv)
            em = jax.device_get(out)
            self.stats["drafted"] += int(em.drafted)
            self.stats["accepted"] += int(em.accepted)
            host.add(em)
        self._caches[(Bb, S, speculative)] = kv
        r = jax.device_get(rows)
        return host.finish(r.stopped[:n], S)

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
        return jax.tree.map(self._put, rows)


# ---------------------------------------------------------------------- device helpers
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
    count: jax.Array
    drafted: jax.Array
    accepted: jax.Array

    @staticmethod
    def empty(B: int, cap: int, top: int) -> "Emitted":
        return Emitted(jnp.zeros((B, cap), jnp.int32), jnp.zeros((B, cap), jnp.float32),
                       jnp.zeros((B, cap, top), jnp.int32), jnp.zeros((B, cap, top), jnp.float32),
                       jnp.zeros((B,), jnp.int32), jnp.int32(0), jnp.int32(0))

    def put(self, live, tok, lps) -> "Emitted":
        chosen, top_ids, top_lp = lps
        B = tok.shape[0]
        col = jnp.where(live, self.count, self.tokens.shape[1])       # out of range: dropped
        rows = jnp.arange(B)
        return dataclasses.replace(
            self, tokens=self.tokens.at[rows, col].set(tok, mode="drop"),
            lp=self.lp.at[rows, col].set(chosen, mode="drop"),
            top_ids=self.top_ids.at[rows, col].set(top_ids, mode="drop"),
            top_lp=self.top_lp.at[rows, col].set(top_lp, mode="drop"),
            count=self.count + live)

    def count_draft(self, live, accept) -> "Emitted":
        return dataclasses.replace(self, drafted=self.drafted + live.sum(), accepted=self.accepted + accept.sum())


STACKS = {"dense_layers": "dense", "moe_layers": "moe"}


EXPERT_WEIGHTS = ("gate_EDF", "up_EDF", "down_EFD")


def _unstacked(state: nnx.State, split_experts: bool):
    """((the state without its layer stacks, {stack: one state per layer}), the stacks' leaves
    as ShapeDtypeStructs). Generation runs the stacks unrolled (`Stack.__call__`); each layer's
    arrays are sliced out once here, and the stacked originals are not kept. With
    `split_experts`, each routed-expert weight becomes a tuple of per-expert arrays (the
    `grouped` dispatch reads a selected expert in place; a slice of a stack would be a copy)."""
    def split(path, var, a):
        if split_experts and path[-1] in EXPERT_WEIGHTS:
            return var.replace(tuple(a[e] for e in range(a.shape[0])))
        return var.replace(a)

    rest, abstract, layers = [], [], {}
    for path, var in nnx.to_flat_state(state):
        name = STACKS.get(path[0])
        if name is None or path[1] != "layers":
            rest.append((path, split(path, var, var.get_value())))
            continue
        a = var.get_value()
        abstract.append((path, var.replace(jax.ShapeDtypeStruct(a.shape, a.dtype))))
        per = layers.setdefault(name, [[] for _ in range(a.shape[0])])
        for i in range(a.shape[0]):
            per[i].append((path[2:], split(path, var, a[i])))
    params = (nnx.from_flat_state(rest), {k: [nnx.from_flat_state(v) for v in per] for k, per in layers.items()})
    return params, nnx.from_flat_state(abstract)


def _in_compute_dtype(state: nnx.State, dtype) -> nnx.State:
    """Parameters stored in the compute dtype (a decode step reads every weight once: casting
    fp32 masters each step would read twice the bytes), the router kept in fp32 as it computes."""
    def one(path, x):
        keep = any(str(p).startswith("router") for p in path)
        return x if keep or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)
    return nnx.from_flat_state([(p, v.replace(one(p, v.get_value()))) for p, v in nnx.to_flat_state(state)])


# ---------------------------------------------------------------------- host bookkeeping
class _HostRows:
    """Per-request completion ids, text, stop strings and streaming on the host."""

    def __init__(self, reqs: list[Request], tokenizer, on_text, want_lp: bool):
        from tokenizers import decoders
        self.reqs, self.tok, self.on_text, self.want_lp = reqs, tokenizer, on_text, want_lp
        n = len(reqs)
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.lps: list[list[float]] = [[] for _ in range(n)]
        self.tops: list[list[dict]] = [[] for _ in range(n)]
        self.text = [""] * n
        self.sent = [0] * n
        self.cut: list[int | None] = [None] * n      # token count where a stop string ended
        # special tokens (EOS) stay in the ids but not in the text, as vLLM and the OpenAI API
        self.streams = [decoders.DecodeStream(skip_special_tokens=True) for _ in range(n)] if tokenizer else None
        self.hold = [max([len(s) for s in r.stop] + [1]) - 1 for r in reqs]

    def _push(self, i: int, toks, lps, top_ids, top_lp):
        for j, t in enumerate(toks):
            if self.cut[i] is not None:
                return
            self.ids[i].append(int(t))
            if self.want_lp:
                self.lps[i].append(float(lps[j]))
                self.tops[i].append({int(a): float(b) for a, b in zip(top_ids[j], top_lp[j])})
            if self.streams is not None:
                piece = self.streams[i].step(self.tok, int(t))
                if piece:
                    before = len(self.text[i])
                    self.text[i] += piece
                    self._match_stop(i, max(0, before - self.hold[i]))
            self._stream(i, final=False)

    def _match_stop(self, i: int, start: int):
        """Cut the text at the first stop string that ends in the new piece (one that began
        earlier would have been found earlier: it cannot start before `start`)."""
        hits = [h for h in (self.text[i].find(s, start) for s in self.reqs[i].stop if s) if h >= 0]
        if hits:
            self.text[i] = self.text[i][:min(hits)]
            self.cut[i] = len(self.ids[i])

    def _stream(self, i: int, final: bool):
        if self.on_text is None:
            return
        upto = len(self.text[i]) if (final or self.cut[i] is not None) else len(self.text[i]) - self.hold[i]
        if upto > self.sent[i]:
            self.on_text(i, self.text[i][self.sent[i]:upto])
            self.sent[i] = upto

    def add_first(self, first, toks):
        chosen, top_ids, top_lp = first
        for i in range(len(self.reqs)):
            self._push(i, [toks[i]], [chosen[i]], [top_ids[i]], [top_lp[i]])

    def add(self, em: Emitted):
        for i in range(len(self.reqs)):
            c = int(em.count[i])
            if c:
                self._push(i, em.tokens[i, :c], em.lp[i, :c], em.top_ids[i, :c], em.top_lp[i, :c])

    def check_stops(self) -> list[int]:
        """Rows a stop string finished since the last call (the device must stop them)."""
        new = [i for i, c in enumerate(self.cut) if c is not None and i not in getattr(self, "_told", set())]
        self._told = getattr(self, "_told", set()) | set(new)
        return new

    def finish(self, stopped, S: int) -> list[Completion]:
        out = []
        for i, r in enumerate(self.reqs):
            ids = self.ids[i]
            if self.cut[i] is not None:
                reason = "stop"
            else:
                reason = "stop" if stopped[i] else "length"
            self._stream(i, final=True)
            text = self.text[i] if self.tok is not None else None
            out.append(Completion(ids, text, reason, len(r.prompt_ids), len(ids),
                                  self.lps[i] if r.logprobs is not None else None,
                                  self.tops[i] if r.logprobs else None))
        return out

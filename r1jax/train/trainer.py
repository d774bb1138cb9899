"""The training loop: data, model, optimizer, jitted step, logging, eval, checkpoints, preemption.

Run directory layout:
    config.yaml        the resolved config of the run
    tokenizer.json     the tokenizer (trained on the corpus unless data.tokenizer names one)
    metrics.jsonl      one JSON object per logged step (and per eval, with "split": "eval")
    tensorboard/       tensorboardX event files (train/*, eval/*, moe/*)
    checkpoints/       Orbax steps (items params, opt_state, meta, data) + model_config.json
    final.json         last metrics, eval results, compile time, MFU peak used
    loss.png           loss curves, written at the end

Starting on a run directory that holds checkpoints resumes from the latest one with the very
next batch. SIGTERM or SIGUSR1 (what SLURM sends before a time limit or a preemption) lets the
current step finish, saves, prints "preempted at step S" and returns normally; with several
processes, all of them stop at the same step whichever received the signal.

Several processes (r1jax.launch, srun): process 0 trains the tokenizer, the others wait and load
it; each process reads `distributed.data_shards / process_count` data shards. A checkpoint whose
data stream was read with another shard count or data.workers restores everything but the data
iterator; the stream restarts at the saved step with a fresh shuffle seeded by (train.seed, step),
and one line says so.
"""
from __future__ import annotations

import json
import math
import signal
import threading
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import psutil
from flax import nnx

from r1jax import config as configlib
from r1jax import model as modellib
from r1jax.config import Config, ConfigError, ModelConfig
from r1jax.data import tokenizer as toklib
from r1jax.data.corpus import describe, open_corpus
from r1jax.data.pipeline import ShardsIterator, lm_batches, saved_workers, split_documents
from r1jax.model.params import count as count_params
from r1jax.parallel import distributed
from r1jax.parallel import mesh as meshlib
from r1jax.parallel import pipeline
from r1jax.parallel.pipeline import Layout
from r1jax.train import checkpoint as ckpt
from r1jax.train import mfu, optim
from r1jax.train.metrics import MetricsWriter, Progress, log_line
from r1jax.train.step import batch_sharding, init_state, make_eval_step, make_train_step

BYTES_PER_PARAM = 8    # fp32 master + fp32 gradient, plus Adam's mu and nu in optim.moment_dtype
ITEMS = ("params", "opt_state", "meta", "data")
# keys that change only how r1jax trains or runs, not the weights a checkpoint holds
RUN_ONLY_KEYS = {"mtp_loss_weight", "bias_update_rate", "seq_aux_loss_alpha", "init_from", "moe_dispatch",
                 "capacity_factor", "moe_tile_size", "attention", "attention_block", "hf_config", "num_nextn_predict_layers",
                 "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"}


def preflight(cfg: Config, devices: list) -> None:
    """Refuse, before any compile, a model whose weights, gradients and Adam state cannot fit."""
    n = count_params(cfg.model).total
    need = n * (BYTES_PER_PARAM + 2 * jnp.dtype(optim.MOMENT_DTYPES[cfg.optim.moment_dtype]).itemsize)
    limits = [(d.memory_stats() or {}).get("bytes_limit") if d.platform != "cpu" else None for d in devices]
    if any(limits):
        have, where = sum(x or 0 for x in limits), f"{len(devices)} {devices[0].platform} devices"
    else:   # CPU devices share the host's RAM
        have, where = psutil.virtual_memory().total, f"this host's RAM ({len(devices)} CPU devices)"
    if need > have:
        raise ConfigError(
            f"model: {n / 1e9:.1f}B parameters need {need / 2**30:,.0f} GiB for fp32 weights, gradients and "
            f"Adam state, but {where} hold {have / 2**30:,.0f} GiB; train it on a GPU cluster with a mesh "
            f"that spreads it (see README, 'Scale'), or shrink the model")


def _tokenizer(cfg: Config, run_dir: Path, docs):
    cached = run_dir / "tokenizer.json"
    if cfg.data.tokenizer:
        tok = toklib.load(cfg.data.tokenizer)
    else:
        # process 0 trains (or finds) it; the others wait for the file rather than train their own
        if jax.process_index() == 0 and not cached.is_file():
            t0 = time.time()
            tok = toklib.train_on(docs, cfg.model.vocab_size, cfg.data.tokenizer_train_mb)
            tok.save(str(cached))
            log_line(f"trained a byte-level BPE tokenizer ({tok.get_vocab_size()} tokens) on up to "
                     f"{cfg.data.tokenizer_train_mb:g} MB of the corpus in {time.time() - t0:.1f}s")
        distributed.barrier("r1jax: tokenizer.json written")
        tok = toklib.load(cached)
    if tok.get_vocab_size() > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size}: the tokenizer has {tok.get_vocab_size()} "
                          f"tokens; vocab_size must be at least that")
    if jax.process_index() == 0 and not cached.is_file():
        tok.save(str(cached))
    return tok


# ------------------------------------------------------------------------------ weights
def _same_architecture(cfg: ModelConfig, other: ModelConfig, source: str) -> None:
    for key, value in configlib.to_dict(cfg).items():
        if key not in RUN_ONLY_KEYS and configlib.to_dict(other)[key] != value:
            raise ConfigError(f"model.init_from: {source} has {key}={configlib.to_dict(other)[key]} "
                              f"but the config says {key}={value}")


def _initial_model(cfg: Config, mesh, dtype, layout: Layout | None = None) -> modellib.Transformer:
    """Fresh weights, or those named by model.init_from (MTP modules it lacks stay fresh)."""
    m, t = cfg.model, cfg.train
    if not m.init_from:
        return modellib.build(m, mesh, seed=t.seed, dtype=dtype, remat=t.remat, layout=layout)
    kind, path = m.init_from.split(":", 1)
    if not Path(path).is_dir():
        raise ConfigError(f"model.init_from={m.init_from}: {path} is not a directory")
    graphdef, abs_state = modellib.abstract(m, mesh, dtype, t.remat, layout)
    abs_leaves = modellib.leaves(abs_state)
    if layout is not None and not layout.identity:       # sources hold the MoE stack in model order
        model_order = modellib.leaves(modellib.abstract(m, mesh, dtype, t.remat)[1])
        abs_leaves = {p: (model_order[p] if p[0] == "moe_layers" else a) for p, a in abs_leaves.items()}
    if kind == "hf":
        from r1jax.convert import hf
        src_cfg, loaded = hf.load(path, mesh=mesh, dtype=dtype, remat=t.remat)
        _same_architecture(m, src_cfg, path)
        values = modellib.leaves(nnx.state(loaded))
        del loaded
    else:
        src_cfg = ckpt.read_model_config(path)
        _same_architecture(m, src_cfg, path)
        reader = ckpt.ParamsReader(path)
        keys = [p for p in abs_leaves if ckpt.path_key(p) in reader.shapes]
        values = reader.read_all(keys, {p: abs_leaves[p].sharding for p in keys})
    missing = [p for p in abs_leaves if p not in values]
    if missing:
        if any(p[0] != "mtp" for p in missing):
            raise ConfigError(f"model.init_from: {path} lacks {'/'.join(map(str, missing[0]))}")
        fresh = modellib.leaves(nnx.state(modellib.build(m, mesh, seed=t.seed, dtype=dtype, remat=t.remat)))
        values.update({p: fresh[p] for p in missing})
        log_line(f"init_from {path}: no MTP weights there; MTP modules start fresh")
    log_line(f"initial weights from {m.init_from}")
    state = modellib.with_leaves(modellib.abstract(m, mesh, dtype, t.remat)[1], values)
    if layout is not None and not layout.identity:
        target = jax.tree.map(lambda a: a.sharding, abs_state)
        state = jax.jit(lambda st: modellib.to_layout(st, layout), out_shardings=target)(state)
    return nnx.merge(graphdef, state)


# -------------------------------------------------------------------------- checkpoints
def _manager(run_dir: Path, cfg: Config) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.checkpoint.keep, enable_async_checkpointing=True,
        save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(cfg.checkpoint.every))
    return ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options, item_names=ITEMS,
                                 item_handlers={"data": grain.checkpoint.CheckpointHandler()})


def _model_tree(state) -> dict:
    return ckpt.nest(modellib.leaves(state["params"]) | modellib.leaves(state["rest"]))


def _save(mngr, state, data_iter, force: bool = False, data_meta: dict | None = None,
          layout: Layout | None = None) -> None:
    step = int(state["step"])
    meta = {"step": step, "rng": np.asarray(state["rng"]).tolist(),
            **({"moe_layout": layout.meta()} if layout is not None and not layout.identity else {}),
            "loss_scale": float(state["loss_scale"]["scale"]),
            "loss_scale_good_steps": int(state["loss_scale"]["good_steps"]), **(data_meta or {})}
    mngr.save(step, force=force, args=ocp.args.Composite(
        params=ocp.args.StandardSave(_model_tree(state)), opt_state=ocp.args.StandardSave(state["opt"]),
        meta=ocp.args.JsonSave(meta), data=grain.checkpoint.CheckpointSave(data_iter)))


def _is_stack(path) -> bool:
    """A leaf of the MoE stack (parameter, router bias, or their optimizer moments)?"""
    return any(getattr(k, "key", getattr(k, "name", k)) == "moe_layers" for k in path)


def _restore(mngr, step: int, state, shardings, data_iter, layout: Layout | None):
    """The saved state onto `shardings`; `data_iter` is restored in place unless it is None.

    A checkpoint whose MoE stack is in another pipeline layout (other stages or repeats) is read
    with the stack's slot axis unsharded and moved into this run's layout, leaf by leaf."""
    saved_meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    n = layout.layers if layout is not None else next(
        (a.shape[0] for p, a in modellib.leaves(state["params"]).items() if p[0] == "moe_layers"), 0)
    saved = Layout.from_meta(saved_meta["moe_layout"]) if "moe_layout" in saved_meta else Layout(n)
    here = layout or Layout(n)
    moved = not (saved.identity and here.identity) and saved != here

    def spot(path, a, sh):
        """Where a leaf is read from the checkpoint: its saved shape, and for moved stack leaves a
        sharding without the pipeline axis on the slot dimension."""
        if not (moved and _is_stack(path)):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
        spec = list(sh.spec) + [None] * (a.ndim - len(sh.spec))
        spec[0] = None
        return jax.ShapeDtypeStruct((saved.slots, *a.shape[1:]), a.dtype,
                                    sharding=jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*spec)))

    def place(path, a, sh):
        if not (moved and _is_stack(path)):
            return a
        return jax.jit(lambda x: here.to_slots(saved.to_layers(x)), out_shardings=sh)(a)

    flat = modellib.leaves(state["params"]) | modellib.leaves(state["rest"])
    flat_sh = modellib.leaves(shardings["params"]) | modellib.leaves(shardings["rest"])
    abstract = ckpt.nest({p: spot(("moe_layers",) if p[0] == "moe_layers" else (), a, flat_sh[p])
                          for p, a in flat.items()})
    opt_target = jax.tree_util.tree_map_with_path(spot, state["opt"], shardings["opt"])
    r = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract),
        opt_state=ocp.args.StandardRestore(opt_target),
        meta=ocp.args.JsonRestore(),
        **({} if data_iter is None else {"data": grain.checkpoint.CheckpointRestore(data_iter)})))
    values = {}
    for p in flat:
        node = r["params"]
        for k in ckpt.path_key(p):
            node = node[k]
        values[p] = place(("moe_layers",) if p[0] == "moe_layers" else (), node, flat_sh[p])
    opt = jax.tree_util.tree_map_with_path(place, r["opt_state"], shardings["opt"])
    if moved:
        log_line(f"checkpoint step {step}: MoE stack moved from pipeline layout {saved.meta()} to {here.meta()}")
    meta = r["meta"]
    small = {"step": jnp.int32(meta["step"]), "rng": jnp.asarray(meta["rng"], jnp.uint32),
             "loss_scale": {"scale": jnp.float32(meta["loss_scale"]),
                            "good_steps": jnp.int32(meta["loss_scale_good_steps"])}}
    return {"params": modellib.with_leaves(state["params"], values),
            "rest": modellib.with_leaves(state["rest"], values), "opt": opt,
            **jax.device_put(small, {k: shardings[k] for k in small})}


# --------------------------------------------------------------------------------- data
def _check_process_rows(bsharding, batch: int, seq_len: int) -> None:
    """Each process feeds its own rows: that needs its devices to hold their own batch shards,
    i.e. the axes the batch is not sharded over (tensor, pipeline) must not span processes."""
    if jax.process_count() == 1:
        return
    local = {idx[0].indices(batch)[:2] for idx in bsharding.addressable_devices_indices_map((batch, seq_len)).values()}
    total = {idx[0].indices(batch)[:2] for idx in bsharding.devices_indices_map((batch, seq_len)).values()}
    if len(local) * jax.process_count() != len(total):
        raise ConfigError(f"mesh: {dict(bsharding.mesh.shape)} puts replicas of a batch shard in different "
                          f"processes (mesh.tensor x mesh.pipeline must fit in one process's "
                          f"{jax.local_device_count()} devices); each process reads its own rows")


def _train_batches(cfg: Config, docs, indices, tok, eos, data_meta: dict):
    """This process's training batches: its data_shards / process_count shards side by side."""
    t, d = cfg.train, cfg.data
    shards = data_meta["data_shards"]
    per = shards // jax.process_count()
    first = jax.process_index() * per
    its = [iter(lm_batches(docs, indices, tok, eos, seq_len=d.seq_len, batch_size=t.global_batch_size // shards,
                           seed=data_meta["data_seed"], shard_index=s, shard_count=shards,
                           block_size=d.block_size, workers=d.workers)) for s in range(first, first + per)]
    return its[0] if per == 1 else ShardsIterator(its)


def _data_start(cfg: Config, mngr, step: int | None) -> tuple[dict, bool]:
    """The data stream's seed and shard count, and whether checkpoint `step`'s iterator state fits
    it. It does not when it was saved by another number of processes, shards or data.workers (Grain
    keeps one state per process): then the stream restarts at `step` with a seed from (seed, step)."""
    procs, seed = jax.process_count(), cfg.train.seed
    shards = cfg.distributed.data_shards or procs
    if shards % procs:
        raise ConfigError(f"distributed.data_shards={shards}: must be a multiple of the process count ({procs})")
    if step is None:
        return {"data_seed": seed, "data_shards": shards}, False
    saved = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    files = sorted((Path(str(mngr.directory)) / str(step) / "data").glob("process_*-of-*.json"))
    saved_procs = int(files[0].stem.rsplit("-of-", 1)[1]) if files else 0
    saved_shards = saved.get("data_shards", saved_procs)
    saved_work = saved_workers(json.loads(files[0].read_text())) if files else 0
    if (saved_procs, saved_shards, saved_work) == (procs, shards, cfg.data.workers):
        return {"data_seed": saved.get("data_seed", seed), "data_shards": shards}, True
    new_seed = int(np.random.SeedSequence([seed, step]).generate_state(1)[0] % 2**31)
    log_line(f"data: checkpoint step {step} read the data as {saved_shards} shards on {saved_procs} processes "
             f"with data.workers={saved_work}, this run reads {shards} on {procs} with data.workers="
             f"{cfg.data.workers}: restarting the data stream at step {step}, reshuffled with seed {new_seed} "
             f"(from train.seed={seed} and the step)")
    return {"data_seed": new_seed, "data_shards": shards}, False


_EARLY = {"signum": 0}


def catch_stop_signals_early() -> None:
    """Record SIGTERM/SIGUSR1 from process start (their default action kills the process), so a
    signal that arrives while the run starts up still ends in a checkpoint at the first step."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, lambda signum, frame: _EARLY.update(signum=signum))


class _StopSignal:
    """SIGTERM/SIGUSR1 set a flag the loop checks between steps (handlers only in the main thread).

    With several processes the flag is voted on every step (`agreed`), so that all of them stop
    at the same step even when only one was signalled."""

    def __init__(self):
        self.signum, _EARLY["signum"] = _EARLY["signum"], 0
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                self._old[sig] = signal.signal(sig, self._handle)
        self._vote = distributed.StopVote() if jax.process_count() > 1 else None

    def _handle(self, signum, frame):
        self.signum = signum

    def agreed(self) -> str | None:
        """The signal to stop on; call once per step on every process."""
        signum = self.signum if self._vote is None else self._vote(self.signum)
        return signal.Signals(signum).name if signum else None

    def restore(self):
        for sig, h in self._old.items():
            signal.signal(sig, h)


# --------------------------------------------------------------------------------- loop
def train(cfg: Config, run_dir: str | Path) -> dict[str, float]:
    """Train per `cfg` in `run_dir`, resuming from its latest checkpoint. Returns final metrics."""
    run_dir = Path(run_dir)
    devices = jax.devices()
    preflight(cfg, devices)
    mesh = meshlib.make_mesh(cfg.mesh, devices)
    t, d, m = cfg.train, cfg.data, cfg.model
    docs = open_corpus(d)
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(configlib.dump_yaml(cfg))
    tok = _tokenizer(cfg, run_dir, docs)
    eos = toklib.eos_id(tok)
    split = split_documents(len(docs), d.eval_fraction, t.seed)
    log_line(f"corpus: {describe(docs)}; {len(split.eval)} documents held out; mesh {dict(mesh.shape)}")

    dtype = modellib.COMPUTE_DTYPES[t.dtype]
    mngr = _manager(run_dir, cfg)
    resume = mngr.latest_step()
    data_meta, restore_data = _data_start(cfg, mngr, resume)
    data_iter = _train_batches(cfg, docs, split.train, tok, eos, data_meta)
    layout = pipeline.mesh_layout(cfg, mesh)
    model = (modellib.build(m, mesh, seed=t.seed, dtype=dtype, remat=t.remat, layout=layout) if resume is not None
             else _initial_model(cfg, mesh, dtype, layout))
    n = count_params(m)
    log_line(f"model: {n.main / 1e6:.1f}M parameters (+{n.mtp / 1e6:.1f}M MTP), {n.activated / 1e6:.1f}M "
             f"activated per token; compute {t.dtype.value}, remat {t.remat.value}, grad_accum {t.grad_accum}")
    if layout is not None:
        r = layout.repeats
        log_line(f"pipeline: {layout.stages} stages x {r} repeats, schedule {cfg.pipeline.schedule.value}, "
                 f"{t.microbatches} microbatches; {layout.layers} MoE layers in {layout.slots} slots "
                 f"({layout.chunk} per virtual stage); bubble (P-1)/(M*R+P-1) = "
                 f"{pipeline.bubble(layout.stages, t.microbatches, r):.3f}")
    if t.remat.value == "offload" and devices[0].platform == "cpu":
        log_line("note: remat=offload on CPU: device memory is host memory, so offloading saves nothing here")
    tx = optim.make(cfg.optim, t.steps)
    graphdef, state, shardings = init_state(model, tx, mesh, cfg)
    del model
    step_fn = make_train_step(graphdef, tx, cfg, mesh, shardings, optim.schedule(cfg.optim, t.steps))
    bsharding = batch_sharding(mesh)
    _check_process_rows(bsharding, t.global_batch_size, d.seq_len)
    if jax.process_index() == 0:
        ckpt.write_model_config(run_dir / "checkpoints", m)
    if resume is not None:
        state = _restore(mngr, resume, state, shardings, data_iter if restore_data else None, layout)
        log_line(f"resumed from {run_dir / 'checkpoints' / str(resume)} (step {resume})")
    start = int(state["step"])
    end = min(t.steps, t.stop_at) if t.stop_at else t.steps

    flops = mfu.flops_per_token(m, d.seq_len)
    peak, peak_how = mfu.peak_flops(devices, t.dtype)
    writer = MetricsWriter(run_dir, t.steps)
    progress = Progress(t.steps, start)
    stop = _StopSignal()
    block_each_step = len(devices) > 1 and devices[0].platform == "cpu"   # avoid CPU collective starvation
    tokens_per_step = t.global_batch_size * d.seq_len
    last_t, last_step, compile_s, window, stopped = time.time(), start, None, [], None
    if jax.process_count() > 1:
        # compile first, then start together: a process that reaches a collective more than 30 s
        # before another (compile times differ) fails in gloo's context set-up
        step_fn.lower(state, {k: jax.ShapeDtypeStruct((t.global_batch_size, d.seq_len), jnp.int32, sharding=bsharding)
                              for k in ("ids", "segment_ids", "positions")}).compile()
        distributed.barrier("r1jax: train step compiled")
    try:
        for step in range(start, end):
            batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(bsharding, x), next(data_iter))
            state, metrics = step_fn(state, batch)
            window.append(metrics)
            done = step + 1
            if block_each_step or step == start:
                jax.block_until_ready(metrics)
                if step == start:
                    compile_s = time.time() - last_t
                    last_t, last_step = time.time(), done
            progress.update(done, metrics if progress.live else None)
            if done % t.log_every == 0 or done == t.steps:
                vals = _summarise(jax.device_get(window))
                window = []
                now = time.time()
                vals["step_time"] = (now - last_t) / max(done - last_step, 1)
                vals["tokens_per_s"] = tokens_per_step / max(vals["step_time"], 1e-9)
                vals["mfu"] = flops * vals["tokens_per_s"] / peak
                last_t, last_step = now, done
                writer.write(done, vals)
                progress.log(done, vals)
            asked = stop.agreed()
            paused = time.time()       # eval and checkpoint time is kept out of tokens/s
            if t.eval_every and done % t.eval_every == 0 and done < t.steps:
                _evaluate(cfg, graphdef, mesh, shardings, state, docs, split, tok, eos, writer, done)
            if asked or (done == end < t.steps):
                stopped = asked or "train.stop_at"
                break
            if mngr.should_save(done):
                _save(mngr, state, data_iter, data_meta=data_meta, layout=layout)
            last_t += time.time() - paused
    finally:
        stop.restore()
        progress.close()

    final = {k: v for k, v in (writer.records[-1] if writer.records else {}).items() if k != "step"}
    done = int(state["step"])
    if stopped is None and t.eval_batches and split.eval:
        final.update({f"eval_{k}": v for k, v in
                      _evaluate(cfg, graphdef, mesh, shardings, state, docs, split, tok, eos, writer, done).items()})
    if mngr.latest_step() != done:
        _save(mngr, state, data_iter, force=True, data_meta=data_meta, layout=layout)
    mngr.wait_until_finished()
    mngr.close()
    if hasattr(data_iter, "close"):
        data_iter.close()          # stops mp_prefetch workers cleanly
    writer.plot(run_dir / "loss.png")
    writer.close()
    final.update(compile_s=compile_s, mfu_peak_flops=peak, mfu_peak=peak_how, stopped=stopped)
    if jax.process_index() == 0:
        (run_dir / "final.json").write_text(json.dumps({"step": done, **final}, indent=2))
    if stopped:
        log_line(f"preempted at step {done} ({stopped}); checkpoint saved" if stopped != "train.stop_at"
                 else f"stopped at step {done} (train.stop_at); checkpoint saved")
    return final


def _summarise(window: list[dict]) -> dict:
    """Mean of each metric over the logged window; per-layer expert imbalance kept as a list."""
    out = {}
    for k in window[-1]:
        vals = np.asarray([w[k] for w in window], np.float64)
        if vals.ndim == 2:
            per_layer = vals.mean(0)
            out[k] = float(per_layer.max())
            out[k + "_layers"] = [float(x) for x in per_layer]
        else:
            out[k] = float(vals.mean())
    for k in ("lr", "loss_scale"):
        out[k] = float(np.asarray(window[-1][k]))
    out["skipped"] = float(sum(float(w["skipped"]) for w in window))
    return out


def _evaluate(cfg: Config, graphdef, mesh, shardings, state, docs, split, tok, eos, writer, step) -> dict:
    t, d = cfg.train, cfg.data
    procs = jax.process_count()
    eval_fn = make_eval_step(graphdef, cfg, mesh, shardings)
    bsharding = batch_sharding(mesh)
    it = iter(lm_batches(docs, split.eval, tok, eos, seq_len=d.seq_len, batch_size=t.global_batch_size // procs,
                         seed=t.seed, shard_index=jax.process_index(), shard_count=procs, epochs=1,
                         shuffle_rows=0, block_size=d.block_size))
    total = count = 0.0
    for _ in range(t.eval_batches):
        try:
            local = next(it)
        except StopIteration:
            break
        if local["ids"].shape[0] != t.global_batch_size // procs:
            break
        batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(bsharding, x), local)
        s, c = eval_fn(state, batch)
        total, count = total + float(s), count + float(c)
    if count == 0:
        return {}
    loss = total / count
    out = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}
    writer.write(step, out, prefix="eval")
    log_line(f"eval @ {step}: loss {loss:.4f}, perplexity {out['perplexity']:.2f} over {int(count)} tokens")
    return out

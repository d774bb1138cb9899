"""The training loop: data, model, optimizer, jitted step, logging, eval, checkpoints.

Run directory layout:
    config.yaml        the resolved config of the run
    tokenizer.json     the tokenizer (trained on the corpus unless data.tokenizer names one)
    metrics.jsonl      one JSON object per logged step (and per eval, with "split": "eval")
    tensorboard/       tensorboardX event files (train/*, eval/*)
    checkpoints/       Orbax steps (items params, opt_state, meta, data) + model_config.json
    loss.png           loss curves, written at the end
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import psutil

from r1jax import config as configlib
from r1jax import model as modellib
from r1jax.config import Config, ConfigError
from r1jax.data import tokenizer as toklib
from r1jax.data.corpus import TextFiles
from r1jax.data.pipeline import lm_batches, split_documents
from r1jax.model.params import count as count_params
from r1jax.parallel import mesh as meshlib
from r1jax.train import checkpoint as ckpt
from r1jax.train import optim
from r1jax.train.metrics import MetricsWriter, log_line
from r1jax.train.step import batch_sharding, init_state, make_eval_step, make_train_step

BYTES_PER_PARAM = 16   # fp32 master + fp32 gradient + Adam mu and nu


def preflight(cfg: Config, devices: list) -> None:
    """Refuse, before any compile, a model whose weights, gradients and Adam state cannot fit."""
    n = count_params(cfg.model).total
    need = n * BYTES_PER_PARAM
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


def _tokenizer(cfg: Config, run_dir: Path, docs: TextFiles):
    cached = run_dir / "tokenizer.json"
    if cfg.data.tokenizer:
        tok = toklib.load(cfg.data.tokenizer)
    elif cached.is_file():
        tok = toklib.load(cached)
    else:
        limit = int(cfg.data.tokenizer_train_mb * 2**20)

        def texts():
            seen = 0
            for i in range(len(docs)):
                text = docs[i]
                seen += len(text)
                yield text
                if seen >= limit:
                    return

        t0 = time.time()
        tok = toklib.train(texts(), cfg.model.vocab_size)
        log_line(f"trained a byte-level BPE tokenizer ({tok.get_vocab_size()} tokens) on "
                 f"{min(limit, docs.total_bytes()) / 2**20:.1f} MB in {time.time() - t0:.1f}s")
    if tok.get_vocab_size() > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size}: the tokenizer has {tok.get_vocab_size()} "
                          f"tokens; vocab_size must be at least that")
    if jax.process_index() == 0 and not cached.is_file():
        tok.save(str(cached))
    return tok


def _manager(run_dir: Path, cfg: Config) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.checkpoint.keep, enable_async_checkpointing=True,
        save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(cfg.checkpoint.every))
    return ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options,
                                 item_names=("params", "opt_state", "meta", "data"),
                                 item_handlers={"data": grain.checkpoint.CheckpointHandler()})


def _save_args(state, data_iter, extra: dict):
    model_state = ckpt.nest(modellib.leaves(state["params"]) | modellib.leaves(state["rest"]))
    return ocp.args.Composite(
        params=ocp.args.StandardSave(model_state),
        opt_state=ocp.args.StandardSave(state["opt"]),
        meta=ocp.args.JsonSave({"step": int(state["step"]), **extra}),
        data=grain.checkpoint.CheckpointSave(data_iter))


def _restore(mngr: ocp.CheckpointManager, step: int, state, shardings, data_iter):
    def target(tree, sh):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, sh)
    params_flat = modellib.leaves(state["params"]) | modellib.leaves(state["rest"])
    sh_flat = modellib.leaves(shardings["params"]) | modellib.leaves(shardings["rest"])
    abstract = ckpt.nest({p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh_flat[p])
                          for p, a in params_flat.items()})
    r = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract),
        opt_state=ocp.args.StandardRestore(target(state["opt"], shardings["opt"])),
        meta=ocp.args.JsonRestore(),
        data=grain.checkpoint.CheckpointRestore(data_iter)))
    flat = {}
    for p in params_flat:
        node = r["params"]
        for k in ckpt.path_key(p):
            node = node[k]
        flat[p] = node
    return {"params": modellib.with_leaves(state["params"], flat),
            "rest": modellib.with_leaves(state["rest"], flat),
            "opt": r["opt_state"],
            "step": jax.device_put(jnp.int32(r["meta"]["step"]), shardings["step"])}


def train(cfg: Config, run_dir: str | Path) -> dict[str, float]:
    """Train per `cfg` in `run_dir`, resuming from its latest checkpoint. Returns final metrics."""
    run_dir = Path(run_dir)
    devices = jax.devices()
    preflight(cfg, devices)
    mesh = meshlib.make_mesh(cfg.mesh, devices)
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(configlib.dump_yaml(cfg))

    t, d, m = cfg.train, cfg.data, cfg.model
    docs = TextFiles.from_config(d)
    tok = _tokenizer(cfg, run_dir, docs)
    eos = toklib.eos_id(tok)
    split = split_documents(len(docs), d.eval_fraction, t.seed)
    procs = jax.process_count()
    local_batch = t.global_batch_size // procs
    data = lm_batches(docs, split.train, tok, eos, seq_len=d.seq_len, batch_size=local_batch, seed=t.seed,
                      shard_index=jax.process_index(), shard_count=procs)
    data_iter = iter(data)
    log_line(f"corpus: {len(docs)} documents ({docs.total_bytes() / 2**20:.1f} MB, {docs.skipped_empty} empty "
             f"skipped), {len(split.eval)} held out; mesh {dict(mesh.shape)}")

    dtype = modellib.COMPUTE_DTYPES[t.dtype]
    model = modellib.build(m, mesh, seed=t.seed, dtype=dtype, remat=t.remat)
    n = count_params(m)
    log_line(f"model: {n.main / 1e6:.1f}M parameters (+{n.mtp / 1e6:.1f}M MTP), "
             f"{n.activated / 1e6:.1f}M activated per token; compute {t.dtype.value}, remat {t.remat.value}")
    tx = optim.make(cfg.optim, t.steps)
    graphdef, state, shardings = init_state(model, tx, mesh)
    del model
    step_fn = make_train_step(graphdef, tx, cfg, mesh, shardings, optim.schedule(cfg.optim, t.steps))
    bsharding = batch_sharding(mesh)

    mngr = _manager(run_dir, cfg)
    ckpt.write_model_config(run_dir / "checkpoints", m)
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.latest_step()
        state = _restore(mngr, start, state, shardings, data_iter)
        log_line(f"resumed from {run_dir / 'checkpoints' / str(start)}")

    writer = MetricsWriter(run_dir, t.steps)
    block_each_step = len(devices) > 1 and devices[0].platform == "cpu"   # avoid CPU collective starvation
    tokens_per_step = t.global_batch_size * d.seq_len
    last_t, last_step, metrics, compile_s = time.time(), start, {}, None
    window: list[dict] = []       # device-side metrics since the last log line, averaged when logged
    for step in range(start, t.steps):
        batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(bsharding, x), next(data_iter))
        state, metrics = step_fn(state, batch)
        window.append(metrics)
        if block_each_step or step == start:
            jax.block_until_ready(metrics)
            if step == start:
                compile_s = time.time() - last_t
                last_t = time.time()
                last_step = step + 1
        done = step + 1
        if done % t.log_every == 0 or done == t.steps:
            fetched = jax.device_get(window)
            vals = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[-1]}
            vals["lr"] = float(fetched[-1]["lr"])
            window = []
            now = time.time()
            steps_run = max(done - last_step, 1)
            vals["step_time"] = (now - last_t) / steps_run
            vals["tokens_per_s"] = tokens_per_step / max(vals["step_time"], 1e-9)
            last_t, last_step = now, done
            writer.write(done, vals)
            writer.console(done, vals)
        paused = time.time()        # eval and checkpoint time is kept out of tokens/s
        if t.eval_every and done % t.eval_every == 0 and done < t.steps:
            _evaluate(cfg, graphdef, mesh, shardings, state, docs, split, tok, eos, writer, done)
        if mngr.should_save(done):
            mngr.save(done, args=_save_args(state, data_iter, {"loss": float(metrics["loss"])}))
        last_t += time.time() - paused

    final = dict(writer.records[-1]) if writer.records else {}
    final.pop("step", None)
    if t.eval_batches and split.eval:
        final.update({f"eval_{k}": v for k, v in
                      _evaluate(cfg, graphdef, mesh, shardings, state, docs, split, tok, eos, writer, t.steps).items()})
    if mngr.latest_step() != t.steps:
        mngr.save(t.steps, args=_save_args(state, data_iter, {"loss": final.get("loss", math.nan)}), force=True)
    mngr.wait_until_finished()
    mngr.close()
    writer.plot(run_dir / "loss.png")
    writer.close()
    if compile_s is not None:
        final["compile_s"] = compile_s
    if jax.process_index() == 0:
        (run_dir / "final.json").write_text(json.dumps({"step": t.steps, **final}, indent=2))
    return final


def _evaluate(cfg: Config, graphdef, mesh, shardings, state, docs, split, tok, eos, writer, step) -> dict:
    t, d = cfg.train, cfg.data
    procs = jax.process_count()
    eval_fn = make_eval_step(graphdef, cfg, mesh, shardings)
    bsharding = batch_sharding(mesh)
    it = iter(lm_batches(docs, split.eval, tok, eos, seq_len=d.seq_len, batch_size=t.global_batch_size // procs,
                         seed=t.seed, shard_index=jax.process_index(), shard_count=procs, epochs=1))
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

"""`train(cfg, run_dir)`: a pre-training run wired from the reusable parts.

config -> mesh -> data (corpus, tokenizer, Grain batches) -> weights (r1jax/weights.py) ->
state (r1jax/train/state.py) -> jitted step for the objective (step.py, objectives.py) ->
the loop (loop.py) with the checkpointer (r1jax/checkpoint/) and the metrics writer.

Run directory layout:
    config.yaml        the resolved config of the run
    tokenizer.json     the tokenizer (trained on the corpus unless data.tokenizer names one)
    metrics.jsonl      one JSON object per logged step (and per eval, with "split": "eval")
    tensorboard/       tensorboardX event files (train/*, eval/*, moe/*)
    checkpoints/       Orbax steps (items params, opt_state, meta, data) + model_config.json
    final.json         last metrics, eval results, compile time, MFU peak used
    loss.png           loss curves, written at the end

Starting on a run directory that holds checkpoints resumes from the latest one with the very
next batch, restoring straight into the abstract state (nothing is initialised first). SIGTERM
or SIGUSR1 lets the current step finish, saves, prints "preempted at step S" and returns
normally; with several processes, all of them stop at the same step whichever received it.

Several processes (r1jax.launch, srun): process 0 trains the tokenizer, the others wait and load
it; each process reads `distributed.data_shards / process_count` data shards. A checkpoint whose
data stream was read with another shard count or data.workers restores everything but the data
iterator; the stream restarts at the saved step with a fresh shuffle seeded by (train.seed, step),
and one line says so.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import psutil
from flax import nnx

from r1jax import config as configlib
from r1jax import weights
from r1jax.checkpoint.manager import CheckpointCorrupt, Checkpointer
from r1jax.config import Config, ConfigError, DataSource, ObjectiveKind
from r1jax.data import chat, sft, tasks
from r1jax.data import tokenizer as toklib
from r1jax.data.pipeline import ShardsIterator, lm_batches, saved_workers, split_documents
from r1jax.data.sources import describe, open_corpus
from r1jax.model.params import count as count_params
from r1jax.parallel import distributed
from r1jax.parallel import mesh as meshlib
from r1jax.parallel import pipeline
from r1jax.train import guard, loop, mfu, objectives, optim
from r1jax.train import state as statelib
from r1jax.train.metrics import MetricsWriter, log_line
from r1jax.train.step import make_eval_step, make_train_step

BYTES_PER_PARAM = 8    # fp32 master + fp32 gradient, plus Adam's mu and nu in optim.moment_dtype
LM_KEYS = ("ids", "segment_ids", "positions")      # what the text pipeline's batches hold
SFT_KEYS = (*LM_KEYS, "loss_mask")                   # ... and the chat pipeline's (data/sft.py)


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


def _tokenizer(cfg: Config, run_dir: Path, docs, extra_specials=(), extra_tokens=()):
    cached = run_dir / "tokenizer.json"
    source = _source_tokenizer(cfg)
    if cfg.data.tokenizer or source:
        tok = toklib.load(cfg.data.tokenizer or source)
    else:
        # process 0 trains (or finds) it; the others wait for the file rather than train their own
        if jax.process_index() == 0 and not cached.is_file():
            t0 = time.time()
            tok = toklib.train_on(docs, cfg.model.vocab_size, cfg.data.tokenizer_train_mb, extra_specials, extra_tokens)
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


def _source_tokenizer(cfg: Config) -> Path | None:
    """A fine-tune's tokenizer when data.tokenizer names none: that of the directory
    model.init_from (else a distillation's teacher) reads: an HF directory's tokenizer.json, or
    the run directory around an orbax: checkpoints/ directory. A model trained on other ids than
    a fresh BPE's."""
    kd = cfg.distill.teacher if cfg.loss.objective is ObjectiveKind.kd else None
    for spec in (cfg.model.init_from, kd):
        if spec:
            d = Path(spec.split(":", 1)[1])
            for p in (d / "tokenizer.json", d.parent / "tokenizer.json"):
                if p.is_file():
                    return p
    return None


def chat_tokenizer(cfg: Config, run_dir: Path, texts: list[str]):
    """(tokenizer, chat template) of a chat run (SFT, distillation, GRPO): the tokenizer as
    `_tokenizer` finds or trains it (with R1's markers and think tags as whole tokens), and the
    template of the directory it came from when that has one, else R1's."""
    tok = _tokenizer(cfg, run_dir, texts, chat.MARKERS, chat.THINK)
    where = cfg.data.tokenizer or _source_tokenizer(cfg)
    return tok, chat.for_directory(None if where is None else Path(where).parent if Path(where).is_file()
                                   else Path(where))


def teacher_logits(cfg: Config, mesh) -> Callable[[dict], jax.Array]:
    """Logit distillation's teacher (distill.teacher), frozen on the run's mesh in model order:
    batch -> its logits [B, T, W] (float32, sharded like the batch). Its compute dtype is the
    run's; it never runs MTP."""
    spec = cfg.distill.teacher
    src = weights.source_model(spec, "distill.teacher")
    if src.vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"distill.teacher={spec}: its vocabulary has {src.vocab_size} entries and the "
                          f"student's model.vocab_size is {cfg.model.vocab_size}; logit distillation needs the "
                          f"same vocabulary (sequence-level distillation does not: python -m r1jax.distill)")
    tcfg = dataclasses.replace(cfg, model=dataclasses.replace(src, init_from=spec, num_nextn_predict_layers=0),
                               lora=configlib.LoraConfig())
    graphdef, _ = weights.graph(tcfg)
    state = weights.initial(tcfg, mesh, None, log=lambda s: log_line(f"teacher: {s}"))
    n = count_params(tcfg.model)
    log_line(f"teacher: {spec}, {n.main / 1e6:.1f}M parameters, frozen; {cfg.distill.loss.value} at T="
             f"{cfg.distill.temperature:g}, alpha {cfg.distill.alpha:g}")
    bs = meshlib.batch_sharding(mesh)

    def forward(st, batch):
        return nnx.merge(graphdef, st)(batch["ids"], batch["positions"], batch["segment_ids"]).logits

    with meshlib.activate(mesh):
        fn = meshlib.MeshedJit(jax.jit(forward, in_shardings=(jax.tree.map(lambda a: a.sharding, state), bs),
                                       out_shardings=bs), mesh)
    return lambda batch: fn(state, {k: batch[k] for k in LM_KEYS})


# --------------------------------------------------------------------------------- data
def _check_process_rows(bsharding, batch: int) -> None:
    """Each process feeds its own rows: that needs its devices to hold their own batch shards,
    i.e. the axis the batch is not sharded over (tensor) must not span processes."""
    if jax.process_count() == 1:
        return
    local = {idx[0].indices(batch)[:2] for idx in bsharding.addressable_devices_indices_map((batch,)).values()}
    total = {idx[0].indices(batch)[:2] for idx in bsharding.devices_indices_map((batch,)).values()}
    if len(local) * jax.process_count() != len(total):
        raise ConfigError(f"mesh: {dict(bsharding.mesh.shape)} puts replicas of a batch shard in different "
                          f"processes (mesh.tensor must fit in one process's "
                          f"{jax.local_device_count()} devices); each process reads its own rows")


class Data(NamedTuple):
    """A run's data: `batches(seed, shard, shards, rows, epochs)` is one shard's Grain dataset over
    `train` or `eval` indices; `keys` are what its batches hold."""
    tok: Any
    train: list[int]
    eval: list[int]
    batches: Callable[..., Any]
    keys: tuple[str, ...]


def _lm_data(cfg: Config, run_dir: Path) -> Data:
    """Pre-training: documents from data.source, next-token rows packed across documents."""
    d, t = cfg.data, cfg.train
    docs = open_corpus(d)
    tok = _tokenizer(cfg, run_dir, docs)
    eos = toklib.eos_id(tok)
    split = split_documents(len(docs), d.eval_fraction, t.seed)
    log_line(f"corpus: {describe(docs)}; {len(split.eval)} documents held out")

    def batches(indices, *, seed, shard, shards, rows, epochs=None):
        return lm_batches(docs, indices, tok, eos, seq_len=d.seq_len, batch_size=rows, seed=seed, shard_index=shard,
                          shard_count=shards, epochs=epochs, shuffle_rows=512 if epochs is None else 0,
                          block_size=d.block_size, workers=d.workers if epochs is None else 0)
    return Data(tok, split.train, split.eval, batches, LM_KEYS)


def _task_records(cfg: Config) -> list[dict]:
    """data.source=task: the generated task's worked solutions as chat records (R1's cold start, in
    miniature); refused in one line before the run directory is touched."""
    d = cfg.data
    if d.task not in tasks.TASKS:
        raise ConfigError(f"data.task={d.task}: unknown; allowed: {', '.join(tasks.TASKS)}")
    try:
        drawn = tasks.generate(d.task, d.task_examples, seed=cfg.train.seed, **d.task_difficulty)
    except ValueError as e:
        raise ConfigError(f"data.task_difficulty={dict(d.task_difficulty)}: {e}") from None
    return [{"messages": [{"role": "user", "content": ex["prompt"]},
                          {"role": "assistant", "content": tasks.solution(ex)}]} for ex in drawn]


def _sft_data(cfg: Config, run_dir: Path, examples: list[dict] | None) -> Data:
    """SFT: chat records (data/sft.py; `examples`: a task's, from `_task_records`), whole examples
    packed per row, the loss on the assistant's tokens. The chat template is the tokenizer
    directory's own when it has one, else R1's."""
    d, t = cfg.data, cfg.train
    if examples is None:
        examples = sft.read(d.paths)
    texts = [" ".join(m["content"] for m in ex["messages"]) for ex in examples]
    tok, template = chat_tokenizer(cfg, run_dir, texts)
    split = split_documents(len(examples), d.eval_fraction, t.seed)
    where_from = f"task {d.task}" if d.source is DataSource.task else f"{len(d.paths)} file(s)"
    log_line(f"sft: {len(examples)} chat records from {where_from}, {len(split.eval)} held out; template "
             f"{template.name}, training {'every assistant turn' if d.sft_turns == 'all' else 'the last assistant turn'}")
    log_line(sft.stats([examples[i] for i in split.train], tok, template, d.seq_len, turns=d.sft_turns).line())

    def batches(indices, *, seed, shard, shards, rows, epochs=None):
        return sft.sft_batches([examples[i] for i in indices], tok, template, seq_len=d.seq_len, batch_size=rows,
                               seed=seed, shard_index=shard, shard_count=shards, epochs=epochs, turns=d.sft_turns)
    return Data(tok, split.train, split.eval, batches, SFT_KEYS)


def _train_batches(cfg: Config, data: Data, data_meta: dict):
    """This process's training batches: its data_shards / process_count shards side by side."""
    t = cfg.train
    shards = data_meta["data_shards"]
    per = shards // jax.process_count()
    first = jax.process_index() * per
    its = [iter(data.batches(data.train, seed=data_meta["data_seed"], shard=s, shards=shards,
                             rows=t.global_batch_size // shards)) for s in range(first, first + per)]
    return its[0] if per == 1 else ShardsIterator(its)


def _eval_batches(cfg: Config, data: Data):
    """A fresh pass over this process's share of the held-out documents, whole batches only."""
    t = cfg.train
    procs = jax.process_count()
    rows = t.global_batch_size // procs
    for local in data.batches(data.eval, seed=t.seed, shard=jax.process_index(), shards=procs, rows=rows, epochs=1):
        if local["ids"].shape[0] != rows:
            return
        yield local


def _data_start(cfg: Config, ckpt: Checkpointer, step: int | None) -> tuple[dict, bool]:
    """The data stream's seed and shard count, and whether checkpoint `step`'s iterator state fits
    it. It does not when it was saved by another number of processes, shards or data.workers (Grain
    keeps one state per process): then the stream restarts at `step` with a seed from (seed, step)."""
    procs, seed = jax.process_count(), cfg.train.seed
    shards = cfg.distributed.data_shards or procs
    if shards % procs:
        raise ConfigError(f"distributed.data_shards={shards}: must be a multiple of the process count ({procs})")
    if step is None:
        return {"data_seed": seed, "data_shards": shards}, False
    saved = ckpt.meta(step)
    files = ckpt.data_states(step)
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


def _restore_step(cfg: Config, ckpt: Checkpointer, data: Data, abstract: dict, step: int):
    """(state, data iterator, data meta) of checkpoint `step`; the iterator is restored with it
    when the data stream was read the same way (`_data_start`)."""
    data_meta, restore_data = _data_start(cfg, ckpt, step)
    data_iter = _train_batches(cfg, data, data_meta)
    try:
        state, meta, note = ckpt.restore(step, abstract, data_iter if restore_data else None)
    except BaseException:
        if hasattr(data_iter, "close"):
            data_iter.close()
        raise
    if note:
        log_line(note)
    data_meta.update(skips_on_record(meta))
    return state, data_iter, data_meta


def skips_on_record(meta: dict) -> dict:
    """What rollbacks skipped, from a checkpoint's meta: kept in every later checkpoint's."""
    return {k: meta[k] for k in ("skipped_batches", "rollbacks") if k in meta}


def rollback_step(ckpt: Checkpointer, first_bad: int, cfg: Config) -> int:
    """The newest checkpoint step before `first_bad` (its writes finished first), or RunFailed."""
    ckpt.wait()
    good = [s for s in ckpt.steps() if s < first_bad]
    if not good:
        raise loop.RunFailed(f"bad steps from step {first_bad} on and no checkpoint before it to roll back to "
                             f"(checkpoint.every={cfg.checkpoint.every})")
    return good[0]


def skips_after_rollback(meta: dict, to: int, done: int) -> dict:
    """`skips_on_record` of the checkpoint rolled back to, plus the steps to+1..done just skipped."""
    return {"skipped_batches": [*meta.get("skipped_batches", []), [to + 1, done]],
            "rollbacks": meta.get("rollbacks", 0) + 1}


def _resume(cfg: Config, ckpt: Checkpointer, data: Data, abstract: dict):
    """The newest checkpoint that restores whole. A corrupted or truncated one is named, kept on
    disk, and passed over for the one before it."""
    steps = ckpt.steps()
    for i, step in enumerate(steps):
        try:
            state, data_iter, data_meta = _restore_step(cfg, ckpt, data, abstract, step)
        except CheckpointCorrupt as e:
            nxt = f"falling back to step {steps[i + 1]}" if i + 1 < len(steps) else "no older checkpoint is left"
            log_line(f"checkpoint: step {step} in {ckpt.directory} cannot be restored ({e}); {nxt}")
            continue
        log_line(f"resumed from {ckpt.directory / str(step)} (step {step})")
        return state, data_iter, data_meta
    raise loop.RunFailed(f"no checkpoint in {ckpt.directory} can be restored (tried steps "
                         f"{', '.join(map(str, steps))}); move the directory away to start afresh")


def _local_rank() -> int:
    """This process's index among the processes on its host (SLURM's or r1jax.launch's)."""
    import os
    return int(os.environ.get("SLURM_LOCALID") or os.environ.get("R1JAX_LOCAL_RANK") or 0)


def _guarding(cfg: Config, run_dir: Path, writer: MetricsWriter, rollback) -> loop.Guarding:
    """The loop's guard against bad steps and spikes, its alerts, fire drills, watchdog and the
    Prometheus exporter (when train.metrics_port is set)."""
    t = cfg.train
    exporter = None
    if t.metrics_port:
        from r1jax.train.exporter import TrainExporter
        exporter = TrainExporter(t.metrics_host, t.metrics_port + _local_rank(), process_index=jax.process_index(),
                                 process_count=jax.process_count(), run_dir=str(run_dir))
        log_line(f"metrics: http://{t.metrics_host}:{exporter.port}/metrics")
    alerts = guard.Alerts(t.alert_command, str(run_dir), writer, exporter)
    watchdog = (guard.Watchdog(t.watchdog_factor, t.watchdog_min_s, t.watchdog_stacks, t.log_every, alerts)
                if t.watchdog_factor else None)
    faults = guard.Faults(t.inject_faults, cfg.model.vocab_size, t.seed, watchdog) if t.inject_faults else None
    return loop.Guarding(guard=guard.Guard(t, alerts), faults=faults, rollback=rollback,
                         max_rollbacks=t.max_rollbacks, exporter=exporter, watchdog=watchdog)


def _close_guarding(g: loop.Guarding) -> None:
    if g.watchdog is not None:
        g.watchdog.close()
    g.guard.alerts.close()
    if g.exporter is not None:
        g.exporter.close()


def trainable_line(cfg: Config, state: dict) -> str:
    """What the optimizer trains, counted from the state (pipeline padding slots included)."""
    def count(tree):
        return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))
    n_train = count(state["params"])
    if not cfg.lora.rank:
        return f"trainable: all {n_train / 1e6:.1f}M parameters"
    base = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(state["rest"])
               if isinstance(v, nnx.Param))
    lo = cfg.lora
    extra = (", rsLoRA" if lo.rslora else "") + (f", dropout {lo.dropout:g}" if lo.dropout else "")
    return (f"trainable: LoRA rank {lo.rank} (alpha {lo.alpha:g}{extra}) on "
            f"{', '.join(lo.targets)}: {n_train:,} parameters, {100 * n_train / (n_train + base):.4f}% of "
            f"{(n_train + base) / 1e6:.1f}M; the base is frozen in {lo.base_dtype.value}")


def _reached_target(finished: Path, step: int, target: float) -> bool:
    """Whether final.json records a run that ended at `step` on train.stop_at_eval_loss with a
    held-out loss that meets `target` (a lower target trains on)."""
    rec = json.loads(finished.read_text())
    return (bool(target) and rec.get("stopped") == "train.stop_at_eval_loss" and rec.get("step") == step
            and rec.get("eval_loss", math.inf) <= target)


# --------------------------------------------------------------------------------- run
def train(cfg: Config, run_dir: str | Path) -> dict[str, float]:
    """Train per `cfg` in `run_dir`, resuming from its latest checkpoint. Returns final metrics."""
    run_dir = Path(run_dir)
    devices = jax.devices()
    preflight(cfg, devices)
    objective = objectives.make(cfg)
    sft_run = cfg.loss.objective in (ObjectiveKind.sft, ObjectiveKind.kd)        # chat records
    provided = (*SFT_KEYS, "teacher_logits") if cfg.loss.objective is ObjectiveKind.kd else SFT_KEYS if sft_run else LM_KEYS
    missing = [k for k in objective.needs if k not in provided]
    if missing:
        raise ConfigError(f"loss.objective={cfg.loss.objective.value}: needs batches with {missing[0]}, which "
                          f"data.source={cfg.data.source.value} does not provide; use loss.objective=lm")
    task_records = _task_records(cfg) if sft_run and cfg.data.source is DataSource.task else None
    mesh = meshlib.make_mesh(cfg.mesh, devices)
    t, d, m = cfg.train, cfg.data, cfg.model
    layout = pipeline.mesh_layout(cfg, mesh)
    ckpt = Checkpointer(run_dir / "checkpoints", every=cfg.checkpoint.every, keep=cfg.checkpoint.keep,
                        model_cfg=m, layout=layout, lora=cfg.lora, on_error=cfg.checkpoint.on_error,
                        log=log_line)
    resume = ckpt.latest_step()
    if resume is not None:
        ckpt.check_model()          # before anything in the run directory is written
        finished = run_dir / "final.json"
        reached = finished.is_file() and _reached_target(finished, resume, t.stop_at_eval_loss)
        if finished.is_file() and (resume >= t.steps or reached):
            log_line(f"{run_dir} is already complete: step {resume} of train.steps={t.steps} ({finished}); nothing "
                     f"to do (to train on, {'lower train.stop_at_eval_loss' if reached else 'raise train.steps'})")
            ckpt.close()
            return {**json.loads(finished.read_text()), "already_complete": True}
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(configlib.dump_yaml(cfg))
    data = _sft_data(cfg, run_dir, task_records) if sft_run else _lm_data(cfg, run_dir)
    across = meshlib.spans(mesh)
    log_line(f"mesh {dict(mesh.shape)}" + (f"; across processes: {', '.join(f'{a} {n}' for a, n in across.items())}"
                                          if across else ""))

    n = count_params(m)
    log_line(f"model: {n.main / 1e6:.1f}M parameters (+{n.mtp / 1e6:.1f}M MTP), {n.activated / 1e6:.1f}M "
             f"activated per token; compute {t.dtype.value}, remat {t.remat.value}, grad_accum {t.grad_accum}")
    if layout is not None:
        r = layout.repeats
        log_line(f"pipeline: {layout.stages} stages x {r} repeats, schedule {cfg.pipeline.schedule.value}, "
                 f"{t.microbatches} microbatches; {layout.layers} MoE layers in {layout.slots} slots "
                 f"({layout.chunk} per virtual stage); bubble "
                 f"{pipeline.bubble(layout.stages, t.microbatches, r, cfg.pipeline.schedule):.3f}")
    if t.remat.value == "offload" and devices[0].platform == "cpu":
        log_line("note: remat=offload on CPU: device memory is host memory, so offloading saves nothing here")
    tx = optim.make(cfg.optim, t.steps)
    graphdef, target = weights.target(cfg, mesh, layout)
    abstract, shardings = statelib.abstract(target, tx, cfg, mesh)
    if resume is not None:
        state, data_iter, data_meta = _resume(cfg, ckpt, data, abstract)
    else:
        data_meta, _ = _data_start(cfg, ckpt, None)
        data_iter = _train_batches(cfg, data, data_meta)
        state, shardings = statelib.create(weights.initial(cfg, mesh, layout, log=log_line), tx, cfg, mesh)
    del target
    log_line(trainable_line(cfg, state))
    step_fn = make_train_step(graphdef, tx, cfg, mesh, shardings, objective)
    bsharding = meshlib.batch_sharding(mesh)
    _check_process_rows(bsharding, t.global_batch_size)
    ckpt.write_model_config()

    teacher = teacher_logits(cfg, mesh) if cfg.loss.objective is ObjectiveKind.kd else None

    def place(local: dict):
        batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(bsharding, x), local)
        if teacher is not None:
            batch["teacher_logits"] = teacher(batch)
        return batch

    writer = MetricsWriter(run_dir, t.steps)

    def rollback(first_bad: int, done: int):
        """The newest checkpoint before `first_bad`, with the batches of the steps after it up to
        `done` skipped (and recorded in the checkpoint meta from now on)."""
        nonlocal data_iter
        to = rollback_step(ckpt, first_bad, cfg)
        if hasattr(data_iter, "close"):
            data_iter.close()
        state, data_iter, meta = _restore_step(cfg, ckpt, data, abstract, to)
        for _ in range(done - to):
            next(data_iter)
        data_meta.update(skips_after_rollback(meta, to, done))
        return state, data_iter, to

    guarding = _guarding(cfg, run_dir, writer, rollback)
    evaluator = None
    if t.eval_batches and data.eval:
        evaluator = loop.Evaluator(make_eval_step(graphdef, cfg, mesh, shardings, objective),
                                   lambda: _eval_batches(cfg, data), t.eval_batches,
                                   place, writer)
    start = int(state["step"])
    end = min(t.steps, t.stop_at) if t.stop_at else t.steps
    peak, peak_how = mfu.peak_flops(devices, t.dtype)
    if jax.process_count() > 1:
        # compile first, then start together: a process that reaches a collective more than 30 s
        # before another (compile times differ) fails in gloo's context set-up
        spec = {k: jax.ShapeDtypeStruct((t.global_batch_size, d.seq_len), jnp.int32, sharding=bsharding)
                for k in data.keys}
        if teacher is not None:
            spec["teacher_logits"] = jax.ShapeDtypeStruct((t.global_batch_size, d.seq_len, m.vocab_size), jnp.float32,
                                                          sharding=bsharding)
        step_fn.lower(state, spec).compile()
        distributed.barrier("r1jax: train step compiled")
    try:
        result = loop.run(step_fn, state, data_iter, place=place, start=start, end=end, total=t.steps,
                          log_every=t.log_every, writer=writer, checkpointer=ckpt, save_meta=data_meta,
                          evaluator=evaluator, eval_every=t.eval_every, tokens_per_step=t.global_batch_size * d.seq_len,
                          flops_per_token=mfu.flops_per_token(m, d.seq_len), peak_flops=peak,
                          block_each_step=len(devices) > 1 and devices[0].platform == "cpu",   # CPU collective starvation
                          guarding=guarding, target_loss=t.stop_at_eval_loss)
    except BaseException:
        _close_guarding(guarding)
        writer.close()
        raise
    state, stopped, data_iter = result.state, result.stopped, result.batches

    final = {k: v for k, v in writer.last("train").items() if k != "step"}
    done = int(state["step"])
    reached = stopped == "train.stop_at_eval_loss"          # done: the run trained to its quality
    if stopped is None and evaluator is not None:
        final.update({f"eval_{k}": v for k, v in evaluator(state, done).items()})
    elif reached:
        final.update({f"eval_{k}": v for k, v in writer.last("eval").items() if k not in ("step", "split")})
    if ckpt.latest_step() != done and result.saveable:
        ckpt.save(state, data_iter, meta=data_meta, force=True)
    elif not result.saveable:
        log_line(f"note: the last step ({done}) was bad; the final checkpoint is not written")
    ckpt.close()
    _close_guarding(guarding)
    if hasattr(data_iter, "close"):
        data_iter.close()          # stops mp_prefetch workers cleanly
    writer.plot(run_dir / "loss.png")
    writer.close()
    final.update(compile_s=result.compile_s, mfu_peak_flops=peak, mfu_peak=peak_how, stopped=stopped)
    if jax.process_index() == 0:
        (run_dir / "final.json").write_text(json.dumps({"step": done, **final}, indent=2))
    if reached:
        log_line(f"done at step {done}: held-out loss {final['eval_loss']:.4f} <= train.stop_at_eval_loss="
                 f"{t.stop_at_eval_loss:g}; checkpoint saved")
    elif stopped:
        log_line(f"preempted at step {done} ({stopped}); checkpoint saved" if stopped != "train.stop_at"
                 else f"stopped at step {done} (train.stop_at); checkpoint saved")
    return final

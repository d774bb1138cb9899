"""Train-state checkpoints: an Orbax `CheckpointManager` over a run's `checkpoints/` directory.

Each step holds four items: `params` (the model's variables under their nnx paths, what
`ParamsReader` and `orbax-to-hf` read), `opt_state` (the optax state), `meta` (JSON: step, loss
scale, the MoE stack's pipeline layout when it is not model order, and whatever the caller adds,
e.g. the data stream's seed and shard count) and `data` (the Grain iterator's state). The
directory also holds `model_config.json`.

`restore` reads straight into an abstract target (ShapeDtypeStructs carrying shardings,
r1jax/train/state.abstract): nothing is initialised first, so resuming holds one copy of the
state. A checkpoint whose MoE stack is in another pipeline layout (other stages or repeats) is
read with the slot axis unsharded and moved into this run's layout, leaf by leaf.

Faults. Orbax writes a step into `<step>.orbax-checkpoint-tmp/` in the background and renames it
when complete, so a save that fails (disk full, read-only) never lists as a step; its partial
directory is removed. Before each save the directory is probed (a one-byte file; free space
against the last step's size), which turns a read-only or full directory into an immediate
refusal: Orbax itself would wait 300 s for a step directory it cannot create, or fill the disk
and fail in the background. A failure in the background is reported at the next `save` (before
it writes) or at `close`/`wait`, naming its step. `on_error` decides: `stop` raises
CheckpointWriteError, `continue` logs one line and the next save tries again. Reading,
`meta`/`data_states`/`restore` first check the step against the sizes and CRC32s recorded when it
was written (r1jax/checkpoint/integrity.py) and raise CheckpointCorrupt for a truncated, changed or
missing file, or one Orbax cannot read; nothing on disk is touched then. When the run goes on
(from an older step), such a step is renamed `<step>.corrupt`: kept, never deleted, but out of
Orbax's sight, so that its rotation (max_to_keep) does not remove it, a later resume does not
try it again, and the run can save that step anew. A checkpoint whose arrays have other shapes
than the restore target (another model) is refused with ConfigError before any read.

Several processes: each decision above (a save's probe and outcome, a step's check, a read's
failure) is agreed on by all of them (integrity.agree), so that none takes another path than its
peers, e.g. when only process 1 finds its own file truncated (tested with r1jax.launch).
Orbax's own collectives come first for a write that fails on some processes only: the others
wait in its commit barrier (timeout 300 s) before it reaches `_settle` (not measured here).
"""
from __future__ import annotations

import contextlib
import errno
import gc
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from r1jax import config as configlib
from r1jax import model as modellib
from r1jax.checkpoint import integrity
from r1jax.checkpoint import params as ckpt_params
from r1jax.config import ConfigError, LoraConfig, ModelConfig, OnError
from r1jax.parallel import distributed
from r1jax.parallel.pipeline import STACK, Layout

ITEMS = ("params", "opt_state", "meta", "data")


class CheckpointCorrupt(RuntimeError):
    """A checkpoint step that cannot be restored: one line naming the item or file and what is
    wrong with it. Nothing in the step is changed or deleted."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (checkpoint.on_error=stop): one line."""


def _is_stack(path) -> bool:
    """A leaf of the MoE stack (parameter, router bias, or their optimizer moments)?"""
    return any(str(getattr(k, "key", getattr(k, "name", k))) == STACK for k in path)


class Checkpointer:
    """Save and restore a run's state (r1jax/train/state.py) in `directory`, keeping `keep`
    checkpoints and saving every `every` steps (`should_save`)."""

    def __init__(self, directory: str | Path, *, every: int, keep: int, model_cfg: ModelConfig,
                 layout: Layout | None, lora: LoraConfig | None = None, on_error: OnError = OnError.stop,
                 log: Callable[[str], None] = print):
        self.directory = Path(directory).absolute()
        self.layout, self.model_cfg = layout, model_cfg
        self.lora = lora if lora is not None and lora.rank else None
        self.on_error = OnError(on_error)
        self.log = log                          # the run's console (train.metrics.log_line)
        self._writing: int | None = None        # the step whose save may still be in flight
        self._last_bytes = 0                    # what this process wrote for the last step
        self._verified: set[int] = set()
        self._corrupt: set[int] = set()         # steps that failed a check: set aside at the next save
        self._failed_step: int | None = None    # the step whose save failed last
        self._leftovers: set[int | None] = set()  # failed steps to sweep again before the next save
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, cleanup_tmp_directories=True,
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(every),
            async_options=ocp.AsyncOptions(post_finalization_callback=self._record_files))
        self.mngr = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS,
                                          item_handlers={"data": grain.checkpoint.CheckpointHandler(),
                                                         **{k: ocp.PyTreeCheckpointHandler(
                                                             type_handler_registry=ckpt_params.arrays_registry())
                                                            for k in ("params", "opt_state")}})
        if (last := self.mngr.latest_step()) is not None:
            self._last_bytes = integrity.recorded_bytes(self.directory / str(last), jax.process_index())

    # ------------------------------------------------------------------------------- queries
    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def steps(self) -> list[int]:
        """Every committed checkpoint step, newest first."""
        return sorted(self.mngr.all_steps(), reverse=True)

    def should_save(self, step: int) -> bool:
        self._set_aside_corrupt()       # Orbax would not save a step it still lists
        return self.mngr.should_save(step)

    def meta(self, step: int) -> dict:
        self._check(step)
        try:
            meta = self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            problem = None if isinstance(meta, dict) and "step" in meta else "meta: holds no step"
        except Exception as e:          # whatever Orbax raises for a missing or unparsable item
            meta, problem = None, f"meta: {integrity.cause(e)}"
        self._raise_if(problem, step)
        return meta

    def data_states(self, step: int) -> list[Path]:
        """The per-process files of step `step`'s data item (`process_<i>-of-<n>.json`)."""
        self._check(step)
        d = self.directory / str(step) / "data"
        files = sorted(d.glob("process_*-of-*.json"))
        problem = None if files else f"data: {'holds no process_*-of-*.json' if d.is_dir() else 'missing'}"
        for f in files:
            try:
                json.loads(f.read_text())
            except (OSError, ValueError) as e:
                problem = problem or f"data/{f.name}: {integrity.cause(e)}"
        self._raise_if(problem, step)
        return files

    def check_model(self) -> None:
        """ConfigError when the checkpoints hold another model than the run's (architecture or
        MTP depth: both fix the state's shapes)."""
        saved = ckpt_params.read_model_config(self.directory)
        configlib.check_same_architecture(self.model_cfg, saved, str(self.directory), "model")
        saved_lora = ckpt_params.read_lora_config(self.directory)
        # what fixes the adapters' shapes and values (dropout may change between runs)
        here = None if self.lora is None else {**configlib.to_dict(self.lora), "dropout": None}
        there = None if saved_lora is None else {**configlib.to_dict(saved_lora), "dropout": None}
        if here != there:
            raise ConfigError(f"lora: the checkpoints in {self.directory} were written with "
                              f"{'no LoRA' if there is None else there} and this run has "
                              f"{'no LoRA' if here is None else here}; resume with the same lora settings")
        if saved.num_nextn_predict_layers != self.model_cfg.num_nextn_predict_layers:
            raise ConfigError(f"model.num_nextn_predict_layers={self.model_cfg.num_nextn_predict_layers}: the "
                              f"checkpoints in {self.directory} hold {saved.num_nextn_predict_layers} MTP modules")

    # ------------------------------------------------------------------------------- writing
    def write_model_config(self) -> None:
        """model_config.json (and lora_config.json): written unless they already say the same,
        so that a resume from a read-only directory gets as far as its first save."""
        if jax.process_index() != 0:
            return
        same = False
        try:
            same = ckpt_params.read_model_config(self.directory) == self.model_cfg and (
                ckpt_params.read_lora_config(self.directory) == self.lora)
        except (ConfigError, OSError, ValueError):
            pass
        if not same:
            ckpt_params.write_model_config(self.directory, self.model_cfg)
            if self.lora is not None:
                ckpt_params.write_lora_config(self.directory, self.lora)

    def save(self, state: dict, data_iter, *, meta: dict | None = None, force: bool = False) -> None:
        """Start writing `state` as its step (in the background), once the previous save is
        known to have finished: a failed one is reported first (`on_error`)."""
        step = int(state["step"])
        self._settle()
        if not (force or self.mngr.should_save(step)) or step == self._failed_step:
            return                    # a step that just failed is not tried twice (one line each)
        while self._leftovers and jax.process_index() == 0:
            self._sweep(f"{self._leftovers.pop()}.orbax-checkpoint-tmp*")   # a straggler's files
        self._set_aside_corrupt()
        self._verified.discard(step)   # a step number written anew (after a rollback) is checked anew
        problem = integrity.agree(self._probe())
        if problem:
            self._failed(step, problem)
            return
        lay = self.layout
        meta = {"step": step, **({"moe_layout": lay.meta()} if lay is not None and not lay.identity else {}),
                "loss_scale": float(state["loss_scale"]["scale"]),
                "loss_scale_good_steps": int(state["loss_scale"]["good_steps"]), **(meta or {})}
        model_tree = ckpt_params.nest(modellib.leaves(state["params"]) | modellib.leaves(state["rest"]))
        self._writing = step           # read by _record_files in Orbax's finalize thread
        try:
            started = self.mngr.save(step, force=force, args=ocp.args.Composite(
                params=ocp.args.PyTreeSave(model_tree), opt_state=ocp.args.PyTreeSave(state["opt"]),
                meta=ocp.args.JsonSave(meta), data=grain.checkpoint.CheckpointSave(data_iter)))
        except Exception as e:         # its synchronous part (directories, the data item)
            started, problem = False, integrity.cause(e)
        if not started:
            self._writing = None
        problem = integrity.agree(problem)
        if problem:
            self._failed(step, problem)

    def wait(self) -> None:
        """Until the last save has finished (a failed one is reported: `on_error`)."""
        self._settle()

    def close(self) -> None:
        try:
            self._settle()
        except BaseException:
            with contextlib.suppress(Exception):      # the failure is already on its way up
                self.mngr.close()
            raise
        self.mngr.close()
        while self._leftovers and jax.process_index() == 0:
            self._sweep(f"{self._leftovers.pop()}.orbax-checkpoint-tmp*")

    # ----------------------------------------------------------------------------- faults
    def _record_files(self) -> None:
        """Orbax's post-finalization callback, in its finalize thread on process 0 only: every
        process's files of the step are complete and not yet renamed into place. Process 0
        records its own (the other processes record theirs once the step has committed:
        `_settle`)."""
        step = self._writing
        tmp = sorted(self.directory.glob(f"{step}.orbax-checkpoint-tmp*"))
        where = tmp[0] if tmp else self.directory / str(step)     # where renames are not atomic
        self._last_bytes = integrity.record(where, 0, jax.process_count())

    def _probe(self) -> str | None:
        """Why a save cannot start now, or None: the directory must take a file, and hold as
        much again as the last step took (Orbax deletes an old step only after the new one)."""
        p = self.directory / f".r1jax-write-probe.{jax.process_index()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"\0")
            p.unlink()
        except OSError as e:
            return e.strerror or integrity.first_line(e)
        free = shutil.disk_usage(self.directory).free
        if free < self._last_bytes:
            return (f"{os.strerror(errno.ENOSPC)}: {free / 2**20:.1f} MiB free, the last checkpoint took "
                    f"{self._last_bytes / 2**20:.1f} MiB")
        return None

    def _settle(self) -> None:
        """Wait for the save in flight; report it (`_failed`) when it did not commit."""
        step, problem = self._writing, None
        try:
            self.mngr.wait_until_finished()
        except Exception as e:
            problem = integrity.cause(e)
        self._writing = None            # only now: the finalize thread reads it until it ends
        if step is not None and problem is None and not (self.directory / str(step)).is_dir():
            problem = "Orbax did not commit it"      # an error it logged and swallowed
        if step is not None and problem is None and jax.process_index() > 0:
            try:       # a step committed without it is only checked less (integrity.verify)
                self._last_bytes = integrity.record(self.directory / str(step), jax.process_index(),
                                                    jax.process_count())
            except OSError:
                pass
        problem = integrity.agree(problem)
        if problem:
            self._failed(step, problem)

    def _failed(self, step: int | None, why: str) -> None:
        """A save that did not commit: its partial directory goes; then stop or go on."""
        self._failed_step = step
        self._leftovers.add(step)
        if jax.process_index() == 0:
            self._sweep(f"{step}.orbax-checkpoint-tmp*")
        try:
            self.mngr.reload()        # Orbax forgot the step it meant to delete after this one
        except Exception:
            pass
        last = self.mngr.latest_step()
        line = (f"checkpoint: step {step} could not be written to {self.directory}: {why}; "
                f"{'the last checkpoint is step ' + str(last) if last is not None else 'there is no checkpoint yet'}")
        if self.on_error is OnError.stop:
            raise CheckpointWriteError(f"{line} (checkpoint.on_error=stop)")
        self.log(f"{line}; training goes on and the next save tries again (checkpoint.on_error=continue)")

    def _sweep(self, pattern: str) -> None:
        """Remove the partial directories matching `pattern`. A failed write's tensorstore
        threads can still create files after Orbax has raised (CI once found a directory left
        behind), so remove until none has reappeared for 0.2 s; 10 s at most."""
        deadline, clean = time.monotonic() + 10, 0
        while clean < 2 and time.monotonic() < deadline:
            found = list(self.directory.glob(pattern))
            for tmp in found:
                shutil.rmtree(tmp, ignore_errors=True)
            clean = 0 if found else clean + 1
            if clean < 2:
                time.sleep(0.1)

    def _check(self, step: int) -> None:
        """CheckpointCorrupt unless step `step`'s files are as they were written."""
        if step in self._verified:
            return
        d = self.directory / str(step)
        try:
            problem = integrity.verify(d, jax.process_index(), jax.process_count()) if d.is_dir() else "missing"
        except OSError as e:
            problem = f"{e.strerror or integrity.first_line(e)}"
        self._raise_if(problem, step)
        self._verified.add(step)

    def _raise_if(self, problem: str | None, step: int) -> None:
        problem = integrity.agree(problem)
        if problem:
            self._corrupt.add(step)
            raise CheckpointCorrupt(problem)

    def _set_aside_corrupt(self) -> None:
        """Rename each step that failed its check to `<step>.corrupt`: kept for inspection, never
        deleted, but out of Orbax's sight, so that neither its rotation (max_to_keep) removes it
        nor a later resume tries it again, and the resumed run can save that step anew. Done
        when the run goes on (its first save decision), not when the check fails."""
        while self._corrupt:
            self._set_aside(min(self._corrupt))

    def _set_aside(self, step: int) -> None:
        self._corrupt.discard(step)
        src = self.directory / str(step)
        dst = next(d for i in range(1, 1000) if not (d := self.directory / (
            f"{step}.corrupt" if i == 1 else f"{step}.corrupt{i}")).exists())
        if jax.process_index() == 0 and src.is_dir():
            src.rename(dst)
        distributed.barrier(f"r1jax: checkpoint step {step} set aside")
        self.mngr.reload()
        self.log(f"checkpoint: step {step}, which could not be restored, is kept as {dst} (not deleted)")

    def _check_shapes(self, step: int, item: str, target) -> None:
        """ConfigError naming the first array whose shape in the checkpoint differs from the
        target's (another model than the run's), before anything is read."""
        saved, problem = {}, None
        try:
            with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
                saved = _shapes(reader.metadata(self.directory / str(step) / item).item_metadata)
        except Exception as e:
            problem = f"{item}: {integrity.cause(e)}"
        want = {k: v for k, v in _shapes(target).items() if v is not None}
        unread = [k for k in want if k in saved and saved[k] is None]
        if problem is None and (not saved or unread):      # what an unreadable OCDBT index gives
            problem = f"{item}: the array metadata{' of ' + unread[0] if unread else ''} cannot be read"
        self._raise_if(problem, step)
        run = "this run's model" if item == "params" else "this run's optimizer state"
        for name, shape in want.items():
            if name not in saved:
                raise ConfigError(f"checkpoint step {step}: {item}/{name} is in {run} but not in the checkpoint "
                                  f"({self.directory})")
            if saved[name] != shape:
                raise ConfigError(f"checkpoint step {step}: {item}/{name} is {saved[name]} in the checkpoint, "
                                  f"{shape} in {run} ({self.directory})")
        extra = sorted(k for k, v in saved.items() if v is not None and k not in want)
        if extra:
            raise ConfigError(f"checkpoint step {step}: {item}/{extra[0]} is in the checkpoint but not in {run} "
                              f"({self.directory})")

    # ------------------------------------------------------------------------------- reading
    def restore(self, step: int, target: dict, data_iter=None) -> tuple[dict, dict, str | None]:
        """(state, meta, note) of step `step` read into `target`, the abstract state; `data_iter` is
        restored in place unless it is None. `note` says when the MoE stack changed layout."""
        saved_meta = self.meta(step)        # checks the step's files first
        n = self.layout.layers if self.layout is not None else self.model_cfg.num_moe_layers
        saved = Layout.from_meta(saved_meta["moe_layout"]) if "moe_layout" in saved_meta else Layout(n)
        here = self.layout or Layout(n)
        moved = not (saved.identity and here.identity) and saved != here

        def spot(path, a):
            """Where a leaf is read from: its saved shape, and for moved stack leaves a sharding
            without the pipeline axis on the slot dimension."""
            if not (moved and _is_stack(path)):
                return a
            sh = a.sharding
            spec = list(sh.spec) + [None] * (len(a.shape) - len(sh.spec))
            spec[0] = None
            return jax.ShapeDtypeStruct((saved.slots, *a.shape[1:]), a.dtype,
                                        sharding=jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*spec)))

        def place(path, read, a):
            if not (moved and _is_stack(path)):
                return read
            return jax.jit(lambda x: here.to_slots(saved.to_layers(x)), out_shardings=a.sharding)(read)

        flat = modellib.leaves(target["params"]) | modellib.leaves(target["rest"])
        model_target = ckpt_params.nest({p: spot((p[0],), a) for p, a in flat.items()})
        opt_target = jax.tree_util.tree_map_with_path(spot, target["opt"])
        # Each shard is read into a host buffer and then copied to its device; where device memory
        # is host memory (CPU) Orbax's default of 96 GB in flight holds a small state twice. In
        # flight at most the largest leaf (whole: a read is rounded up to the saved chunks, which
        # may be coarser than this run's shards) keeps the peak at the state plus about one
        # leaf, and is never above Orbax's default.
        largest = max(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves((model_target, opt_target)))
        handler = ocp.StandardCheckpointHandler(restore_concurrent_gb=min(96.0, (1.05 * largest + 2**20) / 1e9))
        self._check_shapes(step, "params", model_target)
        self._check_shapes(step, "opt_state", opt_target)
        reader = ocp.Checkpointer(handler)
        problem, params, opt_state, item = None, None, None, "params"
        try:
            with ckpt_params.host_buffers_unmapped_on_free():
                params = reader.restore(self.directory / str(step) / "params",
                                        args=ocp.args.StandardRestore(model_target))
                item = "opt_state"
                opt_state = reader.restore(self.directory / str(step) / "opt_state",
                                           args=ocp.args.StandardRestore(opt_target))
            if data_iter is not None:
                item = "data"
                self.mngr.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(data_iter)))
        except Exception as e:          # what a file that is missing, cut short or garbled raises
            problem = f"{item}: {integrity.cause(e)}"
        finally:
            reader.close()
        self._raise_if(problem, step)
        r = {"params": params, "opt_state": opt_state, "meta": saved_meta}
        gc.collect()                      # the host buffers sit in reference cycles until collected
        ckpt_params.release_memory()
        values = {}
        for p, a in flat.items():
            node = r["params"]
            for k in ckpt_params.path_key(p):
                node = node[k]
            values[p] = place((p[0],), node, a)
        opt = jax.tree_util.tree_map_with_path(place, r["opt_state"], target["opt"])
        meta = r["meta"]
        counters = {"step": jnp.int32(meta["step"]),
                    "loss_scale": {"scale": jnp.float32(meta["loss_scale"]),
                                   "good_steps": jnp.int32(meta["loss_scale_good_steps"])}}
        counters = jax.device_put(counters, jax.tree.map(lambda a: a.sharding, {k: target[k] for k in counters}))
        state = {"params": modellib.with_leaves(target["params"], values),
                 "rest": modellib.with_leaves(target["rest"], values), "opt": opt, **counters}
        note = (f"checkpoint step {step}: MoE stack moved from pipeline layout {saved.meta()} to {here.meta()}"
                if moved else None)
        return state, meta, note


def _shapes(tree) -> dict[str, tuple[int, ...] | None]:
    """{'a/b/c': shape} of a tree of arrays, ShapeDtypeStructs or Orbax array metadata (None for
    a leaf Orbax could not describe); an nnx Variable's trailing `value` is left out so that
    both sides name a leaf alike."""
    def name(path) -> str:
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        return "/".join(keys[:-1] if keys and keys[-1] == "value" else keys)
    if tree is None:
        return {}
    return {name(p): (tuple(a.shape) if hasattr(a, "shape") else None)
            for p, a in jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: x is None)}

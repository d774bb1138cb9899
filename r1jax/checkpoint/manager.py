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
"""
from __future__ import annotations

import gc
import math
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from r1jax import config as configlib
from r1jax import model as modellib
from r1jax.checkpoint import params as ckpt_params
from r1jax.config import ConfigError, LoraConfig, ModelConfig
from r1jax.parallel.pipeline import STACK, Layout

ITEMS = ("params", "opt_state", "meta", "data")


def _is_stack(path) -> bool:
    """A leaf of the MoE stack (parameter, router bias, or their optimizer moments)?"""
    return any(str(getattr(k, "key", getattr(k, "name", k))) == STACK for k in path)


class Checkpointer:
    """Save and restore a run's state (r1jax/train/state.py) in `directory`, keeping `keep`
    checkpoints and saving every `every` steps (`should_save`)."""

    def __init__(self, directory: str | Path, *, every: int, keep: int, model_cfg: ModelConfig,
                 layout: Layout | None, lora: LoraConfig | None = None):
        self.directory = Path(directory).absolute()
        self.layout, self.model_cfg = layout, model_cfg
        self.lora = lora if lora is not None and lora.rank else None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True,
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(every))
        self.mngr = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS,
                                          item_handlers={"data": grain.checkpoint.CheckpointHandler(),
                                                         **{k: ocp.PyTreeCheckpointHandler(
                                                             type_handler_registry=ckpt_params.arrays_registry())
                                                            for k in ("params", "opt_state")}})

    # ------------------------------------------------------------------------------- queries
    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def should_save(self, step: int) -> bool:
        return self.mngr.should_save(step)

    def meta(self, step: int) -> dict:
        return self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def data_states(self, step: int) -> list[Path]:
        """The per-process files of step `step`'s data item (`process_<i>-of-<n>.json`)."""
        return sorted((self.directory / str(step) / "data").glob("process_*-of-*.json"))

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
        if jax.process_index() == 0:
            ckpt_params.write_model_config(self.directory, self.model_cfg)
            if self.lora is not None:
                ckpt_params.write_lora_config(self.directory, self.lora)

    def save(self, state: dict, data_iter, *, meta: dict | None = None, force: bool = False) -> None:
        step = int(state["step"])
        lay = self.layout
        meta = {"step": step, **({"moe_layout": lay.meta()} if lay is not None and not lay.identity else {}),
                "loss_scale": float(state["loss_scale"]["scale"]),
                "loss_scale_good_steps": int(state["loss_scale"]["good_steps"]), **(meta or {})}
        model_tree = ckpt_params.nest(modellib.leaves(state["params"]) | modellib.leaves(state["rest"]))
        self.mngr.save(step, force=force, args=ocp.args.Composite(
            params=ocp.args.PyTreeSave(model_tree), opt_state=ocp.args.PyTreeSave(state["opt"]),
            meta=ocp.args.JsonSave(meta), data=grain.checkpoint.CheckpointSave(data_iter)))

    def wait(self) -> None:
        self.mngr.wait_until_finished()

    def close(self) -> None:
        self.mngr.wait_until_finished()
        self.mngr.close()

    # ------------------------------------------------------------------------------- reading
    def restore(self, step: int, target: dict, data_iter=None) -> tuple[dict, dict, str | None]:
        """(state, meta, note) of step `step` read into `target`, the abstract state; `data_iter` is
        restored in place unless it is None. `note` says when the MoE stack changed layout."""
        saved_meta = self.meta(step)
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
        reader = ocp.Checkpointer(handler)
        with ckpt_params.host_buffers_unmapped_on_free():
            params = reader.restore(self.directory / str(step) / "params", args=ocp.args.StandardRestore(model_target))
            opt_state = reader.restore(self.directory / str(step) / "opt_state",
                                       args=ocp.args.StandardRestore(opt_target))
        reader.close()
        r = self.mngr.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore(),
            **({} if data_iter is None else {"data": grain.checkpoint.CheckpointRestore(data_iter)})))
        r = {"params": params, "opt_state": opt_state, "meta": r["meta"]}
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

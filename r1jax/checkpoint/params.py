"""The model's weights in an Orbax checkpoint directory, leaf by leaf.

A checkpoint directory is an Orbax `CheckpointManager` directory whose steps hold named items.
Item `params` is the model's state (parameters and router biases) as a nested dict keyed by
the nnx path; training adds `opt_state`, `meta` and `data` (r1jax/checkpoint/manager.py). The
directory root also holds `model_config.json` (the architecture), so a checkpoint directory
alone is enough to rebuild (or convert) the model.

Params can be written lazily, one leaf at a time (`save_params_lazy`): a leaf is produced only
when Orbax is ready to write it and is dropped afterwards, so converting a checkpoint never
holds the whole model in host memory. They can likewise be read one leaf at a time
(`ParamsReader`) through Orbax's partial restore.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.futures import future as ocp_future
from orbax.checkpoint._src.metadata import array_metadata_store as ocp_array_metadata
from orbax.checkpoint._src.serialization import type_handler_registry as ocp_registry
from orbax.checkpoint._src.serialization import type_handlers as ocp_types

from r1jax import config as configlib
from r1jax.config import LoraConfig, ModelConfig
from r1jax.model import lora as loralib
from r1jax.parallel.pipeline import Layout

PARAMS = "params"
MODEL_CONFIG = "model_config.json"
LORA_CONFIG = "lora_config.json"


def path_key(path: tuple) -> tuple[str, ...]:
    return tuple(str(p) for p in path)


def nest(flat: dict[tuple, Any]) -> dict[str, Any]:
    """{(a, b, 0): x} -> {"a": {"b": {"0": x}}} (Orbax wants string keys)."""
    out: dict[str, Any] = {}
    for path, v in flat.items():
        node = out
        keys = path_key(path)
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = v
    return out


def write_model_config(directory: str | Path, cfg: ModelConfig) -> None:
    """The model's HF keys (its architecture and the rest of DeepseekV3Config), not its sources."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    d = configlib.to_dict(cfg)
    (Path(directory) / MODEL_CONFIG).write_text(json.dumps({k: d[k] for k in configlib.hf_keys()}, indent=2))


def write_lora_config(directory: str | Path, lo: LoraConfig) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / LORA_CONFIG).write_text(json.dumps(configlib.to_dict(lo), indent=2))


def read_lora_config(directory: str | Path) -> LoraConfig | None:
    """The adapters' settings of a LoRA run's checkpoints; None for any other checkpoint."""
    p = Path(directory) / LORA_CONFIG
    if not p.is_file():
        return None
    return configlib.from_dict({"lora": json.loads(p.read_text())}).lora


def read_model_config(directory: str | Path) -> ModelConfig:
    p = Path(directory) / MODEL_CONFIG
    if not p.is_file():
        raise configlib.ConfigError(f"{directory}: not an r1jax checkpoint directory (no {MODEL_CONFIG})")
    return configlib.model_from_dict(json.loads(p.read_text()))


def latest_step(directory: str | Path) -> int:
    steps = sorted(int(p.name) for p in Path(directory).iterdir()
                   if p.is_dir() and p.name.isdigit() and (p / PARAMS).is_dir())
    if not steps:
        raise configlib.ConfigError(f"{directory}: holds no checkpoint step with '{PARAMS}'")
    return steps[-1]


M_MMAP_THRESHOLD = -3          # glibc mallopt parameter
GLIBC_MMAP_MAX = 32 << 20      # the ceiling of glibc's own moving threshold on 64-bit


@contextlib.contextmanager
def host_buffers_unmapped_on_free(threshold: int = 1 << 20):
    """Inside: host allocations above `threshold` are their own mappings, unmapped when freed.
    Restoring a checkpoint frees a read buffer for every shard from Orbax's and tensorstore's
    threads; glibc would keep them in per-thread arenas (about 10% of a restored state, measured)
    instead of returning them. On exit the threshold is left at glibc's own ceiling, where its
    moving threshold ends up anyway. Not glibc: nothing changes."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        yield
        return
    mallopt(M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_MAX)


def release_memory() -> None:
    """Return freed heap to the OS. Tensorstore's worker threads free their encode/decode buffers
    into per-thread glibc arenas that are otherwise kept, so without this a leaf-by-leaf
    conversion still grows by about half of everything it has written."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: nothing to trim
        pass


# ------------------------------------------------------------------------------ lazy saving
@dataclasses.dataclass
class LazyLeaf:
    """A leaf Orbax writes as np.ndarray, produced by `fn` only when its turn comes."""
    shape: tuple[int, ...]
    dtype: np.dtype
    fn: Callable[[], np.ndarray]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


class _LazyHandler(ocp_types.NumpyHandler):
    """Writes LazyLeaf values one after another in numpy's on-disk format (same typestr)."""

    def __init__(self):
        super().__init__(deepcopy_host_arrays=False)

    async def _write_sequentially(self, values, infos, args):
        for leaf, info, arg in zip(values, infos, args):
            arr = np.ascontiguousarray(leaf.fn(), dtype=leaf.dtype)
            if arr.shape != tuple(leaf.shape):
                raise ValueError(f"{info.name}: produced {arr.shape}, expected {tuple(leaf.shape)}")
            await super()._background_serialize([arr], [info], [arg])
            del arr
            release_memory()

    async def serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        return [ocp_future.CommitFutureAwaitingContractedSignals(
            self._write_sequentially(values, infos, args), name="r1jax_lazy_params")]


# Orbax splits a replicated array's shard among its replicas so that several hosts write it, and
# cuts each piece with an eager slice: one XLA compile per piece. Measured on tiny.yaml, 8 CPU
# devices data-parallel: the first save took 25.8 s, 0.85 s without splitting. Below 16 MiB a
# piece writes (~10 ms at 1-2 GB/s) faster than its slice compiles (~25 ms), so only larger
# arrays are split.
MIN_REPLICA_SLICE_BYTES = 16 << 20


def _registry_with(ty, handler):
    """Orbax's default type handlers, with `handler` for `ty`."""
    registry = ocp_registry.create_type_handler_registry(*ocp_registry._DEFAULT_TYPE_HANDLERS)
    registry.add(ty, handler, override=True, ignore_warnings=True)
    return registry


def arrays_registry():
    # Orbax's default jax.Array handler, with the threshold; the metadata store as in the default,
    # so that checkpoints keep their array_metadatas/ (per-array write shapes)
    return _registry_with(jax.Array, ocp_types.ArrayHandler(
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
        array_metadata_store=ocp_array_metadata.Store()))


def _lazy_registry():
    return _registry_with(LazyLeaf, _LazyHandler())


def save_params_lazy(directory: str | Path, step: int, leaves: dict[tuple, LazyLeaf], cfg: ModelConfig) -> None:
    """Write `leaves` as item `params` of step `step` under `directory` (+ model_config.json)."""
    write_model_config(directory, cfg)
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=_lazy_registry())
    with ocp.CheckpointManager(Path(directory).absolute(), item_names=(PARAMS,),
                               item_handlers={PARAMS: handler}) as mngr:
        mngr.save(step, args=ocp.args.Composite(**{PARAMS: ocp.args.PyTreeSave(nest(leaves))}), force=True)
        mngr.wait_until_finished()


# ------------------------------------------------------------------------------ reading
class ParamsReader:
    """Leaves of a `params` item, restored one at a time as numpy arrays. A LoRA run's adapted
    weights are read merged and its adapter leaves are not listed (`merged=False`: as saved)."""

    def __init__(self, directory: str | Path, step: int | None = None, merged: bool = True):
        self.dir = Path(directory).absolute()
        self.step = latest_step(self.dir) if step is None else step
        self.item = self.dir / str(self.step) / PARAMS
        self._ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
        meta = self._ckptr.metadata(self.item).item_metadata
        self.shapes: dict[tuple[str, ...], tuple[int, ...]] = {
            path_key(tuple(getattr(k, "key", k) for k in p)): tuple(m.shape)
            for p, m in jax.tree_util.tree_leaves_with_path(meta)}
        # a pipelined run keeps its MoE stack in slot order (r1jax/parallel/pipeline.py): read in model order
        train_meta = self.dir / str(self.step) / "meta" / "metadata"
        layout = json.loads(train_meta.read_text()).get("moe_layout") if train_meta.is_file() else None
        self.layout = Layout.from_meta(layout) if layout else None
        if self.layout is not None:
            self.shapes = {k: ((self.layout.layers, *v[1:]) if k[0] == "moe_layers" else v)
                           for k, v in self.shapes.items()}
        self._saved = set(self.shapes)
        self.lora = read_lora_config(self.dir)
        self.read = self._read
        if merged and self.lora is not None:
            self.read = loralib.merged_getter(self._read, list(self.shapes), self.lora.scale)
            self.shapes = {k: v for k, v in self.shapes.items() if not loralib.is_lora(k)}

    def _read(self, path: tuple) -> np.ndarray:
        release_memory()
        key = path_key(path)
        if key not in self._saved:
            raise configlib.ConfigError(f"{self.item}: has no parameter {'/'.join(key)}")
        item = nest({key: 0})
        args = nest({key: ocp.RestoreArgs(restore_type=np.ndarray)})
        out = self._ckptr.restore(self.item, args=ocp.args.PyTreeRestore(
            item=item, restore_args=args, partial_restore=True))
        for k in key:
            out = out[k]
        if self.layout is not None and key[0] == "moe_layers":
            out = self.layout.to_layers(out)
        return out


"""A run's weights onto its mesh: fresh from the seed, or from `model.init_from` (`hf:PATH`, an HF
DeepseekV3 directory; `orbax:PATH`, an r1jax checkpoint directory), every leaf created directly
in its shards and in the run's pipeline layout.

Nothing is initialised twice: a fresh model is one compiled init whose outputs are the sharded
leaves; a loaded one is read leaf by leaf from its source into the abstract target, and only
the leaves the source lacks (MTP modules an HF checkpoint does not carry) come from the init,
which then computes just those. Sources are read in model order; the pipeline layout is applied
to each stack leaf on the host before it is placed.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from r1jax import config as configlib
from r1jax import model as modellib
from r1jax.checkpoint import params as ckpt_params
from r1jax.config import Config, ConfigError, KernelConfig, LoraConfig, ModelConfig, Remat
from r1jax.model import lora as loralib
from r1jax.convert import hf
from r1jax.parallel import mesh as meshlib
from r1jax.parallel import pipeline
from r1jax.parallel.pipeline import Layout

Getter = Callable[[tuple], np.ndarray]


def graph(cfg: Config) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract model-order state) of the model `cfg` describes and runs."""
    return modellib.abstract(cfg.model, cfg.kernels, modellib.COMPUTE_DTYPES[cfg.train.dtype], cfg.train.remat,
                             _lora(cfg))


def _lora(cfg: Config) -> LoraConfig | None:
    # targets as a tuple: the compiled init is cached by its arguments
    return dataclasses.replace(cfg.lora, targets=tuple(cfg.lora.targets)) if cfg.lora.rank else None


def rngs(seed) -> nnx.Rngs:
    """The init's random streams: `params` for the model's weights, `lora` for its adapters (so a
    LoRA run's base weights are the plain model's, draw for draw)."""
    key = jax.random.key(seed)
    return nnx.Rngs(params=key, lora=jax.random.fold_in(key, 0x10A))


def target(cfg: Config, mesh: Mesh, layout: Layout | None) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, the state in `layout` as ShapeDtypeStructs carrying their shardings on `mesh`)."""
    graphdef, abs_state = graph(cfg)
    return graphdef, _sharded(pipeline.to_slots(abs_state, layout), mesh, meshlib.rules(cfg.mesh))


def _sharded(abs_state: nnx.State, mesh: Mesh, table: tuple = meshlib.LOGICAL_RULES) -> nnx.State:
    sh = meshlib.shardings(abs_state, mesh, table)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_state, sh)


@functools.lru_cache(maxsize=16)
def _compiled_init(m: ModelConfig, mesh: Mesh | None, layout: Layout | None, paths: tuple | None,
                   lora: LoraConfig | None = None, table: tuple = meshlib.LOGICAL_RULES):
    """The init as one compiled program (its leaves in their shards on `mesh` under the rules
    `table`; on the default device without one). Building the module eagerly dispatches every
    random draw on its own, which XLA:CPU compiles one by one: about 20 s for tests' tiny models
    against 5 s here."""
    _, abs_state = modellib.abstract(m, lora=lora)
    tgt = pipeline.to_slots(abs_state, layout)
    if paths is not None:
        tgt = _only(tgt, paths)

    def init(seed):
        # drawn in model order, so that every layout starts from the same weights; with `paths`
        # XLA computes only the draws those leaves need
        state = pipeline.to_slots(nnx.state(modellib.Transformer(m, lora=lora, rngs=rngs(seed))), layout)
        return state if paths is None else _only(state, paths)

    # Each random draw is its own XLA computation and XLA:CPU spends ~0.25 s optimising each;
    # init runs once, so on CPU compile it without backend optimisation (about 2x faster) and
    # with the elemental emitters instead of the MLIR fusion emitters (quiet 2-core EPYC, compile
    # then run: tiny.yaml 7.3 + 0.08 s -> 5.6 + 0.09 s, moe_small 5.2 + 2.6 s -> 3.6 + 2.8 s).
    options = ({"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False,
                "xla_llvm_disable_expensive_passes": True} if jax.default_backend() == "cpu" else {})
    seed = jax.ShapeDtypeStruct((), jnp.uint32)
    if mesh is None:
        return jax.jit(init).lower(seed).compile(options)
    with meshlib.activate(mesh, table):
        return jax.jit(init, out_shardings=meshlib.shardings(tgt, mesh, table)).lower(seed).compile(options)


def _only(state: nnx.State, paths: tuple) -> nnx.State:
    keep = set(paths)
    return nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(state) if p in keep])


def fresh(cfg: Config, mesh: Mesh, layout: Layout | None = None, paths: list[tuple] | None = None) -> nnx.State:
    """Freshly initialised weights from `train.seed` in their shards and in `layout` (only the
    leaves at `paths` when given: the same values the whole init would give them)."""
    table = meshlib.rules(cfg.mesh)
    init = _compiled_init(cfg.model, mesh, layout, None if paths is None else tuple(paths), _lora(cfg), table)
    with meshlib.activate(mesh, table):
        return init(jnp.uint32(cfg.train.seed))


def create(m: ModelConfig, kernels: KernelConfig = KernelConfig(), dtype=jnp.float32, remat: Remat = Remat.none,
           *, seed: int = 0, lora: LoraConfig | None = None) -> modellib.Transformer:
    """A plain model (no mesh: the default device) with the weights a run with `train.seed=seed`
    starts from; the same as `Transformer(m, ..., rngs=weights.rngs(seed))`, built by one
    compiled init instead of op by op."""
    lora = dataclasses.replace(lora, targets=tuple(lora.targets)) if lora is not None and lora.rank else None
    graphdef, _ = modellib.abstract(m, kernels, dtype, remat, lora)
    return nnx.merge(graphdef, _compiled_init(m, None, None, None, lora)(jnp.uint32(seed)))


def place(target_state: nnx.State, get: Getter, layout: Layout | None) -> nnx.State:
    """`target_state` (in `layout`, with shardings) filled from `get(path)`, model-order host
    arrays, one leaf at a time."""
    def get_in_layout(path):
        a = get(path)
        return layout.to_slots(np.asarray(a)) if layout is not None and path[0] == pipeline.STACK else a
    return meshlib.put(target_state, get_in_layout)


def onto(state: nnx.State, mesh: Mesh) -> nnx.State:
    """A model-order state (e.g. a plain model's) placed on `mesh` by its logical names."""
    abs_state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    return place(_sharded(abs_state, mesh), leaf_getter(state), None)


def leaf_getter(state: nnx.State) -> Getter:
    """`get(path)` over a (model-order) state's leaves, pulled to the host one at a time."""
    values = modellib.leaves(state)
    return lambda path: np.asarray(jax.device_get(values[path]))


def source_model(spec: str, key: str = "model.init_from") -> ModelConfig:
    """The architecture `spec` (hf:DIR or orbax:DIR) holds, read from its config alone."""
    kind, path = spec.split(":", 1)
    if not Path(path).is_dir():
        raise ConfigError(f"{key}={spec}: {path} is not a directory")
    return hf.read_config(path) if kind == "hf" else ckpt_params.read_model_config(path)


def _source(cfg: Config) -> tuple[ModelConfig, set[tuple[str, ...]], Getter, str]:
    """(source model config, its leaves' keys, a getter by nnx path, the source directory)."""
    kind, path = cfg.model.init_from.split(":", 1)
    if not Path(path).is_dir():
        raise ConfigError(f"model.init_from={cfg.model.init_from}: {path} is not a directory")
    if kind == "hf":
        src_cfg, builders = hf.leaf_builders(path)
        by_key = {ckpt_params.path_key(p): b for p, b in builders.items()}
        return src_cfg, set(by_key), lambda p: by_key[ckpt_params.path_key(p)](), path
    src_cfg = ckpt_params.read_model_config(path)
    reader = ckpt_params.ParamsReader(path)
    return src_cfg, set(reader.shapes), reader.read, path


def initial(cfg: Config, mesh: Mesh, layout: Layout | None, log: Callable[[str], None] = print) -> nnx.State:
    """A new run's weights: fresh, or those `model.init_from` names (architecture keys must
    match; MTP modules the source lacks start fresh, and so do LoRA adapters: a LoRA checkpoint
    is read merged, r1jax/checkpoint/params.py)."""
    if not cfg.model.init_from:
        return fresh(cfg, mesh, layout)
    src_cfg, have, get, where = _source(cfg)
    configlib.check_same_architecture(cfg.model, src_cfg, where, "model.init_from")
    _, tgt = target(cfg, mesh, layout)
    paths = [p for p, _ in nnx.to_flat_state(tgt)]
    missing = [p for p in paths if ckpt_params.path_key(p) not in have]
    fresh_ok = [p for p in missing if p[0] == "mtp" or loralib.is_lora(p)]
    if len(fresh_ok) < len(missing):
        bad = next(p for p in missing if p not in fresh_ok)
        raise ConfigError(f"model.init_from: {where} lacks {'/'.join(map(str, bad))}")
    loaded = place(_only(tgt, tuple(p for p in paths if p not in missing)), get, layout)
    log(f"initial weights from {cfg.model.init_from}")
    if not missing:
        return loaded
    if any(p[0] == "mtp" for p in missing):
        log(f"init_from {where}: no MTP weights there; MTP modules start fresh")
    flat = dict(nnx.to_flat_state(loaded)) | dict(nnx.to_flat_state(fresh(cfg, mesh, layout, missing)))
    return nnx.from_flat_state([(p, flat[p]) for p in paths])

"""HF DeepseekV3 safetensors <-> r1jax models and Orbax checkpoints, streamed tensor by tensor.

    cfg, model = load("path/to/hf_dir")           # model(input_ids).logits == HF logits
    save(model, cfg, "out_dir")                    # AutoModelForCausalLM.from_pretrained(out_dir)
    hf_to_orbax(src, dst); orbax_to_hf(src, dst)   # the `python -m r1jax.convert` commands

Reading assembles one r1jax leaf at a time from its HF tensors (all layers, all experts), so
peak host memory is what the destination holds plus one leaf; converting between files never
holds the whole model. FP8 checkpoints (DeepSeek's 128x128 block-scaled e4m3 with
`weight_scale_inv`) are dequantised to float32 on read, or, with `leaf_builders(fp8=True)`
(generation's `--quantize fp8`), read as they are into r1jax/infer/quant.py's fp8 QArrays: the
e4m3 values laid out as the r1jax leaf, the block scales with them.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from r1jax import config as configlib
from r1jax import model as modellib
from r1jax.checkpoint import params as ckpt
from r1jax.config import KernelConfig, ModelConfig, Remat
from r1jax.convert import safetensors_io
from r1jax.convert.mapping import Entry, main_entries, mtp_entries, mtp_shared_copies
from r1jax.convert.safetensors_io import CheckpointError
from r1jax.parallel import mesh as meshlib

F32 = np.dtype(np.float32)


class _Source:
    """HF tensors as float32, FP8 blocks dequantised."""

    def __init__(self, directory: str | Path):
        self.reader = safetensors_io.Reader(directory)
        cfg_path = Path(directory) / "config.json"
        quant = json.loads(cfg_path.read_text()).get("quantization_config") if cfg_path.is_file() else None
        self.block = tuple((quant or {}).get("weight_block_size") or (128, 128))

    def read(self, key: str) -> np.ndarray:
        x = self.reader.read(key)
        if x.dtype in safetensors_io.FP8:
            x, full = self._with_scales(key, x)
            return x.astype(F32) * full
        return x.astype(F32, copy=False)

    def is_e4m3(self, key: str) -> bool:
        return self.reader.dtype(key) == safetensors_io.DTYPES["F8_E4M3"]

    def read_fp8(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(the e4m3 tensor [out, in] as stored, its scale_inv repeated to one per element)."""
        return self._with_scales(key, self.reader.read(key))

    def _with_scales(self, key: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        scale_key = key + "_scale_inv"
        if scale_key not in self.reader:
            raise CheckpointError(f"{key}: fp8 tensor without {scale_key}")
        scale = self.reader.read(scale_key).astype(F32)
        bo, bi = self.block
        if x.ndim != 2 or scale.shape != (-(-x.shape[0] // bo), -(-x.shape[1] // bi)):
            raise CheckpointError(f"{scale_key}: shape {list(scale.shape)} for a {list(x.shape)} weight in "
                                  f"{bo}x{bi} blocks")
        return x, np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[: x.shape[0], : x.shape[1]]


def read_config(directory: str | Path, source: _Source | None = None) -> ModelConfig:
    """The model config of an HF directory; MTP depth 0 when the checkpoint has no MTP weights."""
    d = configlib.model_dict_from_hf(directory)
    cfg = configlib.model_from_dict(d)
    source = source or _Source(directory)
    if cfg.num_nextn_predict_layers and \
            f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" not in source.reader:
        print(f"note: {directory} has no MTP weights (model.layers.{cfg.num_hidden_layers}.*); "
              f"loading it with num_nextn_predict_layers=0")
        cfg = configlib.model_from_dict({**d, "num_nextn_predict_layers": 0})
    return cfg


def entries(cfg: ModelConfig) -> list[Entry]:
    return main_entries(cfg) + mtp_entries(cfg)


def _leaf_builders(cfg: ModelConfig, source: _Source, shapes: dict[tuple, tuple[int, ...]], fp8: bool = False,
                   log: Callable[[str], None] = print) -> dict[tuple, Callable[[], np.ndarray]]:
    """For every r1jax leaf, a function assembling it from its HF tensors."""
    groups: dict[tuple, list[Entry]] = defaultdict(list)
    for e in entries(cfg):
        for p in e.paths:
            groups[p].append(e)
    missing = sorted(set(shapes) - set(groups))
    if missing:
        raise CheckpointError(f"no HF tensor maps to r1jax parameter {'/'.join(map(str, missing[0]))}")
    # every check that needs only the headers runs before anything is read or written
    for es in groups.values():
        for e in es:
            if e.key not in source.reader:
                raise CheckpointError(f"{source.reader.dir}: tensor {e.key} is missing")
            if tuple(source.reader.shape(e.key)) != e.hf_shape:
                raise CheckpointError(f"{e.key}: shape {list(source.reader.shape(e.key))} but the config "
                                      f"implies {list(e.hf_shape)}")
    expected = {e.key for es in groups.values() for e in es}
    ignorable = {e.key for e in mtp_shared_copies(cfg)}
    for key in source.reader.keys():
        if key not in expected and key not in ignorable and not key.endswith("_scale_inv") \
                and not key.endswith("rotary_emb.inv_freq"):
            raise CheckpointError(f"unexpected tensor {key} for this config "
                                  f"(num_hidden_layers={cfg.num_hidden_layers}, "
                                  f"num_nextn_predict_layers={cfg.num_nextn_predict_layers})")

    def builder(path: tuple, group: list[Entry]) -> Callable[[], np.ndarray]:
        def build() -> np.ndarray:
            leaf = np.empty(shapes[path], F32)
            for e in group:
                x = source.read(e.key)
                if tuple(x.shape) != e.hf_shape:
                    raise CheckpointError(f"{e.key}: shape {list(x.shape)} but the config implies "
                                          f"{list(e.hf_shape)}")
                leaf[e.index] = e.split(x)[e.paths.index(path)]
                del x
            return leaf
        return build

    builders = {p: builder(p, g) for p, g in groups.items()}
    if fp8:
        from r1jax.infer import quant
        for p, g in groups.items():
            if p[-1] in quant.MATMULS and all(source.is_e4m3(e.key) for e in g):
                builders[p] = _fp8_builder(p, g, shapes[p], source, builders[p], log)
    return builders


def _fp8_builder(path: tuple, group: list[Entry], shape: tuple[int, ...], source: _Source,
                 dense: Callable[[], np.ndarray], log: Callable[[str], None]):
    """Leaf `path` as an fp8 QArray of host arrays, straight from the checkpoint's e4m3 values
    and block scales. HF tensor [out, in] in bo x bi blocks -> our [*in, *out] viewed as
    [In, Out] in bi x bo blocks: each HF tensor's values and per-element scales go through the
    entry's own layout change (transposes, heads, the fused kv_a/kv_b splits), and the scales
    must then be constant over each of the leaf's blocks. A split that cuts through a block
    (e.g. kv_lora_rank not a multiple of the block) breaks that: such a leaf is read
    dequantised (`dense`) and quantised again in its own blocks by the generator."""
    from r1jax.infer import quant
    n_in, n_out = quant.dims(path[-1], len(shape))
    bo, bi = source.block

    def build():
        q = scale = None
        for e in group:
            x, full = source.read_fp8(e.key)
            k = e.paths.index(path)
            qp, sp = e.split(x)[k], e.split(full)[k]
            In, Out = math.prod(qp.shape[:n_in]), math.prod(qp.shape[n_in:])
            s2 = sp.reshape(In, Out)
            sub = s2[::bi, ::bo]
            if not np.array_equal(np.repeat(np.repeat(sub, bi, axis=0), bo, axis=1)[:In, :Out], s2):
                log(f"{e.key}: its {bo}x{bi} scale blocks do not line up with {'/'.join(map(str, path))}'s; "
                    "read dequantised and quantised again")
                return dense()
            if q is None:
                q = np.empty(shape, qp.dtype)
                scale = np.empty(shape[:len(e.index)] + sub.shape, F32)
            q[e.index] = qp
            scale[e.index] = sub
        return quant.QArray(q, scale, "fp8", n_in, n_out, (bi, bo))
    return build


def is_fp8(directory: str | Path) -> bool:
    """Whether an HF directory holds e4m3 weights (DeepSeek's FP8 release format)."""
    reader = safetensors_io.Reader(directory)
    return any(reader.dtype(k) == safetensors_io.DTYPES["F8_E4M3"] for k in reader.keys())


def leaf_builders(directory: str | Path, *, fp8: bool = False, log: Callable[[str], None] = print
                  ) -> tuple[ModelConfig, dict[tuple, Callable[[], np.ndarray]]]:
    """(config, {nnx path: a function reading that leaf as a float32 host array}) of an HF
    directory, after every check that needs only the headers: nothing is read yet. With `fp8`,
    a matmul weight stored as e4m3 blocks reads as an fp8 QArray of host arrays instead."""
    source = _Source(directory)
    cfg = read_config(directory, source)
    _, abs_state = modellib.abstract(cfg)
    return cfg, _leaf_builders(cfg, source, {p: a.shape for p, a in modellib.leaves(abs_state).items()}, fp8, log)


def load(directory: str | Path, *, mesh: Mesh | None = None, kernels: KernelConfig = KernelConfig(),
         dtype=jnp.float32, remat: Remat = Remat.none) -> tuple[ModelConfig, modellib.Transformer]:
    """(config, model) from an HF DeepseekV3 directory, read leaf by leaf. Without `mesh` the
    model is a plain one on the default device; with one, every leaf is created in its shards."""
    cfg, builders = leaf_builders(directory)
    graphdef, abs_state = modellib.abstract(cfg, kernels, dtype, remat)
    if mesh is None:
        values = {p: jnp.asarray(builders[p]()) for p in modellib.leaves(abs_state)}
        return cfg, nnx.merge(graphdef, modellib.with_leaves(abs_state, values))
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abs_state, meshlib.shardings(abs_state, mesh))
    return cfg, nnx.merge(graphdef, meshlib.put(target, lambda p: builders[p]()))


def write_hf(directory: str | Path, cfg: ModelConfig, get_leaf: Callable[[tuple], np.ndarray],
             dtype=F32, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write an HF checkpoint, pulling r1jax leaves one at a time from `get_leaf(path)`."""
    dtype = np.dtype(dtype)
    ents = sorted(entries(cfg) + mtp_shared_copies(cfg), key=lambda e: tuple(map(str, e.paths[0])))
    by_key = {e.key: e for e in ents}
    cache: dict[tuple, np.ndarray] = {}

    def leaf(path: tuple) -> np.ndarray:
        return cache[path]

    def produce(key: str) -> np.ndarray:
        e = by_key[key]
        if any(p not in cache for p in e.paths):     # keep only the leaves this tensor is made of
            for p in [p for p in cache if p not in e.paths]:
                del cache[p]
            for p in e.paths:
                if p not in cache:
                    cache[p] = np.asarray(get_leaf(p), F32)
        return e.gather(leaf)

    specs = [(e.key, e.hf_shape, F32 if e.fp32 else dtype) for e in ents]
    directory = Path(directory)
    safetensors_io.write(directory, specs, produce, max_shard_bytes)
    hf = configlib.hf_config_dict(cfg)
    hf["dtype"] = {F32: "float32", np.dtype(jnp.bfloat16): "bfloat16", np.dtype(np.float16): "float16"}[dtype]
    (directory / "config.json").write_text(json.dumps(hf, indent=2))


def save(model: modellib.Transformer, cfg: ModelConfig, directory: str | Path, *, dtype=F32,
         max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `model` as an HF DeepseekV3 checkpoint (MTP under model.layers.{L+d}.*)."""
    values = modellib.leaves(nnx.state(model))
    write_hf(directory, cfg, lambda p: jax.device_get(values[p]), dtype, max_shard_bytes)


def hf_to_orbax(src: str | Path, dst: str | Path) -> ModelConfig:
    """HF directory -> r1jax Orbax checkpoint (step 0, item `params`), one leaf in memory at a time."""
    cfg, builders = leaf_builders(src)
    shapes = {p: a.shape for p, a in modellib.leaves(modellib.abstract(cfg)[1]).items()}
    lazy = {p: ckpt.LazyLeaf(shapes[p], F32, builders[p]) for p in shapes}
    ckpt.save_params_lazy(dst, 0, lazy, cfg)
    return cfg


def orbax_to_hf(src: str | Path, dst: str | Path, *, step: int | None = None, dtype=F32,
                max_shard_bytes: int = 5 * 2**30) -> ModelConfig:
    """r1jax Orbax checkpoint directory -> HF directory, one leaf in memory at a time. A checkpoint
    that cannot be read (a file missing, truncated or corrupted) is a CheckpointError naming the
    step and the parameter."""
    cfg = ckpt.read_model_config(src)
    where = f"{src}" + (f" step {step}" if step is not None else "")
    if step is not None and not (Path(src) / str(step) / ckpt.PARAMS).is_dir():
        have = sorted(int(d.name) for d in Path(src).iterdir() if d.name.isdigit() and (d / ckpt.PARAMS).is_dir())
        raise CheckpointError(f"{src}: has no checkpoint step {step} (steps: {', '.join(map(str, have)) or 'none'})")
    try:
        reader = ckpt.ParamsReader(src, step)
    except (configlib.ConfigError, CheckpointError):
        raise
    except Exception as e:            # orbax and tensorstore raise many kinds, with long messages
        raise CheckpointError(f"{where}: its metadata cannot be read ({_first_line(e)}); the checkpoint is "
                              f"incomplete or corrupted") from None
    where = f"{src} step {reader.step}"
    want = sorted({ckpt.path_key(p) for e in entries(cfg) for p in e.paths})
    lost = [k for k in want if k not in reader.shapes]
    if lost:                 # before anything is written
        raise CheckpointError(f"{where}: its metadata lists {len(want) - len(lost)} of the model's {len(want)} "
                              f"parameters (first missing: {'/'.join(lost[0])}); the checkpoint is incomplete "
                              f"or corrupted")

    def read(path: tuple) -> np.ndarray:
        try:
            return reader.read(path)
        except (configlib.ConfigError, CheckpointError):
            raise
        except Exception as e:
            raise CheckpointError(f"{where}: parameter {'/'.join(map(str, path))} cannot be read "
                                  f"({_first_line(e)}); the checkpoint is truncated or corrupted") from None
    write_hf(dst, cfg, read, dtype, max_shard_bytes)
    return cfg


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text if len(text) <= limit else text[:limit] + "..."

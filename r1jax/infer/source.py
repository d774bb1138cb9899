"""Where generation's weights and tokenizer come from: a run directory, `orbax:DIR` or `hf:DIR`.

- a run directory (what `python -m r1jax.train` writes): its latest checkpoint, its
  `tokenizer.json`, and its `config.yaml` for the `infer` and `kernels` sections;
- `orbax:DIR`: an r1jax checkpoint directory (its `model_config.json`); the tokenizer is
  `DIR/tokenizer.json` or, for a run's `checkpoints/`, the run's;
- `hf:DIR`: an HF DeepseekV3 directory (config.json, safetensors) and its `tokenizer.json`.

Weights are read leaf by leaf straight into their shards (r1jax/weights.py), in model order.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from r1jax import config as configlib
from r1jax import weights
from r1jax.checkpoint import params as ckpt_params
from r1jax.config import Config, ConfigError
from r1jax.convert import hf
from r1jax.data import tokenizer as toklib


@dataclasses.dataclass
class Source:
    cfg: Config                     # model = the source's architecture; infer/kernels from the run
    init_from: str                  # "orbax:..." or "hf:..."
    tokenizer_path: Path | None
    mtp_fresh: bool = False         # the source carries no MTP weights
    run_dir: Path | None = None     # the run directory whose config.yaml this is (its data split too)

    def tokenizer(self):
        return None if self.tokenizer_path is None else toklib.load(self.tokenizer_path)

    def load(self, mesh: Mesh, log=lambda s: None, quantize: str = "none") -> nnx.State:
        """The model-order state on `mesh` (no pipeline layout: generation runs the model as is).
        With `quantize="fp8"`, an HF checkpoint in DeepSeek's FP8 format keeps its e4m3 weights
        and block scales (r1jax/infer/quant.py QArrays); otherwise they are dequantised on read."""
        m = dataclasses.replace(self.cfg.model, init_from=self.init_from)
        # a run's mesh.expert_fsdp trades gathers for training memory; decode, which reads every
        # weight every step, places them by the default rules (whole over expert)
        cfg = dataclasses.replace(self.cfg, model=m, mesh=dataclasses.replace(self.cfg.mesh, expert_fsdp=False))
        if quantize == "fp8" and self.init_from.startswith("hf:") and hf.is_fp8(self.init_from[3:]):
            return _load_fp8(cfg, self.init_from[3:], mesh, log)
        return weights.initial(cfg, mesh, None, log)

    def generator(self, tokenizer=None, log=lambda s: None, quantize: str = "none"):
        """A Generator over these weights on the config's mesh (a pipeline axis folds into data:
        generation runs the model as one stage); EOS is the tokenizer's, else the config's;
        `quantize`: none, int8 or fp8 weights (r1jax/infer/quant.py).
        A ConfigError when the mesh does not fit the devices."""
        from r1jax.data import tokenizer as toklib
        from r1jax.infer.generator import Generator
        from r1jax.parallel import mesh as meshlib
        cfg = self.cfg
        mesh = meshlib.make_mesh(meshlib.one_stage(cfg.mesh))
        state = self.load(mesh, log, quantize)
        eos = toklib.eos_id(tokenizer) if tokenizer is not None else None
        eos = cfg.model.eos_token_id if eos is None else eos
        return Generator(cfg.model, state, cfg.infer, mesh=mesh, kernels=cfg.kernels, eos_id=eos, tokenizer=tokenizer,
                         quantize=quantize)


def _load_fp8(cfg: Config, directory: str, mesh: Mesh, log) -> nnx.State:
    """`weights.initial` for an FP8 HF checkpoint whose e4m3 matmul weights stay e4m3: each
    QArray's values are placed in the float leaf's shards, its block scales replicated."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from r1jax.infer import quant
    _, builders = hf.leaf_builders(directory, fp8=True, log=log)
    _, tgt = weights.target(cfg, mesh, None)
    rep = NamedSharding(mesh, PartitionSpec())

    def put(host, shape, sharding):
        host = np.asarray(host)
        return jax.make_array_from_callback(tuple(shape), sharding, lambda idx: host[idx])

    flat = list(nnx.to_flat_state(tgt))
    missing = [p for p, _ in flat if p not in builders]
    if any(p[0] != "mtp" for p in missing):
        raise ConfigError(f"model.init_from: {directory} lacks {'/'.join(map(str, missing[0]))}")
    out, n8 = [], 0
    for path, var in flat:
        if path in missing:
            continue
        want, v = var.get_value(), builders[path]()
        if isinstance(v, quant.QArray):
            if v.shape != tuple(want.shape):
                raise ConfigError(f"{'/'.join(map(str, path))}: got shape {v.shape}, expected {tuple(want.shape)}")
            v = dataclasses.replace(v, q=put(v.q, v.q.shape, want.sharding), scale=put(v.scale, v.scale.shape, rep))
            n8 += 1
        else:
            v = put(np.asarray(v, np.float32).astype(want.dtype, copy=False), want.shape, want.sharding)
        out.append((path, var.replace(v)))
    log(f"initial weights from hf:{directory}: {n8} matmul weights kept in fp8")
    if missing:
        log(f"init_from {directory}: no MTP weights there; MTP modules start fresh")
        out += list(nnx.to_flat_state(weights.fresh(cfg, mesh, None, missing)))
    order = {p: i for i, (p, _) in enumerate(flat)}
    return nnx.from_flat_state(sorted(out, key=lambda pv: order[pv[0]]))


def _tokenizer_in(*dirs: Path) -> Path | None:
    for d in dirs:
        if (d / "tokenizer.json").is_file():
            return d / "tokenizer.json"
    return None


def resolve(src: str, overrides: list[str] = ()) -> Source:
    """The Source `src` names; a ConfigError with one line when it names nothing usable."""
    if src.startswith("hf:"):
        d = Path(src[3:])
        if not (d / "config.json").is_file():
            raise ConfigError(f"--model {src}: {d} is not an HF model directory (no config.json)")
        m = hf.read_config(d)
        cfg = configlib.load(None, list(overrides))
        has_mtp = m.num_nextn_predict_layers == 0 or any(p[0] == "mtp" for p in hf.leaf_builders(d)[1])
        return Source(dataclasses.replace(cfg, model=m), src, _tokenizer_in(d), mtp_fresh=not has_mtp)
    if src.startswith("orbax:"):
        d = Path(src[6:])
        if not (d / ckpt_params.MODEL_CONFIG).is_file():
            raise ConfigError(f"--model {src}: {d} is not an r1jax checkpoint directory (no {ckpt_params.MODEL_CONFIG})")
        run = d.parent if (d.parent / "config.yaml").is_file() else None
        return _from(d, run, src, overrides)
    d = Path(src)
    if (d / "checkpoints" / ckpt_params.MODEL_CONFIG).is_file():
        return _from(d / "checkpoints", d, f"orbax:{d / 'checkpoints'}", overrides)
    raise ConfigError(f"--model {src}: not a run directory (no checkpoints/{ckpt_params.MODEL_CONFIG}); "
                      "give a run directory, orbax:DIR or hf:DIR")


def _from(ckpt: Path, run: Path | None, init_from: str, overrides) -> Source:
    try:
        ckpt_params.latest_step(ckpt)
    except Exception:
        raise ConfigError(f"--model: {ckpt} holds no checkpoint step") from None
    m = ckpt_params.read_model_config(ckpt)
    cfg = configlib.load(run / "config.yaml" if run is not None else None, list(overrides))
    reader = ckpt_params.ParamsReader(ckpt)
    has_mtp = any(k[0] == "mtp" for k in reader.shapes) or m.num_nextn_predict_layers == 0
    return Source(dataclasses.replace(cfg, model=m), init_from,
                  _tokenizer_in(*([ckpt] + ([run] if run is not None else []))), mtp_fresh=not has_mtp,
                  run_dir=run)

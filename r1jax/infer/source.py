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

    def tokenizer(self):
        return None if self.tokenizer_path is None else toklib.load(self.tokenizer_path)

    def load(self, mesh: Mesh, log=lambda s: None) -> nnx.State:
        """The model-order state on `mesh` (no pipeline layout: generation runs the model as is)."""
        m = dataclasses.replace(self.cfg.model, init_from=self.init_from)
        return weights.initial(dataclasses.replace(self.cfg, model=m), mesh, None, log)

    def generator(self, tokenizer=None, log=lambda s: None):
        """A Generator over these weights on the config's mesh (a pipeline axis folds into data:
        generation runs the model as one stage); EOS is the tokenizer's, else the config's.
        A ConfigError when the mesh does not fit the devices."""
        from r1jax.data import tokenizer as toklib
        from r1jax.infer.generator import Generator
        from r1jax.parallel import mesh as meshlib
        cfg = self.cfg
        mesh_cfg = cfg.mesh if cfg.mesh.pipeline == 1 else dataclasses.replace(cfg.mesh, pipeline=1, data=-1)
        mesh = meshlib.make_mesh(mesh_cfg)
        state = self.load(mesh, log)
        eos = toklib.eos_id(tokenizer) if tokenizer is not None else None
        eos = cfg.model.eos_token_id if eos is None else eos
        return Generator(cfg.model, state, cfg.infer, mesh=mesh, kernels=cfg.kernels, eos_id=eos, tokenizer=tokenizer)


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
                  _tokenizer_in(*([ckpt] + ([run] if run is not None else []))), mtp_fresh=not has_mtp)

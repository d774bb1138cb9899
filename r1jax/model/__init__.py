"""DeepSeek-V3/R1 model in Flax NNX; `build` creates one with parameters born sharded."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from r1jax.config import DType, ModelConfig, Remat
from r1jax.model.transformer import Output, Transformer
from r1jax.parallel import mesh as meshlib

COMPUTE_DTYPES = {DType.fp32: jnp.float32, DType.bf16: jnp.bfloat16, DType.fp16: jnp.float16}


def abstract(cfg: ModelConfig, mesh: Mesh, dtype=jnp.float32, remat: Remat = Remat.none, layout=None):
    """(graphdef, abstract state whose leaves carry their shardings); allocates nothing.
    `layout`: the MoE stack's pipeline Layout (r1jax.parallel.pipeline); None: model order."""
    with meshlib.activate(mesh):
        return nnx.get_abstract_model(lambda: Transformer(cfg, dtype, remat, rngs=nnx.Rngs(0), layout=layout), mesh)


def to_layout(state: nnx.State, layout) -> nnx.State:
    """A model-order state with its MoE stack leaves moved into `layout`'s slots (pads zero)."""
    if layout is None or layout.identity:
        return state
    return nnx.from_flat_state([(p, v.replace(layout.to_slots(v.get_value())) if p[0] == "moe_layers" else v)
                                for p, v in nnx.to_flat_state(state)])


@functools.lru_cache(maxsize=16)
def _compiled_init(cfg: ModelConfig, mesh: Mesh, dtype, remat: Remat, layout=None):
    graphdef, abs_state = abstract(cfg, mesh, dtype, remat, layout)
    shardings = jax.tree.map(lambda a: a.sharding, abs_state)

    def init(seed):
        # drawn in model order, so that every layout starts from the same weights
        return to_layout(nnx.split(Transformer(cfg, dtype, remat, rngs=nnx.Rngs(jax.random.key(seed))))[1], layout)

    # Each random draw is its own XLA computation and XLA:CPU spends ~0.25 s optimising each;
    # init runs once, so on CPU compile it without backend optimisation (about 2x faster).
    options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}
    with meshlib.activate(mesh):
        fn = jax.jit(init, out_shardings=shardings).lower(jax.ShapeDtypeStruct((), jnp.uint32)).compile(options)
    return graphdef, fn


def leaves(state: nnx.State) -> dict[tuple, jax.Array]:
    """{nnx path: array} for every variable in `state` (abstract or concrete)."""
    return {path: var.get_value() for path, var in nnx.to_flat_state(state)}


def with_leaves(state: nnx.State, values: dict[tuple, jax.Array]) -> nnx.State:
    """`state` with each variable's value replaced by `values[path]` (metadata kept)."""
    missing = [p for p, _ in nnx.to_flat_state(state) if p not in values]
    if missing:
        raise KeyError(f"no value for {'/'.join(map(str, missing[0]))}")
    return nnx.from_flat_state([(p, v.replace(values[p])) for p, v in nnx.to_flat_state(state)])


def build(cfg: ModelConfig, mesh: Mesh, *, seed: int = 0, dtype=jnp.float32,
          remat: Remat = Remat.none, layout=None) -> Transformer:
    """A freshly initialised model whose parameters are created directly in their shards."""
    graphdef, init = _compiled_init(cfg, mesh, dtype, remat, layout)
    with meshlib.activate(mesh):
        return nnx.merge(graphdef, init(jnp.uint32(seed)))


__all__ = ["Output", "Transformer", "abstract", "build", "leaves", "to_layout", "with_leaves", "COMPUTE_DTYPES"]

"""DeepSeek-V3/R1 model in Flax NNX: a plain module tree, always in model order.

`Transformer(cfg, rngs=nnx.Rngs(0))` works anywhere (no mesh needed): its variables carry
logical axis names as inert metadata (r1jax/logical.py). Placing parameters on a mesh, born in
their shards, is `r1jax.weights`' job."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from r1jax.config import DType, KernelConfig, LoraConfig, ModelConfig, Remat
from r1jax.model.transformer import Output, Transformer

COMPUTE_DTYPES = {DType.fp32: jnp.float32, DType.bf16: jnp.bfloat16, DType.fp16: jnp.float16}


def abstract(cfg: ModelConfig, kernels: KernelConfig = KernelConfig(), dtype=jnp.float32,
             remat: Remat = Remat.none, lora: LoraConfig | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state of ShapeDtypeStruct leaves with their logical names); allocates nothing."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, kernels, dtype, remat, lora, rngs=nnx.Rngs(0))))


def leaves(state: nnx.State) -> dict[tuple, jax.Array]:
    """{nnx path: array} for every variable in `state` (abstract or concrete)."""
    return {path: var.get_value() for path, var in nnx.to_flat_state(state)}


def with_leaves(state: nnx.State, values: dict[tuple, jax.Array]) -> nnx.State:
    """`state` with each variable's value replaced by `values[path]` (metadata kept)."""
    missing = [p for p, _ in nnx.to_flat_state(state) if p not in values]
    if missing:
        raise KeyError(f"no value for {'/'.join(map(str, missing[0]))}")
    return nnx.from_flat_state([(p, v.replace(values[p])) for p, v in nnx.to_flat_state(state)])


__all__ = ["Output", "Transformer", "abstract", "leaves", "with_leaves", "COMPUTE_DTYPES"]

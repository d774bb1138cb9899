"""Weight-only quantisation for generation: `int8` (symmetric, one scale per output channel) and
`fp8` (float8_e4m3fn with one fp32 scale per 128x128 block, DeepSeek-V3/R1's release format).

Every matmul weight of the generator's parameters (the MLA projections, the dense and shared
MLPs, the routed experts, the MTP module's `eh_proj` and the LM head) becomes a `QArray`
(quantised values `q` in the weight's own layout plus fp32 `scale`s) that stays quantised in
memory; the embedding table, norms, router and biases stay floats. A QArray reads like the
array it stands for: `w[...]` (how every layer reads a weight, `layers.cast`) and
`w.astype(dtype)` (how the MoE reads its experts) give the dequantised weight `q * scale`, so
dequantisation happens inside the jitted step where a layer reads the weight; an integer index
(`w[i]`: a layer of a stack, an expert) gives that slice, still quantised. Routed experts that
`grouped` dispatch reads in place (the generator's tuple-of-experts layout) are wrapped by
`for_step` in a `QMatmul`, a matmul operand that dequantises inside the expert's tile loop, tied
to the tile's activations, so only the selected experts are read, from their quantised bytes,
at every decode step. The other weights' dequantisation is loop-invariant, and XLA hoists it
out of a decode chunk's `while_loop` (seen in the compiled decode step: the loop carries f32
copies): those are dequantised once per chunk (`infer.decode_chunk` steps) and the steps read
the copies. Keeping them quantised inside the loop would need the layers to tie the weight to
their input (`layers.dense`), which this module does not reach.

Scales: a weight [*lead, *in, *out] (`lead`: layer and expert stack dims; `in`: the dims the
layer contracts, `MATMULS` per name) is viewed as matrices [In, Out] (DeepSeek's `[out, in]`
Linear weight, transposed). int8: scale [*lead, *out] = max|w| over `in` / 127. fp8: scale
[*lead, ceil(In/bi), ceil(Out/bo)] = the block's max|w| / 448 (e4m3's largest finite value):
DeepSeek's `weight_scale_inv` transposed, so `convert/hf.py` loads their FP8 checkpoints into
fp8 QArrays without dequantising (`Source.load(quantize="fp8")`).

Why not qwix (google/qwix 0.1.8, on PyPI): its PTQ finds a weight by intercepting
`dot_general`/`einsum` and matching the rhs operand to an `nnx.Param` of the current module,
by tracer identity or else by shape. r1jax's projections go through a `jax.custom_vjp`
(`layers.dense`), whose rhs is a fresh tracer, so they could only be matched by shape (MLP's
gate and up share one, and a shape shared by two params silently matches neither); the
generator's routed experts are a tuple of arrays inside one Param (no shape at all) used with
`@` in a `fori_loop`; and the generator merges its own graphdef inside the jitted step, where
qwix's class-level `__call__` patch never runs. Measured: `qwix.quantize_model(tiny.yaml
Transformer, PtqProvider([QuantizationRule(module_path=".*", weight_qtype="int8")]), ids)` fails
inside the scanned stacks (`AssertionError: shape=(64, 48) spec=('layers', 'embed', 'q_lora')`
from `lax.scan` in `transformer.scan_blocks`). qwix's weight-only mode also just dequantises
before a float matmul, which is what this module does, so nothing is lost by owning it.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

KINDS = ("none", "int8", "fp8")
INT8_MAX = 127.0
FP8_MAX = 448.0                     # float8_e4m3fn's largest finite value
FP8 = jnp.float8_e4m3fn
BLOCK = (128, 128)                  # fp8 scale blocks over [In, Out] (DeepSeek: weight_block_size)
F32 = jnp.float32

# the matmul weights by leaf name: (the name's own rank, how many of those dims the layer
# contracts after the leading expert dim if any). A leaf may carry more leading (layer) dims.
# wk_b_CNK is contracted over C when prefill expands the keys and over K by absorbed decode;
# its scales follow the HF layout (kv_b_proj [N*K, C]: in = C) either way.
MATMULS = {
    "wq_DNH": (3, 1), "wq_a_DQ": (2, 1), "wq_b_QNH": (3, 1), "wkv_a_DC": (2, 1), "wk_rope_DR": (2, 1),
    "wk_b_CNK": (3, 1), "wv_b_CNV": (3, 1), "wo_NVD": (3, 2),
    "gate_DF": (2, 1), "up_DF": (2, 1), "down_FD": (2, 1),
    "gate_EDF": (3, 1), "up_EDF": (3, 1), "down_EFD": (3, 1),
    "lm_head_DW": (2, 1), "eh_proj_2DD": (2, 1),
}
EXPERT_DIMS = {"gate_EDF": 1, "up_EDF": 1, "down_EFD": 1}


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"--quantize {kind}: allowed {', '.join(KINDS)}")
    return kind


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantised weight: w ~= q * scale (see the module docstring for the scale layouts)."""
    q: jax.Array                    # int8 or float8_e4m3fn, the weight's shape [*lead, *in, *out]
    scale: jax.Array                # float32: int8 [*lead, *out]; fp8 [*lead, blocks_in, blocks_out]
    kind: str = dataclasses.field(metadata=dict(static=True), default="int8")
    n_in: int = dataclasses.field(metadata=dict(static=True), default=1)
    n_out: int = dataclasses.field(metadata=dict(static=True), default=1)
    block: tuple[int, int] = dataclasses.field(metadata=dict(static=True), default=BLOCK)

    # ------------------------------------------------------------------ array-like surface
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes) + int(self.scale.nbytes)

    @property
    def n_lead(self) -> int:
        return self.ndim - self.n_in - self.n_out

    def __getitem__(self, key):
        """`[...]`: the dequantised weight (float32); an int: one leading (layer/expert) slice."""
        if key is Ellipsis:
            return self.dequantize(F32)
        if isinstance(key, (int, np.integer)) and self.n_lead > 0:
            return dataclasses.replace(self, q=self.q[key], scale=self.scale[key])
        raise TypeError(f"a QArray takes [...] or an integer index over its {self.n_lead} leading dims, not {key!r}")

    def astype(self, dtype) -> jax.Array:
        return self.dequantize(dtype)

    # ------------------------------------------------------------------ values
    def dequantize(self, dtype=F32) -> jax.Array:
        lead, shape = self.q.shape[:self.n_lead], self.q.shape
        if self.kind == "int8":
            s = self.scale.reshape(self.scale.shape[:self.n_lead] + (1,) * self.n_in + self.scale.shape[self.n_lead:])
            return (self.q.astype(F32) * s).astype(dtype)
        In = math.prod(shape[self.n_lead:self.n_lead + self.n_in])
        Out = math.prod(shape[self.n_lead + self.n_in:])
        bi, bo = self.block
        nbi, nbo = self.scale.shape[-2:]
        if In % bi == 0 and Out % bo == 0:
            q = self.q.reshape(lead + (nbi, bi, nbo, bo)).astype(F32)
            w = q * self.scale[..., :, None, :, None]
        else:
            s = jnp.repeat(jnp.repeat(self.scale, bi, axis=-2), bo, axis=-1)[..., :In, :Out]
            w = self.q.reshape(lead + (In, Out)).astype(F32) * s
        return w.reshape(shape).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QMatmul:
    """A routed expert's QArray as `grouped` dispatch uses it (`x @ w` inside its tile loop):
    `astype` keeps it quantised and `x @ w` dequantises right there, so an expert no token
    selected is never read (r1jax/kernels/dispatch.py `routed_grouped`)."""
    w: QArray

    @property
    def shape(self):
        return self.w.shape

    def astype(self, dtype) -> "QMatmul":
        return self

    def __rmatmul__(self, x):
        # tied to x by a barrier: XLA would otherwise hoist the (loop-invariant) dequantisation
        # out of the tile loop, and out of decode's while_loop, dequantising every expert
        # whether selected or not (seen in the compiled decode step)
        q, _ = jax.lax.optimization_barrier((self.w.q, x))
        return x @ dataclasses.replace(self.w, q=q).dequantize(x.dtype)


# ---------------------------------------------------------------------- quantising
def quantize(w, kind: str, n_in: int = 1, n_out: int = 1, block: tuple[int, int] = BLOCK) -> QArray:
    """`w` [*lead, *in (n_in dims), *out (n_out dims)] as a QArray of `kind` (int8 or fp8)."""
    return _quantize_many((w,), kind, ((n_in, n_out),), tuple(block))[0]


def _quantize_one(w, kind: str, n_in: int, n_out: int, block: tuple[int, int]) -> QArray:
    n_lead = w.ndim - n_in - n_out
    if n_lead < 0:
        raise ValueError(f"a {w.ndim}-d weight cannot have {n_in} input and {n_out} output dims")
    if kind == "int8":
        q, s = _int8(w, n_lead, n_in)
    elif kind == "fp8":
        q, s = _fp8(w, n_lead, n_in, block)
    else:
        raise ValueError(f"cannot quantise to {kind!r}: allowed int8, fp8")
    return QArray(q, s, kind, n_in, n_out, block)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_many(ws, kind: str, dims: tuple[tuple[int, int], ...], block: tuple[int, int]) -> list[QArray]:
    # one program for all of a state's weights: one compile instead of one per leaf shape
    return [_quantize_one(w, kind, n_in, n_out, block) for w, (n_in, n_out) in zip(ws, dims)]


def _div(x: jax.Array, c: float) -> jax.Array:
    """x / c, correctly rounded as numpy's (DeepSeek's scales are amax / 448): XLA rewrites a
    division by a broadcast scalar into a multiplication by its reciprocal, one ulp off for
    about half of all values; a full-shape divisor behind a barrier keeps the true division."""
    return x / jax.lax.optimization_barrier(jnp.full(x.shape, c, x.dtype))


def _int8(w, n_lead: int, n_in: int):
    w = w.astype(F32)
    axes = tuple(range(n_lead, n_lead + n_in))
    amax = jnp.max(jnp.abs(w), axis=axes)
    scale = jnp.where(amax > 0, _div(amax, INT8_MAX), 1.0)
    s = scale.reshape(scale.shape[:n_lead] + (1,) * n_in + scale.shape[n_lead:])
    q = jnp.clip(jnp.round(w / s), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def _fp8(w, n_lead: int, n_in: int, block: tuple[int, int]):
    w = w.astype(F32)
    shape, lead = w.shape, w.shape[:n_lead]
    In, Out = math.prod(shape[n_lead:n_lead + n_in]), math.prod(shape[n_lead + n_in:])
    bi, bo = block
    nbi, nbo = -(-In // bi), -(-Out // bo)
    w2 = w.reshape(lead + (In, Out))
    pad = [(0, 0)] * n_lead + [(0, nbi * bi - In), (0, nbo * bo - Out)]
    blocks = jnp.pad(w2, pad).reshape(lead + (nbi, bi, nbo, bo))
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))                       # [*lead, nbi, nbo]
    scale = jnp.where(amax > 0, _div(amax, FP8_MAX), 1.0)
    q = jnp.clip(blocks / scale[..., :, None, :, None], -FP8_MAX, FP8_MAX).astype(FP8)
    q = q.reshape(lead + (nbi * bi, nbo * bo))[..., :In, :Out].reshape(shape)
    return q, scale


def dims(name: str, ndim: int) -> tuple[int, int]:
    """(n_in, n_out) of matmul weight `name` held as an `ndim`-d leaf (leading dims: stacks)."""
    rank, n_in = MATMULS[name]
    if ndim < rank:
        raise ValueError(f"{name}: a {ndim}-d leaf, but the name implies {rank} dims")
    return n_in, rank - EXPERT_DIMS.get(name, 0) - n_in


def quantize_state(state: nnx.State, kind: str, block: tuple[int, int] = BLOCK) -> nnx.State:
    """`state` with every matmul weight (`MATMULS`) as a QArray of `kind`, the rest as it was.
    A weight that already is a QArray of `kind` stays as loaded (an FP8 checkpoint's blocks);
    `kind="none"` turns QArrays back into float32 arrays. Each quantised leaf keeps the float
    leaf's sharding (its scales are replicated)."""
    check_kind(kind)
    flat = list(nnx.to_flat_state(state))
    values = [var.get_value() for _, var in flat]
    todo = []
    for i, (path, _) in enumerate(flat):
        v = values[i]
        if path[-1] not in MATMULS or isinstance(v, jax.ShapeDtypeStruct):
            continue
        if isinstance(v, QArray) and v.kind != kind:
            v = values[i] = v.dequantize(F32)
        if not isinstance(v, QArray) and kind != "none":
            todo.append(i)
    if todo:
        ws = tuple(values[i] for i in todo)
        qs = _quantize_many(ws, kind, tuple(dims(flat[i][0][-1], w.ndim) for i, w in zip(todo, ws)), tuple(block))
        for i, w, qa in zip(todo, ws, qs):
            sharding = getattr(w, "sharding", None)
            if isinstance(sharding, NamedSharding):
                rep = NamedSharding(sharding.mesh, PartitionSpec())
                qa = dataclasses.replace(qa, q=jax.device_put(qa.q, sharding), scale=jax.device_put(qa.scale, rep))
            values[i] = qa
    return nnx.from_flat_state([(path, var.replace(v)) for (path, var), v in zip(flat, values)])


def for_step(params, kernels):
    """The generator's parameters as a step's layers read them: under `grouped` dispatch (the
    step's `kernels`), each routed expert's QArray (the tuple-of-experts layout) becomes a
    `QMatmul`, dequantised inside the expert's tile loop; everything else is unchanged (a QArray
    dequantises where it is read)."""
    from r1jax.kernels import dispatch
    if dispatch.resolve(kernels.moe_dispatch.value) != "grouped":
        return params

    def experts(x):
        return tuple(QMatmul(e) for e in x) if _experts(x) else x
    return jax.tree.map(experts, params, is_leaf=lambda x: isinstance(x, QArray) or _experts(x))


def _experts(x) -> bool:
    return isinstance(x, tuple) and bool(x) and all(isinstance(e, QArray) for e in x)


# ---------------------------------------------------------------------- accounting
def nbytes(tree) -> int:
    """Bytes of every array in `tree` (a QArray counts its values and scales)."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def weight_bytes(tree) -> dict[str, int]:
    """{"total", "quantized" (QArray values + scales), "float" (everything else)} in bytes."""
    q = 0
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QArray)):
        if isinstance(leaf, QArray):
            q += leaf.nbytes
    total = nbytes(tree)
    return {"total": total, "quantized": q, "float": total - q}

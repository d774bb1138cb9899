"""`python -m r1jax.export --format onnx`: the exported prefill and decode as ONNX graphs.

jax2onnx converts a traced function primitive by primitive, and onnxruntime runs the result.
Four things stand between r1jax's greedy functions and that, each handled here:

- jax2onnx replaces some high-level functions while it traces (`jax.random.normal` without a
  vmap rule, `lax.fori_loop` needing a concrete trip count), and r1jax calls them under vmap
  (`nnx.vmap` building the layer stacks) and with data-dependent trip counts (the `grouped`
  expert dispatch). So the functions are traced to a jaxpr first, with jax's own tracing, and
  jax2onnx converts that jaxpr's primitives (`while`, `cond`, `scatter`, ...).
- The sampler's random branch is never taken at temperature 0, but it is traced (a `cond`), and
  jax2onnx writes its `bitcast_convert_type` (Threefry's words made floats) as opset 26's
  `BitCast`, which an opset-23 model may not hold (onnxruntime 1.32: "No Op registered for
  BitCast with domain_version of 23"; at opset 26 it fails on its own `Swish(24)` fusion
  instead). The exported functions fix temperature 0, so
  `specialise` folds the constants and keeps only the `cond` branch that runs: the graphs hold
  no random op at all (`convert` checks).
- jax2onnx converts a `cond` of two branches only, and the `grouped` dispatch switches over the
  experts: a `switch` becomes a chain of two-way conds (`_switch`).
- Two jax2onnx outputs that onnxruntime refuses (`fix_for_onnxruntime`): `Where` on bool tensors
  (onnxruntime's CPU `Where` has no bool kernel: "Could not find an implementation for Where(16)")
  goes through uint8, and a `Reshape` of a zero-size tensor (a scatter whose index vector has no
  dimensions: "[ShapeInferenceError] Invalid position of 0") gets `allowzero=1`, so its target's
  0 is a zero-length dimension, not "copy the input's".

onnxruntime's CPU kernels (Einsum, MatMul) take no bf16, so the export needs infer.dtype=fp32 (a
bf16 cache is only stored and cast: it works). When onnxruntime is installed, `convert` loads
each graph in it before writing it, so what it cannot run fails the export in one line.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Sequence

import jax
import numpy as np
from jax._src import core as jcore
from jax._src.interpreters import partial_eval as pe

OPSET = 23
RANDOM_PRIMITIVES = ("random_bits", "random_seed", "random_wrap", "random_unwrap", "threefry2x32",
                     "random_fold_in", "random_split")
SMALL = 4096          # elements: a value computed from constants alone is folded when at most this big


def _concrete(x) -> bool:
    return not isinstance(x, jcore.Tracer)


def _run(jaxpr: jcore.Jaxpr, consts: Sequence, args: Sequence) -> list:
    """Evaluate `jaxpr` on `args` (tracers or constants), folding what depends on constants only
    (small values), inlining calls, and taking a `cond` whose index is a constant as its branch."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name, params = eqn.primitive.name, eqn.params
        if name == "jit":
            outs = _run(params["jaxpr"].jaxpr, params["jaxpr"].consts, ins)
        elif name in ("custom_jvp_call", "custom_vjp_call"):
            outs = _run(params["call_jaxpr"].jaxpr, params["call_jaxpr"].consts, ins)
        elif name == "cond" and _concrete(ins[0]):
            branch = params["branches"][int(np.asarray(ins[0]))]
            outs = _run(branch.jaxpr, branch.consts, ins[1:])
        elif name == "cond" and len(params["branches"]) > 2:
            outs = _switch(params["branches"], ins[0], ins[1:])
        elif name == "while":
            outs = _while(params, ins)
        else:
            small = all(np.prod(v.aval.shape, dtype=np.int64) <= SMALL for v in eqn.outvars
                        if hasattr(v.aval, "shape"))
            bind = eqn.primitive.get_bind_params(params)
            fold = all(_concrete(x) for x in ins) and small and not eqn.effects
            with eqn.ctx.manager, (jax.ensure_compile_time_eval() if fold else contextlib.nullcontext()):
                outs = eqn.primitive.bind(*ins, **bind)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _switch(branches, index, ops) -> list:
    """A `switch` over n > 2 branches as a chain of two-way conds (jax2onnx converts a `cond` of
    two branches only; the `grouped` expert dispatch switches over the experts)."""
    first = lambda o: _run(branches[0].jaxpr, branches[0].consts, o)
    if len(branches) == 1:
        return first(ops)
    rest = lambda o: _switch(branches[1:], index - 1, o)
    return jax.lax.cond(index == 0, first, rest, ops)


def _while(params, ins) -> list:
    """A `while` rebuilt with its body and condition specialised to the constants among their
    loop-invariant inputs (jax moves a carry that the body passes through unchanged to a body
    constant: the sampling parameters)."""
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cconsts, bconsts, init = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
    cj, bj = params["cond_jaxpr"], params["body_jaxpr"]
    avals = [v.aval for v in bj.jaxpr.outvars]
    init = [jax.numpy.asarray(x, a.dtype) if _concrete(x) else x for x, a in zip(init, avals)]
    out = jax.lax.while_loop(lambda c: _run(cj.jaxpr, cj.consts, [*cconsts, *c])[0],
                             lambda c: tuple(_run(bj.jaxpr, bj.consts, [*bconsts, *c])), tuple(init))
    return list(out)


def primitives(jaxpr: jcore.Jaxpr, into: set | None = None) -> set[str]:
    """Every primitive's name in `jaxpr`, nested jaxprs included."""
    into = set() if into is None else into
    for eqn in jaxpr.eqns:
        into.add(eqn.primitive.name)
        for sub in jcore.jaxprs_in_params(eqn.params):
            primitives(sub, into)
    return into


def specialise(fn: Callable, specs: Sequence) -> jcore.ClosedJaxpr:
    """`fn`'s jaxpr over `specs` with constants folded, taken branches inlined and dead code gone."""
    closed = jax.make_jaxpr(fn)(*specs)
    spec = jax.make_jaxpr(lambda *a: _run(closed.jaxpr, closed.consts, a))(*specs)
    jaxpr, _ = pe.dce_jaxpr(spec.jaxpr, [True] * len(spec.jaxpr.outvars), instantiate=True)
    return jcore.ClosedJaxpr(jaxpr, spec.consts)


def missing() -> str | None:
    """What the conversion needs and this environment lacks, in one line; None when all is there."""
    lacking = []
    for mod in ("jax2onnx", "onnx"):
        try:
            __import__(mod)
        except ImportError:
            lacking.append(mod)
    if not lacking:
        return None
    return (f"{' and '.join(lacking)} (jax2onnx pins orbax-checkpoint<0.11.37: "
            "pip install --no-deps jax2onnx==0.17.1; pip install onnx onnx-ir equinox dm-pix einops)")


class OnnxError(ValueError):
    """The function cannot be written as an ONNX graph onnxruntime runs; one line."""


def convert(fn: Callable, specs: Sequence, name: str, input_names: Sequence[str]):
    """`fn` over `specs` as an onnx.ModelProto that onnxruntime loads. Its outputs keep
    jax2onnx's names (an array returned twice, as prefill's `done`, cannot have two)."""
    from jax2onnx import to_onnx
    closed = specialise(fn, specs)
    left = sorted(primitives(closed.jaxpr) & set(RANDOM_PRIMITIVES))
    if left:
        raise OnnxError(f"{name}: random primitives {', '.join(left)} are left after fixing temperature 0; "
                        "jax2onnx writes them as ONNX RandomUniform/BitCast (not JAX's threefry), "
                        "which onnxruntime cannot run")
    quiet = logging.getLogger("onnx_ir")          # a warning per scalar whose type it does not stamp
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        model = to_onnx(lambda *a: tuple(jcore.eval_jaxpr(closed.jaxpr, closed.consts, *a)), list(specs),
                        model_name=name, opset=OPSET, input_names=list(input_names))
    except Exception as e:       # jax2onnx has no error type of its own: name what failed, in one line
        msg = " ".join(str(e).split())
        raise OnnxError(f"{name}: jax2onnx cannot convert it: {type(e).__name__}: {msg[:300]}") from None
    finally:
        quiet.setLevel(level)
    model = fix_for_onnxruntime(model)
    try:
        import onnxruntime
    except ImportError:          # nothing to check with: the graph is written as converted
        return model
    opts = onnxruntime.SessionOptions()
    opts.log_severity_level = 3
    try:
        onnxruntime.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as e:
        msg = " ".join(str(e).split())
        raise OnnxError(f"{name}: onnxruntime cannot load the converted graph: {msg[:300]}") from None
    return model


def fix_for_onnxruntime(model):
    """The two rewrites onnxruntime needs (the module docstring says why), in every subgraph."""
    import onnx
    from onnx import TensorProto, helper

    types: dict[str, int] = {}
    empty: set[str] = set()                  # values with a zero-length dimension

    def collect(g):
        for v in [*g.value_info, *g.input, *g.output]:
            t = v.type.tensor_type
            types[v.name] = t.elem_type
            if any(d.HasField("dim_value") and d.dim_value == 0 for d in t.shape.dim):
                empty.add(v.name)
        for init in g.initializer:
            types[init.name] = init.data_type
            if 0 in init.dims:
                empty.add(init.name)
        for n in g.node:
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    collect(sub)

    collect(onnx.shape_inference.infer_shapes(model).graph)

    def walk(g):
        nodes = []
        for n in g.node:
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    walk(sub)
            if n.op_type == "Reshape" and n.input[0] in empty and not any(a.name == "allowzero" for a in n.attribute):
                n.attribute.append(helper.make_attribute("allowzero", 1))
            if n.op_type == "Where" and types.get(n.output[0]) == TensorProto.BOOL:
                a8, b8, o8 = (f"{n.output[0]}__u8_{k}" for k in "abo")
                nodes += [helper.make_node("Cast", [n.input[1]], [a8], to=TensorProto.UINT8),
                          helper.make_node("Cast", [n.input[2]], [b8], to=TensorProto.UINT8),
                          helper.make_node("Where", [n.input[0], a8, b8], [o8], name=n.name),
                          helper.make_node("Cast", [o8], [n.output[0]], to=TensorProto.BOOL)]
            else:
                nodes.append(n)
        del g.node[:]
        g.node.extend(nodes)

    walk(model.graph)
    return model

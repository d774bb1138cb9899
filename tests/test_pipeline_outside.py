"""What runs outside the pipeline's stages (#14 item 6): the embedding, dense prefix, head and MTP
are sharded over `pipeline` as over fsdp, never summed whole to every stage, and computed by
each stage on its own rows only. 8 fake CPU devices; compiles only (the numbers of training
through these meshes are test_mesh.py's rule)."""
from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from r1jax import config as configlib
from r1jax.parallel import mesh as meshlib
from r1jax.parallel import pipeline
from r1jax.train import state as statelib
from r1jax.train.step import build
from runs import TINY, tiny_batches

SEQ = 40                     # no parameter has a (40, 64) tail: HLO arrays ending so are activations
PIPE = ["mesh.data=4", "mesh.pipeline=2", "train.microbatches=2", f"data.seq_len={SEQ}",
        "train.global_batch_size=16"]


def _setup(overrides: list[str]):
    cfg = configlib.load(TINY, overrides)
    return cfg, build(cfg, meshlib.make_mesh(cfg.mesh, jax.devices()[:math.prod(
        v for v in (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.mesh.expert, cfg.mesh.pipeline))]))


@pytest.mark.parametrize("zero1", [False, True])
def test_parts_outside_the_stack_hold_a_pipeline_share_per_device(zero1):
    """Per device, the embedding + dense prefix + head + MTP masters are their total / P (plus the
    norms' weight vectors, which stay whole: 0.3% here); the stack's slots are split over the
    stages as before. ZeRO-1 splits them further over data."""
    cfg, setup = _setup(PIPE + ([f"optim.zero1={str(zero1).lower()}"]))
    P = cfg.mesh.pipeline
    total = own = norms = 0
    for path, var in nnx.to_flat_state(setup.state["params"]):
        a = var.get_value()
        key = "/".join(map(str, path))
        shard = a.addressable_shards[0].data.size * a.dtype.itemsize
        if key.startswith(pipeline.STACK + "/"):
            assert a.sharding.spec[0] == "pipeline", key
            continue
        total += a.size * a.dtype.itemsize
        own += shard
        if "norm" in key:
            norms += shard
            continue
        split = P * (cfg.mesh.data if zero1 else 1)
        assert shard * split == a.size * a.dtype.itemsize, (key, a.sharding.spec)
    assert norms < 0.005 * total
    assert own <= total / P / (cfg.mesh.data if zero1 else 1) + norms


def _collectives(compiled) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for line in compiled.as_text().splitlines():
        m = re.match(r"\s*%?\S+ = (\w+)\[([\d,]*)\]\S* (all-reduce|reduce-scatter|all-gather)(?:-start)?\(", line)
        if m:
            out.append((m.group(3), tuple(int(d) for d in m.group(2).split(",") if d)))
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_no_collective_moves_the_stack_output_whole(schedule):
    """The compiled train step holds no collective of the whole stack output or input over the
    stages, nor of more than one microbatch's rows of them (before #14 item 6, GPipe's step had
    two all-reduces of the whole, output and input gradient, and 1F1B's one). Both move one
    microbatch a tick: its stack input summed to stage 0 from the stages holding its rows and its
    gradient summed back; GPipe the last stage's output to those stages and its gradient back;
    1F1B its epilogue rows (a reduce-scatter and an all-gather)."""
    cfg, setup = _setup(PIPE + [f"pipeline.schedule={schedule}"])
    batch = tiny_batches(cfg, 1)[0]
    colls = _collectives(setup.step.lower(setup.state, batch).compile())
    D = cfg.model.hidden_size
    acts = [(k, s) for k, s in colls if s[-2:] == (SEQ, D)]
    assert acts
    rows = cfg.train.global_batch_size // cfg.mesh.data // cfg.train.microbatches
    assert all(math.prod(s) <= rows * SEQ * D for _, s in acts), acts


def test_epilogue_flops_halve_against_a_whole_data_shard():
    """The final norm, head, MTP and their backward on pipeline2 x data4 cost each device half the
    FLOPs of data4 alone (where every device computes its data shard's rows, as each stage did
    when the epilogue was replicated): each stage runs its 1/P of the rows."""
    flops = {}
    for name, mesh_over in (("pipeline2_data4", ["mesh.data=4", "mesh.pipeline=2"]), ("data4", ["mesh.data=4"])):
        cfg, setup = _setup(mesh_over + [f"data.seq_len={SEQ}", "train.global_batch_size=16",
                                         "train.microbatches=2" if "mesh.pipeline=2" in mesh_over else "train.microbatches=1"])
        model = statelib.model(setup.graphdef, setup.state, setup.layout)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        batch = tiny_batches(cfg, 1)[0]
        B, D = cfg.train.global_batch_size, cfg.model.hidden_size
        y = np.random.default_rng(0).standard_normal((B, SEQ, D)).astype(np.float32)
        rows = meshlib.batch_sharding(setup.mesh)

        def loss(p, y, ids, pos, seg):
            out = nnx.merge(graphdef, p, rest).epilogue(y, ids, pos, seg, mtp=True)
            return jnp.mean(out.logits ** 2) + jnp.mean(out.mtp_logits ** 2)

        args = [jax.device_put(a, rows) for a in (y, batch["ids"], batch["positions"], batch["segment_ids"])]
        fn = meshlib.MeshedJit(jax.jit(jax.grad(loss)), setup.mesh)
        flops[name] = fn.lower(params, *args).compile().cost_analysis()["flops"]
    ratio = flops["pipeline2_data4"] / flops["data4"]
    assert 0.45 < ratio < 0.6, flops


def test_1f1b_ticks_carry_only_a_stage_share_of_the_parts_outside():
    """Under 1F1B the parts outside the stack enter the tick loop as stored (1/P a stage) and
    their gradients are summed there at 1/P; each tick's epilogue gathers them for its use. So no
    loop of the compiled step carries the head or the embedding whole (before: both as inputs,
    and their fp32 gradient sums)."""
    V = 4096
    cfg, setup = _setup(PIPE + ["pipeline.schedule=1f1b", f"model.vocab_size={V}"])
    D = cfg.model.hidden_size
    text = setup.step.lower(setup.state, tiny_batches(cfg, 1)[0]).compile().as_text()
    loops = [line for line in text.splitlines() if re.search(r"= \(.*\) while\(", line)]
    assert loops
    whole = (f"f32[{D},{V}]", f"f32[{V},{D}]")
    share = (f"f32[{D // 2},{V}]", f"f32[{V},{D // 2}]")
    # the tick loop: the one carrying the shares (XLA:CPU's elemental emitters, which other test
    # files switch on, also lower the per-tick embedding-gradient scatter to a loop of its own)
    ticks = [line for line in loops if all(s in line for s in share)]
    assert ticks, "no loop carries the stage shares"
    assert not [w for line in ticks for w in whole if w in line]


def test_stage_remat_keeps_one_stage_input_a_tick():
    """pipeline.stage_remat: GPipe's backward keeps each tick's stage input, not the saved input of
    each of the stage's `chunk` layers (remat full), and recomputes the stage from it. 16 MoE
    layers on 4 stages (chunk 4), M=8: 11 ticks x 3 fewer [rows, T, D] tensors of the compiled
    step's temporaries (XLA measured 16.22 -> 14.08 MiB, and 15.64 -> 13.51 since GPipe
    assembles its input a microbatch a tick; the planner's --check within 10% of the
    stage_remat step)."""
    over = ["mesh.data=2", "mesh.pipeline=4", "train.microbatches=8", "train.global_batch_size=32",
            "data.seq_len=128", "train.remat=full", "model.num_hidden_layers=17",
            "model.num_nextn_predict_layers=0", "kernels.moe_dispatch=capacity"]
    temp = {}
    for on in (False, True):
        cfg, setup = _setup(over + [f"pipeline.stage_remat={str(on).lower()}"])
        compiled = setup.step.lower(setup.state, tiny_batches(cfg, 1)[0]).compile()
        temp[on] = compiled.memory_analysis().temp_size_in_bytes
    P, M, chunk = 4, 8, 4
    rows = cfg.train.global_batch_size // cfg.mesh.data // M
    xs = rows * cfg.data.seq_len * cfg.model.hidden_size * 4
    assert temp[False] - temp[True] >= 0.8 * (M + P - 1) * (chunk - 1) * xs, temp
    # stage 0 assembles each microbatch's input at its tick and the last stage sends each output
    # to the stages holding its rows at its tick: no loop carries an [M, rows, T, D] buffer (before:
    # the inputs of all M gathered to stage 0, on every stage), and besides each tick's kept stage
    # input no [M+P-1, rows, T, D] one (the outputs of every tick)
    loops = _loop_lines(compiled.as_text())
    one = f"{rows},{cfg.data.seq_len},{cfg.model.hidden_size}]"
    assert [line for line in loops if f"f32[{one}" in line], "no loop carries a microbatch's stage input"
    assert not [line for line in loops if f"f32[{M},{one}" in line]
    assert not [line for line in loops if line.count(f"f32[{M + P - 1},{one}") > 1]


def test_1f1b_holds_no_stage_input_or_gradient_of_all_microbatches():
    """Stage 0 assembles each microbatch's stack input at its tick and sends the input gradient
    back to the stages holding its rows at its tick, so the tick loop carries the ring of 2P-1
    inputs and each stage's own rows, never an [M, rows, T, D] buffer of all M microbatches (it
    carried two: the inputs gathered to stage 0 and their gradients)."""
    M, P = 8, 2
    cfg, setup = _setup(["mesh.data=2", "mesh.pipeline=2", f"train.microbatches={M}", f"data.seq_len={SEQ}",
                         "train.global_batch_size=32", "pipeline.schedule=1f1b"])
    D = cfg.model.hidden_size
    rows = cfg.train.global_batch_size // cfg.mesh.data // M
    text = setup.step.lower(setup.state, tiny_batches(cfg, 1)[0]).compile().as_text()
    ring = f"f32[{2 * P - 1},{rows},{SEQ},{D}]"
    ticks = [line for line in text.splitlines() if re.search(r"= \(.*\) while\(", line) and ring in line]
    assert ticks, "no loop carries the ring of stage inputs"
    assert not [line for line in ticks if f"f32[{M},{rows},{SEQ},{D}]" in line]


def _loop_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(r"= \(.*\) while\(", line)]


@pytest.mark.slow
def test_circular_stage_remat_keeps_no_weights_per_tick():
    """Circular with stage_remat picks each repeat's weights inside the recomputed stage, so the
    backward keeps the stack once, not a copy of a repeat's weights every tick (M*R+P-1 of them:
    XLA temp on data 2 x pipeline 4, R=2, M=8, 16 MoE layers: 27.03 -> 15.41 MiB)."""
    M, P, R = 4, 2, 2
    cfg, setup = _setup(["mesh.data=2", "mesh.pipeline=2", f"train.microbatches={M}", f"data.seq_len={SEQ}",
                         "train.global_batch_size=16", "pipeline.schedule=circular", f"pipeline.repeats={R}",
                         "pipeline.stage_remat=true", "model.num_hidden_layers=5"])
    ticks = M * R + P - 1
    text = setup.step.lower(setup.state, tiny_batches(cfg, 1)[0]).compile().as_text()
    chunk = setup.layout.chunk
    per_tick = [line for line in _loop_lines(text) if re.search(rf"f32\[{ticks},{chunk},\d+,\d+", line)]
    assert not per_tick, per_tick[0][:300]


def _scan_carries(jaxpr) -> list:
    """The carry avals of every scan in `jaxpr` and the jaxprs inside it (shard_map, cond,
    checkpoint, pjit bodies)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            n, c = eqn.params["num_consts"], eqn.params["num_carry"]
            out += [v.aval for v in eqn.invars[n:n + c]]
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _scan_carries(inner)
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
def test_zero1_bf16_copy_sums_the_ticks_gradients_in_fp32(schedule):
    """bf16 with ZeRO-1 gathers a bf16 copy of the masters, and the pipeline's tick loop and the
    epilogue's chunk loop read it through fp32 zero taps (`layers.tap`): the loops' gradient
    sums of the stage weights and of the head are fp32 carries, never bf16 ones (autodiff sums a
    loop constant's gradient in its own dtype). Read off the traced step (the compiled ones
    train: test_bf16_pipelines_train)."""
    over = PIPE + ["train.dtype=bf16", "optim.zero1=true", "train.epilogue_chunks=2",
                   f"pipeline.schedule={schedule}"]
    cfg, setup = _setup(over)
    leaves = {p[-1]: v for p, v in nnx.to_flat_state(setup.state["params"])}
    gate = leaves["gate_EDF"].get_value()                                      # [slots, E, D, F]
    head = leaves["lm_head_DW"].get_value()
    with meshlib.activate(setup.mesh):
        jaxpr = setup.step.fn.trace(setup.state, tiny_batches(cfg, 1)[0]).jaxpr
    carries = _scan_carries(jaxpr.jaxpr)
    stage_gate = (gate.shape[0] // cfg.mesh.pipeline, *gate.shape[1:])        # one stage's, in the shard_map
    sums = {str(a.dtype) for a in carries if tuple(a.shape) in (stage_gate, gate.shape)}
    heads = {str(a.dtype) for a in carries if tuple(a.shape) == head.shape}
    assert sums == {"float32"} and heads == {"float32"}, (sums, heads)


def test_taps_carry_the_pipeline_and_epilogue_gradients():
    """The tapped forward (ZeRO-1's compute-dtype copy, here in fp32 where the copy is the masters
    themselves) gives the gradients of the plain one: the stack's through the ticks' taps, the
    head's and MTP block's through the epilogue chunks' (each stop-gradients the weights it is
    handed, so a tap not wired would leave those gradients at zero)."""
    from r1jax.model.layers import tap
    from r1jax.train import objectives
    from r1jax.train.step import model_loss
    cfg, setup = _setup(PIPE + ["train.epilogue_chunks=2"])
    params, rest = setup.state["params"], setup.state["rest"]
    batch, objective = tiny_batches(cfg, 1)[0], objectives.make(cfg)
    tokens, rows = objective.tokens(batch), batch["ids"].shape[0]

    def loss(params, z=None):
        model = nnx.merge(setup.graphdef, params if z is None else tap(params, z), rest)
        taps = None if z is None else nnx.merge(setup.graphdef, z, jax.tree.map(jnp.zeros_like, rest))
        return model_loss(model, batch, cfg, setup.layout, objective, tokens, rows, taps=taps)[0]

    zeros = jax.tree.map(jnp.zeros_like, params)
    with meshlib.activate(setup.mesh):
        plain = jax.jit(jax.grad(loss))(params)
        tapped = jax.jit(jax.grad(lambda z: loss(params, z)))(zeros)
    for (path, a), (_, b) in zip(nnx.to_flat_state(plain), nnx.to_flat_state(tapped)):
        a, b = np.asarray(a.get_value()), np.asarray(b.get_value())
        assert np.abs(a).max() > 0 or "mtp" in path, path
        # the two programs' reduction orders differ: measured up to 1.9e-9 on a leaf whose largest
        # gradient is 1.4e-2 (1.3e-7 of it), in a fresh clone's CI run
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6 * max(np.abs(a).max(), 1e-30), err_msg=str(path))


@pytest.fixture(scope="module")
def bf16_reference():
    from runs import train_tiny
    return train_tiny(["optim.eps=1e-6", "train.dtype=bf16", "train.global_batch_size=16",
                       "model.num_hidden_layers=5", "mesh.data=1"], jax.devices()[:1], 3)[4]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["circular", "1f1b"])
def test_bf16_pipelines_train(schedule, bf16_reference):
    """bf16 pipelines with expert parallelism inside the stages (pipeline 2 x expert 2 x data 2;
    circular with ZeRO-1's bf16 copy and two epilogue chunks) compile on XLA:CPU and train: 3
    steps' losses within 1e-4 relative of the 1-device bf16 run (measured 3.1e-5 circular,
    2.9e-5 1F1B; GPipe on data 4 x pipeline 2: 9.5e-6). XLA:CPU's all-reduce promotion cannot
    compile a bf16 sum over the stages ("Invalid binary instruction opcode copy"), so on CPU the
    pipeline's stage sums run in fp32 (pipeline._cpu_sum_dtype: they add one stage's rows to
    zeros, exact in any dtype) and the exchange sums its gradients in fp32 on every backend."""
    from runs import train_tiny
    over = ["optim.eps=1e-6", "train.dtype=bf16", "train.global_batch_size=16", "model.num_hidden_layers=5",
            "mesh.data=2", "mesh.expert=2", "mesh.pipeline=2", "train.microbatches=2", f"pipeline.schedule={schedule}",
            *(["pipeline.repeats=2", "optim.zero1=true", "train.epilogue_chunks=2"] if schedule == "circular" else [])]
    losses = train_tiny(over, jax.devices(), 3)[4]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, bf16_reference))
    print(f"\n{schedule}, bf16: losses {losses}, within {rel:.1e} of one device's")
    assert rel < 1e-4

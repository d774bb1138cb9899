"""ZeRO-1 (`optim.zero1`): the fp32 masters and Adam's moments split over `data` (and `expert`)
change where the numbers live and how much of them each device holds, not what they are. On 8
fake devices with data 8 each device holds 1/8 of the masters and moments; 10 fp32 steps of
tiny.yaml equal the 1-device run (the rule of tests/test_mesh.py); the compiled step's arguments
shrink; a ZeRO-1 checkpoint resumes bit for bit, and checkpoints move between the two layouts."""
from __future__ import annotations

import grain
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from r1jax import config as configlib
from r1jax import model as modellib
from r1jax import weights
from r1jax.checkpoint.manager import Checkpointer
from r1jax.parallel import mesh as meshlib
from r1jax.train import state as statelib
from r1jax.train.step import build
from runs import TINY, tiny_batches
from test_mesh import COMMON, STEPS, _run, init_model, reference  # noqa: F401  (module fixtures)

DATA8 = COMMON + ["mesh.data=8"]
RESUME_AT = 5


def _cfg(*overrides):
    return configlib.load(TINY, [*DATA8, *overrides])


def _bytes_per_device(tree) -> dict:
    """{device: bytes of `tree`'s shards it holds}, read from the arrays themselves."""
    out: dict = {}
    for a in jax.tree.leaves(tree):
        for s in a.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


def _mu(state):
    opt = state["opt"]
    return modellib.leaves(opt[1][0].mu if isinstance(opt, tuple) and len(opt) == 2 else opt[0].mu)


def _values(tree) -> dict:
    return {p: np.asarray(v) for p, v in modellib.leaves(tree).items()}


def _fake_data():
    return iter(grain.MapDataset.range(4).to_iter_dataset())


# --------------------------------------------------------------------------------- the rule itself
def test_zero1_spec():
    """Appended to the first dimension that divides by its own axes times the new ones; expert
    only where the leaf is not already split over it; data alone as the fallback; axes of size
    1 change nothing."""
    sizes = {"data": 8, "fsdp": 1, "tensor": 1, "expert": 1, "pipeline": 1}
    z = statelib.zero1_spec
    assert z((64,), P(None), sizes) == P("data")
    assert z((4, 16, 64), P("tensor", None, "fsdp"), sizes) == P("tensor", "data", "fsdp")
    assert z((512, 64), P("tensor", "fsdp"), sizes) == P(("tensor", "data"), "fsdp")
    assert z((3, 5), P(None, None), sizes) == P(None, None)                     # nothing divides
    sizes = {"data": 2, "fsdp": 2, "tensor": 1, "expert": 4, "pipeline": 1}
    assert z((64, 32), P("fsdp", None), sizes) == P(("fsdp", "data", "expert"), None)     # 64 % (2*8)
    assert z((8, 32), P("fsdp", None), sizes) == P("fsdp", ("data", "expert"))            # 8 % 16 != 0
    assert z((2, 8, 32), P(None, "expert", "fsdp"), sizes) == P("data", "expert", "fsdp")  # expert leaf: data only
    assert z((6,), P(None), sizes) == P("data")                                 # 6 % 8 != 0, 6 % 2 == 0
    assert z((6,), P(None), {**sizes, "data": 1}) == P(None)                    # expert 4 alone does not divide
    assert z((64,), P(None), {**sizes, "data": 1}) == P("expert")
    ones = dict.fromkeys(sizes, 1)
    spec = P("fsdp", "tensor")
    assert z((64, 64), spec, ones) is spec


def test_abstract_state_shardings():
    """With zero1 the masters and the moments (not the Adam counts, not `rest`) take the ZeRO-1
    shardings; on one device (data 1) nothing changes."""
    from r1jax.train import optim
    out = {}
    for z in ("false", "true"):
        cfg = _cfg(f"optim.zero1={z}")
        mesh = meshlib.make_mesh(cfg.mesh)
        _, target = weights.target(cfg, mesh, None)
        out[z] = statelib.abstract(target, optim.make(cfg.optim, cfg.train.steps), cfg, mesh)[1]
    plain, zero = out["false"], out["true"]
    assert jax.tree.leaves(plain["rest"]) == jax.tree.leaves(zero["rest"])
    assert all("data" in str(s.spec) for s in jax.tree.leaves(zero["params"]))
    assert all("data" not in str(s.spec) for s in jax.tree.leaves(plain["params"]))
    assert jax.tree.leaves(statelib.model_shardings(zero["params"], mesh)) == jax.tree.leaves(plain["params"])
    for plain_opt, zero_opt in zip(jax.tree.leaves(plain["opt"]), jax.tree.leaves(zero["opt"])):
        assert ("data" in str(zero_opt.spec)) == (plain_opt.spec != zero_opt.spec)
    assert sum("data" in str(s.spec) for s in jax.tree.leaves(zero["opt"])) == 2 * len(jax.tree.leaves(zero["params"]))

    cfg = configlib.load(TINY, [*COMMON, "mesh.data=1", "optim.zero1=true"])
    mesh = meshlib.make_mesh(cfg.mesh, jax.devices()[:1])
    _, target = weights.target(cfg, mesh, None)
    tx = optim.make(cfg.optim, cfg.train.steps)
    a = statelib.abstract(target, tx, cfg, mesh)[1]
    b = statelib.abstract(target, tx, configlib.load(TINY, [*COMMON, "mesh.data=1"]), mesh)[1]
    assert jax.tree.leaves(a) == jax.tree.leaves(b)


# ------------------------------------------------------------------------------------ whole runs
def _compiled(setup, cfg):
    """The setup's train step compiled ahead of time for tiny's batches."""
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=meshlib.batch_sharding(setup.mesh)),
                         tiny_batches(cfg, 1)[0])
    return setup.step.lower(setup.state, batch).compile()


@pytest.fixture(scope="module")
def zero1_run(init_model, tmp_path_factory):
    """tiny.yaml, 10 steps on data 8 with zero1 from the shared init, run by the step compiled
    ahead of time (its memory analysis is test_zero1_shrinks_the_compiled_arguments'); the state
    after step 5 is checkpointed. Returns (setup, compiled step, losses, final state, checkpoint
    directory, donated)."""
    cfg = _cfg("optim.zero1=true")
    setup = build(cfg, meshlib.make_mesh(cfg.mesh), model=init_model)
    compiled = _compiled(setup, cfg)
    directory = tmp_path_factory.mktemp("zero1_ckpt")
    ckpt = Checkpointer(directory, every=1, keep=2, model_cfg=cfg.model, layout=None)
    state, losses, donated = setup.state, [], None
    for i, batch in enumerate(tiny_batches(cfg, STEPS)):
        old = state
        state, m = compiled(state, jax.device_put(batch, meshlib.batch_sharding(setup.mesh)))
        losses.append(float(m["loss"]))
        if i == 0:              # the step's in and out shardings agree, so every state buffer is reused
            donated = all(a.is_deleted() for a in jax.tree.leaves({k: old[k] for k in ("params", "opt", "rest")}))
        if i + 1 == RESUME_AT:
            ckpt.save(state, _fake_data(), force=True)
            ckpt.wait()
    ckpt.close()
    return setup, compiled, losses, state, directory, donated


@pytest.mark.slow
def test_zero1_holds_an_eighth_per_device(init_model, tmp_path):
    """The masters and Adam's moments each device holds (its addressable shards) are 1/8 of the
    replicated run's on data 8; a checkpoint of the replicated run restores into the ZeRO-1
    layout with the same values."""
    states, held = {}, {}
    for z in ("false", "true"):
        cfg = _cfg(f"optim.zero1={z}")
        setup = build(cfg, meshlib.make_mesh(cfg.mesh), model=init_model)
        states[z] = setup
        held[z] = _bytes_per_device({"params": setup.state["params"], "opt": setup.state["opt"]})
    plain, zero = max(held["false"].values()), max(held["true"].values())
    print(f"\nmasters + moments per device on data8: {plain} B without zero1, {zero} B with "
          f"(ratio {zero / plain:.4f}; min {min(held['true'].values())} B)")
    assert len(held["true"]) == 8
    assert zero <= plain / 8 * 1.01          # only Adam's scalar counts stay whole

    # a replicated run's checkpoint into a ZeRO-1 run: same numbers, ZeRO-1 shards
    ckpt = Checkpointer(tmp_path, every=1, keep=1, model_cfg=_cfg().model, layout=None)
    ckpt.save(states["false"].state, _fake_data(), force=True)
    ckpt.wait()
    zsetup = states["true"]
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), zsetup.state)
    restored, _, _ = ckpt.restore(0, abstract)
    ckpt.close()
    for part in ("params", "rest"):
        want, got = _values(states["false"].state[part]), modellib.leaves(restored[part])
        for p, a in got.items():
            assert a.sharding == modellib.leaves(zsetup.shardings[part])[p], p
            assert np.array_equal(np.asarray(a), want[p]), p
    for a, b in zip(jax.tree.leaves(restored["opt"]), jax.tree.leaves(zsetup.state["opt"])):
        assert a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_zero1_equals_one_device(zero1_run, reference):
    """The rule: per-step loss within 1e-5 relative and final parameters within 1e-5 of the
    1-device run; the masters and moments end in their ZeRO-1 shards; the step donates."""
    setup, _, losses, state, _, donated = zero1_run
    ref_losses, ref_params = reference
    d_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    params = _values(state["params"])
    d_param = max(float(np.abs(params[p] - ref_params[p]).max()) for p in params)
    print(f"\ndata8 zero1: max per-step loss rel {d_loss:.1e}, final params max|diff| {d_param:.1e}")
    assert d_loss <= 1e-5 and d_param <= 1e-5
    z_sh = modellib.leaves(setup.shardings["params"])
    for path, arr in modellib.leaves(state["params"]).items():
        assert arr.sharding == z_sh[path] and "data" in str(arr.sharding.spec), path
    for path, arr in _mu(state).items():
        assert arr.sharding == z_sh[path], path
    assert donated


@pytest.mark.slow
def test_zero1_equals_one_device_data2_fsdp2_expert2(init_model, reference):
    """The rule on data 2 x fsdp 2 x expert 2: non-expert leaves split over data x expert too."""
    ref_losses, ref_params = reference
    cfg, mesh, state, shardings, losses = _run(["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2", "optim.zero1=true"],
                                               jax.devices(), model=init_model)
    d_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    params = _values(state["params"])
    d_param = max(float(np.abs(params[p] - ref_params[p]).max()) for p in params)
    print(f"\ndata2 fsdp2 expert2 zero1: max per-step loss rel {d_loss:.1e}, final params max|diff| {d_param:.1e}")
    assert d_loss <= 1e-5 and d_param <= 1e-5
    emb = modellib.leaves(state["params"])[("embed", "embedding_WD")]
    assert {s.data.shape for s in emb.addressable_shards} == {(cfg.model.vocab_size // 4, cfg.model.hidden_size // 2)}


@pytest.mark.slow
def test_zero1_shrinks_the_compiled_arguments(zero1_run, init_model):
    """`compiled.memory_analysis()` of the data-8 step: its arguments (the state and the batch,
    per device) lose 7/8 of the masters and moments."""
    _, compiled, _, _, _, _ = zero1_run
    cfg = _cfg()
    plain = build(cfg, meshlib.make_mesh(cfg.mesh), model=init_model)
    out = {}
    for name, c in (("without", _compiled(plain, cfg)), ("with", compiled)):
        m = out[name] = c.memory_analysis()
        print(f"\ndata8 {name} zero1: argument {m.argument_size_in_bytes} B, output {m.output_size_in_bytes} B, "
              f"temp {m.temp_size_in_bytes} B, alias {m.alias_size_in_bytes} B")
    split = sum(a.nbytes for a in jax.tree.leaves({"params": plain.state["params"], "opt": plain.state["opt"]}))
    saved = out["without"].argument_size_in_bytes - out["with"].argument_size_in_bytes
    print(f"argument bytes saved {saved} B; 7/8 of the masters and moments {7 * split // 8} B")
    assert out["with"].argument_size_in_bytes < out["without"].argument_size_in_bytes
    assert abs(saved - 7 * split / 8) <= 0.01 * split


@pytest.mark.slow
def test_zero1_resumes_bit_for_bit(zero1_run):
    """The step-5 checkpoint restored into a fresh ZeRO-1 abstract state (in the shardings the
    compiled step takes), steps 6-10: the straight run's losses and final state, bit for bit.
    The same checkpoint restored without zero1 holds the same numbers, replicated."""
    setup, compiled, losses, final, directory, _ = zero1_run
    cfg = _cfg("optim.zero1=true")
    _, target = weights.target(cfg, setup.mesh, None)
    abstract, shardings = statelib.abstract(target, setup.tx, cfg, setup.mesh)
    ckpt = Checkpointer(directory, every=1, keep=2, model_cfg=cfg.model, layout=None)
    state, _, _ = ckpt.restore(RESUME_AT, abstract)
    plain_cfg = _cfg()
    plain_abstract, _ = statelib.abstract(target, setup.tx, plain_cfg, setup.mesh)
    plain_state, _, _ = ckpt.restore(RESUME_AT, plain_abstract)
    ckpt.close()
    for (p, a), b in zip(modellib.leaves(state["params"]).items(), modellib.leaves(plain_state["params"]).values()):
        assert a.sharding == modellib.leaves(shardings["params"])[p] and b.sharding.is_fully_replicated
        assert np.array_equal(np.asarray(a), np.asarray(b)), p
    assert int(state["step"]) == RESUME_AT
    resumed = []
    for batch in tiny_batches(cfg, STEPS)[RESUME_AT:]:
        state, m = compiled(state, jax.device_put(batch, meshlib.batch_sharding(setup.mesh)))
        resumed.append(float(m["loss"]))
    print(f"\nstraight {losses[RESUME_AT:]}\nresumed  {resumed}")
    assert resumed == losses[RESUME_AT:]
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(final)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_bf16_zero1_gathers_a_bf16_copy_with_the_same_gradients():
    """In bf16 ZeRO-1 gathers the masters as a bf16 copy (half the bytes of the fp32 gather; the
    router and the embedding, which the model reads in fp32, stay fp32) and the gradients are
    summed in fp32 as without ZeRO-1: one SGD step (lr 1, so the update is the gradient) on data2
    equals the one without ZeRO-1 bit for bit, the epilogue in 2 chunks (a loop whose gradient
    sums go through fp32 taps). XLA:CPU promotes bf16 collectives to fp32, so the copy is read off
    the traced step: the constraint that gathers each master takes its bf16 cast."""
    import optax
    from jax.sharding import NamedSharding
    from flax import nnx
    from test_step import _batch
    out, gathered = {}, {}
    for zero1 in (False, True):
        # (16 experts: no other leaf has the router's [64, 16] shape)
        cfg = configlib.load(TINY, ["mesh.data=2", "train.dtype=bf16", "train.epilogue_chunks=2",
                                    "model.n_routed_experts=16", f"optim.zero1={str(zero1).lower()}"])
        setup = build(cfg, meshlib.make_mesh(cfg.mesh, jax.devices()[:2]), tx=optax.sgd(1.0))
        batch = _batch(cfg)
        p0 = _values(setup.state["params"])
        with meshlib.activate(setup.mesh):
            jaxpr = setup.step.fn.trace(setup.state, batch).jaxpr
        state, _ = setup.step(setup.state, batch)
        out[zero1] = {k: p0[k] - v for k, v in _values(state["params"]).items()}
        # the dtypes constrained at each master's whole shape: the gather (and the gradients, fp32)
        shapes = {p[-1]: v.get_value().shape for p, v in nnx.to_flat_state(setup.state["params"])}
        gathered[zero1] = {name: set() for name in shapes}
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "sharding_constraint" and isinstance(eqn.params["sharding"], NamedSharding):
                for v in eqn.invars:
                    for name, shape in shapes.items():
                        if tuple(v.aval.shape) == shape:
                            gathered[zero1][name].add(str(v.aval.dtype))
    for k in out[False]:
        assert np.array_equal(out[False][k], out[True][k]), k
    # (without ZeRO-1 only the routed experts are constrained in bf16: the dispatch's cast weights)
    for name in ("lm_head_DW", "wkv_a_DC"):
        assert "bfloat16" in gathered[True][name] and "bfloat16" not in gathered[False][name], name
    assert "bfloat16" not in gathered[True]["router_DE"] | gathered[True]["embedding_WD"], gathered[True]

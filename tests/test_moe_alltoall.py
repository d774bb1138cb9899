"""kernels.moe_dispatch=alltoall and hierarchical (r1jax/kernels/expert_parallel.py), on data 2 x
expert 4 over 8 fake CPU devices (hierarchical: the expert axis as 2 nodes of 2): at the buffer
factor that never drops each equals the all-gather / reduce-scatter exchange (outputs and
gradients within 1e-6); with smaller buffers they drop, and the count they report equals a NumPy
count of the overflow (alltoall: per source and destination; hierarchical: per source and node,
then per forwarding shard and destination inside the node)."""
from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from r1jax import config as configlib
from r1jax import weights
from r1jax.config import ConfigError, MeshConfig, ModelConfig
from r1jax.kernels import expert_parallel
from r1jax.model.moe import route
from r1jax.parallel import mesh as meshlib

ROOT = Path(__file__).resolve().parents[1]

E, D, F, T, K = 8, 32, 24, 128, 2
CFG = ModelConfig(hidden_size=D, n_routed_experts=E, n_group=4, topk_group=2, num_experts_per_tok=K,
                  moe_intermediate_size=F)
DATA, EP = 2, 4


@pytest.fixture(scope="module")
def setup():
    mesh = meshlib.make_mesh(MeshConfig(data=DATA, expert=EP))
    r = np.random.default_rng(0)
    x = r.normal(size=(T, D)).astype(np.float32)
    router = (r.normal(size=(D, E)) * 2 / np.sqrt(D)).astype(np.float32)
    bias = (r.normal(size=(E,)) * 0.3).astype(np.float32)
    experts = [(r.normal(size=s) / np.sqrt(s[1])).astype(np.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
    cot = r.normal(size=(T, D)).astype(np.float32)
    with meshlib.activate(mesh):
        tok = NamedSharding(mesh, P(("data", "fsdp", "expert")))
        exp = NamedSharding(mesh, P("expert"))
        placed = (jax.device_put(x, tok), jax.device_put(router, NamedSharding(mesh, P())),
                  tuple(jax.device_put(e, exp) for e in experts))
    return mesh, placed, bias, cot


NODES = 2          # the hierarchical exchange's nodes along the expert axis: 2 of 2 shards
PER_TOKEN = expert_parallel.expected_nodes(E, K, CFG.n_group, CFG.topk_group, NODES)


def _run(setup, kind: str, buffer_factor: float = 0.0, nodes: int = NODES, fp8: bool = False, jaxpr: bool = False):
    mesh, (x, router, experts), bias, cot = setup

    def f(x, router, experts):
        w, idx, _ = route(x, router, jnp.asarray(bias), CFG)
        y, dropped = expert_parallel.routed(kind, x, w, idx, *experts, tile=8, capacity_factor=1.0,
                                            buffer_factor=buffer_factor, nodes=nodes,
                                            nodes_per_token=expert_parallel.expected_nodes(E, K, CFG.n_group, CFG.topk_group, nodes),
                                            fp8=fp8)
        return y, (dropped, idx)

    @jax.jit
    def fwd_bwd(x, router, experts):
        y, vjp, (dropped, idx) = jax.vjp(f, x, router, experts, has_aux=True)
        return y, vjp(jnp.asarray(cot)), dropped, idx

    with meshlib.activate(mesh):
        if jaxpr:
            return jax.make_jaxpr(fwd_bwd)(x, router, experts)
        y, grads, dropped, idx = fwd_bwd(x, router, experts)
    return np.asarray(y), jax.tree.map(np.asarray, grads), int(dropped), np.asarray(idx)


# hierarchical on 2 nodes of 2 shards, and the edges: 1 node of 4 (no exchange across nodes), 4 of 1
@pytest.mark.parametrize("kind,nodes", [("alltoall", 1), ("hierarchical", 2), ("hierarchical", 1), ("hierarchical", 4)])
def test_exact_buffer_equals_gather_scatter(setup, kind, nodes):
    assert expert_parallel.buffer_rows(T // (DATA * EP), K, E, EP, 0.0) == T // (DATA * EP) * min(K, E // EP)
    y, grads, dropped, _ = _run(setup, kind, nodes=nodes)
    y_ref, grads_ref, dropped_ref, _ = _run(setup, "dropless")
    assert dropped == dropped_ref == 0
    d_y = float(np.abs(y - y_ref).max())
    # the expert-weight gradients (entries up to ~30) sum their pairs in another order: relative
    d_g = max(float(np.abs(a - b).max() / np.abs(b).max())
              for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)))
    print(f"\n{kind} ({nodes} node(s), exact buffers) vs gather/scatter: max |dy| {d_y:.1e}, max |dgrad| / max |grad| {d_g:.1e}")
    assert d_y <= 1e-6 and d_g <= 1e-6


def test_small_buffer_drops_the_overflow_and_counts_it(setup):
    y, _, dropped, idx = _run(setup, "alltoall", 1.25)
    shards, El = DATA * EP, E // EP
    Tl = T // shards
    B = expert_parallel.buffer_rows(Tl, K, E, EP, 1.25)
    want = 0
    for s in range(shards):                  # the tokens of batch shard s, sent to each expert shard
        counts = np.bincount(idx[s * Tl:(s + 1) * Tl].reshape(-1) // El, minlength=EP)
        want += int(np.maximum(counts - B, 0).sum())
    print(f"\nalltoall at 1.25 x balanced ({B} pairs per destination): {dropped} of {T * K} pairs dropped")
    assert want > 0 and dropped == want
    assert np.isfinite(y).all()


def _claim(keys, n, cap):
    """Kept flags of pairs keys [R, k] (n: no pair) claiming `cap` slots per key choice-major, as
    dispatch.first_slots does, and each kept pair's position."""
    count, kept, pos = np.zeros(n + 1, int), np.zeros(keys.shape, bool), np.zeros(keys.shape, int)
    for j in range(keys.shape[1]):
        for r in range(keys.shape[0]):
            key = keys[r, j]
            if key < n:
                pos[r, j] = count[key]
                kept[r, j] = count[key] < cap
                count[key] += 1
    return kept, pos


def test_hierarchical_small_buffers_drop_and_count_both_levels(setup):
    """Factor 1: each source sends each node at most B1 tokens (one row a token and node), each
    forwarding shard each shard of its node at most B2 pairs; the pairs lost at either level,
    counted by replaying both claims in NumPy, are what the kernel reports."""
    _, _, dropped, idx = _run(setup, "hierarchical", 1.0)
    G, El = EP // NODES, E // EP
    per_node, Tl = G * El, T // (DATA * EP)
    B1 = expert_parallel.node_rows(Tl, PER_TOKEN, NODES, 1.0)
    B2 = expert_parallel.gpu_rows(Tl, K, El, G, NODES, B1, 1.0)
    lost_a = lost_b = 0
    for d in range(DATA):
        rows = {}                                 # forwarding shard -> its received rows, in order
        for e in range(EP):
            ids = idx[(d * EP + e) * Tl:(d * EP + e + 1) * Tl]
            node = ids // per_node
            first = np.array([[node[t, j] not in node[t, :j] for j in range(K)] for t in range(Tl)])
            kept, pos = _claim(np.where(first, node, NODES), NODES, B1)
            for t in range(Tl):
                for j in range(K):
                    rep = list(node[t]).index(node[t, j])
                    if not kept[t, rep]:
                        lost_a += 1
                    elif j == rep:                # the token's row on that node
                        here = np.where(node[t] == node[t, j], ids[t] - node[t, j] * per_node, per_node)
                        f = node[t, j] * G + e % G
                        rows.setdefault(f, {})[(e // G) * B1 + pos[t, j]] = here
        for f, got in rows.items():
            keys = np.full((NODES * B1, K), G)    # empty rows carry no pair
            for r, here in got.items():
                keys[r] = np.where(here < per_node, here // El, G)
            kept, _ = _claim(keys, G, B2)
            lost_b += int(((keys < G) & ~kept).sum())
    print(f"\nhierarchical at 1 x balanced ({B1} rows a node, {B2} pairs a shard): {dropped} of {T * K} pairs "
          f"dropped ({lost_a} across nodes, {lost_b} inside them)")
    assert lost_a > 0 and lost_b > 0 and dropped == lost_a + lost_b



def test_the_model_takes_it_from_the_config():
    """kernels.moe_dispatch=alltoall and hierarchical reach the MoE layers of the model (tiny.yaml
    on data 2 x expert 4): logits equal those of the default exchange, nothing dropped; with a 1.0
    buffer factor some pairs drop and the model reports them; kernels.moe_exchange_fp8 moves them
    by FP8's rounding."""
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (8, 64)), jnp.int32)
    out = {}
    for name, extra in {"dropless": [], "alltoall": ["kernels.moe_dispatch=alltoall"],
                        "alltoall_1.0": ["kernels.moe_dispatch=alltoall", "kernels.moe_buffer_factor=1.0"],
                        "hierarchical": ["kernels.moe_dispatch=hierarchical", "kernels.moe_nodes=2"],
                        "hierarchical_fp8": ["kernels.moe_dispatch=hierarchical", "kernels.moe_nodes=2",
                                             "kernels.moe_exchange_fp8=true"]}.items():
        cfg = configlib.load(ROOT / "configs" / "tiny.yaml", ["mesh.data=2", "mesh.expert=4", *extra])
        mesh = meshlib.make_mesh(cfg.mesh)
        graphdef, _ = weights.target(cfg, mesh, None)
        state = weights.fresh(cfg, mesh)
        with meshlib.activate(mesh):
            o = jax.jit(lambda st: nnx.merge(graphdef, st)(ids, mtp=True))(state)
        out[name] = (np.asarray(o.logits), int(np.asarray(o.aux["dropped"]).sum()))
    for kind in ("alltoall", "hierarchical"):
        assert np.abs(out[kind][0] - out["dropless"][0]).max() <= 1e-5 and out[kind][1] == 0
    assert out["alltoall_1.0"][1] > 0
    # the FP8 exchange reaches the model: the logits move (measured 6.1e-2 of the largest, through
    # two MoE layers and the MTP block, each rounding its routed inputs and output gradients)
    d8 = np.abs(out["hierarchical_fp8"][0] - out["dropless"][0]).max() / np.abs(out["dropless"][0]).max()
    print(f"\nhierarchical with the FP8 exchange: logits within {d8:.1e} of the largest")
    assert 1e-5 < d8 < 0.1


def test_a_buffer_factor_below_one_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^kernels.moe_buffer_factor=0.5: must be >= 1 \(x the balanced load\), or 0"):
        configlib.load(ROOT / "configs" / "tiny.yaml", ["kernels.moe_dispatch=alltoall", "kernels.moe_buffer_factor=0.5"])


@pytest.mark.parametrize("nodes", [8, 4])
def test_expected_nodes_matches_deepseek_routing(nodes):
    """The planner and the buffers size the hierarchical exchange by expected_nodes: with
    DeepSeek-V3's routing (256 experts, 8 groups, top 4 groups, 8 experts) on random tokens and
    router, the mean number of nodes a token's experts sit on is within 5% of it."""
    cfg = ModelConfig(hidden_size=64, n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8,
                      moe_intermediate_size=16)
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(4096, 64)), jnp.float32)
    router = jnp.asarray(r.normal(size=(64, 256)) / 8, jnp.float32)
    _, idx, _ = route(x, router, jnp.zeros((256,), jnp.float32), cfg)
    node = np.asarray(idx) // (256 // nodes)
    measured = np.mean([len(set(row)) for row in node])
    want = expert_parallel.expected_nodes(256, 8, 8, 4, nodes)
    print(f"\n{nodes} nodes: a token reaches {measured:.3f} on average, expected_nodes {want:.3f}")
    assert abs(measured / want - 1) < 0.05


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


@pytest.mark.parametrize("kind", ["alltoall", "hierarchical"])
def test_fp8_exchange_is_close_and_sends_the_rows_to_the_experts_in_fp8(setup, kind):
    """kernels.moe_exchange_fp8: the rows going to the experts (forward) and the gradients going
    to them (backward) travel as float8_e4m3fn with a scale per block of channels, the returns in
    the compute dtype: one FP8 all_to_all per level and direction in the step's jaxpr (2 for
    alltoall, 4 for hierarchical), and outputs and gradients near the exact exchange's: e4m3 keeps
    3 mantissa bits (a rounding of up to 2^-4 of each value); measured 3.9e-2 of the largest output
    and 4.8e-2 of the largest gradient, bound 2^-4."""
    y, grads, _, _ = _run(setup, kind, fp8=True)
    y_ref, grads_ref, _, _ = _run(setup, kind)
    d_y = float(np.abs(y - y_ref).max() / np.abs(y_ref).max())
    d_g = max(float(np.abs(a - b).max() / np.abs(b).max())
              for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)))
    jaxpr = _run(setup, kind, fp8=True, jaxpr=True)
    fp8 = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "all_to_all"
           and e.invars[0].aval.dtype == jnp.float8_e4m3fn]
    print(f"\n{kind}, FP8 exchange vs exact: max |dy| / max |y| {d_y:.1e}, max |dgrad| / max |grad| {d_g:.1e}, "
          f"{len(fp8)} FP8 all_to_alls")
    assert len(fp8) == (2 if kind == "alltoall" else 4)
    assert 1e-4 < d_y < 0.0625 and 1e-4 < d_g < 0.0625


def _step_hlo(overrides: list[str]):
    """(config, the compiled train step's HLO) of tiny.yaml under `overrides`."""
    return _step_hlo_text(overrides, compiled=True)


def _step_hlo_text(overrides: list[str], compiled: bool):
    """(config, the train step's HLO, compiled or as lowered) of tiny.yaml under `overrides`
    (abstract state: nothing allocated)."""
    from r1jax.parallel import pipeline
    from r1jax.train import optim
    from r1jax.train import state as statelib
    from r1jax.train.step import make_train_step
    cfg = configlib.load(ROOT / "configs" / "tiny.yaml", overrides)
    mesh = meshlib.make_mesh(cfg.mesh)
    graphdef, target = weights.target(cfg, mesh, pipeline.mesh_layout(cfg, mesh))
    tx = optim.make(cfg.optim, cfg.train.steps)
    state, shardings = statelib.abstract(target, tx, cfg, mesh)
    step = make_train_step(graphdef, tx, cfg, mesh, shardings)
    batch = {k: jax.ShapeDtypeStruct((cfg.train.global_batch_size, cfg.data.seq_len), jnp.int32,
                                     sharding=meshlib.batch_sharding(mesh)) for k in ("ids", "segment_ids", "positions")}
    lowered = step.lower(state, batch)
    return cfg, lowered.compile().as_text() if compiled else lowered.compiler_ir("hlo").as_hlo_text()


PIPELINED = ["mesh.data=2", "mesh.expert=2", "mesh.pipeline=2", "train.microbatches=2"]


@pytest.mark.slow
@pytest.mark.parametrize("case, overrides, want", [
    ("no pipeline", ["mesh.data=2", "mesh.expert=4"], (3, 2)),
    ("circular, a layer a tick", [*PIPELINED, "pipeline.schedule=circular", "pipeline.repeats=2",
                                  "pipeline.stage_remat=true", "model.num_hidden_layers=5"], (3, 2)),
    ("circular, 2 layers a tick", [*PIPELINED, "pipeline.schedule=circular", "pipeline.repeats=2",
                                   "pipeline.stage_remat=true", "model.num_hidden_layers=9"], (4, 3)),
    ("1f1b", [*PIPELINED, "pipeline.schedule=1f1b", "model.num_hidden_layers=5"], (4, 3)),
])
def test_remat_recomputes_the_way_there_and_the_planner_counts_what_runs(case, overrides, want):
    """The pairs' weights are applied on the experts' shards, so a recomputed forward (remat full
    here) needs the exchange's way there, not its way back, and autodiff drops the return: the
    compiled step's all_to_alls of a MoE layer's rows (FP8 to the experts, fp32 back; no MTP
    block) are 3 there and 2 back without a pipeline. A pipeline tick of several layers under
    stage_remat and 1F1B's backward tick read a layer's output in the recompute, so there the
    return runs again (and the way there once more); a one-layer tick's two recomputes are one
    after XLA's CSE. The planner's exchange_passes gives the same counts: the rows it bills."""
    from r1jax import plan
    cfg, hlo = _step_hlo([*overrides, "kernels.moe_dispatch=alltoall", "kernels.moe_exchange_fp8=true",
                          "train.remat=full", "model.num_nextn_predict_layers=0"])
    D = cfg.model.hidden_size
    there = back = 0
    for line in hlo.splitlines():
        if " all-to-all(" not in line and " all-to-all-start(" not in line:
            continue
        dtype, dims = re.search(r"= \(?(\w+)\[([\d,]*)\]", line).groups()
        dims = [int(d) for d in dims.split(",")]
        there += dtype != "f32" and dims[-2:] == [1, D]           # FP8 rows (XLA:CPU moves them as f16)
        back += dtype == "f32" and len(dims) == 3 and dims[-1] == D
    mesh = {a: getattr(cfg.mesh, a) for a in plan.AXES}
    print(f"\n{case}: the way there {there} times, back {back}; planner {plan.exchange_passes(cfg, mesh)}")
    assert (there, back) == want == plan.exchange_passes(cfg, mesh)


@pytest.fixture(scope="module")
def bf16_reference():
    from runs import train_tiny
    return train_tiny(["optim.eps=1e-6", "train.dtype=bf16", "mesh.data=1"], jax.devices()[:1], 3)[4]


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["dropless", "hierarchical"])
def test_bf16_expert_parallel_steps_sum_in_fp32(dispatch, bf16_reference):
    """bf16 on data 2 x expert 4: the experts' weight gradients are summed over their copies on
    `data` in fp32 (the weights enter the exchange marked varying in fp32), and the all-gather
    exchange sums the shards' partial outputs and input gradients in fp32: the step holds no
    bf16 all-reduce or reduce-scatter. (XLA:CPU cannot compile one: its bf16 all-reduce promotion
    fails with "Invalid binary instruction opcode copy", which kept bf16 expert parallelism off
    this machine.) 3 steps' losses are those of the 1-device bf16 run within 1e-4 relative
    (measured 2.2e-5 dropless, 9.5e-6 hierarchical; by hand over 5 steps, alltoall 3.5e-5, capacity
    3.1e-5, data 8 alone 1.2e-5)."""
    from runs import train_tiny
    over = ["optim.eps=1e-6", "train.dtype=bf16", "mesh.data=2", "mesh.expert=4", f"kernels.moe_dispatch={dispatch}",
            *(["kernels.moe_nodes=2"] if dispatch == "hierarchical" else [])]
    _, hlo = _step_hlo_text(over, compiled=False)
    sums = [line.strip()[:120] for line in hlo.splitlines()
            if re.search(r"= bf16\[[\d,]*\]\{[\d,]*\} (all-reduce|reduce-scatter)\(", line)]
    assert not sums, sums
    losses = train_tiny(over, jax.devices(), 3)[4]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, bf16_reference))
    print(f"\n{dispatch}, bf16: losses {losses}, within {rel:.1e} of one device's")
    assert rel < 1e-4

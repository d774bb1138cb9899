"""Capacity planner: per-device memory and communication of r1jax's train step and the MLA KV cache on a GPU mesh.

    python -m r1jax.plan --config C [--mesh data=2,expert=64,pipeline=16,dcn_data=2,dcn_expert=8,dcn_pipeline=16]
                         --hardware h100-80gb --nodes 256 [--json PATH] [--check] [--no-search] [section.key=value ...]

The mesh is --mesh's (axes it does not name are 1; they replace the config's mesh.* before the
config is validated) or, without --mesh, the config's own mesh.* after the overrides, a -1 axis
filled from --nodes x GPUs per node. `dcn_<axis>` (mesh.dcn_<axis>) is how many nodes the axis
spans, as r1jax.parallel.mesh.make_mesh lays devices out; all 1: in jax.devices() order, the
first axis (data) outermost, so the innermost axes fill a node first.

Nothing is allocated: each parameter's shape, dtype and logical axis names come from
`r1jax.model.abstract` (no mesh), and its per-device shard from `LOGICAL_RULES` and the
planned mesh sizes, by arithmetic (a 2048-device mesh is never built). What is counted, per device:

- state (the step's donated arguments): fp32 master parameters, AdamW mu + nu (fp32, sharded like
  the parameters), router biases, the step and loss-scale scalars and this device's batch rows.
  With mesh.pipeline > 1 the MoE stack sits in `Layout.slots` padded slots sharded over
  `pipeline`; everything else is sharded over `pipeline` as over fsdp (no stage holds it whole,
  r1jax/parallel/mesh.py), and a layer of it is gathered where it runs (its working set);
- the step's temporaries (XLA's `temp`): fp32 gradients (sharded like the parameters; with
  grad_accum > 1 the running sum plus one microbatch's, of which a stack's (its backward adds
  into the sum: unpipelined, and the MoE stack under GPipe and circular) only one layer's; 1F1B's
  tick loop sums into it), what each layer saves for its backward
  under `train.remat` (one stacked buffer per scanned stack; GPipe/circular keep every tick's),
  the fp32 logits of the head and the MTP heads with their gradient, and the working set of the
  layer running. `_phases` lists the live bytes at each point of the step (forward through the
  dense, MoE and MTP blocks, loss, backward, optimizer); the peak is the largest, times `PACKING`;
- inference: the MLA latent KV cache, (kv_lora_rank + qk_rope_head_dim) x layers x 2 bytes a token.

ZeRO-1 (optim.zero1): the fp32 masters and Adam's moments of each trainable leaf are split further
over `data` (and `expert` for leaves not split over it) where r1jax.train.state.zero1_spec puts
them (the first dimension that divides; a leaf no dimension of which divides keeps its model
shard); the gradients stay a whole model-sharded fp32 set, and the step holds the masters
gathered back to the model's sharding until the optimizer runs: as r1jax/train/step.py gathers
them, in the compute dtype (the router and the embedding in fp32) or in fp32 (fp32 runs, 1F1B).

Communication (`communication`): the bytes each device moves per optimizer step over each mesh
axis of size > 1, and where. An axis's groups sit on `inside` GPUs of each of `nodes` nodes,
read off the device layout (`_node_grid`: make_mesh's order or its node-aware `hybrid_order`);
a group inside one node uses NVLink, one that spans nodes InfiniBand (IB). Collectives are rings,
hierarchical across nodes (n = inside x nodes; S the array; bytes one device moves):
    all-reduce        NVLink 2(inside-1)/inside S,  IB 2(nodes-1)/nodes S/inside     (2(n-1)/n S on one link)
    all-gather / reduce-scatter   (inside-1)/inside S,  (nodes-1)/nodes S/inside        ((n-1)/n S)
    all-to-all (S sent)           (inside-1)/n S,       (n-inside)/n S
    permute (S sent)              S over NVLink, or over IB when the group spans nodes
Per axis (A = grad_accum; M = pipeline microbatches; passes = 2, forward and backward, + 1 when
train.remat recomputes the forward; D hidden, dt the compute dtype's bytes; tok = this device's
tokens per step = global batch / (data x fsdp x expert) x seq):
    fsdp      all-gather of every part's weights in dt, FSDP_GATHERS = 2 times (forward, backward:
              a recomputed forward reuses the backward's gather), and reduce-scatter of their
              fp32 gradients, A times (the pipelined MoE stack A x M times; the head and MTP
              blocks A x train.epilogue_chunks times); `pipeline` the same for the parts
              outside the pipelined stack, and `expert` for all but the routed experts under
              mesh.expert_fsdp; a leaf split over several of them is gathered axis after axis,
              fewest GPUs in a node first, each later axis the whole the earlier ones made;
    data, fsdp, expert (the batch axes)
              all-reduce of the fp32 gradients of the leaves each does not split, once per step;
              over several axes axis by axis, the one with most GPUs in a node first, each
              later axis on the shards left (ZeRO-1's reduce-scatter + all-gather: the same bytes);
    tensor    all-reduces of tok x D x dt, 2 a layer a pass, over the layers a device runs;
    expert    dispatch + combine a MoE layer a pass: `capacity`'s all-to-all of its [E, C, D] dt
              buffers (C = ceil(capacity_factor x tokens x k / E): about tokens x k x D x dt,
              of which (n-1)/n leaves the device), `alltoall`'s ep buffers of f x tokens x k / ep
              rows, `hierarchical`'s buffers to each node (f x tokens x the nodes a token reaches
              / nodes rows, with each row's k ids and weights; its (nodes-1)/nodes over IB) and
              from each node's forwarding shards to the node's shards (f x tokens x k / shards a
              node pairs, over NVLink), or the dropless/ragged exchange's all-gather of the expert
              group's tokens and reduce-scatter of their outputs in fp32 (ep x tokens x D x
              (dt + 4)); with
              kernels.moe_exchange_fp8 the way to the experts in FP8 (+ a fp32 scale per 128).
              A recomputed forward of the stack runs the way there only (the weights are
              applied on the experts' shards, so nothing in the backward reads the way back),
              except where the recompute itself reads a layer's output (`exchange_passes`);
    pipeline  stage boundaries, rows x seq x D x dt a tick forward and backward (GPipe/circular:
              M x repeats + P - 1 ticks, 1F1B: M + 2P - 2), the other stages' rows of the
              stack's input sent to stage 0 and their gradient back, and (GPipe/circular) of its
              output from the last stage and back, A times; 1F1B: the epilogue's rows each tick.
The compute lower bound is the FLOPs the step runs: r1jax.train.mfu.flops_per_token (6 x
activated parameters + attention) x the step's tokens / devices, plus the forwards r1jax runs
again (remat full: every decoder layer; stage_remat and 1F1B's backward tick: the stage, as
`exchange_passes` counts them), the pipelined stack's share spread over the schedule's ticks,
bubble included, over the datasheet dense peak of the compute dtype (mfu.GPU_PEAKS). The
communication's lower bound is the busier of a GPU's two links, all of its InfiniBand bytes at
the IB rate or all of its NVLink bytes at the NVLink rate (`serial_s`: every collective alone,
IB and NVLink parts one after the other). `comm_bound` (communication seconds > compute
seconds) says the step is bound by communication even if all of it hid behind compute and
the two links ran side by side. Not counted: the head's softmax statistics over tensor, the
router's weights and choices gathered by the dropless exchange, and collective buffers.

How the activation model was built: the inventory follows r1jax's code (mla.py, moe.py,
dispatch.py, transformer.py, pipeline.py); how many copies of each tensor XLA keeps at each point
was read off its buffer assignment of the real step (XLA_FLAGS=--xla_dump_to, the
`*-live-range.txt` peak lists) on tiny configs, and checked against `compiled.memory_analysis()`
(`--check`, tests/test_plan.py). Two facts from there shape it: without expert parallelism the
routed dispatch sorts the tokens of the whole (pipeline) microbatch, so every device holds the
routed buffers of *all* of them (their hidden dimension sharded over fsdp, the expert FFN width
over tensor); and dense attention materialises fp32 scores [rows, heads/tensor, T, T], which
dominate at 4K tokens (`kernels.attention=flash` keeps [rows, heads/tensor, T] and block tiles).
What the CPU cannot show is modelled from the code and not measured: bf16/fp16 buffers (XLA:CPU keeps much of a bf16 step in fp32), ragged_dot (the GPU
dispatch; counted like the dropless tiles, a row per token-expert pair), the fsdp-gathered layer.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from r1jax import config as configlib
from r1jax import logical
from r1jax.config import AttentionImpl, Config, ConfigError, DType, MeshConfig, MoEDispatch, Remat, Schedule
from r1jax.train.step import FP32_LEAVES, compute_gather

AXES = configlib.MESH_AXES
GPUS_PER_NODE = 8


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU model as the planner sees it. Link rates are per GPU and direction: NVLink to the
    GPUs of its node through the NVSwitches, InfiniBand to other nodes through its own NIC (the
    usual one NIC per GPU)."""
    mib: int                   # device memory as nvidia-smi reports it (MiB)
    gpu: str                   # its row in r1jax.train.mfu.GPU_PEAKS (datasheet dense tensor-core peaks)
    nvlink: float              # bytes/s inside a node
    ib: float                  # bytes/s across nodes
    gpus_per_node: int = GPUS_PER_NODE


HARDWARE = {
    "a100-80gb": Hardware(81920, "A100", 300e9, 25e9),      # NVLink 3 (600 GB/s both ways), HDR 200 Gb/s
    "h100-80gb": Hardware(81559, "H100", 450e9, 50e9),      # NVLink 4 (900 GB/s both ways), NDR 400 Gb/s
    "h200-141gb": Hardware(143771, "H200", 450e9, 50e9),
}
HARDWARE_MIB = {name: hw.mib for name, hw in HARDWARE.items()}
# the share of the device the planner lets the step use
RESERVE = 0.10       # CUDA context, NCCL buffers, XLA's allocator slack (set XLA_PYTHON_CLIENT_MEM_FRACTION=0.9)
# XLA's temp over the live bytes at its peak: its heap packing leaves gaps. Measured 1.02-1.29 on
# CPU (buffer assignments of 10 configs); the activation counts were fitted with this value.
PACKING = 1.12
F32 = 4
DTYPE_BYTES = {DType.fp32: 4, DType.bf16: 2, DType.fp16: 2}
GiB = 2**30


# ----------------------------------------------------------------------------------- parameters
@dataclasses.dataclass(frozen=True)
class Leaf:
    path: str
    shape: tuple[int, ...]
    itemsize: int
    names: tuple[str | None, ...]
    trainable: bool            # nnx.Param (a weight: gradients, AdamW state); False: router biases
    adapter: bool = False      # a LoRA adapter leaf: with LoRA only these train, the other weights are frozen


@functools.lru_cache(maxsize=8)
def leaves(model: configlib.ModelConfig, lora: configlib.LoraConfig | None = None) -> tuple[Leaf, ...]:
    """Every variable of the model in model order (no pipeline layout), from abstract shapes."""
    from flax import nnx

    from r1jax import logical
    from r1jax.model import abstract

    _, state = abstract(model, lora=lora)
    out = []
    for path, var in nnx.to_flat_state(state):
        v = var.get_value()
        names = logical.names_of(var) or (None,) * len(v.shape)
        out.append(Leaf("/".join(map(str, path)), tuple(v.shape), v.dtype.itemsize, names,
                        isinstance(var, nnx.Param), isinstance(var, nnx.LoRAParam)))
    return tuple(out)


def _lora(cfg: Config) -> configlib.LoraConfig | None:
    return dataclasses.replace(cfg.lora, targets=tuple(cfg.lora.targets)) if cfg.lora.rank else None


@functools.cache
def _rule(name: str | None, expert_fsdp: bool = False) -> tuple[str, ...]:
    """Mesh axes a logical axis name maps to under the rules table (parallel/mesh.py `rules`:
    LOGICAL_RULES, or with `mesh.expert_fsdp`'s additions; first match wins)."""
    from r1jax.config import MeshConfig
    from r1jax.parallel.mesh import rules
    for key, axes in rules(MeshConfig(expert_fsdp=expert_fsdp)):
        if key == name:
            return logical.axes_of(axes)
    return ()


def shard_shape(shape: tuple[int, ...], names: tuple[str | None, ...], mesh: dict[str, int]) -> tuple[int, ...]:
    """One device's shard of an array with logical `names` on `mesh` (GSPMD pads uneven shards)."""
    return _shard_shape(tuple(shape), tuple(names), _key(mesh))


@functools.lru_cache(maxsize=65536)
def _dim_axes(names: tuple[str | None, ...], mesh_items: tuple) -> DimAxes:
    """The mesh axes (of size > 1) each dimension is split over; an axis an earlier dimension
    uses is not used again."""
    mesh = dict(mesh_items)
    used: set[str] = set()
    out = []
    for name in names:
        axes = tuple(a for a in _rule(name, bool(mesh.get(EXPERT_FSDP))) if a not in used and mesh.get(a, 1) > 1)
        used.update(axes)
        out.append(axes)
    return tuple(out)


DimAxes = tuple[tuple[str, ...], ...]       # per dimension, the mesh axes splitting it


def _split_shape(shape: tuple[int, ...], dim_axes: DimAxes, mesh: dict[str, int]) -> tuple[int, ...]:
    return tuple(-(-dim // math.prod(mesh[a] for a in axes)) for dim, axes in zip(shape, dim_axes))


@functools.lru_cache(maxsize=65536)
def _shard_shape(shape, names, mesh_items) -> tuple[int, ...]:
    return _split_shape(shape, _dim_axes(names, mesh_items), dict(mesh_items))


def _zero1_shape(shape: tuple[int, ...], dim_axes: DimAxes, mesh: dict[str, int]) -> tuple[int, ...]:
    """One device's shard of a leaf's fp32 master and Adam moments under optim.zero1: the model
    shard split further over data (and expert), where r1jax.train.state.zero1_spec puts them."""
    from jax.sharding import PartitionSpec

    from r1jax.train.state import zero1_spec
    spec = zero1_spec(tuple(shape), PartitionSpec(*(axes or None for axes in dim_axes)), mesh)
    return _split_shape(shape, tuple(logical.axes_of(e) for e in spec), mesh)


def _layout(cfg: Config, mesh: dict[str, int]):
    from r1jax.parallel.pipeline import layout_for
    return layout_for(cfg, mesh["pipeline"]) if mesh["pipeline"] > 1 else None


EXPERT_FSDP = "+expert_fsdp"    # a mesh key's marker (not an axis) that mesh.expert_fsdp's rules apply


def _key(mesh: dict[str, int], expert_fsdp: bool = False) -> tuple:
    """A mesh as a cache key: its axes of size > 1, and whether the rules are mesh.expert_fsdp's."""
    return tuple(sorted((a, v) for a, v in mesh.items() if v > 1 and a != EXPERT_FSDP)) + (
        ((EXPERT_FSDP, 1),) if expert_fsdp else ())


def _placed(model: configlib.ModelConfig, layout, lora=None):
    """(leaf, shape, logical names) of every variable as the step holds it: the MoE stack in the
    pipeline's slots (as pipeline.to_slots places it), sharded over `pipeline`."""
    for leaf in leaves(model, lora):
        shape, names = leaf.shape, leaf.names
        if leaf.path.startswith("moe_layers/") and layout is not None:
            shape, names = (layout.slots, *shape[1:]), ("stages", *names[1:])
        yield leaf, shape, names


def state_bytes(cfg: Config, mesh: dict[str, int]) -> dict[str, Any]:
    """Per-device bytes of the parameters, router biases and AdamW state, by part of the model."""
    out = _state_bytes(cfg.model, _layout(cfg, mesh), _key(mesh, cfg.mesh.expert_fsdp), _lora(cfg), cfg.optim.zero1)
    # AdamW's mu + nu are counted in fp32 below; optim.moment_dtype=bf16 halves them
    opt = (out["opt"] - 8) * _moment_bytes(cfg) // F32 + 8
    gathered = out["gathered"]
    if compute_gather(cfg) is not None:     # ZeRO-1 gathers a compute-dtype copy (fp32 where the model reads fp32)
        gathered = (gathered - out["gathered_fp32"]) * DTYPE_BYTES[cfg.train.dtype] // F32 + out["gathered_fp32"]
    return {**out, "opt": opt, "gathered": gathered, "by_part": dict(out["by_part"])}


def _moment_bytes(cfg: Config) -> int:
    return 2 if cfg.optim.moment_dtype is DType.bf16 else F32


@functools.lru_cache(maxsize=4096)
def _state_bytes(model: configlib.ModelConfig, layout, mesh_key: tuple, lora=None, zero1: bool = False
                 ) -> dict[str, Any]:
    """`params`: the fp32 masters (ZeRO-1 shards with `zero1`); `grads`, `by_part` and
    `largest_leaf`: the trainable leaves in the model's sharding (gradients, the compute copy);
    `gathered`: with ZeRO-1, the masters gathered back to the model's sharding for the step
    (r1jax/train/step.py gathers every leaf ZeRO-1 splits once per step), in fp32, and
    `gathered_fp32` of them the leaves it gathers in fp32 in any compute dtype (FP32_LEAVES)."""
    mesh = dict(mesh_key)
    parts: dict[str, int] = {}
    out = {"params": 0, "grads": 0, "gathered": 0, "gathered_fp32": 0, "router_bias": 0, "frozen": 0,
           "largest_leaf": 0, "params_global": 0, "by_part": parts}
    for leaf, shape, names in _placed(model, layout, lora):
        dims = _dim_axes(names, mesh_key)
        n = math.prod(_split_shape(shape, dims, mesh)) * leaf.itemsize
        if lora is not None and leaf.trainable and not leaf.adapter:       # LoRA's frozen base weights
            out["frozen"] += n * DTYPE_BYTES[lora.base_dtype] // F32
        elif leaf.trainable:
            master = math.prod(_zero1_shape(shape, dims, mesh)) * leaf.itemsize if zero1 else n
            out["params"] += master
            out["gathered"] += n if master < n else 0
            if master < n and leaf.path.rsplit("/", 1)[-1] in FP32_LEAVES:
                out["gathered_fp32"] += n
            out["grads"] += n                      # fp32, constrained to the model's shardings
            out["params_global"] += math.prod(leaf.shape) * leaf.itemsize
            out["largest_leaf"] = max(out["largest_leaf"], n)
            part = leaf.path.split("/")[0]
            parts[part] = parts.get(part, 0) + n
        else:
            out["router_bias"] += n
    out["opt"] = 2 * out["params"] + 2 * 4       # AdamW mu + nu, like the masters; optax's counts (int32 scalars)
    return out


# ---------------------------------------------------------------------------------- activations
@dataclasses.dataclass(frozen=True)
class Geometry:
    """Per-device sizes the activation model needs (rows = batch rows on this device)."""
    rows_accum: int        # rows of one grad_accum microbatch (prologue, epilogue, loss)
    rows_stage: int        # rows of one pipeline microbatch (= rows_accum without a pipeline)
    seq: int
    dt: int                # compute dtype bytes
    heads: int             # N / tensor
    vocab: int             # V / tensor (act_vocab)
    mlp: int               # intermediate_size / tensor
    moe_mlp: int           # moe_intermediate_size / tensor
    shared_mlp: int        # moe_intermediate_size * n_shared_experts / tensor
    batch_shards: int      # data x fsdp x expert
    fsdp: int
    expert: int
    dispatch: str          # dropless | ragged | capacity (auto resolved for the backend)
    attn_block: int = 0    # flash attention's block (0: dense attention, whole [T, T] scores)
    capacity_factor: float = 1.25   # kernels.capacity_factor
    tile: int = 64                  # kernels.moe_tile_size
    buffer_factor: float = 0.0      # kernels.moe_buffer_factor (alltoall, hierarchical)
    pipeline: int = 1               # outside the stages the batch is sharded over pipeline too
    nodes: int = 1                  # kernels.moe_nodes (hierarchical): nodes the expert axis spans
    nodes_per_token: float = 1.0    # expert_parallel.expected_nodes: a token's nodes, balanced
    exchange_fp8: bool = False      # kernels.moe_exchange_fp8: rows to the experts in FP8
    moe_chunks: int = 1             # kernels.moe_chunks: the routed experts run on seq / moe_chunks at a time

    @property
    def routed_seq(self) -> int:
        """Positions of each row the routed experts run on at a time (kernels.moe_chunks)."""
        return self.seq // self.moe_chunks

    def hierarchical_rows(self, m: configlib.ModelConfig, rows: int, seq: int | None = None) -> tuple[int, int]:
        """(rows one shard sends each node, pairs one forwarding shard sends each shard of its
        node) of the hierarchical exchange on `rows` batch rows of `seq` positions (default: the
        whole sequence) (expert_parallel.node_rows, gpu_rows)."""
        from r1jax.kernels.expert_parallel import gpu_rows, node_rows
        tokens, k = rows * (seq or self.seq), m.num_experts_per_tok
        b1 = node_rows(tokens, self.nodes_per_token, self.nodes, self.buffer_factor)
        gpus = self.expert // self.nodes
        return b1, gpu_rows(tokens, k, m.n_routed_experts // self.expert, gpus, self.nodes, b1, self.buffer_factor)

    @property
    def rows_outer(self) -> int:
        """Rows of one grad_accum microbatch a device holds outside the pipeline's stages (the
        embedding, dense prefix, head, MTP and loss): its 1/pipeline of the data shard's."""
        return max(self.rows_accum // self.pipeline, 1)


def geometry(cfg: Config, mesh: dict[str, int], backend: str = "gpu") -> Geometry:
    m, t = cfg.model, cfg.train
    tp = mesh["tensor"]
    shards = mesh["data"] * mesh["fsdp"] * mesh["expert"]
    rows_accum = t.global_batch_size // t.grad_accum // shards
    rows_stage = rows_accum // t.microbatches if mesh["pipeline"] > 1 else rows_accum
    k = cfg.kernels
    kind = k.moe_dispatch.value
    if kind == MoEDispatch.auto.value:
        kind = "dropless" if backend == "cpu" else "ragged"
    c = lambda n: -(-n // tp)
    from r1jax.kernels.expert_parallel import expected_nodes
    nodes = max(1, k.moe_nodes)
    per_token = expected_nodes(m.n_routed_experts, m.num_experts_per_tok, m.n_group, m.topk_group, nodes)
    return Geometry(rows_accum, max(rows_stage, 1), cfg.data.seq_len, DTYPE_BYTES[t.dtype], c(m.num_attention_heads),
                    c(m.vocab_size), c(m.intermediate_size), c(m.moe_intermediate_size),
                    c(m.moe_intermediate_size * m.n_shared_experts), shards, mesh["fsdp"], mesh["expert"], kind,
                    min(k.attention_block, cfg.data.seq_len) if k.attention is AttentionImpl.flash else 0,
                    k.capacity_factor, k.moe_tile_size, k.moe_buffer_factor, mesh["pipeline"], nodes, per_token,
                    k.moe_exchange_fp8, k.moe_chunks)


def _scores(m: configlib.ModelConfig, g: Geometry, rows: int, phase: str) -> int:
    """Bytes of attention's score-sized tensors in a phase: `saved` for the backward, `forward`
    and `backward` transients. Dense attention keeps fp32 scores and probabilities [rows, N, T, T];
    flash attention keeps the log-sum-exp [rows, N, T] and works on [rows, N, b, b] tiles, with
    fp32 dQ and output accumulators (r1jax/kernels/flash.py)."""
    T, N = g.seq, g.heads
    if not g.attn_block:
        return {"saved": 2, "forward": 3, "backward": 4}[phase] * rows * N * T * T * F32
    b = g.attn_block
    Tp = -(-T // b) * b
    tile = rows * N * b * b * F32
    if phase == "saved":
        return rows * N * Tp * F32
    if phase == "forward":
        return 3 * tile + rows * N * b * m.v_head_dim * F32
    # the recomputed tile, its probabilities, dP and dS; fp32 dQ, dK, dV for every position (dQ is
    # accumulated over key blocks, dK and dV written a key block at a time) and the key block's
    # running dK, dV; rowsum(dO * O)
    K, R, V = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    grads = N * (2 * K + R + V) + R
    return 4 * tile + rows * Tp * grads * F32 + rows * b * (N * (K + V) + R) * F32 + rows * N * Tp * F32


def _routed_rows(m: configlib.ModelConfig, g: Geometry, rows: int, local_sort: bool) -> tuple[int, int, int]:
    """(buffer rows, their hidden width, token-expert pairs) of one MoE layer's routed dispatch.

    Without expert parallelism each batch shard sorts its own tokens (`expert_parallel.local`),
    every expert whole, but for `capacity`, whose sort runs over the whole (pipeline) microbatch,
    replicated on every batch shard (XLA gathers the tokens); with it, each device gathers the
    tokens of its expert group (r1jax/kernels/expert_parallel.py) and holds E/expert experts.
    `local_sort`: the batch axes are manual (1F1B), so only this device's tokens. With
    kernels.moe_chunks, one chunk's (the chunks run one after another)."""
    k, E, S = m.num_experts_per_tok, m.n_routed_experts, g.routed_seq
    if g.expert > 1 and g.dispatch == "capacity":    # all_to_all: C slots per expert from each source
        cap = max(1, math.ceil(g.capacity_factor * rows * S * k / E))
        return (E // g.expert) * g.expert * cap, m.hidden_size, rows * S * k
    if g.expert > 1 and g.dispatch in ("alltoall", "hierarchical"):
        # the pairs the owner receives, run dropless (one pair a row): alltoall's f x the balanced
        # pairs from each source, or hierarchical's from each forwarding shard of its node
        from r1jax.kernels.expert_parallel import buffer_rows
        if g.dispatch == "alltoall":
            recv = g.expert * buffer_rows(rows * S, k, E, g.expert, g.buffer_factor)
        else:
            recv = g.expert // g.nodes * g.hierarchical_rows(m, rows, S)[1]
        n = -(-(recv + (E // g.expert) * (g.tile - 1)) // g.tile) * g.tile
        return n, m.hidden_size, rows * S * k
    if g.expert > 1:
        tokens, experts, width = rows * S * g.expert, E // g.expert, m.hidden_size
    elif local_sort or g.dispatch != "capacity":
        tokens, experts, width = rows * S, E, m.hidden_size
    else:
        tokens, experts, width = rows * S * g.batch_shards, E, m.hidden_size
    pairs = tokens * k
    if g.dispatch == "capacity":
        n = experts * max(1, math.ceil(g.capacity_factor * tokens * k / E))
    elif g.dispatch in ("dropless", "alltoall") or g.expert > 1:   # expert parallelism runs the dropless tiles (kernels/expert_parallel.py)
        tile = g.tile
        n = -(-(pairs + experts * (tile - 1)) // tile) * tile
    else:                                              # ragged / loop: one row per pair
        n = pairs
    return n, width, pairs


# Routed-expert buffers of one MoE layer, in units of (buffer rows x hidden width, buffer rows x
# expert FFN width), as XLA's buffer assignment shows them for r1jax's dispatch kernels:
# saved for the backward (no remat); the forward's transients inside a scan (which copies its
# outputs into the stacked residuals) and outside one (the MTP block); a rematerialised backward.
# `ragged` (the GPU path) could not be compiled here and reuses the dropless counts.
ROUTED_BUFFERS = {
    "dropless": {"saved": (1, 6), "forward_scanned": (3, 2), "forward": (3, 3), "backward": (4, 5),
                 "backward_scanned": (3, 5)},
    "capacity": {"saved": (1, 5), "forward_scanned": (3, 3), "forward": (2, 2), "backward": (3, 4),
                 "backward_scanned": (3, 4)},
}


def _routed_kind(g: Geometry) -> str:
    # expert parallelism runs the dropless tiles unless the dispatch is `capacity` (expert.py)
    return "capacity" if g.dispatch == "capacity" else "dropless"


def layer_inventory(m: configlib.ModelConfig, g: Geometry, moe: bool, rows: int, local_sort: bool = False
                    ) -> dict[str, int]:
    """Bytes of what one layer keeps for its backward without remat, by kind of tensor."""
    t, dt, Nl = rows * g.seq, g.dt, g.heads
    D, C, R, K, V = m.hidden_size, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
    Q = m.q_lora_rank or 0
    inv = {
        # x, normed x (fp32 inside RMSNorm), attention output, h, normed h, the next block's input
        "hidden": t * D * (4 * dt + 2 * F32) + (t * D * F32 if moe else 0),     # + the router's fp32 copy
        "attn_latent": t * (3 * Q + (C + R) + 4 * C + R) * dt,                  # qa, q_norm, kv_a, c, k_rope
        "attn_heads": t * Nl * ((K + R) + R + 2 * K + 2 * V) * dt,              # q, q_rope, q/k_nope, v, o
        "attn_scores": _scores(m, g, rows, "saved"),                               # fp32 scores and probabilities
    }
    if moe:
        n, width, _ = _routed_rows(m, g, rows, local_sort)
        d_, f_ = ROUTED_BUFFERS[_routed_kind(g)]["saved"]
        inv["routed"] = n * (d_ * width + f_ * g.moe_mlp) * dt     # tile inputs; gate, up, silu*up, copies
        # each token's k expert outputs [t, k, D] before they are combined (the combine weights'
        # gradient needs them): this device's tokens, or its expert group's with expert parallelism;
        # the hierarchical exchange combines on the forwarding shards, over the rows they received,
        # and gathers its tokens' rows back as [t, k, D] before summing them
        # (with kernels.moe_chunks, one chunk's: a chunk's backward recomputes its own)
        S = g.routed_seq
        combined = rows * S * (g.expert if (g.expert > 1 and g.dispatch != "capacity") else 1)
        if g.expert > 1 and g.dispatch == "hierarchical":
            combined = rows * S + g.nodes * g.hierarchical_rows(m, rows, S)[0]
        inv["routed_out"] = combined * m.num_experts_per_tok * m.hidden_size * dt
        inv["router"] = t * m.n_routed_experts * F32
        inv["shared_mlp"] = 3 * t * g.shared_mlp * dt
    else:
        inv["mlp"] = 3 * t * g.mlp * dt
    return inv


def layer_saved(m: configlib.ModelConfig, g: Geometry, moe: bool, rows: int, remat: Remat, local_sort=False) -> int:
    """Bytes one scanned layer keeps for its backward under `remat` (device memory)."""
    t, dt = rows * g.seq, g.dt
    carry = t * m.hidden_size * dt
    if remat is Remat.none:
        return sum(layer_inventory(m, g, moe, rows, local_sort).values())
    if remat is Remat.full or remat is Remat.offload:      # offload parks attn_out on the host
        return carry
    if remat is Remat.save_attention:
        return 2 * carry
    # save_dots: outputs of matmuls without batch dimensions (projections, routed tiles), not attention
    Q, C, R, K, V, D = (m.q_lora_rank or 0, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim,
                        m.v_head_dim, m.hidden_size)
    dots = t * (Q + C + R + D) * dt + t * g.heads * ((K + R) + (K + V)) * dt
    if moe:
        n, width, _ = _routed_rows(m, g, rows, local_sort)
        dots += n * (width + 2 * g.moe_mlp) * dt + t * m.n_routed_experts * F32 + t * (2 * g.shared_mlp + D) * dt
    else:
        dots += t * (2 * g.mlp + D) * dt
    return carry + dots


def layer_working(m: configlib.ModelConfig, g: Geometry, moe: bool, rows: int, local_sort=False,
                  scanned: bool = True) -> int:
    """Transient bytes while one layer runs forward, beyond what it saves: the softmax's fp32
    temporaries and the routed dispatch's gathers, while-loop carries and, inside a scan, the
    copies of its outputs into the stacked residual buffers (an unscanned layer, the MTP block,
    keeps its routed buffers as they are: they are counted here and not among its residuals)."""
    t, dt = rows * g.seq, g.dt
    w = _scores(m, g, rows, "forward") + 4 * t * m.hidden_size * dt
    if moe:
        w += _routed_working(m, g, rows, "forward_scanned" if scanned else "forward", local_sort)
    else:
        w += 2 * t * g.mlp * dt
    return w


def _routed_working(m: configlib.ModelConfig, g: Geometry, rows: int, phase: str, local_sort=False) -> int:
    """The routed dispatch's transient buffers going forward (`ROUTED_BUFFERS[kind][phase]`); an
    unscanned block also holds the zero-filled [pairs, D] scatter-add buffer of its backward."""
    n, width, pairs = _routed_rows(m, g, rows, local_sort)
    d_, f_ = ROUTED_BUFFERS[_routed_kind(g)][phase]
    return (n * (d_ * width + f_ * g.moe_mlp) + (pairs * width if phase == "forward" else 0)) * g.dt


def layer_backward(m: configlib.ModelConfig, g: Geometry, moe: bool, rows: int, local_sort=False,
                   scanned: bool = True) -> int:
    """Peak bytes of a rematerialised layer's backward: its recomputed forward tensors plus the
    backward's own (gradients of the hidden states, the transposed operands of the weight
    gradients, the routed dispatch's scatter-adds)."""
    t, dt = rows * g.seq, g.dt
    inv = layer_inventory(m, g, moe, rows, local_sort)
    w = sum(v for k, v in inv.items() if k not in ("routed", "attn_scores"))
    w += _scores(m, g, rows, "backward") + 16 * t * m.hidden_size * dt
    if moe:
        n, width, pairs = _routed_rows(m, g, rows, local_sort)
        # the scatter-add buffers keep the tiles' fsdp-sharded width; the gathered expert outputs
        # come back whole (all-reduced over fsdp)
        d_, f_ = ROUTED_BUFFERS[_routed_kind(g)]["backward_scanned" if scanned else "backward"]
        w += n * (d_ * width + f_ * g.moe_mlp) * dt + (1 if scanned else 2) * pairs * (width + m.hidden_size) * dt
    else:
        w += 2 * t * g.mlp * dt
    return w


def _layer_weights(cfg: Config, mesh: dict[str, int], prefix: str, stacked: bool = True) -> int:
    """Elements one device holds of one layer's trainable weights under `prefix` (a pipeline
    stage holds its MoE layers whole over `pipeline`)."""
    if prefix.startswith("moe_layers"):
        mesh = dict(mesh, pipeline=1)
    key = _key(mesh, cfg.mesh.expert_fsdp)
    return _layer_weights_of(cfg.model, key, key, (), prefix, stacked)


@functools.lru_cache(maxsize=16384)
def _layer_weights_of(model: configlib.ModelConfig, mesh_key: tuple, split_key: tuple, axes: tuple[str, ...],
                      prefix: str, stacked: bool) -> int:
    """Elements of a layer's trainable leaves under `prefix` on `mesh_key`; with `axes`, of those
    leaves alone that `axes` split on `split_key`."""
    cut = 1 if stacked else 0
    return sum(math.prod(_shard_shape(l.shape[cut:], l.names[cut:], mesh_key))
               for l in leaves(model) if l.trainable and l.path.startswith(prefix)     # the base weights
               and (not axes or any(a in axes for d in _dim_axes(l.names[cut:], split_key) for a in d)))


def _weights_gathered(cfg: Config, mesh: dict[str, int], prefix: str, layers: int, dt: int,
                      stacked: bool = True) -> int:
    """One layer's weights all-gathered over fsdp (outside the pipelined MoE stack over fsdp and
    pipeline; with mesh.expert_fsdp over expert too, which leaves the routed experts split) in
    the compute dtype, and their fp32 gradient before the reduce-scatter: the transient they add
    where the layer runs. 0 when those axes do not split them."""
    axes = _gather_axes(cfg, prefix)
    if layers == 0 or all(mesh[a] == 1 for a in axes):
        return 0
    if prefix.startswith("moe_layers"):
        mesh = dict(mesh, pipeline=1)
    whole = _key(dict(mesh, **{a: 1 for a in axes if a != "expert"}))       # expert: the default rules
    return _layer_weights_of(cfg.model, whole, _key(mesh, cfg.mesh.expert_fsdp), axes, prefix, stacked) * (dt + F32)


def _embed_lookup(cfg: Config, mesh: dict[str, int], g: Geometry, rows: int) -> int:
    """The embedding lookup's transient on `rows` rows (r1jax/model/layers.py `Embed`): the table
    gathered whole over the axes that split its hidden axis, in the compute dtype, with its fp32
    gradient; or, where `lookup_in_place` says so, the looked-up rows in fp32 (slices of the
    hidden axis) and exchanged whole in the compute dtype."""
    if _embed_in_place(cfg, mesh, g, rows):
        return rows * g.seq * cfg.model.hidden_size * (F32 + g.dt)
    return _weights_gathered(cfg, mesh, "embed", 1, g.dt, stacked=False)


def _embed_in_place(cfg: Config, mesh: dict[str, int], g: Geometry, rows: int) -> bool:
    """Whether the model looks the embedding up in its slices on `rows` rows (the axes that split
    its hidden axis are batch axes, so a device looks up its own tokens there)."""
    from r1jax.model.layers import lookup_in_place
    return any(mesh[a] > 1 for a in _gather_axes(cfg, "embed")) and lookup_in_place(g.vocab, rows * g.seq)


def _gather_axes(cfg: Config, prefix: str) -> tuple[str, ...]:
    """The axes that shard a part's weights ZeRO-3 style: fsdp; pipeline outside the pipelined
    stack; expert under mesh.expert_fsdp."""
    axes = ("fsdp",) if prefix.startswith("moe_layers") else ("fsdp", "pipeline")
    return axes + (("expert",) if cfg.mesh.expert_fsdp else ())


def _epilogue(cfg: Config, g: Geometry, rows: int, w_gather: int, local_sort: bool = False) -> dict[str, int]:
    """The final norm, head, MTP blocks and loss on `rows` rows: what they save and their peaks.
    The MTP blocks are checkpointed like the stacks but not scanned: going forward, a block's
    saved tensors appear as it runs (its routed buffers are counted in its working set); without
    remat its backward consumes them as fast as it makes temporaries; with remat it recomputes
    them and runs the backward's working set on top."""
    m, remat, T = cfg.model, cfg.train.remat, g.seq
    depth = m.num_nextn_predict_layers
    x = rows * T * m.hidden_size * g.dt
    logits = rows * T * g.vocab * F32
    inv = sum(layer_inventory(m, g, True, rows, local_sort).values())
    routed = layer_inventory(m, g, True, rows, local_sort)["routed"]
    saved = layer_saved(m, g, True, rows, remat, local_sort)
    out = {"saved": depth * (saved + 3 * x), "logits": logits, "all_logits": (1 + depth) * logits,
           "fwd_saved": 0, "fwd_work": 0, "bwd_work": 0}
    if depth:
        out["fwd_saved"] = depth * 3 * x + (depth - 1) * saved + (inv - routed if remat is Remat.none else saved)
        out["fwd_work"] = layer_working(m, g, True, rows, local_sort, scanned=False) + w_gather
        if remat is not Remat.none:
            out["bwd_work"] = layer_backward(m, g, True, rows, local_sort, scanned=False) + w_gather
    return out


def _phases(cfg: Config, mesh: dict[str, int], st: dict, g: Geometry) -> list[tuple[str, dict[str, int]]]:
    """Live temporary bytes (not the state) at each point of the step, as named components:
    activations saved for the backward, logits, the working set of what runs, gradients, and
    with ZeRO-1 the masters gathered to the model's sharding (live until the optimizer)."""
    m, t = cfg.model, cfg.train
    remat, dt, T = t.remat, g.dt, g.seq
    P = mesh["pipeline"]
    n_dense, n_moe = m.first_k_dense_replace, m.num_moe_layers
    ra, rs = g.rows_outer, g.rows_stage          # outside the stages, inside one (ra: the whole shard without)
    re = max(ra // t.epilogue_chunks, 1)         # the epilogue's rows at a time (train.epilogue_chunks)
    parts = st["by_part"]
    grads_all = st["grads"]
    g_head = parts.get("lm_head_DW", 0) + parts.get("final_norm", 0) + parts.get("mtp", 0)
    g_moe = parts.get("moe_layers", 0)
    accum = grads_all if t.grad_accum > 1 else 0       # the scanned running sum of the gradients
    # a stack's backward adds its gradients into that sum, so that of them one layer's are a
    # microbatch's own: unpipelined (r1jax/model/accumulate.py), and the MoE stack's under GPipe
    # and circular, whose ticks carry the sum (pipeline.trunk); 1F1B's tick loop starts its sums
    # from it (below)
    onefoneb = P > 1 and cfg.pipeline.schedule is Schedule.onefoneb
    dense_in = moe_in = t.grad_accum > 1 and not onefoneb
    slots = _layout(cfg, mesh).slots // P if P > 1 and n_moe else n_moe
    layer_of = {k: parts.get(k, 0) // n for k, n in (("moe_layers", slots), ("dense_layers", n_dense)) if n}
    g_moe_own = layer_of.get("moe_layers", 0) if moe_in else g_moe
    g_dense_own = ((layer_of.get("dense_layers", 0) - parts.get("dense_layers", 0) if dense_in else 0)
                   - (g_moe if moe_in else 0))

    def ph(name, act, lg, work, grads, gathered=st["gathered"]):
        return name, {"activations": act, "logits": lg, "working": work, "gradients": accum + grads,
                      "gathered": gathered}

    # bf16/fp16 without remat: a layer outside the stacks' written-out backward (the MTP blocks,
    # and 1F1B's dense prefix: its step sums no stack) also keeps its weights cast to the compute
    # dtype (the matmuls' backward needs them); the stacks' backward derives what it needs of
    # the weights again per layer (r1jax/model/accumulate.py). fp32 casts are no-ops.
    cast = dt if (remat is Remat.none and dt < F32) else 0
    x = ra * T * m.hidden_size * dt
    cast_dense = (cast if onefoneb else 0) * _layer_weights(cfg, mesh, "dense_layers")
    r_dense = n_dense * (layer_saved(m, g, False, ra, remat) + cast_dense) + x
    w_dense = layer_working(m, g, False, ra) + _weights_gathered(cfg, mesh, "dense_layers", n_dense, dt)
    bwd_dense = (layer_backward(m, g, False, ra) - layer_working(m, g, False, ra)
                 if (n_dense and remat is not Remat.none) else 0)
    w_gather = _weights_gathered(cfg, mesh, "moe_layers", n_moe, dt)
    w_mtp = _weights_gathered(cfg, mesh, "mtp/0/block/", m.num_nextn_predict_layers, dt, stacked=False)
    # the head (shared by the MTP blocks), gathered where it runs; the embedding's lookup
    w_head = _weights_gathered(cfg, mesh, "lm_head", 1, dt, stacked=False)
    w_dense += _embed_lookup(cfg, mesh, g, ra)
    opt = ph("optimizer", 0, 0, (2 if t.grad_accum == 1 else 1) * st["largest_leaf"], grads_all, gathered=0)
    dense_phases = [ph("forward dense layers", r_dense, 0, w_dense, 0)]
    # (1F1B with grad_accum: the tick loop's sums are the running sum, and the prologue's
    # gradients are added to it after)
    own_dense = (parts.get("dense_layers", 0) + parts.get("embed", 0) if onefoneb and t.grad_accum > 1
                 else grads_all - parts.get("embed", 0) + g_dense_own)
    dense_bwd = ph("backward dense layers", r_dense, 0, w_dense + bwd_dense, own_dense)

    if onefoneb and n_moe:
        # the lock-step 1F1B (pipeline.loss_and_grads_1f1b), pipeline and data manual: every tick
        # runs one stage forward, the epilogue's forward and backward on 1/P of the last stage's
        # rows, and one stage backward (recomputed from the kept input). A device keeps a ring of
        # 2P-1 stage inputs, the received activation and gradient, the stage outputs, the input
        # gradients of its own rows (M/P microbatches' worth; stage 0 assembles each input at its
        # tick), and one set of running gradient sums. The
        # parts outside the stack enter the ticks as stored (1/P a stage), their gradients are
        # summed there at 1/P, and each tick's epilogue gathers them whole: the head and the MTP
        # blocks in the compute dtype, the embedding (which the MTP blocks read) in fp32, each
        # with its fp32 gradient before the reduce-scatter.
        from r1jax.parallel.pipeline import ticks_1f1b
        layout = _layout(cfg, mesh)
        _, ring = ticks_1f1b(P, t.microbatches)
        xs = rs * T * m.hidden_size * dt
        outside = sum(n for k, n in parts.items() if k != "moe_layers")
        carry = (ring + t.microbatches // P + 4) * xs + (0 if t.grad_accum > 1 else g_moe + outside)
        depth = m.num_nextn_predict_layers
        gathered = w_head + depth * _weights_gathered(cfg, mesh, "mtp/0/", 1, dt, stacked=False) + (
            _weights_gathered(cfg, mesh, "embed", 1, F32, stacked=False) if depth else 0)
        ep = _epilogue(cfg, g, rs // P if rs >= P else rs, gathered, local_sort=True)
        fwd = layer_working(m, g, True, rs, True) + w_gather
        epi = ep["saved"] + ep["all_logits"] + max(ep["bwd_work"], ep["fwd_work"])
        # the stage's backward: its forward again from the kept input, each layer keeping what
        # the remat policy saves, then one layer's backward at a time (its recomputed tensors)
        bwd = layout.chunk * layer_saved(m, g, True, rs, remat, True) + w_gather + (
            layer_backward(m, g, True, rs, True) if remat is not Remat.none else layer_working(m, g, True, rs, True))
        return [*dense_phases, ph("1F1B ticks", r_dense + carry, 0, max(fwd, epi, bwd), 0), dense_bwd, opt]

    # the MoE stack: one scan (no pipeline), or GPipe/circular's scan over M*R+P-1 ticks, where
    # autodiff keeps every tick's residuals of its chunk of layers (bubble ticks included) and the
    # ticks' outputs
    if n_moe == 0:
        r_moe = w_moe = bwd_moe = 0
    elif P == 1:
        r_moe = n_moe * layer_saved(m, g, True, ra, remat)
        w_moe = layer_working(m, g, True, ra) + w_gather
        bwd_moe = (layer_backward(m, g, True, ra) - layer_working(m, g, True, ra) if remat is not Remat.none
                   else 0)
    else:
        layout = _layout(cfg, mesh)
        ticks = t.microbatches * layout.repeats + P - 1
        xs = rs * T * m.hidden_size * dt
        per_layer = layer_saved(m, g, True, rs, remat)
        # pipeline.stage_remat: a tick keeps its stage input only, and a tick's backward holds
        # its recomputed stage's residuals. Beside them: the stage's own rows of the stack output
        # (M/P microbatches; the input's are the dense prefix's output, counted there), the tick's
        # carried and received stage inputs and the microbatch assembled at stage 0, and under
        # circular the ring of M-P+1 outputs parked for their next repeat
        own = max(t.microbatches // P, 1)
        r_moe = (ticks * (xs if cfg.pipeline.stage_remat else layout.chunk * per_layer)
                 + (own + 3 + (t.microbatches - P + 1 if layout.repeats > 1 else 0)) * xs)
        w_moe = layer_working(m, g, True, rs) + w_gather
        bwd_moe = layer_backward(m, g, True, rs) - layer_working(m, g, True, rs) if remat is not Remat.none else 0
        bwd_moe += layout.chunk * per_layer if cfg.pipeline.stage_remat else 0

    # outside the stages the batch is split over pipeline as well (the MTP's routed sort, without
    # expert parallelism, runs on each shard's own tokens, but `capacity`'s gathers the whole
    # batch, pipeline shards included)
    # (epilogue chunks: each chunk's forward keeps nothing, its backward recomputes it, so every
    # epilogue phase below is one chunk's)
    outer = dataclasses.replace(g, batch_shards=g.batch_shards * g.pipeline)
    ep = _epilogue(cfg, outer, re, w_mtp)
    if cast and m.num_nextn_predict_layers:
        ep["saved"] += m.num_nextn_predict_layers * cast * _layer_weights(cfg, mesh, "mtp/0/", stacked=False)
    before = r_dense + r_moe
    # XLA materialises the MTP blocks' zero-filled dispatch buffers early: they are live while the
    # MoE stack runs forward (seen in XLA:CPU's buffer assignment, absent without MTP; assumed
    # on GPU too)
    early = m.num_nextn_predict_layers * _routed_working(m, outer, re, "forward") if n_moe else 0
    return [
        *dense_phases,
        ph("forward MoE layers", before, 0, w_moe + early, 0),
        ph("forward MTP", before + ep["fwd_saved"], ep["logits"], ep["fwd_work"], 0),
        ph("loss", before + ep["saved"], ep["all_logits"], 2 * ep["logits"] + w_head, 0),
        ph("backward MTP and head", before + ep["saved"], ep["logits"], ep["bwd_work"] + w_head, g_head),
        ph("backward MoE layers", before, 0, w_moe + bwd_moe, g_head + g_moe_own),
        dense_bwd,
        opt,
    ]


def activation_peak(cfg: Config, mesh: dict[str, int], st: dict, g: Geometry) -> dict[str, Any]:
    phases = _phases(cfg, mesh, st, g)
    name, comp = max(phases, key=lambda p: sum(p[1].values()))
    live = sum(comp.values())
    return {"phase": name, **comp, "live": live, "packing": int(live * (PACKING - 1)),
            "temp": int(live * PACKING), "phases": {n: sum(c.values()) for n, c in phases}}

# -------------------------------------------------------------------------------- communication
# All-gathers of a layer's fsdp-sharded weights per microbatch: forward and backward. A
# rematerialised backward recomputes the forward with the weights its own gather made (the
# backward scan's body gathers once for both), so remat adds no gather; it does repeat the
# forward's activation collectives (tensor, expert), whose inputs are recomputed.
FSDP_GATHERS = 2
EPILOGUE_PARTS = ("lm_head_DW", "final_norm", "mtp")     # what train.epilogue_chunks runs per chunk


def hardware_spec(hardware: str) -> Hardware:
    """HARDWARE[hardware], or ConfigError naming the known ones."""
    if hardware not in HARDWARE:
        raise ConfigError(f"--hardware {hardware}: unknown; allowed: {', '.join(HARDWARE)}")
    return HARDWARE[hardware]


@functools.lru_cache(maxsize=64)
def _node_grid(sizes: tuple[int, ...], dcn: tuple[int, ...], gpus_per_node: int) -> Any:
    """The node of every device of the mesh (an int array of its shape, AXES order), laid out as
    r1jax.parallel.mesh.make_mesh lays out jax.devices(), whose i-th device sits on node
    i // gpus_per_node: in order, the first axis outermost, or node-aware (`hybrid_order`)."""
    import numpy as np

    from r1jax.parallel.mesh import hybrid_order
    node = np.arange(math.prod(sizes)) // gpus_per_node
    if all(d == 1 for d in dcn):
        return node.reshape(sizes)
    return node[hybrid_order(dict(zip(AXES, sizes)), dict(zip(AXES, dcn)), node.tolist())]


def _span(grid: Any, axis: str) -> tuple[int, int]:
    """(GPUs of one node in a group of `axis`, nodes the group spans), the group that spans most."""
    import numpy as np
    i = AXES.index(axis)
    groups = np.sort(np.moveaxis(grid, i, -1).reshape(-1, grid.shape[i]), axis=1)
    nodes = int(((np.diff(groups, axis=1) != 0).sum(axis=1) + 1).max())
    return max(1, grid.shape[i] // nodes), nodes


def _collective(kind: str, size: float, inside: int, nodes: int) -> tuple[float, float]:
    """(NVLink bytes, InfiniBand bytes) one device moves in a collective over a group of
    `inside` GPUs in each of `nodes` nodes. `size`: the array reduced (all_reduce), the array
    gathered or scattered (all_gather, also reduce-scatter), what the device sends, itself
    included (all_to_all), what it sends its neighbour (permute). Rings, hierarchical across
    nodes: inside the node first, then each GPU's 1/inside share over its own NIC."""
    n = inside * nodes
    if kind == "all_reduce":
        return 2 * (inside - 1) / inside * size, 2 * (nodes - 1) / nodes * size / inside
    if kind == "all_gather":
        return (inside - 1) / inside * size, (nodes - 1) / nodes * size / inside
    if kind == "all_to_all":
        return (inside - 1) / n * size, (n - inside) / n * size
    return (size, 0.0) if nodes == 1 else (0.0, size)          # permute: a neighbour on another node


def _fsdp_traffic(cfg: Config, mesh: dict[str, int], spans: dict[str, tuple[int, int]]
                  ) -> list[tuple[str, str, str, float]]:
    """Each part's weights all-gathered over fsdp in the compute dtype (FSDP_GATHERS times) and
    their fp32 gradients reduce-scattered, per grad_accum microbatch (the pipelined MoE stack:
    per pipeline microbatch). `pipeline` does the same for the parts outside the pipelined stack,
    which it shards as fsdp does (r1jax/parallel/mesh.py's `embed` rules), and `expert` under
    mesh.expert_fsdp for all but the routed experts. A leaf split over several of these axes is
    gathered axis after axis, the one with the fewest GPUs in a node first (its ring carries the
    smallest pieces, over InfiniBand when that is its link), each later axis the whole of what the
    earlier ones gathered: the bytes of one gather over their product group, hierarchically."""
    t = cfg.train
    layout, lora = _layout(cfg, mesh), _lora(cfg)
    ef = cfg.mesh.expert_fsdp
    dt = DTYPE_BYTES[t.dtype]
    order = sorted((a for a in _gather_axes(cfg, "") if mesh[a] > 1), key=lambda a: spans[a][0])
    g = geometry(cfg, mesh)
    in_place = _embed_in_place(cfg, mesh, g, g.rows_outer)
    rows_bytes = t.grad_accum * g.rows_outer * g.seq * cfg.model.hidden_size * dt

    @functools.cache
    def held(done: tuple[str, ...]) -> dict[str, Any]:
        """The state's bytes with the axes in `done` gathered (expert: the default rules, under
        which it splits the routed experts alone)."""
        m = {**mesh, **{a: 1 for a in done if a != "expert"}}
        return _state_bytes(cfg.model, layout, _key(m, ef and "expert" not in done), lora)

    def gathered(axis: str, part: str | None) -> float:
        """The ring size of `axis`'s gather of `part` (None: LoRA's frozen base weights): a device
        lacks (f-1)/f of the leaves the axis splits, so those leaves whole are (whole - own) x f/(f-1)."""
        axes = [a for a in order if not (a == "pipeline" and part in ("moe_layers", None))]    # a stage's own slots
        if axis not in axes:
            return 0.0
        before = tuple(axes[:axes.index(axis)])
        whole, own = held(before + (axis,)), held(before)
        n = (whole["by_part"][part] - own["by_part"][part]) if part else (whole["frozen"] - own["frozen"])
        return n * mesh[axis] / (mesh[axis] - 1)

    out = []
    for axis in order:
        # under 1F1B each of the M ticks that run an epilogue gathers the head, the MTP blocks
        # and (for the MTP blocks' lookups, in fp32) the embedding once for its forward and
        # backward, and reduce-scatters their gradients (pipeline.loss_and_grads_1f1b)
        ticked = {}
        if axis == "pipeline" and cfg.pipeline.schedule is Schedule.onefoneb and cfg.model.num_moe_layers:
            ticks = t.grad_accum * t.microbatches
            ticked = {"lm_head_DW": (ticks, dt), "final_norm": (ticks, dt), "mtp": (ticks, dt),
                      **({"embed": (ticks, F32)} if cfg.model.num_nextn_predict_layers else {})}
        for part in held(())["by_part"]:
            size = gathered(axis, part)
            if not size:
                continue
            calls = t.grad_accum * (t.microbatches if part == "moe_layers" and mesh["pipeline"] > 1 else 1)
            if part in EPILOGUE_PARTS and not ticked:
                calls *= t.epilogue_chunks        # each chunk's forward (recomputed) and backward gathers them
            if part == "embed" and in_place:
                # the lookups run in the table's slices: each axis that splits it exchanges the
                # looked-up rows (forward) and their gradients, the prologue's and (unless 1F1B's
                # ticks gather the table for them) the MTP blocks'; axis after axis
                looks = 1 + (0 if ticked else cfg.model.num_nextn_predict_layers)
                out.append((axis, "embedding rows exchanged", "all_to_all", 2 * looks * rows_bytes))
            elif part not in ticked or part == "embed":                   # the prologue's embedding
                out += [(axis, "weight all-gathers", "all_gather", FSDP_GATHERS * calls * size * dt / F32),
                        (axis, "gradient reduce-scatters", "all_gather", calls * size)]
            if part in ticked:
                n_ticks, gdt = ticked[part]
                out += [(axis, "weight all-gathers", "all_gather", n_ticks * size * gdt / F32),
                        (axis, "gradient reduce-scatters", "all_gather", n_ticks * size)]
        if held(())["frozen"] and (size := gathered(axis, None)):        # LoRA's base weights, as stored
            out.append((axis, "weight all-gathers", "all_gather", FSDP_GATHERS * t.grad_accum * size))
    return out


@functools.lru_cache(maxsize=4096)
def _grad_groups(model: configlib.ModelConfig, layout, mesh_key: tuple, lora=None
                 ) -> tuple[tuple[tuple[str, ...], int], ...]:
    """(batch axes, bytes): the fp32 gradients of this device's trainable leaves summed by the
    batch axes (LOGICAL_RULES' `batch`) that do not split them, over which they are all-reduced."""
    mesh = dict(mesh_key)
    groups: dict[tuple[str, ...], int] = {}
    for leaf, shape, names in _placed(model, layout, lora):
        if not leaf.trainable or (lora is not None and not leaf.adapter):
            continue
        dims = _dim_axes(names, mesh_key)
        used = {a for axes in dims for a in axes}
        group = tuple(a for a in _rule("batch") if a in mesh and a not in used)
        if group:
            groups[group] = groups.get(group, 0) + math.prod(_split_shape(shape, dims, mesh)) * leaf.itemsize
    return tuple(groups.items())


def _grad_traffic(cfg: Config, mesh: dict[str, int], spans: dict[str, tuple[int, int]]
                  ) -> list[tuple[str, str, str, float]]:
    """The gradients' all-reduce over the batch axes, once per step. Over several axes it is
    done axis by axis (a reduce-scatter over one, the rest on the shards), the axis with the
    most GPUs inside a node first; ZeRO-1's reduce-scatter plus all-gather moves the same, or
    (1 + dt/4)/2 of it when its all-gather is of a compute-dtype copy (the router's and the
    embedding's fp32 gathers counted so too: a small share)."""
    out = []
    low = cfg.optim.zero1 and compute_gather(cfg) is not None
    for group, size in _grad_groups(cfg.model, _layout(cfg, mesh), _key(mesh, cfg.mesh.expert_fsdp), _lora(cfg)):
        size *= (1 + DTYPE_BYTES[cfg.train.dtype] / F32) / 2 if low else 1
        for a in sorted(group, key=lambda a: (-spans[a][0], spans[a][1])):
            out.append((a, "gradient all-reduce", "all_reduce", size))
            size /= mesh[a]
    return out


def _activation_traffic(cfg: Config, mesh: dict[str, int], g: Geometry) -> list[tuple[str, str, str, float]]:
    """Collectives on activations: tensor's all-reduces (2 a layer a pass), the expert
    exchange (dispatch and combine a pass), the pipeline's stage boundaries. Passes: forward,
    backward, and the forward again when remat recomputes it."""
    m, t = cfg.model, cfg.train
    P, A, dt, D = mesh["pipeline"], t.grad_accum, g.dt, m.hidden_size
    M = t.microbatches if P > 1 else 1
    passes = 2 + (t.remat is not Remat.none)
    layout = _layout(cfg, mesh)
    stack = layout.slots // P if layout else m.num_moe_layers         # MoE layers a device runs
    depth = m.num_nextn_predict_layers
    out = []
    if mesh["tensor"] > 1:
        layers = m.first_k_dense_replace + stack + depth
        tokens = A * g.rows_accum * g.seq                                # this device's, per step
        out.append(("tensor", "activation all-reduces", "all_reduce", passes * 2 * layers * tokens * D * dt))
    if mesh["expert"] > 1 and m.num_moe_layers:
        there_passes, back_passes = exchange_passes(cfg, mesh)
        for what, kind, there, back, mtp_there, mtp_back in zip(*_exchange(m, g, g.rows_stage),
                                                                *_exchange(m, g, g.rows_outer)[2:]):
            # (the MTP block runs outside the stages, on rows_outer rows)
            out.append(("expert", what, kind, A * (M * stack * (there_passes * there + back_passes * back)
                                                   + depth * passes * (mtp_there + mtp_back))))
    if P > 1:
        xs = g.rows_stage * g.seq * D * dt                               # one microbatch's stage input
        onefoneb = cfg.pipeline.schedule is Schedule.onefoneb
        ticks = M + 2 * P - 2 if onefoneb else M * layout.repeats + P - 1
        sends = 2 * ticks                                                # forward and backward, every tick
        out.append(("pipeline", "stage boundaries", "permute", A * sends * xs))
        if onefoneb:
            # each of the M epilogues scatters the last stage's output rows and gathers their
            # gradients (pipeline.loss_and_grads_1f1b)
            out.append(("pipeline", "epilogue rows", "all_gather", A * 2 * M * xs))
        # outside the stages the rows are split over pipeline: at its tick each microbatch's
        # stack input is summed to stage 0 from the stages holding its rows, and its gradient
        # summed back; gpipe and circular send the last stage's output to those stages the
        # same way, and its gradient back (pipeline._assemble, _give_back)
        out.append(("pipeline", "stack input to stage 0 and its gradient back", "all_reduce", A * 2 * M * xs))
        if not onefoneb:
            out.append(("pipeline", "stack output from the last stage and its gradient back", "all_reduce",
                        A * 2 * M * xs))
    return out


def exchange_passes(cfg: Config, mesh: dict[str, int]) -> tuple[int, int]:
    """(times a step runs the way there, the way back) of each pipelined-stack MoE layer's expert
    exchange per microbatch. Forward and backward run both. A recomputed forward needs the way
    there (the experts' inputs) and the way back only where the recompute itself reads the
    output: a later layer of a pipeline tick of several layers under stage_remat, or 1F1B's
    backward tick (a vjp of its stage, which computes the stage's output too). Those recompute
    the tick, and remat recomputes each layer again inside it (twice there), except that
    stage_remat's one-layer tick is the layer's own recompute. (The compiled step's all_to_alls:
    tests/test_moe_alltoall.py.)"""
    P = mesh.get("pipeline", 1)
    layout = _layout(cfg, mesh)
    onefoneb = P > 1 and cfg.pipeline.schedule is Schedule.onefoneb
    r, s = cfg.train.remat is not Remat.none, P > 1 and (cfg.pipeline.stage_remat or onefoneb)
    several = s and (onefoneb or layout.chunk > 1)
    return 2 + (r or s) + (several and r), 2 + several


def _exchange(m: configlib.ModelConfig, g: Geometry, rows: int) -> tuple[tuple, tuple, tuple, tuple]:
    """(what, collective, bytes there, bytes back) of each collective of one pass of one MoE
    layer's expert exchange on `rows` rows (r1jax/kernels/expert_parallel.py), as four tuples. A
    pass sends its buffers to the experts and back: forward the tokens (with each pair's expert
    id and weight) and their weighted outputs, backward the output gradients and the input
    gradients (with the weights' gradients); with kernels.moe_exchange_fp8 the way there is FP8
    rows and a fp32 scale per 128 channels. `capacity` sends its whole [E, C, D] buffer through
    all_to_all, `alltoall` its ep per-destination buffers of f x the balanced pairs;
    `hierarchical` its nodes' buffers of rows (with each row's k expert ids and fp32 weights)
    over the shards at its position on every node (`all_to_all_nodes`), then the forwarding
    shards' per-shard pair buffers inside the node (`all_to_all_node`); the others all-gather
    the expert group's tokens and reduce-scatter the outputs in fp32."""
    from r1jax.kernels.expert_parallel import FP8_BLOCK
    D, k, dt = m.hidden_size, m.num_experts_per_tok, g.dt
    there = D * dt                                                     # a row to the experts
    if g.exchange_fp8:
        there = D + D // math.gcd(D, FP8_BLOCK) * F32
    back = D * dt
    if g.dispatch == "capacity":
        n, width, _ = _routed_rows(m, g, rows, local_sort=False)
        return ("dispatch + combine",), ("all_to_all",), (n * (width + 1) * dt,), (n * width * dt,)
    if g.dispatch == "alltoall":
        from r1jax.kernels.expert_parallel import buffer_rows
        n = g.expert * buffer_rows(rows * g.seq, k, m.n_routed_experts, g.expert, g.buffer_factor)
        return ("dispatch + combine",), ("all_to_all",), (n * (there + 4 + dt),), (n * back,)
    if g.dispatch == "hierarchical":
        b1, b2 = g.hierarchical_rows(m, rows)
        n1, n2 = g.nodes * b1, g.expert // g.nodes * b2
        return (("dispatch + combine across nodes", "dispatch + combine inside nodes"),
                ("all_to_all_nodes", "all_to_all_node"),
                (n1 * (there + k * (4 + F32)), n2 * (there + 4 + dt)), (n1 * back, n2 * back))
    n = g.expert * rows * g.seq * D                       # the group's tokens; their partial outputs summed in fp32
    return ("dispatch + combine",), ("all_gather",), (n * dt,), (n * F32,)


def _forward_flops(cfg: Config) -> dict[str, float]:
    """Forward FLOPs per token of the decoder layers, by where they run: the pipelined MoE
    stack's layers (`stack`) and the layers outside it (`outside`: the dense prefix and the
    MTP blocks' own layers): 2 x their activated weights (routed experts k of E) + causal
    attention's forward (T x heads x (qk + v) a layer, the third of mfu's attention term that
    is the forward). The embedding lookup, the head and the loss are not in it (remat does not
    recompute them)."""
    m, T = cfg.model, cfg.data.seq_len
    frac = m.num_experts_per_tok / max(m.n_routed_experts, 1)
    from r1jax.model.params import ROUTED
    weights = {"moe_layers": 0.0, "dense_layers": 0.0, "mtp": 0.0}
    for leaf in leaves(m):
        part = leaf.path.split("/")[0]
        if part in weights and leaf.trainable and "norm" not in leaf.path:
            n = math.prod(leaf.shape)
            weights[part] += n * frac if leaf.path.rsplit("/", 1)[-1] in ROUTED else n
    attn = T * m.num_attention_heads * (m.qk_head_dim + m.v_head_dim)
    return {"stack": 2 * weights["moe_layers"] + attn * m.num_moe_layers,
            "outside": 2 * (weights["dense_layers"] + weights["mtp"])
            + attn * (m.first_k_dense_replace + m.num_nextn_predict_layers)}


def compute_bound(cfg: Config, mesh: dict[str, int], hw: Hardware) -> dict[str, float]:
    """The step's compute per device at the datasheet peak of the compute dtype: the model FLOPs
    (r1jax.train.mfu.flops_per_token: 6 x activated parameters + attention) x the step's tokens /
    devices, plus the forwards r1jax runs again: under remat full every decoder layer once, and a
    pipeline stage recomputed from its input (stage_remat, 1F1B's backward tick) once more, as
    many times as `exchange_passes` counts the way to the experts beyond forward and backward.
    Other remat policies' partial recomputes are not counted, so it stays a lower bound. The
    pipelined stack's share is spread over the schedule's ticks (`pipeline.bubble`: a stage
    idles in the bubble), the rest is not. `model_s` is the model FLOPs alone at the peak."""
    from r1jax.parallel.pipeline import bubble
    from r1jax.train.mfu import GPU_PEAKS, flops_per_token
    t, T = cfg.train, cfg.data.seq_len
    devices = math.prod(mesh.values())
    tokens = t.global_batch_size * T / devices
    model = flops_per_token(cfg.model, T) * tokens
    fwd = _forward_flops(cfg)
    full = t.remat is Remat.full
    P = mesh.get("pipeline", 1)
    layout = _layout(cfg, mesh)
    # the stack's forwards run again are the exchange's extra passes there; other policies'
    # partial recompute counted as none (only a recomputed stage, which runs whole)
    counted = t.remat if t.remat in (Remat.none, Remat.full) else Remat.none
    there, _ = exchange_passes(dataclasses.replace(cfg, train=dataclasses.replace(t, remat=counted)), mesh)
    again = {"stack": there - 2, "outside": int(full)}
    recompute = sum(again[k] * fwd[k] for k in fwd) * tokens
    # the stack's FLOPs of the model and its recompute: 3 forwards' worth of its layers (6 x
    # weights + 3 x attention), and what runs again
    stack = (3 * fwd["stack"] + again["stack"] * fwd["stack"]) * tokens if cfg.model.num_moe_layers else 0.0
    idle = bubble(P, t.microbatches, layout.repeats, cfg.pipeline.schedule) if P > 1 and layout else 0.0
    peak = GPU_PEAKS[hw.gpu]["fp32" if t.dtype is DType.fp32 else "bf16"]
    seconds = (model + recompute + stack * idle / (1 - idle)) / peak
    return {"flops_per_device": model, "recompute_flops": recompute, "bubble": idle,
            "peak_flops": peak, "model_s": model / peak, "compute_s": seconds}


def communication(cfg: Config, mesh: dict[str, int], dcn: dict[str, int], hardware: str, g: Geometry
                  ) -> dict[str, Any]:
    """Bytes each device moves per optimizer step over each mesh axis of size > 1, the link
    (NVLink when the axis stays inside a node, else InfiniBand), the seconds at the hardware's
    link rates, and the compute lower bound (`compute_bound`). `comm_s` is the busier link's
    seconds (`ib_s`, `nvlink_s`), `serial_s` every collective's one after another; `comm_bound`
    (comm_s > compute_s) means the step is slower than its compute even if every transfer hid
    behind it and the two links ran side by side."""
    hw = hardware_spec(hardware)
    grid = _node_grid(tuple(mesh[a] for a in AXES), tuple(dcn[a] for a in AXES), hw.gpus_per_node)
    spans = {a: _span(grid, a) for a in AXES if mesh[a] > 1}
    axes = {a: {"size": mesh[a], "gpus_per_node": i, "nodes": n, "link": "ib" if n > 1 else "nvlink",
                "nvlink_bytes": 0, "ib_bytes": 0, "parts": {}} for a, (i, n) in spans.items()}
    for axis, what, kind, size in [*_fsdp_traffic(cfg, mesh, spans), *_grad_traffic(cfg, mesh, spans),
                                   *_activation_traffic(cfg, mesh, g)]:
        if kind == "all_to_all_nodes":              # the hierarchical exchange's groups: one shard a node
            nv, ib = _collective("all_to_all", size, 1, g.nodes)
        elif kind == "all_to_all_node":             # ... and one node's shards
            nv, ib = _collective("all_to_all", size, g.expert // g.nodes, 1)
        else:
            nv, ib = _collective(kind, size, *spans[axis])
        row = axes[axis]
        row["nvlink_bytes"] += int(nv)
        row["ib_bytes"] += int(ib)
        row["parts"][what] = row["parts"].get(what, 0) + int(nv + ib)
    for row in axes.values():
        row["bytes"] = row["nvlink_bytes"] + row["ib_bytes"]
        row["seconds"] = row["nvlink_bytes"] / hw.nvlink + row["ib_bytes"] / hw.ib
    comp = compute_bound(cfg, mesh, hw)
    # a GPU's NVLink and its NIC are separate links: at best each is busy the whole step, so the
    # communication takes at least the busier one's time (the sum: every collective alone)
    ib_s = sum(row["ib_bytes"] for row in axes.values()) / hw.ib
    nvlink_s = sum(row["nvlink_bytes"] for row in axes.values()) / hw.nvlink
    comm_s = max(ib_s, nvlink_s)
    return {"axes": axes, **comp, "comm_s": comm_s, "ib_s": ib_s, "nvlink_s": nvlink_s,
            "serial_s": sum(row["seconds"] for row in axes.values()), "ratio": comm_s / comp["compute_s"],
            "comm_bound": comm_s > comp["compute_s"], "nvlink_rate": hw.nvlink, "ib_rate": hw.ib}


# ------------------------------------------------------------------------------------------ plan
def _mesh_config(cfg: Config, mesh: dict[str, int], dcn: dict[str, int] | None = None) -> MeshConfig:
    """`cfg`'s mesh section with the sizes `mesh` and `dcn` (its other keys kept)."""
    dcn = dcn or {}
    return dataclasses.replace(cfg.mesh, **{a: mesh.get(a, 1) for a in AXES}, **{f"dcn_{a}": dcn.get(a, 1) for a in AXES})


def _dcn_str(dcn: dict[str, int]) -> str:
    return " x ".join(f"dcn_{a}={v}" for a, v in dcn.items() if v > 1)


def check_dcn(mesh: dict[str, int], dcn: dict[str, int] | None, nodes: int) -> dict[str, int]:
    """{axis: nodes it spans} for every axis (omitted = 1), or ConfigError: each must divide its
    axis, and unless all are 1 they must multiply to `nodes` (each node then holds the rest)."""
    dcn = dict(dcn or {})
    unknown = sorted(set(dcn) - set(AXES))
    if unknown:
        raise ConfigError(f"--mesh: unknown axis 'dcn_{unknown[0]}'; allowed: {', '.join(f'dcn_{a}' for a in AXES)}")
    dcn = {a: int(dcn.get(a, 1)) for a in AXES}
    for a, v in dcn.items():
        if v < 1 or mesh[a] % v:
            raise ConfigError(f"dcn_{a}={v}: must be a positive divisor of {a}={mesh[a]} (the nodes the axis "
                              f"spans; {a}/dcn_{a} of it stays inside each node)")
    spanned = math.prod(dcn.values())
    if spanned > 1 and spanned != nodes:
        raise ConfigError(f"{_dcn_str(dcn)} = {spanned} nodes, but --nodes {nodes}: the dcn sizes must multiply "
                          f"to the number of nodes (or all be 1: devices in order, the first axis outermost)")
    return dcn


def mesh_error(cfg: Config, mesh: dict[str, int]) -> str | None:
    """config.validate's refusal of `cfg` on `mesh`, or None when r1jax runs it."""
    try:
        configlib.validate(dataclasses.replace(cfg, mesh=_mesh_config(cfg, mesh)))
        return None
    except ConfigError as e:
        return str(e)


def plan(cfg: Config, mesh_shape: dict[str, int], hardware: str, nodes: int = 1, *, backend: str = "gpu",
         search: bool = True, dcn: dict[str, int] | None = None) -> dict[str, Any]:
    """Per-device memory of `cfg`'s train step on `mesh_shape` ({axis: size}, omitted = 1) of
    `nodes` nodes of `hardware` GPUs, FITS or not, its communication per step against its compute
    (`comm`, `comm_bound`), the smallest fitting mesh (`search`), the KV cache and the rules of
    thumb. `dcn`: {axis: nodes it spans} (omitted = 1; all 1: devices in order, the first axis
    outermost). Raises ConfigError for an unknown axis or hardware, a mesh whose product is not
    nodes x GPUs per node (unless `backend='cpu'`), dcn sizes that do not fit it, or a mesh the config's
    rules refuse."""
    hw = hardware_spec(hardware)
    unknown = sorted(set(mesh_shape) - set(AXES))
    if unknown:
        raise ConfigError(f"--mesh: unknown axis '{unknown[0]}'; allowed: {', '.join(AXES)}")
    mesh = {a: int(mesh_shape.get(a, 1)) for a in AXES}
    bad = [a for a, v in mesh.items() if v < 1]
    if bad:
        raise ConfigError(f"--mesh {bad[0]}={mesh[bad[0]]}: must be a positive integer")
    devices = math.prod(mesh.values())
    if backend != "cpu" and devices != nodes * hw.gpus_per_node:
        raise ConfigError(f"--mesh: {' x '.join(f'{a} {v}' for a, v in mesh.items() if v > 1) or 'data 1'} = "
                          f"{devices} devices, but --nodes {nodes} x {hw.gpus_per_node} GPUs = "
                          f"{nodes * hw.gpus_per_node}")
    dcn = check_dcn(mesh, dcn, nodes)
    error = mesh_error(cfg, mesh)
    if error:
        raise ConfigError(error)
    out = evaluate(cfg, mesh, hardware, backend)
    comm = communication(cfg, mesh, dcn, hardware, geometry(cfg, mesh, backend))
    # `refused` stays in the JSON (its readers check it): always None now, as a mesh r1jax would
    # refuse is an error above
    out.update(nodes=nodes, devices=devices, gpus_per_node=hw.gpus_per_node, dcn=dcn, refused=None,
               comm=comm, comm_bound=comm["comm_bound"], kv_cache=kv_cache(cfg.model),
               rules_of_thumb=rules_of_thumb(cfg, devices, hardware))
    if search:
        out["proposal"] = smallest_fit(cfg, hardware)
    return out


def evaluate(cfg: Config, mesh: dict[str, int], hardware: str, backend: str = "gpu") -> dict[str, Any]:
    """The per-device numbers of one mesh (no validation, no search)."""
    st = state_bytes(cfg, mesh)
    g = geometry(cfg, mesh, backend)
    t = cfg.train
    batch = 3 * (t.global_batch_size // (g.batch_shards * g.pipeline)) * cfg.data.seq_len * 4   # ids, segment_ids, positions
    small = 4 + 4 + 4                                                                # step, loss scale
    arg = st["params"] + st["opt"] + st["router_bias"] + st["frozen"] + small + batch
    act = activation_peak(cfg, mesh, st, g)
    capacity = hardware_spec(hardware).mib * 2**20
    usable = int(capacity * (1 - RESERVE))
    total = arg + act["temp"]
    return {"mesh": mesh, "hardware": hardware, "backend": backend, "dispatch": g.dispatch,
            "rows_per_device": g.rows_outer, "rows_per_stage_microbatch": g.rows_stage,
            "params": st["params"], "grads": st["grads"], "opt": st["opt"], "router_bias": st["router_bias"],
            "frozen": st["frozen"], "trainable": trainable(cfg),
            "params_by_part": st["by_part"], "batch_and_scalars": batch + small, "argument": arg,
            "activations": act, "temp": act["temp"], "total": total,
            "device_bytes": capacity, "usable_bytes": usable, "fits": total <= usable,
            "params_global": st["params_global"]}


def trainable(cfg: Config) -> dict[str, Any]:
    """What the optimizer trains: every weight, or with LoRA the adapters (and their share)."""
    ls = leaves(cfg.model, _lora(cfg))
    base = sum(math.prod(l.shape) for l in ls if l.trainable and not l.adapter)
    adapters = sum(math.prod(l.shape) for l in ls if l.adapter)
    n = adapters if cfg.lora.rank else base
    return {"parameters": n, "fraction": n / base, "lora": bool(cfg.lora.rank)}


def kv_cache(m: configlib.ModelConfig, bytes_per: int = 2) -> dict[str, int]:
    """MLA's latent cache: the normalised latent c [C] and the shared rope key [R], per layer
    (r1jax/infer/cache.py), and what per-head keys and values would take."""
    from r1jax.infer import cache as cachelib
    dtype = {2: "bfloat16", 4: "float32"}[bytes_per]
    per_token = cachelib.bytes_per_token(m, dtype)
    return {"per_token": per_token, "max_positions": m.max_position_embeddings,
            "per_sequence": per_token * m.max_position_embeddings,
            "mha_per_token": cachelib.mha_bytes_per_token(m, dtype)}


def rules_of_thumb(cfg: Config, devices: int, hardware: str) -> dict[str, Any]:
    """'GPU memory >= 1.5 x parameters', read as: all GPUs' memory together against 1.5 x the
    parameters in bf16 (2 bytes each); 'host memory = 2 x GPU memory', per node."""
    n = sum(math.prod(l.shape) for l in leaves(cfg.model) if l.trainable)
    hw = hardware_spec(hardware)
    gpu = devices * hw.mib * 2**20
    need = int(1.5 * 2 * n)
    return {"parameters": n, "gpu_memory_total": gpu, "one_and_half_bf16_params": need, "gpu_rule_ok": gpu >= need,
            "host_memory_per_node": 2 * hw.gpus_per_node * hw.mib * 2**20}


def _pow2(n: int) -> list[int]:
    return [2**i for i in range(int(math.log2(n)) + 1)] if n >= 1 else []


def candidate_meshes(devices: int):
    """Every assignment of power-of-two sizes to the five axes with product `devices`."""
    k = int(math.log2(devices))
    for split in itertools.product(range(k + 1), repeat=4):
        if sum(split) <= k:
            yield dict(zip(AXES, [2**s for s in split] + [2**(k - sum(split))]))


def smallest_fit(cfg: Config, hardware: str, max_nodes: int = 4096) -> dict[str, Any] | None:
    """The fewest whole nodes (a power of two) with a power-of-two mesh that fits, keeping the
    config's batch, remat and schedule, and the least memory among the meshes of that size that
    fit and that r1jax runs."""
    hw = hardware_spec(hardware)
    usable = hw.mib * 2**20 * (1 - RESERVE)
    # the fp32 masters and AdamW moments (12 B a parameter in fp32) cannot be split over more than all devices
    n_params = sum(math.prod(l.shape) for l in leaves(cfg.model) if l.trainable)
    per_param = F32 + 2 * _moment_bytes(cfg)
    nodes = 2 ** max(0, math.ceil(math.log2(max(1.0, per_param * n_params / usable / hw.gpus_per_node))))
    while nodes <= max_nodes:
        fits = []
        for mesh in candidate_meshes(nodes * hw.gpus_per_node):
            if mesh_error(cfg, mesh):
                continue
            st = state_bytes(cfg, mesh)
            if st["params"] + st["opt"] > usable:          # the state alone is too big: skip the rest
                continue
            r = evaluate(cfg, mesh, hardware)
            if r["fits"]:
                fits.append((r["total"], mesh))
        if fits:
            total, mesh = min(fits, key=lambda f: f[0])
            return {"smallest": {"nodes": nodes, "mesh": mesh, "total": total, "usable_bytes": int(usable)}}
        nodes *= 2
    return None


# ------------------------------------------------------------------------------------- printing
def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def _num(x: float) -> str:
    """Two decimals, or three significant digits below 1 (small meshes move little)."""
    return f"{x:,.2f}" if x >= 1 or x == 0 else f"{x:.3g}"


def _mesh_str(mesh: dict[str, int]) -> str:
    return " x ".join(f"{a} {v}" for a, v in mesh.items() if v > 1) or "1 device"


def report(cfg: Config, r: dict[str, Any]) -> str:
    m, t = cfg.model, cfg.train
    a = r["activations"]
    gpn = r["gpus_per_node"]
    dcn = _dcn_str(r["dcn"])
    lines = [(f"r1jax capacity plan: {r['devices']} x {r['hardware']} ({r['nodes']} node(s) x {gpn} GPUs), "
              f"mesh {_mesh_str(r['mesh'])}" + (f", across nodes {dcn}" if dcn else "")),
             f"train: global batch {t.global_batch_size} x seq {cfg.data.seq_len}, grad_accum {t.grad_accum}, "
             f"dtype {t.dtype.value}, remat {t.remat.value}, MoE dispatch {r['dispatch']}"
             + (f", pipeline {cfg.pipeline.schedule.value} M={t.microbatches}" if r["mesh"]["pipeline"] > 1 else "")
             + (f"; {r['rows_per_device']} row(s) per device per microbatch" if r["mesh"]["pipeline"] == 1 else
                f"; per device {r['rows_per_device']} row(s) outside the stages, {r['rows_per_stage_microbatch']} per "
                f"pipeline microbatch")]
    tr = r["trainable"]
    if tr["lora"]:
        lo = cfg.lora
        lines.append(f"LoRA rank {lo.rank} on {', '.join(lo.targets)}: {tr['parameters'] / 1e6:,.1f}M trainable "
                     f"parameters, {100 * tr['fraction']:.3f}% of the model's; the base is frozen in "
                     f"{lo.base_dtype.value} (no gradients, no optimizer state)")
    zero1 = " ZeRO-1" if cfg.optim.zero1 else ""
    rows = [("state (the step's donated arguments)", None),
            (f"  {'adapters' if tr['lora'] else 'parameters'} (fp32 masters{zero1})", r["params"]),
            (f"  optimizer state (AdamW mu+nu, {cfg.optim.moment_dtype.value}{zero1})", r["opt"]),
            *([(f"  frozen base weights ({cfg.lora.base_dtype.value})", r["frozen"])] if tr["lora"] else []),
            ("  router biases", r["router_bias"]),
            ("  batch rows + step scalars", r["batch_and_scalars"]),
            ("  = state", r["argument"]),
            (f"temporaries at the peak ({a['phase']})", None),
            ("  gradients (fp32" + (", running sum + microbatch)" if t.grad_accum > 1 else ")"), a["gradients"]),
            *([(f"  masters gathered for the step ({'fp32' if compute_gather(cfg) is None else t.dtype.value} "
                "copy, ZeRO-1)", a["gathered"])] if cfg.optim.zero1 else []),
            ("  activations saved for backward", a["activations"]),
            ("  logits + their gradient (fp32)", a["logits"]),
            ("  transient working set", a["working"]),
            (f"  XLA heap packing (x{PACKING} of the live bytes)", a["packing"]),
            ("  = temporaries", r["temp"]),
            ("TOTAL per device", r["total"]),
            (f"usable ({1 - RESERVE:.0%} of {_gib(r['device_bytes'])})", r["usable_bytes"])]
    w = max(len(n) for n, _ in rows) + 2
    lines.append(f"{'per device':<{w}}{'memory':>14}")
    lines += [f"{name:<{w}}{'' if v is None else _gib(v):>14}" for name, v in rows]
    verdict = "FITS" if r["fits"] else "DOES NOT FIT"
    lines.append(f"{verdict}: {_gib(r['total'])} of {_gib(r['usable_bytes'])} usable "
                 f"({r['total'] / r['usable_bytes']:.0%})")
    lines.append("live temporaries by phase: " + ", ".join(f"{k} {_gib(v)}" for k, v in a["phases"].items()))
    P = r["mesh"]["pipeline"]
    if P > 1:
        from r1jax.parallel.pipeline import bubble, layout_for, ticks_1f1b
        sched, lay = cfg.pipeline.schedule, layout_for(cfg, P)
        flight = (f"a ring of {ticks_1f1b(P, t.microbatches)[1]} stage inputs in flight" if sched is Schedule.onefoneb
                  else f"every tick's {'stage input' if cfg.pipeline.stage_remat else 'residuals'} "
                       f"({t.microbatches * lay.repeats + P - 1} ticks)")
        lines.append(f"pipeline stages: each of the {P} holds these figures (the stack's {lay.slots} slots are "
                     f"{lay.chunk * lay.repeats} a stage, padding included; the parts outside are split evenly; "
                     f"one program runs on every stage), so every stage is the worst; {flight}; bubble "
                     f"{bubble(P, t.microbatches, lay.repeats, sched):.1%}")
    lines += comm_report(r["comm"])
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in sorted(r["params_by_part"].items(), key=lambda kv: -kv[1]))
    lines.append(f"parameters by part (per device): {parts}")
    kv = r["kv_cache"]
    lines.append(f"inference KV cache (MLA latent, bf16): {kv['per_token'] / 2**10:,.1f} KiB per token "
                 f"(({m.kv_lora_rank} + {m.qk_rope_head_dim}) x {m.num_hidden_layers} layers x 2 B), "
                 f"{_gib(kv['per_sequence'])} per sequence of {kv['max_positions']:,} tokens; per-head K/V "
                 f"would take {kv['mha_per_token'] / 2**10:,.1f} KiB per token ({kv['mha_per_token'] / kv['per_token']:.1f}x)")
    th = r["rules_of_thumb"]
    lines.append(f"rule of thumb 'GPU memory >= 1.5 x parameters' (all GPUs together vs 1.5 x the weights in bf16): "
                 f"{_gib(th['gpu_memory_total'])} vs {_gib(th['one_and_half_bf16_params'])} "
                 f"({th['parameters'] / 1e9:,.1f} B parameters): {'holds' if th['gpu_rule_ok'] else 'fails'}; "
                 f"r1jax's training state alone is {F32 + 2 * _moment_bytes(cfg)} B/parameter (+4 B of gradients) = "
                 f"{_gib((2 * F32 + 2 * _moment_bytes(cfg)) * th['parameters'])} over all GPUs")
    lines.append(f"rule of thumb 'host memory = 2 x GPU memory': {_gib(th['host_memory_per_node'])} of host RAM "
                 f"per node of {gpn} GPUs")
    if "proposal" in r:
        p = r["proposal"]
        if p is None:
            lines.append("smallest mesh that fits: none up to 4096 nodes (reduce the per-device batch: "
                         "train.grad_accum, or train.remat)")
        else:
            s = p["smallest"]
            lines.append(f"smallest mesh that fits (powers of two, this config's batch and remat): {s['nodes']} "
                         f"node(s) = {s['nodes'] * gpn} GPUs, {_mesh_str(s['mesh'])}: "
                         f"{_gib(s['total'])} per device")
    return "\n".join(lines)


def comm_report(c: dict[str, Any]) -> list[str]:
    """The communication table: per mesh axis, where its groups sit, the link, GB per step
    (all, and over InfiniBand), seconds; then the compute lower bound and the verdict."""
    lines = [f"communication per optimizer step, per device (NVLink {c['nvlink_rate'] / 1e9:.0f} GB/s, InfiniBand "
             f"{c['ib_rate'] / 1e9:.0f} GB/s per GPU; ring collectives, hierarchical across nodes):"]
    head = f"{'axis':<10}{'size':>6}  {'groups':<22}{'link':<12}{'GB/step':>10}{'over IB':>10}{'seconds':>10}  what"
    lines.append(head)
    for axis, row in c["axes"].items():
        i, n = row["gpus_per_node"], row["nodes"]
        where = f"{i} GPU{'s' * (i > 1)} x {n} node{'s' * (n > 1)}"
        what = ", ".join(f"{k} {_num(v / 1e9)}" for k, v in row["parts"].items()) or "nothing"
        link = "InfiniBand" if row["link"] == "ib" else "NVLink"
        lines.append(f"{axis:<10}{row['size']:>6}  {where:<22}{link:<12}{_num(row['bytes'] / 1e9):>10}"
                     f"{_num(row['ib_bytes'] / 1e9):>10}{_num(row['seconds']):>10}  {what}")
    lines.append(f"links: InfiniBand {_num(c['ib_s'])} s, NVLink {_num(c['nvlink_s'])} s; communication at least the "
                 f"busier link's {_num(c['comm_s'])} s (every collective one after another: {_num(c['serial_s'])} s)")
    again = (f" + {c['recompute_flops'] / 1e12:,.1f} recomputed" if c["recompute_flops"] else "")
    idle = f", the stack's share over the ticks (bubble {c['bubble']:.1%})" if c["bubble"] else ""
    lines.append(f"compute lower bound: {c['flops_per_device'] / 1e12:,.1f} TFLOP per device per step (model FLOPs)"
                 f"{again} at {c['peak_flops'] / 1e12:,.0f} TFLOP/s peak{idle} = {_num(c['compute_s'])} s "
                 f"(model FLOPs alone {_num(c['model_s'])} s)")
    verdict = "COMM-BOUND" if c["comm_bound"] else "compute-bound"
    lines.append(f"{verdict}: communication {_num(c['comm_s'])} s vs compute {_num(c['compute_s'])} s "
                 f"({c['ratio']:.2g}x)")
    return lines


# ----------------------------------------------------------------------- compiler cross-check
def measure(cfg: Config, mesh_shape: dict[str, int]) -> dict[str, int]:
    """`compiled.memory_analysis()` of the real train step (r1jax.train.step.make_train_step) on
    the first prod(mesh) local devices, lowered from abstract state (nothing allocated)."""
    import jax
    import jax.numpy as jnp

    from r1jax import weights
    from r1jax.parallel import mesh as meshlib
    from r1jax.parallel import pipeline
    from r1jax.train import optim
    from r1jax.train import state as statelib
    from r1jax.train.step import make_train_step

    mesh_cfg = _mesh_config(cfg, mesh_shape)
    cfg = dataclasses.replace(cfg, mesh=mesh_cfg)
    n = math.prod(mesh_shape.get(a, 1) for a in AXES)
    mesh = meshlib.make_mesh(mesh_cfg, jax.devices()[:n])
    t = cfg.train
    graphdef, target = weights.target(cfg, mesh, pipeline.mesh_layout(cfg, mesh))
    tx = optim.make(cfg.optim, t.steps)
    state, shardings = statelib.abstract(target, tx, cfg, mesh)
    step = make_train_step(graphdef, tx, cfg, mesh, shardings)
    bs = meshlib.batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct((t.global_batch_size, cfg.data.seq_len), jnp.int32, sharding=bs)
             for k in ("ids", "segment_ids", "positions")}
    # LLVM's optimisation level changes code, not buffers: level 0 compiles ~2x faster on CPU
    options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}
    ma = step.lower(state, batch).compile(options).memory_analysis()
    return {"argument": int(ma.argument_size_in_bytes), "temp": int(ma.temp_size_in_bytes),
            "output": int(ma.output_size_in_bytes), "alias": int(ma.alias_size_in_bytes)}


def compare(cfg: Config, mesh_shape: dict[str, int]) -> dict[str, Any]:
    """Prediction (backend 'cpu': the dispatch XLA:CPU runs) against memory_analysis: argument,
    temp and total = argument + temp + output - alias (the donated state is its own output)."""
    mesh = {a: int(mesh_shape.get(a, 1)) for a in AXES}
    pred = evaluate(cfg, mesh, "h100-80gb", backend="cpu")
    xla = measure(cfg, mesh)
    xla_total = xla["argument"] + xla["temp"] + xla["output"] - xla["alias"]
    rows = {"argument": (pred["argument"], xla["argument"]), "temp": (pred["temp"], xla["temp"]),
            "total": (pred["total"], xla_total)}
    return {"mesh": mesh, "xla": xla, "predicted": pred, "dtype": cfg.train.dtype.value,
            "rows": {k: {"predicted": p, "xla": x, "rel_error": (p - x) / x} for k, (p, x) in rows.items()}}


def check_report(c: dict[str, Any]) -> str:
    lines = [(f"check against XLA (memory_analysis of the real train step on {math.prod(c['mesh'].values())} "
              f"fake CPU devices, mesh {_mesh_str(c['mesh'])}):"),
             f"{'':<10}{'predicted':>14}{'XLA':>14}{'rel error':>11}"]
    for k, v in c["rows"].items():
        lines.append(f"{k:<10}{v['predicted'] / 2**20:>11,.2f} MiB{v['xla'] / 2**20:>10,.2f} MiB{v['rel_error']:>+10.1%}")
    if c["predicted"]["backend"] == "cpu" and c.get("dtype") in ("bf16", "fp16"):
        lines.append("note: XLA:CPU keeps much of a bf16/fp16 step in fp32, so this comparison under-states XLA's "
                     "temp; the 2-byte model is meant for GPUs and is not validated here")
    a = c["predicted"]["activations"]
    lines.append("predicted temp by component: " + ", ".join(
        f"{k} {a[k] / 2**20:,.2f} MiB" for k in ("gradients", "gathered", "activations", "logits", "working", "packing")
        if a[k] or k != "gathered")
        + f" (peak: {a['phase']})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ CLI
def parse_mesh(text: str) -> tuple[dict[str, int], dict[str, int]]:
    """--mesh axis=size,...[,dcn_axis=nodes,...] as ({axis: size}, {axis: nodes it spans}), every
    axis present (omitted: 1)."""
    sizes: dict[str, int] = {}
    dcn: dict[str, int] = {}
    allowed = ", ".join([*AXES, *(f"dcn_{a}" for a in AXES)])
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, eq, value = (x.strip() for x in item.partition("="))
        if not eq or not value.lstrip("-").isdigit():
            raise ConfigError(f"--mesh {text}: expected axis=size[,axis=size...], e.g. data=8,tensor=8 "
                              f"(with dcn_axis=nodes for an axis that spans nodes)")
        axis = name.removeprefix("dcn_")
        if axis not in AXES:
            raise ConfigError(f"--mesh: unknown axis '{name}'; allowed: {allowed}")
        (dcn if name.startswith("dcn_") else sizes)[axis] = int(value)
    return {a: sizes.get(a, 1) for a in AXES}, {a: dcn.get(a, 1) for a in AXES}


def config_mesh(path: str, overrides: list[str], devices: int) -> tuple[dict[str, int], dict[str, int]]:
    """The config's own mesh after `overrides` ({axis: size} with its -1 axis filled in for
    `devices`, {axis: dcn size}), for a plan without --mesh."""
    try:
        mesh = configlib.load(path, overrides).mesh
    except ConfigError as e:
        mesh = _unvalidated_mesh(path, overrides, e)
    try:
        sizes = configlib.resolve_mesh_shape(mesh, devices)
    except ConfigError as e:
        raise ConfigError(f"{e} (here: --nodes x GPUs per node = {devices}; or give --mesh)") from None
    return sizes, configlib.dcn_sizes(mesh)


def _unvalidated_mesh(path: str, overrides: list[str], error: ConfigError) -> MeshConfig:
    """The mesh section of the YAML after the mesh.* overrides, read without config.validate (whose
    refusal load_for_mesh raises once the -1 axis is resolved); `error`, the loader's, when even
    that cannot be read."""
    import yaml
    from omegaconf import OmegaConf
    try:
        raw = (yaml.safe_load(Path(path).read_text()) or {}).get("mesh") or {}
        dots = OmegaConf.from_dotlist([o for o in overrides if o.startswith("mesh.")]).get("mesh") or {}
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MeshConfig), raw, dots))
    except Exception:               # whatever is wrong, the loader's own message says it best
        raise error from None


def _mesh_overrides(mesh: dict[str, int], dcn: dict[str, int]) -> list[str]:
    return [*(f"mesh.{a}={mesh.get(a, 1)}" for a in AXES), *(f"mesh.dcn_{a}={dcn.get(a, 1)}" for a in AXES)]


def load_for_mesh(path: str, overrides: list[str], mesh: dict[str, int], dcn: dict[str, int] | None = None
                  ) -> Config:
    """The config with its mesh replaced by `mesh` (axes not in it are 1) and its dcn sizes by
    `dcn` before it is validated (so the YAML's own mesh never refuses a --mesh)."""
    return configlib.load(path, [*overrides, *_mesh_overrides(mesh, dcn or {})])


def _jsonable(r: Any) -> Any:
    return json.loads(json.dumps(r, default=lambda o: o.value if hasattr(o, "value") else str(o)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m r1jax.plan", description=__doc__.splitlines()[0],
                                 epilog="Omitted mesh axes are 1; the mesh product must equal nodes x GPUs per node.")
    ap.add_argument("--config", required=True, help="YAML config (see configs/)")
    ap.add_argument("--mesh", default=None,
                    help="axis=size,... over data, fsdp, tensor, expert, pipeline, and dcn_<axis>=nodes the axis "
                         "spans (default 1); without --mesh: the config's mesh.* (a -1 axis takes the rest)")
    ap.add_argument("--hardware", required=True, help=f"one of {', '.join(HARDWARE)}")
    ap.add_argument("--nodes", type=int, default=1, help=f"nodes of {GPUS_PER_NODE} GPUs (default 1)")
    ap.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    ap.add_argument("--check", action="store_true",
                    help="compile the real train step on fake CPU devices and compare (mesh of <= 8 devices)")
    ap.add_argument("--no-search", action="store_true", help="skip the smallest-fitting-mesh search")
    ap.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    args = ap.parse_args(argv)
    try:
        if args.nodes < 1:
            raise ConfigError(f"--nodes {args.nodes}: must be a positive integer")
        hw = hardware_spec(args.hardware)
        gpus = args.nodes * hw.gpus_per_node
        if args.mesh is None:
            mesh, dcn = config_mesh(args.config, args.overrides, gpus)
        else:
            mesh, dcn = parse_mesh(args.mesh)
        devices = math.prod(mesh.values())
        if devices != gpus:
            raise ConfigError(f"--mesh: {_mesh_str(mesh)} = {devices} devices, but --nodes {args.nodes} x "
                              f"{hw.gpus_per_node} GPUs = {gpus}")
        check_dcn(mesh, dcn, args.nodes)
        cfg = load_for_mesh(args.config, args.overrides, mesh, dcn)
        r = plan(cfg, mesh, args.hardware, args.nodes, search=not args.no_search, dcn=dcn)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(report(cfg, r))
    out = {"config": args.config, "overrides": args.overrides, **r}
    if args.check:
        n = math.prod(r["mesh"].values())
        if n > 8:
            print(f"--check: the mesh has {n} devices; the check compiles on at most 8 fake CPU devices")
        else:
            c = compare(cfg, r["mesh"])
            print(check_report(c))
            out["check"] = {k: v for k, v in c.items() if k != "predicted"}
    if args.json:
        Path(args.json).write_text(json.dumps(_jsonable(out), indent=2) + "\n")
    return 0


def _cpu_devices_for_check(argv: list[str]) -> None:
    """--check compiles on fake CPU devices: ask for 8 before JAX starts its backend."""
    if "--check" in argv:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
        import jax
        jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))


if __name__ == "__main__":
    _cpu_devices_for_check(sys.argv[1:])
    sys.exit(main())

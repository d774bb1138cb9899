"""Typed, frozen run configuration: YAML file + dotted `section.key=value` overrides.

OmegaConf structured configs do the type checking (wrong types, unknown keys, bad enum values);
`validate` adds the cross-field rules (divisibility, ranges). Every failure is a `ConfigError`
whose message is one line naming the key and what is allowed; the CLIs print it and exit 2.

Sections: `model` is the architecture, spelled as Hugging Face's `DeepseekV3Config` with its
defaults (DeepSeek-V3/R1's dimensions) so a DeepSeek config.json maps one to one, plus where the
model comes from (`hf_config`, `init_from`). How it computes is `kernels`, the training objective
and its weights `loss`, the rest `mesh`, `pipeline`, `data`, `optim`, `train`, `checkpoint`,
`distributed`. `architecture()` is the one definition of which keys make a checkpoint's model.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import math
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A bad configuration; `str(err)` is a single line naming the key."""


class RopeType(str, enum.Enum):
    default = "default"
    yarn = "yarn"


class Activation(str, enum.Enum):
    silu = "silu"


class MoEDispatch(str, enum.Enum):
    auto = "auto"          # dropless on CPU, ragged on GPU/TPU
    dropless = "dropless"  # sort pairs by expert into fixed-size tiles; exact, ~useful FLOPs on CPU
    ragged = "ragged"      # sort + jax.lax.ragged_dot (grouped GEMM where the backend has one)
    capacity = "capacity"  # fixed per-expert capacity; drops overflow, reports how many
    loop = "loop"          # every expert on every token, masked (reference; E x FLOPs)
    gather = "gather"      # each pair's expert weights gathered: decode-sized batches
    dense = "dense"        # every expert on every token in one batched product (E/k x FLOPs, no copies)
    grouped = "grouped"    # per expert, a loop over its own tiles, weights read in place (inference only)
    alltoall = "alltoall"  # expert parallel: all_to_all into per-shard buffers, dropless at the owner
    hierarchical = "hierarchical"  # expert parallel: a token once per node, then to its experts inside it


class AttentionImpl(str, enum.Enum):
    dense = "dense"    # whole [T, S] scores (the parity-measured path; fastest at short T)
    flash = "flash"    # blocks of kernels.attention_block positions; memory linear in T


class ObjectiveKind(str, enum.Enum):
    lm = "lm"                # next-token (+ MTP) cross-entropy on every target in a segment
    masked_lm = "masked_lm"  # the same, only on targets where batch["loss_mask"] is set
    sft = "sft"              # masked_lm on chat records (data/sft.py): the loss on assistant tokens only
    kd = "kd"                # logit distillation from distill.teacher on chat records' assistant tokens
    grpo = "grpo"            # GRPO on the generator's own rollouts (r1jax/rl/grpo.py; grpo.*)


class LossAgg(str, enum.Enum):
    token = "token"          # sum over every completion token of the step / their number (DAPO, TRL's bnpo)
    sequence = "sequence"    # each completion's token mean, averaged over completions (GRPO's paper form)
    constant = "constant"    # sum over tokens / (completions x grpo.max_new_tokens) (Dr. GRPO)


class Advantage(str, enum.Enum):
    std = "std"              # (r - group mean) / (group std + 1e-4), the std with ddof 1 (TRL's)
    mean = "mean"            # r - group mean (Dr. GRPO: no division by the std)


class KDLoss(str, enum.Enum):
    forward_kl = "forward_kl"  # KL(teacher || student): mode-covering (TRL GKD's beta=0)
    reverse_kl = "reverse_kl"  # KL(student || teacher): mode-seeking (GKD's beta=1)
    jsd = "jsd"                # generalised Jensen-Shannon with distill.beta (GKD's form)


class DType(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Remat(str, enum.Enum):
    none = "none"                      # keep every activation of the layer body
    full = "full"                      # keep only the layer inputs
    save_attention = "save_attention"  # keep attention outputs, recompute MLP/MoE
    save_dots = "save_dots"            # keep matmul outputs without batch dims
    offload = "offload"                # move the tagged activations to host memory (where supported)


class SpikePolicy(str, enum.Enum):
    off = "off"            # no spike detection
    warn = "warn"          # log the spike (metrics.jsonl event, console, alert hook) and go on
    rollback = "rollback"  # as for non-finite steps: back to the last good checkpoint, skip the batches


class OnError(str, enum.Enum):
    stop = "stop"          # a failed checkpoint write ends the run (exit 1); the previous checkpoint stays
    continue_ = "continue" # one line, training goes on, the next save tries again


class Schedule(str, enum.Enum):
    gpipe = "gpipe"
    circular = "circular"
    onefoneb = "1f1b"


class DataSource(str, enum.Enum):
    stdlib = "stdlib"            # this Python's own standard-library sources (found via sysconfig)
    text = "text"                # text files or globs in `data.paths` (see data.text_mode)
    jsonl = "jsonl"              # JSON Lines files; the text is under `data.text_field`
    parquet = "parquet"          # Parquet files; the text column is `data.text_field`
    arrayrecord = "arrayrecord"  # ArrayRecord files; records are UTF-8 text or JSON objects
    task = "task"                # loss.objective=sft: worked solutions of a generated task (data/tasks.py)


class TextMode(str, enum.Enum):
    document = "document"  # one document per file
    lines = "lines"        # one document per non-empty line (as HF's LineByLineTextDataset)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling` / `rope_parameters` (minus rope_theta, which is top level)."""
    type: RopeType = RopeType.default
    factor: Optional[float] = None  # None: max_position_embeddings / original_max_position_embeddings
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: Optional[float] = None  # None: derived from factor/mscale as HF does
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # --- HF DeepseekV3Config keys (same names, same defaults) ---
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: Optional[int] = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    hidden_act: Activation = Activation.silu
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 1  # MTP depth D (HF alias: num_mtp_layers)
    bos_token_id: Optional[int] = 0
    eos_token_id: Optional[int] = 1
    pad_token_id: Optional[int] = None
    # --- where the model comes from (not architecture; see SOURCE_KEYS) ---
    init_from: Optional[str] = None    # start from weights: "hf:PATH" (HF dir) or "orbax:PATH" (r1jax ckpt)
    hf_config: Optional[str] = None    # load the keys above from an HF config.json first

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace


# Where a model comes from, not what it is: the two `model` keys that are not HF config keys.
SOURCE_KEYS = ("init_from", "hf_config")
# HF keys that a checkpoint may differ in and still hold this model's weights: initialisation,
# special token ids, the context length (rope is computed, never stored) and the MTP depth
# (modules a source lacks start fresh; extra ones are not read).
NOT_ARCHITECTURE = ("initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
                    "max_position_embeddings", "num_nextn_predict_layers")
# Keys that left the `model` section: a config that still sets one is refused with its new place.
MOVED = {"model.mtp_loss_weight": "loss.mtp_loss_weight", "model.seq_aux_loss_alpha": "loss.seq_aux_loss_alpha",
         "model.bias_update_rate": "optim.bias_update_rate", "model.moe_dispatch": "kernels.moe_dispatch",
         "model.capacity_factor": "kernels.capacity_factor", "model.moe_tile_size": "kernels.moe_tile_size",
         "model.attention": "kernels.attention", "model.attention_block": "kernels.attention_block"}


def hf_keys() -> list[str]:
    """The ModelConfig keys that are HF `DeepseekV3Config` keys (all but SOURCE_KEYS)."""
    return [f.name for f in dataclasses.fields(ModelConfig) if f.name not in SOURCE_KEYS]


def architecture(m: ModelConfig) -> dict[str, Any]:
    """The one definition of what makes a checkpoint's architecture: the keys that fix its
    parameters' shapes and meaning. Two configs with equal architectures share weights."""
    d = to_dict(m)
    return {k: d[k] for k in hf_keys() if k not in NOT_ARCHITECTURE}


def check_same_architecture(ours: ModelConfig, theirs: ModelConfig, where: str, key: str) -> None:
    """ConfigError (one line, naming `key`) when `theirs`, read from `where`, is another architecture."""
    a, b = architecture(ours), architecture(theirs)
    for k, v in a.items():
        if b[k] != v:
            raise ConfigError(f"{key}: {where} has {k}={b[k]} but the config says {k}={v}")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """How the model's compute runs; never what it computes (every choice is held to the others)."""
    attention: AttentionImpl = AttentionImpl.dense  # MLA's softmax(qk)v core
    attention_block: int = 512         # positions per query/key block for attention=flash
    moe_dispatch: MoEDispatch = MoEDispatch.auto
    moe_tile_size: int = 64            # rows per expert tile for moe_dispatch=dropless
    capacity_factor: float = 1.25      # only for moe_dispatch=capacity
    moe_buffer_factor: float = 0.0     # moe_dispatch=alltoall: pairs one shard sends another, x the balanced
                                       # T*k/ep; 0: min(ep, E/k), which never drops (hierarchical: both levels)
    moe_nodes: int = 0                 # moe_dispatch=hierarchical: nodes the expert axis spans (0: mesh.dcn_expert)
    moe_exchange_fp8: bool = False     # alltoall, hierarchical: rows to the experts (and their output gradients)
                                       # as FP8 e4m3 with a scale per 128 channels, as DeepSeek-V3 dispatches
    moe_chunks: int = 1                # a MoE layer's routed experts run over its sequence in this many chunks, one
                                       # after another, each recomputed in the backward: 1/chunks of the buffers


@dataclasses.dataclass(frozen=True)
class InferConfig:
    """Generation (r1jax/infer): how prefill and decode compute. Sampling is per request."""
    dtype: DType = DType.fp32          # compute dtype (parameters stay fp32 masters)
    cache_dtype: DType = DType.bf16    # the latent cache's storage dtype
    batch_size: int = 8                # rows decoded together (generate --batch-size)
    max_len: int = 0                   # cache positions per row; 0: the bucket of prompt + new tokens
    decode_chunk: int = 16             # decode steps per dispatch (output streams per chunk)
    moe_decode: MoEDispatch = MoEDispatch.auto   # routed experts at decode; auto: by batch bucket
    decode_tile: int = 8               # expert tile rows at decode for a named moe_decode (auto sizes its own)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    objective: ObjectiveKind = ObjectiveKind.lm
    mtp_loss_weight: float = 0.3       # lambda in L = L_main + lambda/D * sum_k L_mtp^k
    seq_aux_loss_alpha: float = 0.0001 # alpha of the sequence-wise MoE balance loss (0: off)


# LoRA targets: HF DeepseekV3 module names (what PEFT's adapter_config.json names), plus three
# groups of SwiGLU projections. q_proj stands for the query projection of a q_lora_rank=null
# model, where HF has one q_proj instead of q_a_proj + q_b_proj.
LORA_ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
LORA_TARGETS = ("q_proj", *LORA_ATTENTION, "mlp", "shared_experts", "experts")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (r1jax/model/lora.py): with rank > 0 only the adapters train; the base
    weights are frozen (no gradient, no optimizer state)."""
    rank: int = 0                      # 0: no LoRA (full fine-tuning or pre-training)
    alpha: float = 16.0                # the update is (alpha / rank) * x A B (alpha / sqrt(rank) with rslora)
    targets: list[str] = dataclasses.field(default_factory=lambda: list(LORA_ATTENTION))
    dropout: float = 0.0               # on the adapter's input, training only
    rslora: bool = False               # rank-stabilised scaling alpha / sqrt(rank)
    base_dtype: DType = DType.fp32     # storage of the frozen base weights: fp32 or bf16

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Logit distillation (loss.objective=kd): a frozen teacher's token distributions as targets."""
    teacher: Optional[str] = None      # orbax:DIR or hf:DIR, same vocabulary as the student
    loss: KDLoss = KDLoss.forward_kl
    temperature: float = 1.0           # both distributions softened by T; the term is scaled by T^2
    beta: float = 0.5                  # jsd only: the mixture's teacher weight
    alpha: float = 1.0                 # loss = alpha * T^2 * divergence + (1 - alpha) * cross-entropy


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """GRPO (loss.objective=grpo): each step samples group_size completions for each of
    train.global_batch_size / group_size prompts with the generator on the current weights."""
    task: str = "reverse"              # a generated task of r1jax/data/tasks.py: reverse, arithmetic, countdown
    task_difficulty: dict[str, Any] = dataclasses.field(default_factory=dict)  # its difficulty keywords, for
    #   the rollouts' and the eval's prompts alike, e.g. {digits: 6}; {}: the task's defaults
    group_size: int = 8                # G completions per prompt
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    rewards: dict[str, float] = dataclasses.field(default_factory=lambda: {"task_partial": 1.0})
    eval_reward: str = "task_exact"    # eval's reward_mean: this reward on held-out prompts, greedy
    eval_prompts: int = 32
    beta: float = 0.001                # k3 KL to the reference (the starting weights); 0: no reference
    clip_low: float = 0.2              # ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO's clip-higher: 0.28)
    clip_high: float = 0.2
    advantage: Advantage = Advantage.std
    loss_agg: LossAgg = LossAgg.token
    dynamic_sampling: bool = False     # drop groups whose rewards are all equal (their advantage is 0)
    resample_rounds: int = 0           # with dynamic_sampling: up to N more rounds of prompts replace those groups (DAPO)
    overlong_buffer: int = 0           # DAPO's soft overlong penalty over the last N tokens (0: off)
    overlong_penalty: float = 1.0      # ... reaching -overlong_penalty at max_new_tokens
    routing_replay: bool = False       # Rollout Routing Replay: the update uses the rollout's expert choices


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes; one axis may be -1, meaning all remaining devices.

    `dcn_<axis>`: how many nodes the axis spans, each process counting as a node (so run one
    process per node); the rest of it, <axis> / dcn_<axis>, stays inside each one, on its fast links. All 1
    (the default): devices are laid out in `jax.devices()` order, the first axis outermost. See
    r1jax/parallel/mesh.py."""
    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    pipeline: int = 1
    dcn_data: int = 1
    dcn_fsdp: int = 1
    dcn_tensor: int = 1
    dcn_expert: int = 1
    dcn_pipeline: int = 1
    expert_fsdp: bool = False      # the expert axis also shards the other weights, as fsdp does (parallel/mesh.py)


MESH_AXES = ("data", "fsdp", "tensor", "expert", "pipeline")


def dcn_sizes(mesh: MeshConfig) -> dict[str, int]:
    """{axis: nodes it spans} (mesh.dcn_<axis>)."""
    return {a: getattr(mesh, f"dcn_{a}") for a in MESH_AXES}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: DataSource = DataSource.stdlib
    paths: list[str] = dataclasses.field(default_factory=list)
    seq_len: int = 256
    tokenizer: Optional[str] = None   # tokenizer.json (or a directory holding one); None: train BPE
    tokenizer_train_mb: float = 8.0    # corpus megabytes used to train the BPE tokenizer
    eval_fraction: float = 0.01        # documents held out for eval
    text_mode: TextMode = TextMode.document  # data.source=text/stdlib: a file or a line is a document
    text_field: str = "text"           # jsonl/parquet/arrayrecord: the field or column holding the text
    block_size: int = 0                # split documents into blocks of at most this many tokens (0: off)
    clean: bool = False                # NFC, \r\n -> \n, strip line ends, drop control characters
    workers: int = 0                   # Grain worker processes (mp_prefetch); 0: read in-process
    sft_turns: str = "last"            # loss.objective=sft: train the last assistant turn, or all of them
    task: str = "reverse"              # data.source=task: reverse, arithmetic or countdown
    task_examples: int = 2000          # data.source=task: examples generated (train split, from train.seed)
    task_difficulty: dict[str, Any] = dataclasses.field(default_factory=dict)  # data.source=task: the task's
    #   difficulty keywords (r1jax/data/tasks.py), e.g. {digits: [3, 5]}; {}: the task's defaults


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1          # cosine floor = lr * min_lr_ratio
    warmup_ratio: float = 0.05         # of train.steps
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0             # global-norm clipping; 0 disables
    moment_dtype: DType = DType.fp32   # storage of AdamW's mu and nu: fp32 or bf16 (DeepSeek-V3's choice)
    zero1: bool = False                # ZeRO-1: shard moments and fp32 masters over mesh.data too
    bias_update_rate: float = 0.001    # gamma of the aux-loss-free router-bias update (0: frozen)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    global_batch_size: int = 8
    log_every: int = 10
    eval_every: int = 0                # 0: eval only at the end
    eval_batches: int = 4
    dtype: DType = DType.fp32
    remat: Remat = Remat.none
    grad_accum: int = 1                # microbatches per step (scanned); global batch = A x microbatch
    loss_scale_init: float = 65536.0   # fp16 only: dynamic loss scaling as torch's GradScaler
    loss_scale_growth_interval: int = 2000
    stop_at: int = 0                   # stop (with a checkpoint) after this step; 0: run to train.steps
    stop_at_eval_loss: float = 0.0     # the run is done at the first eval (train.eval_every) whose held-out loss
    #   is at or below this: a model trained to a quality rather than a step count (R1's cold start); 0: off
    microbatches: int = 1              # pipeline microbatches per (grad_accum) microbatch; mesh.pipeline > 1 only
    # the final norm, head, MTP modules and loss run on the rows in this many sequential chunks, each
    # recomputed in the backward: logits and the MTP blocks' working set shrink by it (r1jax/train/step.py)
    epilogue_chunks: int = 1
    seed: int = 0
    # bad steps (r1jax/train/guard.py): a non-finite loss or gradient skips the update in the step
    max_bad_steps: int = 3             # this many in a row: roll back to the last good checkpoint
    max_rollbacks: int = 5             # more than this many rollbacks in one run: stop with an error
    spike_policy: SpikePolicy = SpikePolicy.warn
    spike_zscore: float = 6.0          # a step's loss this many standard deviations above the window's mean
    spike_window: int = 100            # steps of loss history the z-score is taken over (judged after 20)
    grad_norm_window: int = 100        # steps of gradient-norm history for the anomaly alert
    grad_norm_std_alert: float = 0.5   # alert when the window's gradient-norm std exceeds this; 0: off
    alert_command: Optional[str] = None  # run (sh -c) on each alert, with R1JAX_ALERT_* in its environment
    inject_faults: list[str] = dataclasses.field(default_factory=list)  # fire drills: nan_data@S, nan_param@S, spike@S, stall@S
    watchdog_factor: float = 10.0      # report a step slower than this x the median step time; 0: off
    watchdog_min_s: float = 60.0       # ... and never before this many seconds without progress
    watchdog_stacks: bool = False      # the report includes every thread's Python stack
    # live metrics (r1jax/train/exporter.py): Prometheus /metrics, off when the port is 0
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 1000
    keep: int = 3
    on_error: OnError = OnError.stop   # a write that fails (disk full, read-only): stop, or go on and retry


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism over mesh.pipeline stages (the MoE stack; see r1jax/parallel/pipeline.py)."""
    schedule: Schedule = Schedule.gpipe
    repeats: int = 1                   # circular only: virtual stages per device
    # gpipe/circular: keep only each tick's stage input for the backward and recompute the stage's
    # layers there (their own remat inside), not every layer's saved tensors of every tick: the
    # stack's residuals shrink by about `chunk` x, for one more forward of the stack
    stage_remat: bool = False


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs (launched by r1jax.launch or srun); ignored by a single process."""
    init_timeout_s: int = 300          # every process must join within this many seconds, else exit 1
    data_shards: int = 0               # training data shards, a multiple of the process count; 0: one per process
    heartbeat_timeout_s: int = 100     # a peer silent this long is taken as dead: the others exit 1 naming it


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    kernels: KernelConfig = dataclasses.field(default_factory=KernelConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    infer: InferConfig = dataclasses.field(default_factory=InferConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)


# ----------------------------------------------------------------------------------- loading
def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Config from a YAML file (may be None) plus `section.key=value` overrides; validated."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {path}: not valid YAML ({_first_line(e)})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"--config {path}: top level must be a mapping of sections "
                              f"({', '.join(_fields(Config))})")
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}': expected section.key=value")
    try:
        merged = OmegaConf.merge(OmegaConf.create(raw), OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_line(e)) from None
    tree = OmegaConf.to_container(merged)
    _refuse_moved(tree)
    model = tree.get("model")
    if isinstance(model, dict) and model.get("hf_config"):
        tree["model"] = {**model_dict_from_hf(model["hf_config"]), **model}
    return from_dict(tree)


def _refuse_moved(tree: dict[str, Any]) -> None:
    for old, new in MOVED.items():
        section, key = old.split(".")
        if isinstance(tree.get(section), dict) and key in tree[section]:
            raise ConfigError(f"{old}: moved to {new} (the model section holds the architecture only)")


def from_dict(tree: dict[str, Any]) -> Config:
    """Typed, validated Config from a plain nested dict (e.g. a saved config.yaml)."""
    _refuse_moved(tree)
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), tree))
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_line(e)) from None
    validate(cfg)
    if cfg.kernels.moe_nodes == 0:          # the hierarchical exchange's nodes: those the expert axis spans
        cfg = dataclasses.replace(cfg, kernels=dataclasses.replace(cfg.kernels, moe_nodes=cfg.mesh.dcn_expert))
    return cfg


def model_from_dict(tree: dict[str, Any]) -> ModelConfig:
    """A validated ModelConfig alone (no run around it), e.g. from a checkpoint's config.json."""
    try:
        m = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), tree))
    except OmegaConfBaseException as e:
        raise ConfigError("model." + _omegaconf_line(e)) from None
    validate_model(m)
    return m


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict with enums as their string values (YAML/JSON friendly)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=lambda o: o.value))


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


_SECTION_TYPES = {"": Config, "model": ModelConfig, "kernels": KernelConfig, "loss": LossConfig,
                  "mesh": MeshConfig, "data": DataConfig,
                  "optim": OptimConfig, "train": TrainConfig, "checkpoint": CheckpointConfig,
                  "distributed": DistributedConfig, "pipeline": PipelineConfig,
                  "infer": InferConfig, "lora": LoraConfig, "distill": DistillConfig, "grpo": GRPOConfig,
                  "model.rope_scaling": RopeScaling}


def _omegaconf_line(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or ""
    msg = (getattr(e, "msg", None) or str(e)).strip().splitlines()[0]
    if msg.startswith("Key '") and "not in" in msg:
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        cls = _SECTION_TYPES.get(parent)
        if cls is None:
            return f"{key}: unknown key"
        close = difflib.get_close_matches(key.rsplit(".", 1)[-1], _fields(cls), n=1)
        hint = f"did you mean {close[0]}?" if close else f"allowed: {', '.join(_fields(cls))}"
        return f"{key}: unknown key; {hint}"
    if "is not a ListConfig" in msg:      # a list key given one value (data.paths=/x.jsonl)
        return f"{key}: expects a list; write {key}=[a,b] (brackets, even for one item)"
    return f"{key}: {msg}" if key else msg


# ------------------------------------------------------------------------ HF config.json keys
_HF_IGNORED = {  # keys HF itself ignores for DeepseekV3 or that do not change the math
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "pretraining_tp", "output_router_logits", "scoring_func", "topk_method",
    "aux_loss_alpha", "seq_aux", "ep_size", "moe_layer_freq", "quantization_config",
    "num_experts_per_tok_", "head_dim", "qk_head_dim", "_name_or_path", "router_aux_loss_coef",
    "initializer_factor", "id2label", "label2id", "return_dict", "output_hidden_states",
    "output_attentions", "tie_encoder_decoder", "is_encoder_decoder", "chunk_size_feed_forward",
    "problem_type", "add_cross_attention", "tokenizer_class", "prefix", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "max_length", "attention_dropout",
}


def model_dict_from_hf(path: str | Path) -> dict[str, Any]:
    """ModelConfig keys from an HF DeepseekV3 config.json (file or directory).

    Accepts both the official/4.x spelling (`rope_scaling` + top-level `rope_theta`) and the 5.x
    one (`rope_parameters` with `rope_theta` inside, `type` and/or `rope_type`)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"model.hf_config: {p} does not exist")
    try:
        hf = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.hf_config: {p} is not valid JSON ({e.msg})") from None
    if hf.get("model_type") not in (None, "deepseek_v3", "deepseek_v2"):
        raise ConfigError(f"model.hf_config: model_type '{hf.get('model_type')}' is not a "
                          f"DeepSeek-V3 config; allowed: deepseek_v3")
    if float(hf.get("attention_dropout") or 0.0) != 0.0:
        raise ConfigError("model.hf_config: attention_dropout must be 0 (r1jax trains without it)")
    known = set(_fields(ModelConfig))
    out: dict[str, Any] = {}
    rope = hf.get("rope_parameters") or hf.get("rope_scaling")
    for k, v in hf.items():
        if k in ("rope_parameters", "rope_scaling") or k in _HF_IGNORED:
            continue
        if k == "num_mtp_layers":
            k = "num_nextn_predict_layers"
        if k in known:
            out[k] = v
    if rope:
        rope = dict(rope)
        if "rope_theta" in rope:
            out["rope_theta"] = rope.pop("rope_theta")
        kind = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        rope.pop("type", None)
        rs_known = set(_fields(RopeScaling))
        unknown = sorted(set(rope) - rs_known)
        if unknown:
            raise ConfigError(f"model.hf_config: rope parameter '{unknown[0]}' is not supported; "
                              f"allowed: {', '.join(sorted(rs_known - {'type'}))}")
        out["rope_scaling"] = {"type": kind, **{k: v for k, v in rope.items() if v is not None}}
    if out.get("rope_scaling", {}).get("type") == "yarn":
        out["rope_scaling"].setdefault("original_max_position_embeddings",
                                       out.get("max_position_embeddings", 4096))
    return out


def hf_config_dict(m: ModelConfig) -> dict[str, Any]:
    """The config.json HF `DeepseekV3Config` expects for this model (5.x spelling)."""
    keys = [k for k in hf_keys() if k not in ("rope_scaling", "rope_theta", "num_nextn_predict_layers", "hidden_act")]
    d: dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    d.update({k: getattr(m, k) for k in keys})
    d["hidden_act"] = m.hidden_act.value
    d["num_nextn_predict_layers"] = m.num_nextn_predict_layers
    rope: dict[str, Any] = {"rope_theta": m.rope_theta, "rope_type": m.rope_scaling.type.value}
    if m.rope_scaling.type is RopeType.yarn:
        rs = m.rope_scaling
        rope.update(factor=rs.factor, original_max_position_embeddings=rs.original_max_position_embeddings,
                    beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, mscale=rs.mscale,
                    mscale_all_dim=rs.mscale_all_dim, truncate=rs.truncate)
        if rs.attention_factor is not None:
            rope["attention_factor"] = rs.attention_factor
    d["rope_parameters"] = rope
    d["dtype"] = "float32"
    return d


# --------------------------------------------------------------------------------- validation
def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def validate_model(m: ModelConfig) -> None:
    for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim",
                 "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok",
                 "max_position_embeddings"):
        _need(getattr(m, name) > 0, f"model.{name}={getattr(m, name)}: must be a positive integer")
    for name in ("n_shared_experts", "n_routed_experts", "first_k_dense_replace",
                 "num_nextn_predict_layers"):
        _need(getattr(m, name) >= 0, f"model.{name}={getattr(m, name)}: must be >= 0")
    _need(m.q_lora_rank is None or m.q_lora_rank > 0,
          f"model.q_lora_rank={m.q_lora_rank}: must be a positive integer or null")
    _need(m.num_key_value_heads == m.num_attention_heads,
          f"model.num_key_value_heads={m.num_key_value_heads}: MLA needs it equal to "
          f"model.num_attention_heads ({m.num_attention_heads})")
    _need(m.qk_rope_head_dim % 2 == 0,
          f"model.qk_rope_head_dim={m.qk_rope_head_dim}: must be even (RoPE rotates pairs)")
    _need(m.first_k_dense_replace <= m.num_hidden_layers,
          f"model.first_k_dense_replace={m.first_k_dense_replace}: must be <= "
          f"model.num_hidden_layers ({m.num_hidden_layers})")
    moe_used = m.num_moe_layers > 0 or m.num_nextn_predict_layers > 0
    if moe_used:
        E, G = m.n_routed_experts, m.n_group
        _need(E > 0, "model.n_routed_experts=0: MoE layers (or MTP blocks) need at least 2 experts")
        _need(E % G == 0, f"model.n_routed_experts={E}: must be divisible by model.n_group ({G})")
        _need(E // G >= 2, f"model.n_group={G}: each group needs >= 2 experts "
                           f"(group score = sum of its top 2); n_routed_experts is {E}")
        _need(m.topk_group <= G, f"model.topk_group={m.topk_group}: must be <= model.n_group ({G})")
        kept = m.topk_group * (E // G)
        _need(m.num_experts_per_tok <= kept,
              f"model.num_experts_per_tok={m.num_experts_per_tok}: must be <= the experts in the kept "
              f"groups (topk_group {m.topk_group} x {E // G} per group = {kept})")
    _need(m.rms_norm_eps > 0, f"model.rms_norm_eps={m.rms_norm_eps}: must be > 0")
    _need(m.rope_theta > 0, f"model.rope_theta={m.rope_theta}: must be > 0")
    _need(m.init_from is None or m.init_from.split(":", 1)[0] in ("hf", "orbax") and ":" in m.init_from,
          f"model.init_from={m.init_from}: must be hf:PATH or orbax:PATH")
    rs = m.rope_scaling
    if rs.type is RopeType.yarn:
        _need(rs.original_max_position_embeddings > 0,
              "model.rope_scaling.original_max_position_embeddings: must be > 0 for yarn")
        _need(rs.factor is None or rs.factor > 0,
              f"model.rope_scaling.factor={rs.factor}: must be > 0")
        _need(rs.beta_fast > rs.beta_slow > 0,
              f"model.rope_scaling.beta_fast={rs.beta_fast}: must be > beta_slow ({rs.beta_slow}) > 0")
    for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(m, tok)
        _need(v is None or 0 <= v < m.vocab_size,
              f"model.{tok}={v}: must be null or in [0, vocab_size={m.vocab_size})")


def validate_kernels(k: KernelConfig) -> None:
    for name in ("attention_block", "moe_tile_size", "moe_chunks"):
        _need(getattr(k, name) > 0, f"kernels.{name}={getattr(k, name)}: must be a positive integer")
    _need(k.capacity_factor > 0, f"kernels.capacity_factor={k.capacity_factor}: must be > 0")
    _need(k.moe_buffer_factor == 0 or k.moe_buffer_factor >= 1,
          f"kernels.moe_buffer_factor={k.moe_buffer_factor}: must be >= 1 (x the balanced load), or 0 for the "
          f"size that never drops")
    _need(k.moe_nodes >= 0, f"kernels.moe_nodes={k.moe_nodes}: must be >= 0 (0: mesh.dcn_expert)")
    _need(not k.moe_exchange_fp8 or k.moe_dispatch in (MoEDispatch.alltoall, MoEDispatch.hierarchical),
          f"kernels.moe_exchange_fp8=true: only for moe_dispatch=alltoall or hierarchical (the exchanges that send "
          f"rows to the experts), not {k.moe_dispatch.value}")
    _need(k.moe_dispatch is not MoEDispatch.grouped,
          "kernels.moe_dispatch=grouped: inference only (no gradient); training takes auto, dropless, ragged, "
          "capacity, loop, gather or dense (infer.moe_decode may name grouped)")


def validate_infer(i: InferConfig) -> None:
    for name in ("batch_size", "decode_chunk", "decode_tile"):
        _need(getattr(i, name) > 0, f"infer.{name}={getattr(i, name)}: must be a positive integer")
    _need(i.max_len >= 0, f"infer.max_len={i.max_len}: must be >= 0 (0: sized from the requests)")
    _need(i.moe_decode is not MoEDispatch.capacity,
          "infer.moe_decode=capacity: drops tokens; decoding must be exact (auto, grouped, gather, dense, dropless, ragged or loop)")


def validate_lora(lo: LoraConfig, m: ModelConfig) -> None:
    if lo.rank == 0:
        return
    _need(lo.rank > 0, f"lora.rank={lo.rank}: must be >= 0 (0: no LoRA)")
    _need(lo.alpha > 0, f"lora.alpha={lo.alpha}: must be > 0")
    _need(0 <= lo.dropout < 1, f"lora.dropout={lo.dropout}: must be in [0, 1)")
    _need(lo.dropout == 0 or "experts" not in lo.targets,
          f"lora.dropout={lo.dropout}: not with lora.targets experts (the routed experts' update is merged into "
          f"their weights, so there is no adapter input to drop; PEFT's target_parameters refuse it too)")
    _need(lo.base_dtype is not DType.fp16, "lora.base_dtype=fp16: must be fp32 or bf16")
    _need(len(lo.targets) > 0, f"lora.targets: at least one of {', '.join(LORA_TARGETS)}")
    for t in lo.targets:
        _need(t in LORA_TARGETS, f"lora.targets: '{t}' is not a target; allowed: {', '.join(LORA_TARGETS)}")
    if m.q_lora_rank is not None:
        _need("q_proj" not in lo.targets, f"lora.targets: q_proj exists only with model.q_lora_rank=null "
                                          f"(this model has q_a_proj and q_b_proj)")
    moe_used = m.num_moe_layers > 0 or m.num_nextn_predict_layers > 0
    _need("experts" not in lo.targets or moe_used, "lora.targets: experts needs MoE layers")
    _need("shared_experts" not in lo.targets or (m.num_moe_layers > 0 and m.n_shared_experts > 0),
          "lora.targets: shared_experts needs MoE layers with model.n_shared_experts > 0")
    _need("mlp" not in lo.targets or m.first_k_dense_replace > 0,
          "lora.targets: mlp (the dense layers' SwiGLU) needs model.first_k_dense_replace > 0")


FAULTS = ("nan_data", "nan_param", "spike", "stall")   # train.inject_faults kinds (r1jax/train/guard.py)


def validate(cfg: Config) -> None:
    m, mesh, d, o, t, c = cfg.model, cfg.mesh, cfg.data, cfg.optim, cfg.train, cfg.checkpoint
    validate_model(m)
    validate_kernels(cfg.kernels)
    validate_infer(cfg.infer)
    validate_lora(cfg.lora, m)
    ls = cfg.loss
    _need(ls.mtp_loss_weight >= 0, f"loss.mtp_loss_weight={ls.mtp_loss_weight}: must be >= 0")
    _need(ls.seq_aux_loss_alpha >= 0, f"loss.seq_aux_loss_alpha={ls.seq_aux_loss_alpha}: must be >= 0")
    _need(o.bias_update_rate >= 0, f"optim.bias_update_rate={o.bias_update_rate}: must be >= 0")
    moe_used = m.num_moe_layers > 0 or m.num_nextn_predict_layers > 0

    axes = {a: getattr(mesh, a) for a in MESH_AXES}
    for k, v in axes.items():
        _need(v == -1 or v >= 1, f"mesh.{k}={v}: must be a positive integer or -1 (the rest)")
    for k, v in dcn_sizes(mesh).items():
        _need(v >= 1, f"mesh.dcn_{k}={v}: must be a positive integer (the nodes mesh.{k} spans)")
        _need(axes[k] == -1 or axes[k] % v == 0,
              f"mesh.dcn_{k}={v}: must divide mesh.{k} ({axes[k]}); the rest of the axis stays inside a node")
    _need(sum(v == -1 for v in axes.values()) <= 1,
          f"mesh: at most one axis may be -1; got {[k for k, v in axes.items() if v == -1]}")
    if mesh.tensor > 1:
        _need(m.num_attention_heads % mesh.tensor == 0,
              f"mesh.tensor={mesh.tensor}: must divide model.num_attention_heads ({m.num_attention_heads})")
    if mesh.fsdp > 1:
        for key in ("hidden_size", "q_lora_rank", "kv_lora_rank"):
            v = getattr(m, key)
            _need(v is None or v % mesh.fsdp == 0,
                  f"mesh.fsdp={mesh.fsdp}: must divide model.{key} ({v}); fsdp shards those dimensions")
    if mesh.pipeline > 1 and mesh.fsdp >= 1:
        # outside the pipelined stack `pipeline` shards the parameters as fsdp does (parallel/mesh.py)
        k = mesh.fsdp * mesh.pipeline
        for key in ("hidden_size", "q_lora_rank", "kv_lora_rank"):
            v = getattr(m, key)
            _need(v is None or v % k == 0,
                  f"mesh.fsdp x mesh.pipeline = {k}: must divide model.{key} ({v}); outside the pipelined MoE "
                  f"stack both shard those dimensions of the parameters")
    if mesh.expert > 1 and moe_used:
        _need(m.n_routed_experts % mesh.expert == 0,
              f"mesh.expert={mesh.expert}: must divide model.n_routed_experts ({m.n_routed_experts})")
    nodes = cfg.kernels.moe_nodes or mesh.dcn_expert
    if cfg.kernels.moe_dispatch is MoEDispatch.hierarchical and mesh.expert != -1:
        _need(mesh.expert % nodes == 0,
              f"kernels.moe_nodes={nodes}: must divide mesh.expert ({mesh.expert}); the hierarchical exchange "
              f"splits the expert axis into that many nodes of equal size")

    _need(d.seq_len >= 2, f"data.seq_len={d.seq_len}: must be >= 2 (next-token targets)")
    if cfg.kernels.moe_chunks > 1 and moe_used:
        _need(d.seq_len % cfg.kernels.moe_chunks == 0,
              f"kernels.moe_chunks={cfg.kernels.moe_chunks}: must divide data.seq_len ({d.seq_len}); each chunk "
              f"is an equal slice of every row")
        _need(cfg.kernels.moe_dispatch is not MoEDispatch.capacity,
              "kernels.moe_chunks > 1: not with moe_dispatch=capacity, whose expert capacity is a share of "
              "all the layer's tokens (a chunk's would drop other pairs)")
    _need(d.seq_len <= m.max_position_embeddings,
          f"data.seq_len={d.seq_len}: must be <= model.max_position_embeddings ({m.max_position_embeddings})")
    _need(0.0 <= d.eval_fraction < 1.0, f"data.eval_fraction={d.eval_fraction}: must be in [0, 1)")
    _need(d.tokenizer_train_mb > 0, f"data.tokenizer_train_mb={d.tokenizer_train_mb}: must be > 0")
    if d.source in (DataSource.stdlib, DataSource.task):
        _need(not d.paths, "data.paths: only used with data.source=text, jsonl, parquet or arrayrecord")
    else:
        _need(len(d.paths) > 0, f"data.paths: data.source={d.source.value} needs at least one file or glob")
    _need(d.text_mode is TextMode.document or d.source in (DataSource.text, DataSource.stdlib),
          f"data.text_mode={d.text_mode.value}: only applies to data.source=text or stdlib")
    _need(d.text_field != "", "data.text_field: must name a field or column")
    _need(d.block_size >= 0, f"data.block_size={d.block_size}: must be >= 0 (0: no splitting)")
    _need(d.workers >= 0, f"data.workers={d.workers}: must be >= 0 (0: read in-process)")
    _need(d.sft_turns in ("last", "all"), f"data.sft_turns={d.sft_turns}: must be last or all")
    if ls.objective in (ObjectiveKind.sft, ObjectiveKind.kd):
        _need(d.source in (DataSource.jsonl, DataSource.task),
              f"loss.objective={ls.objective.value}: reads chat records: data.source=jsonl with data.paths, or "
              f"data.source=task (not {d.source.value})")
    else:
        _need(d.source is not DataSource.task, f"data.source=task: chat records for loss.objective=sft or kd "
                                               f"(not {ls.objective.value})")
    _need(d.task_examples > 0, f"data.task_examples={d.task_examples}: must be positive")
    _need(not d.task_difficulty or d.source is DataSource.task,
          f"data.task_difficulty: only used with data.source=task (not {d.source.value})")
    kd = cfg.distill
    if ls.objective is ObjectiveKind.kd:
        _need(kd.teacher is not None and kd.teacher.split(":", 1)[0] in ("hf", "orbax") and ":" in kd.teacher,
              f"distill.teacher={kd.teacher}: loss.objective=kd needs the teacher as hf:PATH or orbax:PATH")
    _need(kd.temperature > 0, f"distill.temperature={kd.temperature}: must be > 0")
    _need(0 < kd.beta < 1, f"distill.beta={kd.beta}: must be in (0, 1) (0 and 1 are forward_kl and reverse_kl)")
    _need(0 <= kd.alpha <= 1, f"distill.alpha={kd.alpha}: must be in [0, 1]")
    g = cfg.grpo
    if ls.objective is ObjectiveKind.grpo:
        _need(g.group_size >= 2, f"grpo.group_size={g.group_size}: must be >= 2 (advantages compare a group)")
        _need(t.global_batch_size % g.group_size == 0,
              f"train.global_batch_size={t.global_batch_size}: must be a multiple of grpo.group_size ({g.group_size}): "
              f"each step holds global_batch_size / group_size prompts x group_size completions")
        _need(g.max_new_tokens >= 1, f"grpo.max_new_tokens={g.max_new_tokens}: must be >= 1")
        _need(g.temperature > 0, f"grpo.temperature={g.temperature}: must be > 0 (rollouts sample)")
        _need(0 < g.top_p <= 1, f"grpo.top_p={g.top_p}: must be in (0, 1]")
        _need(g.beta >= 0, f"grpo.beta={g.beta}: must be >= 0")
        _need(g.clip_low >= 0 and g.clip_high >= 0, "grpo.clip_low, grpo.clip_high: must be >= 0")
        _need(g.resample_rounds >= 0, f"grpo.resample_rounds={g.resample_rounds}: must be >= 0")
        _need(g.resample_rounds == 0 or g.dynamic_sampling,
              f"grpo.resample_rounds={g.resample_rounds}: replaces the groups dynamic sampling drops; "
              f"set grpo.dynamic_sampling=true too (or resample_rounds=0)")
        _need(0 <= g.overlong_buffer < g.max_new_tokens, f"grpo.overlong_buffer={g.overlong_buffer}: must be in "
                                                         f"[0, grpo.max_new_tokens={g.max_new_tokens})")
        _need(g.eval_prompts >= 0, f"grpo.eval_prompts={g.eval_prompts}: must be >= 0")
        _need(mesh.pipeline == 1, "loss.objective=grpo: rollouts run the model as one stage; use mesh.pipeline=1")
        _need(not g.routing_replay or m.num_moe_layers > 0,
              f"grpo.routing_replay=true: the model has no MoE layer (model.first_k_dense_replace="
              f"{m.first_k_dense_replace} of {m.num_hidden_layers} layers); set it false")
    if d.tokenizer is None:
        _need(m.vocab_size >= 260, f"model.vocab_size={m.vocab_size}: a trained byte-level BPE needs "
                                   f">= 260 (256 bytes + special tokens)")

    _need(o.lr >= 0, f"optim.lr={o.lr}: must be >= 0")
    _need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")
    _need(0 <= o.warmup_ratio < 1, f"optim.warmup_ratio={o.warmup_ratio}: must be in [0, 1)")
    _need(0 <= o.b1 < 1, f"optim.b1={o.b1}: must be in [0, 1)")
    _need(0 <= o.b2 < 1, f"optim.b2={o.b2}: must be in [0, 1)")
    _need(o.eps > 0, f"optim.eps={o.eps}: must be > 0")
    _need(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay}: must be >= 0")
    _need(o.clip_norm >= 0, f"optim.clip_norm={o.clip_norm}: must be >= 0 (0 disables clipping)")
    _need(o.moment_dtype is not DType.fp16, "optim.moment_dtype=fp16: must be fp32 or bf16 (fp16's range "
                                            "cannot hold squared gradients)")

    _need(t.steps > 0, f"train.steps={t.steps}: must be a positive integer")
    _need(t.global_batch_size > 0, f"train.global_batch_size={t.global_batch_size}: must be positive")
    _need(t.log_every > 0, f"train.log_every={t.log_every}: must be a positive integer")
    _need(t.eval_every >= 0, f"train.eval_every={t.eval_every}: must be >= 0 (0: only at the end)")
    _need(t.eval_batches >= 0, f"train.eval_batches={t.eval_batches}: must be >= 0")
    _need(t.stop_at >= 0, f"train.stop_at={t.stop_at}: must be >= 0 (0: run to train.steps)")
    _need(t.stop_at_eval_loss >= 0, f"train.stop_at_eval_loss={t.stop_at_eval_loss}: must be >= 0 (0: off)")
    _need(not t.stop_at_eval_loss or (t.eval_every > 0 and t.eval_batches > 0),
          f"train.stop_at_eval_loss={t.stop_at_eval_loss}: needs evals during the run (train.eval_every > 0 and "
          f"train.eval_batches > 0)")
    _need(not t.stop_at_eval_loss or ls.objective is not ObjectiveKind.grpo,
          f"train.stop_at_eval_loss: GRPO's evals score rewards, not a loss (loss.objective=grpo)")
    _need(t.grad_accum >= 1, f"train.grad_accum={t.grad_accum}: must be a positive integer")
    _need(t.loss_scale_init > 0, f"train.loss_scale_init={t.loss_scale_init}: must be > 0")
    _need(t.loss_scale_growth_interval >= 1,
          f"train.loss_scale_growth_interval={t.loss_scale_growth_interval}: must be a positive integer")
    _need(t.global_batch_size % t.grad_accum == 0,
          f"train.global_batch_size={t.global_batch_size}: must be divisible by train.grad_accum ({t.grad_accum})")
    batch_shards = math.prod(v for k, v in axes.items() if k in ("data", "fsdp", "expert") and v > 0)
    row_shards = batch_shards * max(axes["pipeline"], 1)     # outside the stages the batch is over pipeline too
    _need((t.global_batch_size // t.grad_accum) % row_shards == 0,
          f"train.global_batch_size={t.global_batch_size}: each of the {t.grad_accum} microbatches must be "
          f"divisible by the batch shards mesh.data x mesh.fsdp x mesh.expert x mesh.pipeline ({row_shards})")
    _need(t.microbatches >= 1, f"train.microbatches={t.microbatches}: must be a positive integer")
    per_micro = t.global_batch_size // t.grad_accum
    _need(per_micro % t.microbatches == 0 and (per_micro // t.microbatches) % batch_shards == 0,
          f"train.microbatches={t.microbatches}: each of the {t.grad_accum} x {t.microbatches} pipeline "
          f"microbatches of train.global_batch_size={t.global_batch_size} must be divisible by the batch "
          f"shards mesh.data x mesh.fsdp x mesh.expert ({batch_shards})")
    n = t.epilogue_chunks
    _need(n >= 1, f"train.epilogue_chunks={n}: must be a positive integer")
    _need(per_micro % (n * row_shards) == 0,
          f"train.epilogue_chunks={n}: each of the {t.grad_accum} microbatches of train.global_batch_size="
          f"{t.global_batch_size} must split into {n} chunks divisible by the batch shards mesh.data x mesh.fsdp "
          f"x mesh.expert x mesh.pipeline ({row_shards})")
    pp = cfg.pipeline
    _need(n == 1 or mesh.pipeline == 1 or pp.schedule is not Schedule.onefoneb,
          f"train.epilogue_chunks={n}: pipeline.schedule=1f1b already runs the epilogue on one pipeline "
          f"microbatch's rows at a time (1/mesh.pipeline of them a stage)")
    _need(pp.repeats >= 1, f"pipeline.repeats={pp.repeats}: must be a positive integer")
    _need(not (pp.stage_remat and pp.schedule is Schedule.onefoneb),
          "pipeline.stage_remat=true: 1f1b already keeps only each stage's input and recomputes the stage in "
          "its backward (stage_remat is for gpipe and circular)")
    _need(pp.repeats == 1 or pp.schedule is Schedule.circular,
          f"pipeline.repeats={pp.repeats}: only the circular schedule has repeats (pipeline.schedule="
          f"{pp.schedule.value})")
    if mesh.pipeline != 1:
        _need(m.num_moe_layers > 0, f"mesh.pipeline={mesh.pipeline}: the pipeline splits the MoE layers into "
                                    f"stages, and this model has none (num_hidden_layers = first_k_dense_replace)")
    if mesh.pipeline > 1:
        if pp.schedule is Schedule.onefoneb:
            # 1F1B shares the last stage's epilogue out over the stages by rows of a data shard
            data_rows = per_micro // t.microbatches // max(axes["data"], 1)
            _need(data_rows % mesh.pipeline == 0,
                  f"train.microbatches={t.microbatches}: under pipeline.schedule=1f1b each pipeline microbatch's "
                  f"rows on one data shard ({data_rows}) must be divisible by mesh.pipeline={mesh.pipeline} (the "
                  f"stages share the epilogue by rows); use fewer microbatches or a larger global batch")
        _need(pp.schedule is not Schedule.circular or t.microbatches >= mesh.pipeline,
              f"train.microbatches={t.microbatches}: the circular schedule needs at least mesh.pipeline="
              f"{mesh.pipeline} microbatches")
    _need(c.every > 0, f"checkpoint.every={c.every}: must be a positive integer")
    _need(c.keep > 0, f"checkpoint.keep={c.keep}: must be a positive integer")
    _need(t.max_bad_steps >= 1, f"train.max_bad_steps={t.max_bad_steps}: must be a positive integer")
    _need(t.max_rollbacks >= 0, f"train.max_rollbacks={t.max_rollbacks}: must be >= 0")
    _need(t.spike_zscore > 0, f"train.spike_zscore={t.spike_zscore}: must be > 0")
    _need(t.spike_window >= 20, f"train.spike_window={t.spike_window}: must be >= 20 steps")
    _need(t.grad_norm_window >= 2, f"train.grad_norm_window={t.grad_norm_window}: must be >= 2 steps")
    _need(t.grad_norm_std_alert >= 0, f"train.grad_norm_std_alert={t.grad_norm_std_alert}: must be >= 0 (0: off)")
    _need(t.watchdog_factor == 0 or t.watchdog_factor > 1,
          f"train.watchdog_factor={t.watchdog_factor}: must be > 1 (times the median step time) or 0 (off)")
    _need(t.watchdog_min_s >= 0, f"train.watchdog_min_s={t.watchdog_min_s}: must be >= 0")
    _need(0 <= t.metrics_port < 65536, f"train.metrics_port={t.metrics_port}: must be a TCP port (0: off)")
    for f in t.inject_faults:
        kind, _, at = f.partition("@")
        _need(kind in FAULTS and at.isdigit() and int(at) >= 1,
              f"train.inject_faults: '{f}' is not KIND@STEP with KIND one of {', '.join(FAULTS)} and STEP >= 1")
    dist = cfg.distributed
    _need(dist.init_timeout_s > 0, f"distributed.init_timeout_s={dist.init_timeout_s}: must be a positive integer")
    _need(dist.heartbeat_timeout_s > 0,
          f"distributed.heartbeat_timeout_s={dist.heartbeat_timeout_s}: must be a positive integer")
    _need(dist.data_shards >= 0, f"distributed.data_shards={dist.data_shards}: must be >= 0 (0: one per process)")
    _need(dist.data_shards == 0 or t.global_batch_size % dist.data_shards == 0,
          f"distributed.data_shards={dist.data_shards}: must divide train.global_batch_size ({t.global_batch_size})")


def resolve_mesh_shape(mesh: MeshConfig, num_devices: int) -> dict[str, int]:
    """Mesh axis sizes with -1 filled in; ConfigError when they cannot cover `num_devices`."""
    axes = {a: getattr(mesh, a) for a in MESH_AXES}
    fixed = math.prod(v for v in axes.values() if v != -1)
    free = [k for k, v in axes.items() if v == -1]
    if free:
        if num_devices % fixed:
            raise ConfigError(f"mesh.{free[0]}=-1: the other axes multiply to {fixed}, which does not "
                              f"divide the {num_devices} devices")
        axes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(f"mesh: data x fsdp x tensor x expert x pipeline = {fixed}, but there are "
                          f"{num_devices} devices; make the product equal or set one axis to -1")
    return axes

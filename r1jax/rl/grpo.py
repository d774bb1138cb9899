"""GRPO (loss.objective=grpo): R1's RL stage on r1jax's own rollouts, on the same loop as training.

Each step (`Rollouts.__next__`, the batches `train.loop.run` reads):
1. P = train.global_batch_size / grpo.group_size prompts of a generated task (data/tasks.py),
   drawn from (train.seed, step), rendered with the chat template as serving renders them;
2. the generator (r1jax/infer) samples G completions each, on the policy's *current* weights on
   the run's mesh (`Generator.load` swaps the arrays; nothing is shipped, nothing recompiles),
   with each token's log-probability (the ratio's old policy);
3. rewards on the decoded text (rl/rewards.py and the task's; DAPO's soft overlong penalty),
   advantages per group (`advantages`), groups of equal rewards dropped from the loss with
   `grpo.dynamic_sampling` (with `grpo.resample_rounds`, replaced from further rounds of prompts);
4. one row per completion (prompt + completion, loss mask on the completion's tokens, its EOS
   included), and the reference's log-probs when grpo.beta > 0 (`place`, a jitted forward of
   the starting weights: for a LoRA run, the LoRA-off base). With grpo.routing_replay (Rollout
   Routing Replay) the rows carry the rollout's expert ids, and the update and the reference
   route every fed token as the generator did.
The update is the train step with the GRPO objective (train/objectives.GRPO). Checkpoints,
resume (the rollout stream restarts at the saved step, seeded by it), the metrics writer and
SIGTERM are the trainer's. Eval (`RewardEval`) decodes held-out prompts greedily before the
first update, every train.eval_every steps and at the end, and writes `reward_mean` (the
grpo.eval_reward) with "split": "eval".
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from r1jax import config as configlib
from r1jax import weights
from r1jax.checkpoint.manager import Checkpointer
from r1jax.config import Advantage, Config, ConfigError
from r1jax.data import chat, tasks
from r1jax.data import tokenizer as toklib
from r1jax.infer.generator import Generator, Request
from r1jax.model import lora as loralib
from r1jax.model.params import count as count_params
from r1jax.parallel import mesh as meshlib
from r1jax.rl import rewards as rewardlib
from r1jax.train import loop, trainer
from r1jax.train import state as statelib
from r1jax.train.metrics import MetricsWriter, log_line
from r1jax.train.objectives import make as make_objective
from r1jax.train.objectives import token_logp
from r1jax.train.optim import make as make_optimizer
from r1jax.train.step import make_train_step

KEYS = ("ids", "segment_ids", "positions", "loss_mask", "advantages", "old_logp")


def advantages(rewards_PG: np.ndarray, kind: Advantage = Advantage.std, eps: float = 1e-4) -> np.ndarray:
    """[P, G]: r - the group's mean, divided by (its std with ddof 1 + eps) for `std` (TRL's
    GRPO), not divided for `mean` (Dr. GRPO). A group of equal rewards gets 0 either way."""
    r = np.asarray(rewards_PG, np.float64)
    a = r - r.mean(axis=1, keepdims=True)
    if kind is Advantage.std:
        a = a / (r.std(axis=1, ddof=1, keepdims=True) + eps)
    return a.astype(np.float32)


def overlong(lengths: np.ndarray, max_new: int, buffer: int, penalty: float) -> np.ndarray:
    """DAPO's soft overlong punishment: 0 up to max_new - buffer tokens, then falling linearly
    to -penalty at max_new."""
    if buffer <= 0:
        return np.zeros(len(lengths), np.float32)
    over = np.clip(np.asarray(lengths) - (max_new - buffer), 0, buffer)
    return (-penalty * over / buffer).astype(np.float32)


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "little") & 0x7FFFFFFF


def policy_state(state: dict, cfg: Config) -> nnx.State:
    """The train state's weights as the plain model the generator runs: adapters merged, no MTP
    modules (rollouts never draft)."""
    flat = dict(nnx.to_flat_state(state["params"])) | dict(nnx.to_flat_state(state["rest"]))
    merged = nnx.from_flat_state([(p, v) for p, v in flat.items() if p[0] != "mtp"])
    return loralib.merged_state(merged, cfg.lora.scale) if cfg.lora.rank else merged


@dataclasses.dataclass
class Prompts:
    """A task's prompts as token ids (rendered with the chat template, as serving renders them)."""
    task: str
    tok: Any
    template: chat.Template

    def encode(self, examples: list[dict]) -> list[list[int]]:
        return [self.tok.encode(self.template.render([{"role": "user", "content": ex["prompt"]}]),
                                add_special_tokens=False).ids for ex in examples]


ROW_BUCKET = 32       # GRPO rows are padded to a multiple of this (data.seq_len caps them)


def step_examples(cfg: Config, step: int, rnd: int, n: int) -> list[dict]:
    """The n task problems GRPO poses at `step` (round `rnd` > 0: DAPO's resampling draws)."""
    return tasks.generate(cfg.grpo.task, n, seed=_seed(cfg.train.seed, "grpo", step, *((rnd,) if rnd else ())),
                          **cfg.grpo.task_difficulty)


def eval_examples(cfg: Config) -> list[dict]:
    """The held-out problems RewardEval scores: grpo.eval_prompts of the eval split."""
    g = cfg.grpo
    return tasks.generate(g.task, g.eval_prompts, seed=_seed(cfg.train.seed, "eval"), split="eval", **g.task_difficulty)


class Rollouts(grain.DatasetIterator):
    """The GRPO batches: each `next` rolls out on `current()`'s weights (the loop asks for a batch
    only after the previous step returned). State: the step, so a resumed run continues its
    stream of prompts and seeds exactly."""

    def __init__(self, cfg: Config, prompts: Prompts, gen: Generator, current: Callable[[], dict], step: int,
                 reward: rewardlib.Combined | None = None,
                 examples: Callable[[int, int, int], list[dict]] | None = None):
        super().__init__()
        self.cfg, self.prompts, self.gen, self.current, self.step = cfg, prompts, gen, current, step
        g = cfg.grpo
        # the task's prompts and grpo.rewards unless given (tests pose other problems);
        # examples(step, round, n): round 0 is the step's own draw, rounds 1.. DAPO's resampling
        self.reward = reward or rewardlib.combine(dict(g.rewards), {**rewardlib.REWARDS, **tasks.TASK_REWARDS})
        self.examples = examples or (lambda step, rnd, n: step_examples(cfg, step, rnd, n))
        self.metrics: dict[str, float] = {}

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])

    def _round(self, rnd: int, P: int):
        """P prompts of this step's round `rnd`, G completions each on the current weights: (prompt
        ids, completions, per-completion reward parts, total rewards, lengths)."""
        cfg, g = self.cfg, self.cfg.grpo
        G = g.group_size
        examples = self.examples(self.step, rnd, P)
        ids = self.prompts.encode(examples)
        extra = (rnd,) if rnd else ()                 # round 0 keeps the seeds a step always had
        reqs = [Request(tuple(p), max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                        seed=_seed(cfg.train.seed, self.step, i, k, *extra), logprobs=0, routing=g.routing_replay)
                for i, p in enumerate(ids) for k in range(G)]
        outs = self.gen.generate(reqs)
        tok = self.prompts.tok
        texts = [tok.decode(o.completion_ids, skip_special_tokens=False) for o in outs]
        texts = [t[:-len(e)] if (e := tok.decode([self.gen.eos_id], skip_special_tokens=False)) and t.endswith(e)
                 else t for t in texts]
        scores = [self.reward.scores(t, examples[j // G]) for j, t in enumerate(texts)]
        lengths = np.asarray([len(o.completion_ids) for o in outs])
        r = np.asarray([self.reward.total(s) for s in scores], np.float32)
        r = r + overlong(lengths, g.max_new_tokens, g.overlong_buffer, g.overlong_penalty)
        return ids, outs, scores, r, lengths

    def __next__(self) -> dict:
        cfg, g = self.cfg, self.cfg.grpo
        t0 = time.perf_counter()
        G = g.group_size
        P = cfg.train.global_batch_size // G
        self.gen.load(policy_state(self.current(), cfg))
        ids, outs, scores, r, lengths = self._round(0, P)
        same = np.ptp(r.reshape(P, G), axis=1) == 0
        # the step's metrics describe round 0: the policy's own samples, before any filtering
        self.metrics = {"reward_mean": float(r.mean()), "reward_std": float(r.std()),
                        "frac_reward_zero_std": float(same.mean()), "completion_len": float(lengths.mean()),
                        "stopped_frac": float(np.mean([o.finish_reason == "stop" for o in outs])),
                        **{f"reward_{k}": float(np.mean([s[k] for s in scores])) for k in scores[0]},
                        **{f"reward_{k}_std": float(np.std([s[k] for s in scores])) for k in scores[0]}}
        # DAPO's dynamic sampling: groups whose rewards are all equal are replaced by groups with
        # a spread from further rounds of P prompts, up to grpo.resample_rounds of them
        replaced, rounds = 0, 0
        while g.dynamic_sampling and same.any() and rounds < g.resample_rounds:
            rounds += 1
            ids2, outs2, _, r2, _ = self._round(rounds, P)
            spread = np.flatnonzero(np.ptp(r2.reshape(P, G), axis=1) > 0)
            for dst, src in zip(np.flatnonzero(same), spread):
                ids[dst] = ids2[src]
                outs[dst * G:(dst + 1) * G] = outs2[src * G:(src + 1) * G]
                r[dst * G:(dst + 1) * G] = r2[src * G:(src + 1) * G]
                same[dst] = False
                replaced += 1
        adv = advantages(r.reshape(P, G), g.advantage).reshape(-1)
        batch = self._rows(ids, outs, adv, keep=np.repeat(~same, G) if g.dynamic_sampling else None)
        self.step += 1
        if g.resample_rounds:
            self.metrics.update(resampled_groups=float(replaced), resample_rounds=float(rounds))
        self.metrics["rollout_s"] = time.perf_counter() - t0
        self.metrics["batch_tokens"] = float(batch["segment_ids"].sum())   # the rows' real tokens: tokens_per_s
        return batch

    def _rows(self, prompts: list[list[int]], outs, adv: np.ndarray, keep: np.ndarray | None) -> dict:
        """One row per completion: prompt ids then completion ids (EOS included), right-padded to
        the longest row rounded up to ROW_BUCKET (at most data.seq_len): the update computes no
        padding past that, and compiles once per bucket."""
        G, cap = self.cfg.grpo.group_size, self.cfg.data.seq_len
        B = len(outs)
        longest = max(len(prompts[j // G]) + len(o.completion_ids) for j, o in enumerate(outs))
        T = min(cap, -(-longest // ROW_BUCKET) * ROW_BUCKET)
        batch = {k: np.zeros((B, T), np.int32) for k in ("ids", "segment_ids", "positions", "loss_mask")}
        batch["old_logp"] = np.zeros((B, T), np.float32)
        m = self.cfg.model
        if self.cfg.grpo.routing_replay:      # -1: the router chooses (padding, each row's last token)
            batch["routing"] = np.full((B, T, m.num_moe_layers, m.num_experts_per_tok), -1, np.int32)
        for j, o in enumerate(outs):
            p, c = prompts[j // G], o.completion_ids
            n = len(p) + len(c)
            if n > cap:
                raise ConfigError(f"data.seq_len={cap}: a prompt of {len(p)} tokens and {len(c)} new tokens need {n}; "
                                  f"raise data.seq_len or lower grpo.max_new_tokens")
            batch["ids"][j, :n] = p + c
            batch["segment_ids"][j, :n] = 1
            batch["positions"][j, :n] = np.arange(n)
            if keep is None or keep[j]:
                batch["loss_mask"][j, len(p):n] = 1
            batch["old_logp"][j, len(p):n] = o.logprobs
            if o.routing is not None:
                batch["routing"][j, :len(o.routing)] = o.routing
        batch["advantages"] = adv.astype(np.float32)
        return batch


class RewardEval:
    """Held-out reward: greedy completions of grpo.eval_prompts eval-split prompts, scored with
    grpo.eval_reward; written as an eval record ({"split": "eval", "reward_mean": ...})."""

    def __init__(self, cfg: Config, prompts: Prompts, gen: Generator, writer: MetricsWriter):
        g = cfg.grpo
        self.cfg, self.prompts, self.gen, self.writer = cfg, prompts, gen, writer
        self.examples = eval_examples(cfg)
        self.ids = prompts.encode(self.examples)
        self.reward = rewardlib.combine({g.eval_reward: 1.0}, {**rewardlib.REWARDS, **tasks.TASK_REWARDS})

    def __call__(self, state: dict, step: int) -> dict:
        self.gen.load(policy_state(state, self.cfg))
        outs = self.gen.generate([Request(tuple(p), max_new_tokens=self.cfg.grpo.max_new_tokens) for p in self.ids])
        tok = self.prompts.tok
        texts = [tok.decode(o.completion_ids, skip_special_tokens=False) for o in outs]
        r = np.asarray([self.reward(t, ex) for t, ex in zip(texts, self.examples)])
        out = {"reward_mean": float(r.mean()), "completion_len": float(np.mean([len(o.completion_ids) for o in outs]))}
        self.writer.write(step, out, prefix="eval")
        log_line(f"eval @ {step}: reward_mean {out['reward_mean']:.4f} ({self.cfg.grpo.eval_reward}, greedy, "
                 f"{len(r)} held-out prompts)")
        return out


def plot(train: list[dict], evals: list[dict], path: Path) -> None:
    """Reward (train: sampled; eval: greedy on held-out prompts) and completion length by step, from
    the whole run's curves (MetricsWriter.series)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    train = [r for r in train if "reward_mean" in r]
    evals = [r for r in evals if "reward_mean" in r]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, ylabel in zip(axes, ("reward_mean", "completion_len"), ("reward", "completion tokens")):
        ax.plot([r["step"] for r in train], [r[key] for r in train], label="train (sampled)")
        ax.plot([r["step"] for r in evals], [r[key] for r in evals], "o-", label="eval (greedy)")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _reference_logp(cfg: Config, graphdef, start_state: dict, mesh):
    """batch -> the reference's per-token log-probs [B, T] (token j's at index j): the starting
    weights' forward (a LoRA run's start is its LoRA-off base), frozen."""
    ref = jax.tree.map(lambda a: a.copy(), {"params": start_state["params"], "rest": start_state["rest"]})
    bs = meshlib.batch_sharding(mesh)

    def forward(st, batch):
        model = nnx.merge(graphdef, st["params"], st["rest"])
        lp = token_logp(model(batch["ids"], batch["positions"], batch["segment_ids"],
                              routing=batch.get("routing")).logits, batch["ids"])
        return jnp.roll(lp, 1, axis=1)

    with meshlib.activate(mesh):
        fn = meshlib.MeshedJit(jax.jit(forward, in_shardings=(jax.tree.map(lambda a: a.sharding, ref), bs),
                                       out_shardings=bs), mesh)
    return lambda batch: fn(ref, {k: batch[k] for k in ("ids", "positions", "segment_ids", "routing") if k in batch})


def _fingerprint(start_state: dict) -> list[float]:
    """[sum, sum of squares] over the starting weights (float64 on the host): how a resumed run
    knows it rebuilt the same reference."""
    leaves = jax.tree.leaves({"params": start_state["params"], "rest": start_state["rest"]})
    sums = jax.device_get([(jnp.sum(a.astype(jnp.float32)), jnp.sum(jnp.square(a.astype(jnp.float32))))
                           for a in leaves])
    return [float(np.sum([a for a, _ in sums], dtype=np.float64)), float(np.sum([b for _, b in sums], dtype=np.float64))]


def _check_reference(saved: list[float] | None, now: list[float], cfg: Config) -> None:
    if saved is None:
        raise ConfigError("grpo.beta > 0: the checkpoint records no reference (written with grpo.beta=0); "
                          "resume with grpo.beta=0 or start a new run")
    if not np.allclose(saved, now, rtol=1e-6, atol=0):
        raise ConfigError(f"grpo.beta > 0: the starting weights loaded again for the KL reference "
                          f"(model.init_from={cfg.model.init_from}, train.seed={cfg.train.seed}) are not the ones this run "
                          f"started from "
                          f"(sum, sum of squares {now[0]:.7g}, {now[1]:.7g} against {saved[0]:.7g}, {saved[1]:.7g}); "
                          f"point model.init_from (and train.seed) at the original ones")


def train(cfg: Config, run_dir: str | Path, devices: list | None = None) -> dict[str, float]:
    """A GRPO run in `run_dir` (resuming from its latest checkpoint) on `devices` (default: all);
    returns the final metrics."""
    run_dir = Path(run_dir)
    devices = devices or jax.devices()
    trainer.preflight(cfg, devices)
    if jax.process_count() > 1:
        raise ConfigError("loss.objective=grpo: runs in one process for now (its rollouts are not split "
                          "between processes); use the devices of one host")
    if cfg.grpo.task not in tasks.TASKS:
        raise ConfigError(f"grpo.task={cfg.grpo.task}: unknown; allowed: {', '.join(tasks.TASKS)}")
    try:                                      # the eval set too: a small difficulty may hold too few problems
        tasks.generate(cfg.grpo.task, cfg.grpo.eval_prompts, seed=0, split="eval", **cfg.grpo.task_difficulty)
    except ValueError as e:
        raise ConfigError(f"grpo.task_difficulty={dict(cfg.grpo.task_difficulty)}: {e}") from None
    known = {**rewardlib.REWARDS, **tasks.TASK_REWARDS}
    for name in (*cfg.grpo.rewards, cfg.grpo.eval_reward):
        if name not in known:
            raise ConfigError(f"grpo.rewards: unknown reward '{name}'; allowed: {', '.join(known)}")
    mesh = meshlib.make_mesh(cfg.mesh, devices)
    t, m = cfg.train, cfg.model
    ckpt = Checkpointer(run_dir / "checkpoints", every=cfg.checkpoint.every, keep=cfg.checkpoint.keep,
                        model_cfg=m, layout=None, lora=cfg.lora, on_error=cfg.checkpoint.on_error,
                        log=log_line)
    resume = ckpt.latest_step()
    if resume is not None:
        ckpt.check_model()
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(configlib.dump_yaml(cfg))
    sample = tasks.generate(cfg.grpo.task, 256, seed=0, **cfg.grpo.task_difficulty)
    texts = [ex["prompt"] + " " + tasks.solution(ex) for ex in sample]
    tok, template = trainer.chat_tokenizer(cfg, run_dir, texts)
    prompts = Prompts(cfg.grpo.task, tok, template)
    eos = toklib.eos_id(tok)

    tx = make_optimizer(cfg.optim, t.steps)
    graphdef, target = weights.target(cfg, mesh, None)
    meta: dict = {}
    if resume is not None:
        abstract, shardings = statelib.abstract(target, tx, cfg, mesh)
        state, meta, _ = ckpt.restore(resume, abstract, None)
        log_line(f"resumed from {run_dir / 'checkpoints' / str(resume)} (step {resume})")
    else:
        state, shardings = statelib.create(weights.initial(cfg, mesh, None, log=log_line), tx, cfg, mesh)
    log_line(trainer.trainable_line(cfg, state))
    n = count_params(m)
    g = cfg.grpo
    log_line(f"grpo: task {g.task}, {t.global_batch_size // g.group_size} prompts x {g.group_size} completions "
             f"of up to {g.max_new_tokens} tokens a step at T={g.temperature:g}; rewards {dict(g.rewards)}; beta "
             f"{g.beta:g}, clip [{1 - g.clip_low:g}, {1 + g.clip_high:g}], advantage {g.advantage.value}, "
             f"loss {g.loss_agg.value}; model {n.main / 1e6:.1f}M; mesh {dict(mesh.shape)}")
    objective = make_objective(cfg)
    step_fn = make_train_step(graphdef, tx, cfg, mesh, shardings, objective)
    ckpt.write_model_config()

    # rollouts stream nothing and stop on EOS alone, so a whole completion is one decode dispatch
    # (the loop ends when every row is done): bench/configs/grpo_trl.yaml's rollout 72 -> 64 ms
    infer = dataclasses.replace(cfg.infer, batch_size=t.global_batch_size,
                                decode_chunk=max(cfg.infer.decode_chunk, cfg.grpo.max_new_tokens))
    gen = Generator(dataclasses.replace(m, num_nextn_predict_layers=0), policy_state(state, cfg), infer, mesh=mesh,
                    kernels=cfg.kernels, eos_id=eos, tokenizer=tok)
    holder = {"state": state}
    # what rollbacks skipped stays on record in every later checkpoint; the rollout stream runs
    # ahead of the loop's step by the draws they skipped
    save_meta = trainer.skips_on_record(meta)
    ahead = sum(hi - lo + 1 for lo, hi in meta.get("skipped_batches", []))
    rollouts = Rollouts(cfg, prompts, gen, lambda: holder["state"], (resume or 0) + ahead)
    reference = None
    if g.beta:
        # the reference is the starting weights: a resumed run loads them again from where the
        # first start did (model.init_from, or train.seed's init), and checks they are the same
        start_state = state if resume is None else dict(zip(("params", "rest"), statelib.split(
            weights.initial(cfg, mesh, None, log=lambda s: log_line(f"reference: {s}")), cfg)))
        reference = _reference_logp(cfg, graphdef, start_state, mesh)
        save_meta["reference_fingerprint"] = _fingerprint(start_state)
        if resume is not None:
            _check_reference(meta.get("reference_fingerprint"), save_meta["reference_fingerprint"], cfg)
    bsharding = meshlib.batch_sharding(mesh)

    def place(local: dict):
        batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(bsharding, x), local)
        if reference is not None:
            batch["ref_logp"] = reference(batch)
        return batch

    def step(state, batch):
        t0 = time.perf_counter()
        new, metrics = step_fn(state, batch)
        jax.block_until_ready(metrics)
        holder["state"] = new
        return new, {**metrics, **rollouts.metrics, "update_s": time.perf_counter() - t0}

    writer = MetricsWriter(run_dir, t.steps)
    evaluator = RewardEval(cfg, prompts, gen, writer) if g.eval_prompts else None
    start = int(state["step"])
    if evaluator is not None and start == 0:
        evaluator(state, 0)                 # before the first update

    def rollback(first_bad: int, done: int):
        """The newest checkpoint before `first_bad`. The rollouts of the steps after it up to
        `done` are not drawn again: the stream goes on from where it is, so their prompts and
        seeds are skipped (recorded in the checkpoint meta from now on)."""
        to = trainer.rollback_step(ckpt, first_bad, cfg)
        holder["state"] = None                  # free it before the checkpoint is read
        restored, saved, _ = ckpt.restore(to, statelib.abstract(target, tx, cfg, mesh)[0], None)
        holder["state"] = restored
        save_meta.update(trainer.skips_after_rollback(saved, to, done))
        return restored, rollouts, to

    guarding = trainer._guarding(cfg, run_dir, writer, rollback)
    try:
        result = loop.run(step, state, rollouts, place=place, start=start, end=min(t.steps, t.stop_at or t.steps),
                          total=t.steps, log_every=t.log_every, writer=writer, checkpointer=ckpt, save_meta=save_meta,
                          evaluator=evaluator, eval_every=t.eval_every,
                          tokens_per_step=t.global_batch_size * cfg.data.seq_len, tokens_metric="batch_tokens",
                          flops_per_token=0.0, peak_flops=1.0,     # no MFU: rollouts dominate a step
                          guarding=guarding)
    finally:
        trainer._close_guarding(guarding)
    state = result.state
    done = int(state["step"])
    final = {k: v for k, v in writer.last("train").items() if k != "step"}
    if result.stopped is None and evaluator is not None:
        final.update({f"eval_{k}": v for k, v in evaluator(state, done).items()})
    if ckpt.latest_step() != done and result.saveable:
        ckpt.save(state, rollouts, meta=save_meta, force=True)
    ckpt.close()
    if jax.process_index() == 0:
        plot(writer.series("train"), writer.series("eval"), run_dir / "rewards.png")
    writer.close()
    final.update(compile_s=result.compile_s, stopped=result.stopped)
    if jax.process_index() == 0:
        (run_dir / "final.json").write_text(json.dumps({"step": done, **final}, indent=2))
    return final


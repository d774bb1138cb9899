"""Training objectives: what a step minimises, given the model's outputs and the batch dict.

An objective is a callable `objective(out, batch) -> (loss_sum, tokens, metrics)`:
- `loss_sum`: float32 scalar, the loss summed over this batch's targets (weights included);
- `tokens`: float32 scalar, what the loss is divided by: the step's loss is
  sum(loss_sum) / sum(tokens) over its microbatches, pipeline pieces and data shards;
- `metrics`: {name: (sum, count)}; the step reports sum / count over the whole step.

`balance_weight` is the objective's weight on the MoE sequence-wise balance loss. The balance
loss itself is computed inside the MoE layers (inside the stages on a pipeline) and the step
carries it through every schedule; the objective only says how much of it to add.

`tokens(batch)` gives the same denominator from the batch alone. The step needs it before any
forward pass: each microbatch's gradient (and each 1F1B piece's backward) is scaled by the
whole step's 1 / tokens, which makes `grad_accum` and every pipeline schedule equal one large
batch, and keeps fp16's scaled gradients the size of a mean's. `mtp` says whether the objective
reads the MTP heads' logits (the forward skips them otherwise).

The batch dict reaches the objective unchanged, whatever splits it: any [B, ...] entry
(`loss_mask` here; teacher logits or advantages later) is split with the rows.

Add an objective by writing such a callable and naming it in `make`.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

from r1jax.config import Config, KDLoss, LossAgg, ObjectiveKind
from r1jax.model import Output
from r1jax.train.loss import cross_entropy_sum, shifted_targets

F32 = jnp.float32
Metrics = dict[str, tuple[jax.Array, jax.Array]]


class Objective(Protocol):
    mtp: bool
    needs: tuple[str, ...]        # batch keys beyond ids/segment_ids/positions
    balance_weight: float         # x the MoE balance loss (mean over rows, summed over layers)

    def tokens(self, batch: dict) -> jax.Array: ...

    def __call__(self, out: Output, batch: dict) -> tuple[jax.Array, jax.Array, Metrics]: ...


@dataclasses.dataclass(frozen=True)
class NextToken:
    """Next-token cross-entropy plus DeepSeek-V3's MTP loss (report eq. 24-25):
    L = (sum_t CE_t + lambda/D * sum_k sum_t CE^k_t) / N, N the next-token targets. Every MTP depth
    shares the main loss's denominator, as the report's 1/T. Targets never cross a segment.
    `masked`: only targets where batch["loss_mask"] is set count (SFT's completion tokens), at
    every depth: position t predicts token t+s when loss_mask[t+s]. `balance_weight` is the
    report's alpha (eq. 17-20) on the sequence-wise balance loss."""
    mtp_weight: float = 0.3
    mtp_depth: int = 0
    masked: bool = False
    balance_weight: float = 0.0

    @property
    def mtp(self) -> bool:
        return self.mtp_depth > 0

    @property
    def needs(self) -> tuple[str, ...]:
        return ("loss_mask",) if self.masked else ()

    def _targets(self, batch: dict, shift: int):
        targets, valid = shifted_targets(batch["ids"], batch["segment_ids"], shift)
        if self.masked:
            valid = valid & (jnp.roll(batch["loss_mask"], -shift, axis=1) != 0)
        return targets, valid

    def tokens(self, batch: dict) -> jax.Array:
        return self._targets(batch, 1)[1].sum().astype(F32)

    def __call__(self, out: Output, batch: dict) -> tuple[jax.Array, jax.Array, Metrics]:
        loss, n = cross_entropy_sum(out.logits, *self._targets(batch, 1))
        metrics = {"lm_loss": (loss, n)}
        if self.mtp_depth:
            pairs = [cross_entropy_sum(out.mtp_logits[k], *self._targets(batch, k + 2)) for k in range(self.mtp_depth)]
            mtp_sum = sum(s for s, _ in pairs)
            loss = loss + self.mtp_weight / self.mtp_depth * mtp_sum
            metrics["mtp_loss"] = (mtp_sum, sum(c for _, c in pairs))
        return loss, n, metrics


def divergence(student_logp: jax.Array, teacher_logp: jax.Array, kind: KDLoss, beta: float = 0.5) -> jax.Array:
    """Per position [...]: forward KL(teacher || student), reverse KL(student || teacher), or the
    generalised JSD_beta = beta KL(t || m) + (1 - beta) KL(s || m), m = beta t + (1 - beta) s (TRL
    GKD's convention: beta -> 0 tends to forward KL, beta -> 1 to reverse), over log-probs [..., W]."""
    def kl(logp, logq):                       # KL(p || q); log-softmax of finite logits is finite
        return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
    if kind is KDLoss.forward_kl:
        return kl(teacher_logp, student_logp)
    if kind is KDLoss.reverse_kl:
        return kl(student_logp, teacher_logp)
    m = jnp.logaddexp(teacher_logp + jnp.log(beta), student_logp + jnp.log1p(-beta))
    return beta * kl(teacher_logp, m) + (1 - beta) * kl(student_logp, m)


@dataclasses.dataclass(frozen=True)
class LogitKD:
    """Logit distillation: at each position whose next token is a target (SFT's loss mask), the
    student's distribution over the vocabulary is pulled to the teacher's (batch["teacher_logits"]
    [B, T, W], the frozen teacher's forward on the same rows):
        L = (alpha * T^2 * sum_t D(teacher_t / T, student_t / T) + (1 - alpha) * sum_t CE_t) / N.
    T^2 keeps the gradient's size independent of T (Hinton et al.); `kd_loss` is the divergence
    at T (without T^2), `lm_loss` the plain cross-entropy, both per target."""
    kind: KDLoss = KDLoss.forward_kl
    temperature: float = 1.0
    beta: float = 0.5
    alpha: float = 1.0
    balance_weight: float = 0.0
    mtp: bool = False
    needs: tuple[str, ...] = ("loss_mask", "teacher_logits")

    def _targets(self, batch: dict):
        targets, valid = shifted_targets(batch["ids"], batch["segment_ids"], 1)
        return targets, valid & (jnp.roll(batch["loss_mask"], -1, axis=1) != 0)

    def tokens(self, batch: dict) -> jax.Array:
        return self._targets(batch)[1].sum().astype(F32)

    def __call__(self, out: Output, batch: dict) -> tuple[jax.Array, jax.Array, Metrics]:
        targets, valid = self._targets(batch)
        T = self.temperature
        s = jax.nn.log_softmax(out.logits.astype(F32) / T, axis=-1)
        t = jax.nn.log_softmax(jax.lax.stop_gradient(batch["teacher_logits"]).astype(F32) / T, axis=-1)
        w = valid.astype(F32)
        kd = jnp.sum(divergence(s, t, self.kind, self.beta) * w)
        ce, n = cross_entropy_sum(out.logits, targets, valid)
        loss = self.alpha * T * T * kd + (1 - self.alpha) * ce
        return loss, n, {"kd_loss": (kd, n), "lm_loss": (ce, n)}


def token_logp(logits_BTW: jax.Array, ids_BT: jax.Array) -> jax.Array:
    """[B, T]: log p(ids[t+1] | ..t) at position t (fp32); the last position's is meaningless."""
    lp = jax.nn.log_softmax(logits_BTW.astype(F32), axis=-1)
    return jnp.take_along_axis(lp, jnp.roll(ids_BT, -1, axis=1)[..., None], axis=-1)[..., 0]


@dataclasses.dataclass(frozen=True)
class GRPO:
    """GRPO's clipped surrogate with a k3 KL to a reference (DeepSeekMath eq. 3; R1 2.2.1), per
    completion token t of a row (one prompt + completion per row, batch["loss_mask"] on the
    completion's tokens):
        rho_t = exp(logp_t - old_t)         old: the rollout's log-probs (batch["old_logp"])
        l_t   = -min(rho_t A, clip(rho_t, 1 - clip_low, 1 + clip_high) A) + beta k3_t
        k3_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (batch["ref_logp"])
    with A the row's advantage (batch["advantages"] [B]). Log-probs are under the raw logits, as
    the generator reports them. Per-token arrays hold token j's value at index j (where
    loss_mask is); position t predicts token t+1. `agg` (LossAgg): `token` sums l over the
    step's completion tokens over their number, `sequence` averages each row's token mean over
    rows, `constant` divides the sum by rows x `max_new_tokens` (Dr. GRPO)."""
    beta: float = 0.001
    clip_low: float = 0.2
    clip_high: float = 0.2
    agg: LossAgg = LossAgg.token
    max_new_tokens: int = 1
    balance_weight: float = 0.0
    mtp: bool = False

    @property
    def needs(self) -> tuple[str, ...]:
        return ("loss_mask", "advantages", "old_logp") + (("ref_logp",) if self.beta else ())

    def _valid(self, batch: dict) -> jax.Array:
        _, valid = shifted_targets(batch["ids"], batch["segment_ids"], 1)
        return valid & (jnp.roll(batch["loss_mask"], -1, axis=1) != 0)

    def tokens(self, batch: dict) -> jax.Array:
        w = self._valid(batch)
        if self.agg is LossAgg.token:
            return w.sum().astype(F32)
        rows = jnp.any(w, axis=1).sum().astype(F32)
        return rows if self.agg is LossAgg.sequence else w.shape[0] * jnp.float32(self.max_new_tokens)

    def __call__(self, out: Output, batch: dict) -> tuple[jax.Array, jax.Array, Metrics]:
        valid = self._valid(batch)
        w = valid.astype(F32)
        n_tok = w.sum()
        logp = token_logp(out.logits, batch["ids"])
        old = jnp.roll(batch["old_logp"].astype(F32), -1, axis=1)
        adv = batch["advantages"].astype(F32)[:, None]
        ratio = jnp.exp(logp - old)
        clipped = jnp.clip(ratio, 1 - self.clip_low, 1 + self.clip_high)
        per = -jnp.minimum(ratio * adv, clipped * adv)
        metrics: Metrics = {}
        if self.beta:
            d = jnp.roll(batch["ref_logp"].astype(F32), -1, axis=1) - logp
            k3 = jnp.exp(d) - d - 1
            per = per + self.beta * k3
            metrics["kl"] = (jnp.sum(k3 * w), n_tok)
        if self.agg is LossAgg.sequence:
            loss = jnp.sum(jnp.sum(per * w, axis=1) / jnp.maximum(w.sum(axis=1), 1.0))
        else:
            loss = jnp.sum(per * w)
        low = (ratio < 1 - self.clip_low) & (adv < 0)       # where the clip holds the update back
        high = (ratio > 1 + self.clip_high) & (adv > 0)
        metrics.update(clip_low_frac=(jnp.sum(low * w), n_tok), clip_high_frac=(jnp.sum(high * w), n_tok),
                       ratio_drift=(jnp.sum(jnp.abs(ratio - 1) * w), n_tok), lm_loss=(-jnp.sum(logp * w), n_tok))
        return loss, self.tokens(batch), metrics


def make(cfg: Config) -> Objective:
    """The objective `loss.objective` names."""
    kind, ls = cfg.loss.objective, cfg.loss
    # a zero weight runs no MTP module at all (a fine-tune of a checkpoint whose MTP is untrained)
    depth = cfg.model.num_nextn_predict_layers if ls.mtp_loss_weight > 0 else 0
    if kind in (ObjectiveKind.lm, ObjectiveKind.masked_lm, ObjectiveKind.sft):
        return NextToken(ls.mtp_loss_weight, depth, masked=kind is not ObjectiveKind.lm,
                         balance_weight=ls.seq_aux_loss_alpha)
    if kind is ObjectiveKind.grpo:
        g = cfg.grpo
        return GRPO(g.beta, g.clip_low, g.clip_high, g.loss_agg, g.max_new_tokens, balance_weight=ls.seq_aux_loss_alpha)
    if kind is ObjectiveKind.kd:
        kd = cfg.distill
        return LogitKD(kd.loss, kd.temperature, kd.beta, kd.alpha, balance_weight=ls.seq_aux_loss_alpha)
    raise ValueError(f"loss.objective={kind}: no such objective")

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

from r1jax.config import Config, ObjectiveKind
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


def make(cfg: Config) -> Objective:
    """The objective `loss.objective` names."""
    kind, ls = cfg.loss.objective, cfg.loss
    depth = cfg.model.num_nextn_predict_layers
    if kind in (ObjectiveKind.lm, ObjectiveKind.masked_lm):
        return NextToken(ls.mtp_loss_weight, depth, masked=kind is ObjectiveKind.masked_lm,
                         balance_weight=ls.seq_aux_loss_alpha)
    raise ValueError(f"loss.objective={kind}: no such objective")

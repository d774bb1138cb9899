"""Where metrics go: tensorboardX scalars, one JSON object per line, the console, a loss PNG.

Only process 0 writes. Tensorboard tags are `train/<name>` and `eval/<name>`, and per-layer
expert-load imbalance (max/mean) is `moe/imbalance_layer_<i>`; the JSONL records carry `step`
plus the same names (e.g. `loss`, `lr`, `grad_norm`, `tokens_per_s`, `mfu`). On a terminal the
console shows a live progress bar; otherwise one plain line per log step."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import jax


class MetricsWriter:
    def __init__(self, run_dir: Path, total_steps: int):
        self.run_dir = Path(run_dir)
        self.total = total_steps
        self.active = jax.process_index() == 0
        self.records: list[dict] = []
        self.t0 = time.time()
        if self.active:
            from tensorboardX import SummaryWriter
            self.tb = SummaryWriter(logdir=str(self.run_dir / "tensorboard"), flush_secs=5)
            self.jsonl = open(self.run_dir / "metrics.jsonl", "a")

    def write(self, step: int, values: dict[str, float], prefix: str = "train") -> None:
        if not self.active:
            return
        rec = {"step": step, **({"split": prefix} if prefix != "train" else {}), **values}
        self.records.append(rec)
        self.jsonl.write(json.dumps(rec) + "\n")
        self.jsonl.flush()
        for k, v in values.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.tb.add_scalar(f"{prefix}/{k}", v, step)
            elif k == "expert_imbalance_layers":
                for i, x in enumerate(v):
                    self.tb.add_scalar(f"moe/imbalance_layer_{i}", x, step)

    def plot(self, path: Path) -> None:
        """Loss curves (train loss, its MTP part, eval loss) as a PNG."""
        if not self.active or not self.records:
            return
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        train = [r for r in self.records if "split" not in r and "loss" in r]
        evals = [r for r in self.records if r.get("split") == "eval"]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in train], [r["lm_loss"] for r in train], label="train next-token loss")
        if any(r.get("mtp_loss") for r in train):
            ax.plot([r["step"] for r in train], [r["mtp_loss"] for r in train], label="train MTP loss")
        if evals:
            ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval loss")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    def close(self) -> None:
        if self.active:
            self.tb.close()
            self.jsonl.close()


def _line(step: int, total: int, v: dict, elapsed: float, done_frac: float) -> str:
    eta = elapsed / done_frac * (1 - done_frac) if done_frac > 0 else float("nan")
    parts = [f"step {step}/{total}", f"loss {v['loss']:.4f}"]
    if v.get("mtp_loss"):
        parts.append(f"mtp {v['mtp_loss']:.4f}")
    if "reward_mean" in v:                    # GRPO (r1jax/rl/grpo.py)
        parts.append(f"reward {v['reward_mean']:.3f} (len {v['completion_len']:.1f})")
    parts += [f"lr {v['lr']:.2e}", f"gnorm {v['grad_norm']:.3f}", f"{v['tokens_per_s']:.0f} tok/s"]
    if math.isfinite(v.get("mfu", math.nan)):
        parts.append(f"mfu {100 * v['mfu']:.1f}%")
    if v.get("skipped"):
        parts.append(f"skipped {int(v['skipped'])} (loss scale {v['loss_scale']:.0f})")
    parts.append(f"eta {eta:.0f}s")
    return " | ".join(parts)


class Progress:
    """A rich progress bar when stdout is a terminal (process 0), plain log lines otherwise."""

    def __init__(self, total: int, start: int):
        self.total, self.start, self.t0 = total, start, time.time()
        self.live = jax.process_index() == 0 and sys.stdout.isatty()
        self.bar = None
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
                TimeRemainingColumn
            self.bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                    TextColumn("{task.description}"))
            self.task = self.bar.add_task("", total=total, completed=start)
            self.bar.start()

    def update(self, step: int, metrics: dict | None) -> None:
        if self.bar is not None:
            desc = f"loss {float(metrics['loss']):.4f}" if metrics is not None else ""
            self.bar.update(self.task, completed=step, description=desc)

    def log(self, step: int, values: dict) -> None:
        if jax.process_index() != 0:
            return
        frac = (step - self.start) / max(self.total - self.start, 1)
        text = _line(step, self.total, values, time.time() - self.t0, frac)
        if self.bar is not None:    # above the live bar; plain text (no highlighting codes in logs)
            self.bar.console.print(text, highlight=False, markup=False, soft_wrap=True)
        else:
            print(text)
        sys.stdout.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def log_line(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, file=sys.stderr if msg.startswith("error") else sys.stdout, flush=True)

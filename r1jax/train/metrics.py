"""Where metrics go: tensorboardX scalars, one JSON object per line, the console, a loss PNG.

Only process 0 writes. Tensorboard tags are `train/<name>` and `eval/<name>`; the JSONL
records carry `step` plus the same names (e.g. `loss`, `lr`, `grad_norm`, `tokens_per_s`)."""
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

    def console(self, step: int, values: dict[str, float]) -> None:
        if not self.active:
            return
        done = step / max(self.total, 1)
        elapsed = time.time() - self.t0
        eta = elapsed / done * (1 - done) if done > 0 else float("nan")
        parts = [f"step {step}/{self.total}", f"loss {values['loss']:.4f}"]
        if "mtp_loss" in values and values["mtp_loss"]:
            parts.append(f"mtp {values['mtp_loss']:.4f}")
        parts += [f"lr {values['lr']:.2e}", f"gnorm {values['grad_norm']:.3f}",
                  f"{values['tokens_per_s']:.0f} tok/s", f"eta {eta:.0f}s"]
        print(" | ".join(parts), flush=True)

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


def log_line(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, file=sys.stderr if msg.startswith("error") else sys.stdout, flush=True)

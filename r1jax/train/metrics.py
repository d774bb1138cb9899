"""Where metrics go: tensorboardX scalars, one JSON object per line, the console, a loss PNG.

Only process 0 writes. Tensorboard tags are `train/<name>` and `eval/<name>`, and per-layer
expert-load imbalance (max/mean) is `moe/imbalance_layer_<i>`; the JSONL records carry `step`
plus the same names (e.g. `loss`, `lr`, `grad_norm`, `tokens_per_s`, `mfu`). On a terminal the
console shows a live progress bar; otherwise one plain line per log step.

A run's metrics.jsonl outlives its processes: a resumed (or re-started) run appends to it, and
the writer reads back what earlier processes wrote, so `last`, `series` and the PNG cover the
whole run. The file then holds the run's history as it happened: steps logged again after a
resume from an older checkpoint or after a rollback, and event records (`"event"` key)."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import jax


def read_records(path: Path) -> tuple[list[dict], list[dict]]:
    """(train and eval records, event records) of a metrics.jsonl, in the order written. A line
    that does not parse (the process was killed while writing it) is passed over."""
    records, events = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                (events if "event" in rec else records).append(rec)
    return records, events


def per_step(records: list[dict], split: str = "train") -> list[dict]:
    """The run's curve for `split` ("train", "eval"): one record per step, by step. Read in the
    order written, a record at step S replaces those of its split at S or later, and those of
    other splits after S: they were logged by a process that went further from an older state
    (killed past its last checkpoint, or rolled back) and that history was abandoned."""
    kept: list[dict] = []           # ascending in step: each record drops every later one first
    for r in records:
        s, sp = r["step"], r.get("split", "train")
        while kept and kept[-1]["step"] > s:
            kept.pop()
        i = len(kept)
        while i and kept[i - 1]["step"] == s:
            i -= 1
        kept[i:] = [k for k in kept[i:] if k.get("split", "train") != sp] + [r]
    return [r for r in kept if r.get("split", "train") == split]


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1)


class MetricsWriter:
    """The run's metrics.jsonl, tensorboard scalars and loss PNG (see the module docstring)."""

    def __init__(self, run_dir: Path, total_steps: int):
        self.run_dir = Path(run_dir)
        self.total = total_steps
        self.active = jax.process_index() == 0
        self.records: list[dict] = []    # train and eval records, earlier processes' first, as written
        self.events: list[dict] = []     # event records (rollbacks, spikes, alerts), likewise
        self.t0 = time.time()
        if self.active:
            from tensorboardX import FileWriter
            path = self.run_dir / "metrics.jsonl"
            if path.is_file():
                self.records, self.events = read_records(path)
            self.tb = FileWriter(str(self.run_dir / "tensorboard"), flush_secs=5)
            self.jsonl = open(path, "a")
            if self.jsonl.tell() and _last_byte(path) != b"\n":
                self.jsonl.write("\n")      # a line cut short by a kill must not swallow the next record

    def write(self, step: int, values: dict[str, float], prefix: str = "train") -> None:
        if not self.active:
            return
        rec = {"step": step, **({"split": prefix} if prefix != "train" else {}), **values}
        self.records.append(rec)
        self.jsonl.write(json.dumps(rec) + "\n")
        self.jsonl.flush()
        from tensorboardX.proto.summary_pb2 import Summary
        scalars = [(f"{prefix}/{k}", v) for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)]
        scalars += [(f"moe/imbalance_layer_{i}", x) for i, x in enumerate(values.get("expert_imbalance_layers", ()))]
        # one event holding the record's scalars: SummaryWriter.add_scalar writes an event per
        # scalar and costs about 0.1 ms each (tiny GRPO logs 31 a step: 2.5 ms of a 105 ms step)
        self.tb.add_summary(Summary(value=[Summary.Value(tag=t, simple_value=float(v)) for t, v in scalars]), step)

    def event(self, step: int, kind: str, fields: dict) -> None:
        """Something that happened rather than a measurement (a rollback, a loss spike, an alert):
        a metrics.jsonl record with an "event" key, and a tensorboard text entry."""
        if not self.active:
            return
        rec = {"step": step, "event": kind, **fields}
        self.events.append(rec)
        self.jsonl.write(json.dumps(rec) + "\n")
        self.jsonl.flush()
        from tensorboardX.summary import text
        self.tb.add_summary(text(f"events/{kind}", json.dumps(fields)), step)

    def last(self, split: str = "train") -> dict:
        """The last record of `split` ("train" or "eval") written to the run's metrics.jsonl, by
        this process or an earlier one, as written (with "step"; eval records carry "split"); {}
        when there is none. What final.json reports."""
        return dict(next((r for r in reversed(self.records) if r.get("split", "train") == split), {}))

    def series(self, split: str = "train") -> list[dict]:
        """The whole run's curve for `split`, one record per step (`per_step`)."""
        return per_step(self.records, split)

    def plot(self, path: Path) -> None:
        """Loss curves of the whole run (train next-token loss, its MTP part, eval loss) as a PNG;
        a dashed vertical line at each step a rollback went back to, where the curve takes up the
        retrained steps."""
        if not self.active or not self.records:
            return
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        train = [r for r in self.series("train") if "lm_loss" in r]
        evals = [r for r in self.series("eval") if "loss" in r]
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, e in enumerate(e for e in self.events if e["event"] == "rollback"):
            ax.axvline(e.get("to_step", e["step"]), color="grey", linestyle="--", linewidth=0.8,
                       label="rolled back to" if i == 0 else None)
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


def _line(step: int, total: int, v: dict, eta: float | None, mfu_approx: bool = False) -> str:
    """One log step's console line; `eta` in seconds (None: not known yet), `mfu_approx`: MFU over
    a measured CPU peak, shown as approximate."""
    parts = [f"step {step}/{total}", f"loss {v['loss']:.4f}"]
    if v.get("mtp_loss"):
        parts.append(f"mtp {v['mtp_loss']:.4f}")
    if "reward_mean" in v:                    # GRPO (r1jax/rl/grpo.py)
        parts.append(f"reward {v['reward_mean']:.3f} (len {v['completion_len']:.1f})")
    parts += [f"lr {v['lr']:.2e}", f"gnorm {v['grad_norm']:.3f}"]
    if "tokens_per_s" in v:      # absent when the window held only the compiling step
        parts.append(f"{v['tokens_per_s']:.0f} tok/s")
    if math.isfinite(v.get("mfu", math.nan)):
        parts.append(f"mfu {'~' if mfu_approx else ''}{100 * v['mfu']:.1f}%")
    if v.get("skipped"):
        parts.append(f"skipped {int(v['skipped'])}" + (f" (loss scale {v['loss_scale']:.0f})"
                                                       if v.get("loss_scale", 1.0) != 1.0 else ""))
    parts.append("eta ?" if eta is None else f"eta {eta:.0f}s")
    return " | ".join(parts)


class Progress:
    """A rich progress bar when stdout is a terminal (process 0), plain log lines otherwise.

    The ETA is the time per step since the first step after start, resume or rollback completed,
    times the steps left: that first step compiles (tens of seconds against a step's fraction of
    one), and counting it would put the first estimates of a resumed run far off. Evals and
    checkpoints after it are counted, as they take the run's time too."""

    def __init__(self, total: int, start: int):
        self.total, self.start = total, start
        self.clock: tuple[float, int] | None = None     # (time, step) the first step completed
        self.seen = start
        self.mfu_approx = jax.devices()[0].platform == "cpu"     # over a measured peak (mfu.py)
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
        restart = self.clock is None or step <= self.seen        # first step, or after a rollback
        self.seen = step
        if restart:
            self.clock = (time.time(), step)
        if self.bar is not None:
            desc = f"loss {float(metrics['loss']):.4f}" if metrics is not None else ""
            if restart:     # drop the bar's own speed samples, which hold the compile
                self.bar.reset(self.task, total=self.total, completed=step, description=desc)
            else:
                self.bar.update(self.task, completed=step, description=desc)

    def eta(self, step: int) -> float | None:
        """Seconds to train.steps at the pace since the clock started; None before a second step."""
        if self.clock is None or step <= self.clock[1]:
            return None
        t, s = self.clock
        return (time.time() - t) / (step - s) * (self.total - step)

    def log(self, step: int, values: dict) -> None:
        if jax.process_index() != 0:
            return
        text = _line(step, self.total, values, self.eta(step), self.mfu_approx)
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

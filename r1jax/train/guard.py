"""Bad steps, loss spikes and gradient-norm anomalies, judged on the host; alerts; fire drills.

The step (step.py) already leaves the state untouched when its loss or a gradient is not finite
and reports `skipped`. What to do about a run of them is decided here, from the per-step metrics
the loop fetches anyway at log and checkpoint steps, so guarding adds no host sync per step:
- `train.max_bad_steps` bad steps in a row ask for a rollback (a NaN in the parameters makes
  every step bad; skipping cannot cure that, an older checkpoint can). Under fp16 a skipped step
  whose loss is finite is the loss scaler's business (an overflow in the scaled gradients), so
  only non-finite losses count there.
- A loss more than `train.spike_zscore` standard deviations above the mean of the last
  `train.spike_window` good steps (judged once 20 are known) is a spike: with
  `train.spike_policy=rollback` it asks for a rollback too, with `warn` it is an event only. A
  spike never joins the history it is judged against.
- The standard deviation of the gradient norm over the last `train.grad_norm_window` steps
  above `train.grad_norm_std_alert` raises an alert when it crosses the threshold (not again
  until it has fallen back below).

`Alerts` is where every alert goes: the console, a metrics.jsonl event, the Prometheus counter,
and `train.alert_command` (run through sh with R1JAX_ALERT_KIND/_STEP/_MESSAGE/_RUN_DIR set,
not waited for). `Faults` injects `train.inject_faults` for fire drills and tests: `nan_data@S`
puts an out-of-range token id in step S's batch (the embedding lookup then yields NaN, as a
corrupt pre-tokenized file would), `spike@S` replaces step S's batch with uniformly random ids,
`nan_param@S` sets one parameter to NaN before step S, `stall@S` holds step S's batch back for
twice the watchdog's limit (a stuck reader). Each fires once per process lifetime.
"""
from __future__ import annotations

import collections
import dataclasses
import faulthandler
import math
import os
import subprocess
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from r1jax.config import DType, SpikePolicy, TrainConfig
from r1jax.train.metrics import log_line

MIN_HISTORY = 20          # losses known before a z-score is trusted


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Why the run should go back to its last good checkpoint."""
    kind: str              # "bad_steps" or "spike"
    first: int             # first step involved
    last: int              # the step it was seen at
    line: str


class Alerts:
    """Console line + metrics.jsonl event + exporter counter + the optional hook command."""

    def __init__(self, command: str | None, run_dir: str, writer, exporter=None):
        self.command, self.run_dir, self.writer, self.exporter = command, run_dir, writer, exporter
        self._hooks: list[subprocess.Popen] = []

    def __call__(self, kind: str, step: int, message: str, fields: dict | None = None, *, hook: bool = True) -> None:
        log_line(f"{'alert' if hook else 'note'}: {message}")
        self.writer.event(step, kind, {"message": message, **(fields or {})})
        if self.exporter is not None:
            self.exporter.event(kind)
        if hook and self.command and jax.process_index() == 0:
            env = {**os.environ, "R1JAX_ALERT_KIND": kind, "R1JAX_ALERT_STEP": str(step),
                   "R1JAX_ALERT_MESSAGE": message, "R1JAX_RUN_DIR": str(self.run_dir)}
            self._hooks = [p for p in self._hooks if p.poll() is None]      # reap finished hooks
            self._hooks.append(subprocess.Popen(["sh", "-c", self.command], env=env, stdin=subprocess.DEVNULL,
                                                start_new_session=True))

    def close(self, timeout_s: float = 10.0) -> None:
        """Give running hooks a moment (a page should not be cut off by the run's exit)."""
        for p in self._hooks:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log_line(f"note: train.alert_command still running after {timeout_s:g} s; left running")


class Guard:
    """Reads the per-step metrics of consecutive steps; see the module docstring."""

    def __init__(self, t: TrainConfig, alerts: Alerts):
        self.t, self.alerts = t, alerts
        self.fp16 = t.dtype is DType.fp16
        self.bad_run, self.bad_first = 0, 0
        self.losses: collections.deque = collections.deque(maxlen=t.spike_window)    # (step, loss)
        self.gnorms: collections.deque = collections.deque(maxlen=t.grad_norm_window)
        self.gn_alerting = False
        self.bad_total = self.spikes = 0

    def stats(self) -> dict:
        """Rolling gradient-norm mean and std (for the log record), once there are 2 norms."""
        if len(self.gnorms) < 2:
            return {}
        g = np.asarray(self.gnorms, np.float64)
        return {"grad_norm_mean": float(g.mean()), "grad_norm_std": float(g.std())}

    def forget_after(self, step: int) -> None:
        """A rollback to `step`: what came after it is no longer the run's history."""
        self.losses = collections.deque(((s, x) for s, x in self.losses if s <= step), maxlen=self.losses.maxlen)
        self.bad_run = 0

    def inspect(self, first: int, per_step: list[dict]) -> Verdict | None:
        """Judge steps first, first+1, ... from their metrics (host values)."""
        t = self.t
        for i, m in enumerate(per_step):
            s = first + i
            loss = float(np.asarray(m["loss"]))
            skipped = bool(float(np.asarray(m["skipped"])))
            bad = skipped and (not self.fp16 or not math.isfinite(loss))
            if bad:
                self.bad_total += 1
                self.alerts("bad_step", s, f"step {s}: loss {loss:.4g}, gradient norm {float(m['grad_norm']):.4g}; "
                            f"update skipped", {"loss": loss}, hook=False)
                self.bad_first = s if self.bad_run == 0 else self.bad_first
                self.bad_run += 1
                if self.bad_run >= t.max_bad_steps:
                    return Verdict("bad_steps", self.bad_first, s,
                                   f"{self.bad_run} bad steps in a row ({self.bad_first}-{s}: non-finite loss or "
                                   f"gradients; train.max_bad_steps={t.max_bad_steps})")
                continue
            self.bad_run = 0
            if skipped:
                continue
            z = self._zscore(loss)
            if z is not None and z > t.spike_zscore and t.spike_policy is not SpikePolicy.off:
                self.spikes += 1
                mean = np.mean([x for _, x in self.losses])
                line = (f"loss spike at step {s}: {loss:.4f} is {z:.1f} standard deviations above the mean "
                        f"{mean:.4f} of the last {len(self.losses)} steps (train.spike_zscore={t.spike_zscore:g})")
                self.alerts("spike", s, line, {"loss": loss, "zscore": z})
                if t.spike_policy is SpikePolicy.rollback:
                    return Verdict("spike", s, s, line)
            else:
                self.losses.append((s, loss))
            self._grad_norm(s, float(np.asarray(m["grad_norm"])))
        return None

    def _zscore(self, loss: float) -> float | None:
        if len(self.losses) < MIN_HISTORY:
            return None
        x = np.asarray([v for _, v in self.losses], np.float64)
        # a floor on the spread: a flat stretch of loss must not turn noise into a spike
        return (loss - x.mean()) / max(x.std(), 0.01 * abs(x.mean()), 1e-6) if math.isfinite(loss) else math.inf

    def _grad_norm(self, step: int, g: float) -> None:
        if not math.isfinite(g):
            return
        self.gnorms.append(g)
        thr = self.t.grad_norm_std_alert
        if not thr or len(self.gnorms) < self.gnorms.maxlen:
            return
        arr = np.asarray(self.gnorms, np.float64)
        std = float(arr.std())
        if std > thr and not self.gn_alerting:
            self.alerts("alert_grad_norm_std", step,
                        f"gradient norm std {std:.3f} over the last {len(arr)} steps exceeds "
                        f"train.grad_norm_std_alert={thr:g} (mean {arr.mean():.3f}) at step {step}",
                        {"std": std, "mean": float(arr.mean())})
        self.gn_alerting = std > thr


class Watchdog:
    """A thread that reports a loop making no progress for much longer than usual: a hang in a
    collective, a stuck reader, a straggler. Progress is `mark()`ed where the loop has waited for
    the device (each log or checkpoint step's metrics fetch) and after an eval or a save, so the
    usual gap is a log window: `interval_steps` x the median step time of the windows so far.
    Nothing is judged before the first window's step time is known (compiling takes long)."""

    def __init__(self, factor: float, min_s: float, stacks: bool, interval_steps: int, alerts: Alerts,
                 poll_s: float = 1.0):
        self.factor, self.min_s, self.stacks, self.interval, self.alerts = factor, min_s, stacks, interval_steps, alerts
        self.times: collections.deque = collections.deque(maxlen=50)
        self.last, self.step, self.reported_at = time.monotonic(), 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="r1jax-step-watchdog", daemon=True)
        self._thread.start()

    def step_time(self, seconds: float, step: int | None = None) -> None:
        self.times.append(seconds)
        if step is not None:
            self.step = step

    def mark(self, step: int | None = None) -> None:
        if self.reported_at is not None:
            log_line(f"watchdog: progress again after {time.monotonic() - self.last:.0f} s")
        self.last, self.reported_at = time.monotonic(), None
        if step is not None:
            self.step = step

    def limit(self) -> float:
        return max(self.min_s, self.factor * self.interval * float(np.median(self.times)))

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            if not self.times or self.reported_at is not None:
                continue
            limit, quiet = self.limit(), time.monotonic() - self.last
            if quiet > limit:
                self.reported_at = time.monotonic()
                med = float(np.median(self.times))
                self.alerts("watchdog", self.step,
                            f"watchdog: no progress for {quiet:.0f} s (a log window of {self.interval} steps "
                            f"usually takes {self.interval * med:.2f} s; train.watchdog_factor={self.factor:g}): a "
                            f"hang in a collective, a stuck data reader or a straggler", {"seconds": quiet})
                if self.stacks:
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Faults:
    """train.inject_faults: see the module docstring."""

    def __init__(self, specs: list[str], vocab_size: int, seed: int, watchdog: Watchdog | None = None):
        self.watchdog = watchdog
        self.plan: dict[int, list[str]] = {}
        for spec in specs:
            kind, _, at = spec.partition("@")
            self.plan.setdefault(int(at), []).append(kind)
        self.vocab, self.rng, self.fired = vocab_size, np.random.default_rng(seed), set()

    def _due(self, step: int, kind: str) -> bool:
        if kind in self.plan.get(step, ()) and (step, kind) not in self.fired:
            self.fired.add((step, kind))
            log_line(f"fire drill: {kind} at step {step} (train.inject_faults)")
            return True
        return False

    def batch(self, step: int, local: dict) -> dict:
        if not self.plan:
            return local
        if self._due(step, "nan_data"):
            ids = np.array(local["ids"])
            ids[0, 0] = self.vocab
            local = {**local, "ids": ids}
        if self._due(step, "spike"):
            local = {**local, "ids": self.rng.integers(0, self.vocab, local["ids"].shape).astype(local["ids"].dtype)}
        if self._due(step, "stall"):
            time.sleep(2 * self.watchdog.limit() if self.watchdog is not None and self.watchdog.times else 5.0)
        return local

    def state(self, step: int, state: dict) -> dict:
        if not self.plan or not self._due(step, "nan_param"):
            return state
        leaves, treedef = jax.tree.flatten(state["params"])
        a = leaves[0]
        poison = jax.jit(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), donate_argnums=0, out_shardings=a.sharding)
        leaves[0] = poison(a)
        return {**state, "params": jax.tree.unflatten(treedef, leaves)}

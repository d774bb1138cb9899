"""The training loop, for any step and any batches: log, evaluate, checkpoint, stop on signals.

`run` drives a jitted `step(state, batch) -> (state, metrics)` over host batches from `batches`
(placed with `place`), from step `start` to `end`. Every `log_every` steps it averages the
window's metrics and adds step time, tokens/s and MFU; every `eval_every` steps the `Evaluator`
runs; the `Checkpointer` saves on its schedule with the data iterator's state. SIGTERM or
SIGUSR1 (what SLURM sends before a time limit or a preemption) end the loop after the current
step, with several processes all at the same step. Eval and checkpoint time are kept out of
tokens/s. Pre-training, SFT, distillation and GRPO share it: they differ in the step and the
batches they hand in.
"""
from __future__ import annotations

import dataclasses
import math
import signal
import threading
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np

from r1jax.parallel import distributed
from r1jax.train.metrics import MetricsWriter, Progress, log_line

_EARLY = {"signum": 0}


def catch_stop_signals_early() -> None:
    """Record SIGTERM/SIGUSR1 from process start (their default action kills the process), so a
    signal that arrives while the run starts up still ends in a checkpoint at the first step."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, lambda signum, frame: _EARLY.update(signum=signum))


class StopSignal:
    """SIGTERM/SIGUSR1 set a flag the loop checks between steps (handlers only in the main thread).

    With several processes the flag is voted on every step (`agreed`), so that all of them stop
    at the same step even when only one was signalled."""

    def __init__(self):
        self.signum, _EARLY["signum"] = _EARLY["signum"], 0
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                self._old[sig] = signal.signal(sig, self._handle)
        self._vote = distributed.StopVote() if jax.process_count() > 1 else None

    def _handle(self, signum, frame):
        self.signum = signum

    def agreed(self) -> str | None:
        """The signal to stop on; call once per step on every process."""
        signum = self.signum if self._vote is None else self._vote(self.signum)
        return signal.Signals(signum).name if signum else None

    def restore(self):
        for sig, h in self._old.items():
            signal.signal(sig, h)


class Evaluator:
    """The run's evaluation: one eval step, built (and so compiled) once per run, over fresh
    held-out batches each time. `eval_step(state, batch)` returns {name: (sum, count)}; what is
    reported is each sum / count over the batches, `loss` (the objective's `lm_loss`) with its
    perplexity, and `tokens`."""

    def __init__(self, eval_step: Callable, batches: Callable[[], Iterator[dict]], n_batches: int,
                 place: Callable[[dict], Any], writer: MetricsWriter):
        self.step, self.batches, self.n, self.place, self.writer = eval_step, batches, n_batches, place, writer

    def __call__(self, state, step: int) -> dict:
        sums: dict[str, list[float]] = {}
        it = self.batches()
        for _ in range(self.n):
            local = next(it, None)
            if local is None:
                break
            for k, (s, c) in jax.device_get(self.step(state, self.place(local))).items():
                acc = sums.setdefault(k, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + float(s), acc[1] + float(c)
        if not sums or sums["lm_loss"][1] == 0:
            return {}
        out = {k: s / c for k, (s, c) in sums.items() if c}
        loss = out.pop("lm_loss")
        out = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": sums["lm_loss"][1], **out}
        self.writer.write(step, out, prefix="eval")
        log_line(f"eval @ {step}: loss {loss:.4f}, perplexity {out['perplexity']:.2f} over {int(out['tokens'])} tokens")
        return out


def summarise(window: list[dict]) -> dict:
    """Mean of each metric over the logged window's good steps (a skipped step's NaN would hide
    the others; `skipped` counts them); per-layer expert imbalance kept as a list."""
    out = {}
    good = [w for w in window if not float(w["skipped"])] or window
    for k in window[-1]:
        vals = np.asarray([w[k] for w in good], np.float64)
        if vals.ndim == 2:
            per_layer = vals.mean(0)
            out[k] = float(per_layer.max())
            out[k + "_layers"] = [float(x) for x in per_layer]
        else:
            out[k] = float(vals.mean())
    for k in ("lr", "loss_scale"):
        out[k] = float(np.asarray(window[-1][k]))
    out["skipped"] = float(sum(float(w["skipped"]) for w in window))
    return out


class RunFailed(RuntimeError):
    """The run cannot go on (bad steps with nothing to roll back to, too many rollbacks); one line."""


@dataclasses.dataclass
class Result:
    state: Any
    compile_s: float | None
    stopped: str | None        # None, "SIGTERM", "SIGUSR1", "train.stop_at" or "train.stop_at_eval_loss"
    batches: Iterator[dict]    # the data iterator the state goes with (a rollback replaces it)
    saveable: bool             # the last step was good: the state may be checkpointed


@dataclasses.dataclass
class Guarding:
    """What the loop needs beyond stepping: the guard (guard.py), fire drills, and how to roll
    back: `rollback(first_bad, done) -> (state, batches, step)` restores the last good checkpoint
    before step `first_bad` and skips the batches up to `done`."""
    guard: Any = None
    faults: Any = None
    rollback: Callable | None = None
    max_rollbacks: int = 0
    exporter: Any = None
    watchdog: Any = None


def run(step_fn: Callable, state, batches: Iterator[dict], *, place: Callable[[dict], Any], start: int, end: int,
        total: int, log_every: int, writer: MetricsWriter, checkpointer, save_meta: dict,
        evaluator: Evaluator | None, eval_every: int, tokens_per_step: int, flops_per_token: float,
        peak_flops: float, block_each_step: bool = False, guarding: Guarding | None = None,
        target_loss: float = 0.0, tokens_metric: str | None = None) -> Result:
    """Steps start+1 .. end (of `total`); see the module docstring. With `target_loss`, the loop
    also ends (stopped "train.stop_at_eval_loss") after the first eval whose loss is at or below it.
    `tokens_per_s` counts `tokens_per_step` a step, or with `tokens_metric` that per-step metric
    (GRPO's rows vary in length: it reports their real tokens).

    Per-step metrics are fetched (and judged by the guard) only at log and checkpoint steps and at
    the end: a checkpoint is written only when every step before it was judged and the last was
    good, so a bad state is never saved."""
    g = guarding or Guarding()
    progress = Progress(total, start)
    stop = StopSignal()
    last_t, last_step, compile_s, stopped = time.time(), start, None, None
    pending: list = []          # device metrics of steps not yet judged
    window: list[dict] = []     # judged host metrics since the last log
    wait, rollbacks, saveable, step, first_call = 0.0, 0, True, start, True
    try:
        while step < end:
            done = step + 1
            t0 = time.time()
            local = next(batches)
            if g.faults is not None:
                local, state = g.faults.batch(done, local), g.faults.state(done, state)
            batch = place(local)
            wait += time.time() - t0
            state, metrics = step_fn(state, batch)
            pending.append(metrics)
            if g.exporter is not None:
                g.exporter.step(done)
            if block_each_step or first_call:
                jax.block_until_ready(metrics)
                if first_call:
                    compile_s = time.time() - last_t
                    last_t, last_step, wait, first_call = time.time(), done, 0.0, False
            progress.update(done, metrics if progress.live else None)
            log_now = done % log_every == 0 or done == total
            save_now = checkpointer.should_save(done)
            asked = stop.agreed()
            if log_now or save_now or asked or done == end:
                host = jax.device_get(pending)
                pending = []
                verdict = g.guard.inspect(done - len(host) + 1, host) if g.guard is not None else None
                last = host[-1]
                saveable = not float(last["skipped"]) and math.isfinite(float(last["param_norm"]))
                if verdict is not None:
                    rollbacks += 1
                    if g.rollback is None or rollbacks > g.max_rollbacks:
                        why = ("this objective has no rollback" if g.rollback is None else
                               f"already rolled back {g.max_rollbacks} times (train.max_rollbacks)")
                        raise RunFailed(f"{verdict.line}; {why}; stopping")
                    state = None                     # free it before the checkpoint is read
                    state, batches, to = g.rollback(verdict.first, done)
                    g.guard.alerts("rollback", done, f"rolled back to the checkpoint of step {to} after the "
                                                     f"{verdict.kind.replace('_', ' ')} at step {verdict.last}, and "
                                                     f"skipped the batches of steps {to + 1}-{done}",
                                   {"reason": verdict.kind, "to_step": to, "skipped_batches": [to + 1, done]})
                    g.guard.forget_after(to)
                    window, saveable, step = [], True, to
                    last_t, last_step, wait = time.time(), to, 0.0
                    if g.watchdog is not None:
                        g.watchdog.mark(to)
                    continue
                window += host
                if g.watchdog is not None:
                    g.watchdog.mark(done)
            if log_now:
                vals = summarise(window)
                window = []
                now = time.time()
                steps = done - last_step
                if steps:
                    vals["step_time"] = (now - last_t) / steps
                    vals["data_wait"] = wait / steps
                    n = vals[tokens_metric] if tokens_metric else tokens_per_step
                    vals["tokens_per_s"] = n / max(vals["step_time"], 1e-9)
                    vals["mfu"] = flops_per_token * vals["tokens_per_s"] / peak_flops
                # else the window held only the compiling step: nothing is timed, so no timing keys
                if g.guard is not None:
                    vals.update(g.guard.stats())
                last_t, last_step, wait = now, done, 0.0
                writer.write(done, vals)
                progress.log(done, vals)
                if g.exporter is not None:
                    g.exporter.log(done, vals)
                if g.watchdog is not None and steps:
                    g.watchdog.step_time(vals["step_time"])
            paused = time.time()
            reached = False
            if evaluator is not None and eval_every and done % eval_every == 0 and done < total:
                ev = evaluator(state, done)
                if g.exporter is not None and ev:
                    g.exporter.eval(done, ev)
                reached = bool(target_loss and ev and ev["loss"] <= target_loss)
            if asked or (done == end < total) or reached:
                stopped = asked or ("train.stop_at_eval_loss" if reached else "train.stop_at")
                break
            if save_now:
                if saveable:
                    t_save = time.time()
                    checkpointer.save(state, batches, meta=save_meta)
                    if g.exporter is not None:
                        g.exporter.checkpoint_saved(done, time.time() - t_save)
                else:
                    log_line(f"note: checkpoint of step {done} not written: the step was bad (skipped update "
                             f"or non-finite parameters)")
            if g.watchdog is not None and time.time() - paused > 1.0:
                g.watchdog.mark(done)        # an eval or a save is progress too
            last_t += time.time() - paused
            step = done
    finally:
        stop.restore()
        progress.close()
    return Result(state, compile_s, stopped, batches, saveable)

"""Prometheus /metrics for one training process (train.metrics_port; launch/monitoring/README.md).

Process 0 exports the run: the step and when it was taken, the loop's log record (loss, learning
rate, gradient norm and the guard's window statistics, tokens/s, MFU, step and data-wait time,
expert imbalance per MoE layer), eval loss, checkpoints, and counters of the guard's events
(guard.Alerts). Every process exports its own devices' memory and, on NVIDIA GPUs, their
utilisation and temperature through NVML, read at scrape time and labelled with `process`; a
multi-host job so runs one exporter per process, and Prometheus scrapes them all
(launch/monitoring/prometheus-slurm.yml).

The run's values are kept as plain numbers and turned into metric families only when scraped,
so a series is absent until its first value: a loss of 0 before the first log, or an MTP loss on
a model without MTP, would be a lie. The text format is served by a small http.server handler,
not prometheus_client's start_http_server, whose content negotiation answers Prometheus 2.x's
OpenMetrics Accept header with name escaping (tests/prom.py). The registry is the exporter's
own: Orbax and Grain register theirs in the global one.
"""
from __future__ import annotations

import errno
import os
import resource
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jax
import psutil
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

from r1jax.config import ConfigError

# the loop's log record: key -> (gauge, help). A key missing from a record leaves its series as it was.
LOG_GAUGES = {
    "loss": ("r1jax_train_loss", "Training loss (LM + MTP), mean over the log window."),
    "lm_loss": ("r1jax_train_lm_loss", "Next-token cross-entropy, mean over the log window."),
    "mtp_loss": ("r1jax_train_mtp_loss", "Multi-token-prediction loss, mean over the log window."),
    "lr": ("r1jax_train_learning_rate", "Learning rate at the last step."),
    "grad_norm": ("r1jax_train_grad_norm", "Global gradient norm, mean over the log window."),
    "grad_norm_mean": ("r1jax_train_grad_norm_window_mean",
                       "Mean gradient norm over the guard's window (train.grad_norm_window steps)."),
    "grad_norm_std": ("r1jax_train_grad_norm_window_std",
                      "Standard deviation of the gradient norm over the guard's window."),
    "param_norm": ("r1jax_train_param_norm", "Global parameter norm after the last step."),
    "tokens_per_s": ("r1jax_train_tokens_per_second", "Training tokens per second over the log window."),
    "mfu": ("r1jax_train_mfu_ratio", "Model FLOPs utilisation over the log window, 0-1."),
    "step_time": ("r1jax_train_step_time_seconds", "Wall time per step over the log window."),
    "data_wait": ("r1jax_train_data_wait_seconds", "Time per step spent waiting for the next batch."),
    "expert_imbalance": ("r1jax_train_expert_imbalance_max",
                         "Max over MoE layers of (max expert load / mean expert load)."),
    "dropped_frac": ("r1jax_train_dropped_tokens_ratio", "Fraction of routed tokens dropped by expert capacity."),
    "balance_loss": ("r1jax_train_balance_loss", "Auxiliary load-balance loss."),
    "loss_scale": ("r1jax_train_loss_scale", "fp16 dynamic loss scale."),
    "reward_mean": ("r1jax_train_reward_mean", "GRPO: mean reward of the step's rollouts."),
}
EVAL_GAUGES = {
    "loss": ("r1jax_train_eval_loss", "Held-out next-token loss at the last eval."),
    "perplexity": ("r1jax_train_eval_perplexity", "Held-out perplexity at the last eval."),
    "reward_mean": ("r1jax_train_eval_reward_mean", "GRPO: held-out mean reward at the last eval."),
}
RUN_GAUGES = {
    "r1jax_train_step": "Last step taken.",
    "r1jax_train_last_step_timestamp_seconds": "Unix time of the last step (time() - it: seconds without a step).",
    "r1jax_train_start_time_seconds": "Unix time the exporter (the run) started.",
    "r1jax_train_checkpoint_save_duration_seconds": "Seconds the last checkpoint save held the loop.",
    "r1jax_train_last_checkpoint_timestamp_seconds": "Unix time the last checkpoint save returned.",
    "r1jax_train_last_checkpoint_step": "Step of the last checkpoint saved.",
}
LAYER_GAUGE = ("r1jax_train_expert_imbalance", "Per MoE layer (label layer: index among the MoE layers): "
               "max expert load / mean expert load over the log window.")
# guard.Alerts kinds with a counter of their own; every kind also counts in r1jax_train_alerts_total{kind}
EVENTS = {"bad_step": "r1jax_train_bad_steps", "rollback": "r1jax_train_rollbacks", "spike": "r1jax_train_loss_spikes"}
ALERT_KINDS = ("bad_step", "rollback", "spike", "alert_grad_norm_std", "watchdog", "checkpoint_error")
COUNTERS = {
    "r1jax_train_skipped_steps": "Steps whose update was skipped (non-finite loss or gradient, fp16 overflow).",
    "r1jax_train_bad_steps": "Steps the guard judged bad (non-finite; fp16 overflows excluded).",
    "r1jax_train_rollbacks": "Rollbacks to the last good checkpoint.",
    "r1jax_train_loss_spikes": "Loss spikes (z-score above train.spike_zscore).",
    "r1jax_train_checkpoints_saved": "Checkpoints saved.",
}
ALERTS_COUNTER = ("r1jax_train_alerts", "Events of the guard, watchdog and checkpointer, by kind.")
DEVICE_GAUGES = {
    "used": ("r1jax_train_device_memory_used_bytes", "Device memory in use (CPU: the process RSS)."),
    "peak": ("r1jax_train_device_memory_peak_bytes", "Peak device memory in use (CPU: the process's peak RSS)."),
    "limit": ("r1jax_train_device_memory_limit_bytes", "Device memory limit (CPU: the machine's RAM)."),
}
GPU_GAUGES = {
    "util": ("r1jax_train_gpu_utilization_percent", "NVML: percent of time a kernel ran on the GPU."),
    "temp": ("r1jax_train_gpu_temperature_celsius", "NVML: GPU die temperature."),
}
INFO = ("r1jax_train_info", "The run (value 1): its directory and process count.")

# every name the exporter can expose (counters as exposed, with _total): what dashboards and alerts may use
METRICS = tuple([n for n, _ in LOG_GAUGES.values()] + [n for n, _ in EVAL_GAUGES.values()] + list(RUN_GAUGES)
                + [LAYER_GAUGE[0]] + [n + "_total" for n in (*COUNTERS, ALERTS_COUNTER[0])]
                + [n for n, _ in DEVICE_GAUGES.values()] + [n for n, _ in GPU_GAUGES.values()] + [INFO[0]])


def _number(x) -> float:
    """A record's value as a float; NaN for what is not a number (the exporter must never stop a run)."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def _numbers(table: dict, vals: dict) -> dict[str, float]:
    return {name: _number(vals[k]) for k, (name, _) in table.items() if k in vals}


class _Run:
    """Process 0's training series as plain values, made into families at scrape time."""

    def __init__(self):
        self.lock = threading.Lock()
        self.gauges: dict[str, float] = {"r1jax_train_start_time_seconds": time.time()}
        self.layers: list[float] = []
        # counters exist from the start at 0: increase() needs the sample before the first event
        self.counters = dict.fromkeys(COUNTERS, 0.0)
        self.alerts = dict.fromkeys(ALERT_KINDS, 0.0)
        self.help = {**RUN_GAUGES, **dict(LOG_GAUGES.values()), **dict(EVAL_GAUGES.values())}

    def collect(self):
        with self.lock:
            gauges, layers = dict(self.gauges), list(self.layers)
            counters, alerts = dict(self.counters), dict(self.alerts)
        for name, v in gauges.items():
            yield GaugeMetricFamily(name, self.help[name], value=v)
        if layers:
            g = GaugeMetricFamily(*LAYER_GAUGE, labels=["layer"])
            for i, v in enumerate(layers):
                g.add_metric([str(i)], v)
            yield g
        for name, v in counters.items():
            yield CounterMetricFamily(name, COUNTERS[name], value=v)
        c = CounterMetricFamily(*ALERTS_COUNTER, labels=["kind"])
        for kind, v in alerts.items():
            c.add_metric([kind], v)
        yield c


class _System:
    """This process's devices, read when scraped: allocator stats (CPU: RSS against RAM) and NVML.
    Whatever cannot be read is left out, silently: a scrape must not fail, nor the log fill up."""

    def __init__(self, process_index: int, process_count: int, run_dir: str):
        self.process = str(process_index)
        self.info = {"run_dir": run_dir, "process_count": str(process_count)}
        self.devices = jax.local_devices()
        self.proc = psutil.Process(os.getpid())
        self.nvml, self.gpus = None, []
        if any(d.platform in ("gpu", "cuda") for d in self.devices):
            self._nvml_init()

    def _nvml_init(self) -> None:
        try:
            import pynvml
            pynvml.nvmlInit()
        except Exception:            # no nvidia-ml-py or no driver library: no GPU series
            return
        self.nvml = pynvml
        # this process's GPUs: CUDA_VISIBLE_DEVICES as SLURM and launchers set it (UUIDs, or CUDA
        # ordinals, which are NVML's indices on a node of identical GPUs); unset, every GPU of the
        # host. One NVML cannot open (another job's, behind a cgroup) is left out.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [v.strip() for v in visible.split(",") if v.strip()] if visible is not None else \
            [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        for v in ids:
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(int(v)) if v.isdigit() else pynvml.nvmlDeviceGetHandleByUUID(v)
                self.gpus.append((str(pynvml.nvmlDeviceGetIndex(h)), h))
            except Exception:
                continue

    def memory(self) -> list[tuple[str, dict]]:
        rows = []
        for d in self.devices:
            try:
                stats = d.memory_stats() or {}
            except Exception:
                stats = {}
            if "bytes_in_use" in stats:
                rows.append((f"{d.platform}:{d.id}", {"used": stats["bytes_in_use"],
                                                       "peak": stats.get("peak_bytes_in_use"),
                                                       "limit": stats.get("bytes_limit")}))
        if rows:
            return rows
        # CPU devices have no allocator stats: they share the process's memory and the host's RAM.
        # ru_maxrss (KiB on Linux, bytes on macOS) lags the current RSS by a page or two at times
        rss = self.proc.memory_info().rss
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return [("cpu", {"used": rss, "peak": max(peak, rss), "limit": psutil.virtual_memory().total})]

    def collect(self):
        info = GaugeMetricFamily(*INFO, labels=["process", *self.info])
        info.add_metric([self.process, *self.info.values()], 1)
        yield info
        try:
            rows = self.memory()
        except Exception:
            rows = []
        for key, (name, doc) in DEVICE_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["process", "device"])
            for dev, vals in rows:
                if vals.get(key) is not None:
                    g.add_metric([self.process, dev], float(vals[key]))
            yield g
        if not self.gpus:
            return
        util = GaugeMetricFamily(*GPU_GAUGES["util"], labels=["process", "gpu"])
        temp = GaugeMetricFamily(*GPU_GAUGES["temp"], labels=["process", "gpu"])
        for idx, h in self.gpus:
            try:
                util.add_metric([self.process, idx], self.nvml.nvmlDeviceGetUtilizationRates(h).gpu)
                temp.add_metric([self.process, idx], self.nvml.nvmlDeviceGetTemperature(h, self.nvml.NVML_TEMPERATURE_GPU))
            except Exception:
                continue
        yield util
        yield temp

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
            self.nvml, self.gpus = None, []


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry      # set on the per-exporter subclass

    def do_GET(self):
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "only /metrics here")
            return
        body = generate_latest(self.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):   # a line per scrape would bury the training log
        pass


class TrainExporter:
    """Serves Prometheus text-format /metrics for one training process."""

    def __init__(self, host: str, port: int, *, process_index: int, process_count: int, run_dir: str):
        self.registry = CollectorRegistry()
        self._run = _Run() if process_index == 0 else None
        self._system = _System(process_index, process_count, run_dir)
        if self._run is not None:
            self.registry.register(self._run)
        self.registry.register(self._system)
        handler = type("TrainMetricsHandler", (_Handler,), {"registry": self.registry})
        try:
            self._server = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            self._system.close()
            if e.errno == errno.EADDRINUSE:
                msg = f"{host}:{port} is already in use (another run on this host?); pick another port"
            else:
                msg = f"cannot listen on {host}:{port} ({e.strerror or e})"
            raise ConfigError(f"train.metrics_port={port}: {msg}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="r1jax-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def _set(self, **gauges: float) -> None:
        with self._run.lock:
            self._run.gauges.update(gauges)

    def step(self, step: int) -> None:
        if self._run is not None:
            self._set(r1jax_train_step=step, r1jax_train_last_step_timestamp_seconds=time.time())

    def log(self, step: int, vals: dict) -> None:
        if self._run is None:
            return
        gauges = _numbers(LOG_GAUGES, vals)
        with self._run.lock:
            self._run.gauges.update(gauges)
            if isinstance(vals.get("expert_imbalance_layers"), (list, tuple)):
                self._run.layers = [_number(x) for x in vals["expert_imbalance_layers"]]
            skipped = _number(vals.get("skipped", 0.0))
            if skipped > 0:             # (NaN compares False: a counter only grows)
                self._run.counters["r1jax_train_skipped_steps"] += skipped

    def eval(self, step: int, vals: dict) -> None:
        if self._run is not None:
            self._set(**_numbers(EVAL_GAUGES, vals))

    def checkpoint_saved(self, step: int, seconds: float) -> None:
        if self._run is None:
            return
        self._set(r1jax_train_checkpoint_save_duration_seconds=seconds,
                  r1jax_train_last_checkpoint_timestamp_seconds=time.time(), r1jax_train_last_checkpoint_step=step)
        with self._run.lock:
            self._run.counters["r1jax_train_checkpoints_saved"] += 1

    def event(self, kind: str) -> None:
        if self._run is None:
            return
        with self._run.lock:
            self._run.alerts[kind] = self._run.alerts.get(kind, 0.0) + 1
            if kind in EVENTS:
                self._run.counters[EVENTS[kind]] += 1

    def close(self) -> None:
        """Stops serving and frees the port; safe to call twice."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=10)
        self._server.server_close()
        self._system.close()

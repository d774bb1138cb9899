"""Prometheus metrics under vLLM's own names and buckets.

Exactly vLLM's names (`vllm:...`, labels `model_name` and `engine`), not an `r1jax:` copy of
them: dashboards, alerts and load tools written for vLLM (its Grafana JSON, `vllm bench serve`
users' PromQL) then work on r1jax unchanged. What vLLM has no name for is `r1jax:...`: device
memory (the 90% alert's input) and rejected requests. Buckets are vLLM's; the end-to-end ones
have an edge at 0.5 s, so the SLA fraction `le="0.5"` / count is exact.
"""
from __future__ import annotations

import os

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class Metrics:
    """The server's metrics in their own registry (served at /metrics)."""

    def __init__(self, model_name: str, device=None):
        self.registry = r = CollectorRegistry()
        L = ["model_name", "engine"]
        self.labels = {"model_name": model_name, "engine": "0"}

        def g(name, doc):
            return Gauge(name, doc, L, registry=r).labels(**self.labels)

        def h(name, doc, buckets):
            return Histogram(name, doc, L, buckets=buckets, registry=r).labels(**self.labels)

        self.running = g("vllm:num_requests_running", "Requests in decode slots.")
        self.waiting = g("vllm:num_requests_waiting", "Requests waiting for a slot.")
        self.kv_usage = g("vllm:kv_cache_usage_perc", "Fraction of decode slots (cache rows) in use, 0-1.")
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.", L, registry=r).labels(**self.labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", L,
                                         registry=r).labels(**self.labels)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               L + ["finished_reason"], registry=r)
        self.ttft = h("vllm:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.tpot = h("vllm:time_per_output_token_seconds", "Per request: (e2e - ttft) / (tokens - 1).", TPOT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Gap between tokens as delivered.", TPOT_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Arrival to the last token.", REQUEST_BUCKETS)
        self.queue = h("vllm:request_queue_time_seconds", "Arrival to prefill.", REQUEST_BUCKETS)
        self.req_prompt = h("vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.req_gen = h("vllm:request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self.iteration_tokens = h("vllm:iteration_tokens_total", "Tokens one engine decode call emitted.",
                                  (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
        self.rejected = Counter("r1jax:requests_rejected", "Requests answered with an HTTP error, by status code.",
                                ["model_name", "code"], registry=r)
        self.mem_used = Gauge("r1jax:device_memory_used_bytes", "Device memory in use (CPU: the process RSS).",
                              ["model_name", "device"], registry=r)
        self.mem_limit = Gauge("r1jax:device_memory_limit_bytes", "Device memory limit (CPU: the machine's RAM).",
                               ["model_name", "device"], registry=r)
        self.device = device
        info = Gauge("r1jax:engine_config_info", "The engine's batching settings (value 1).",
                     ["model_name", "max_batch_size", "preferred_batch_sizes", "max_queue_delay_ms"], registry=r)
        self._info = info

    def config(self, cfg) -> None:
        self._info.labels(self.labels["model_name"], str(cfg.max_batch_size),
                          ",".join(map(str, cfg.preferred_batch_sizes)), str(cfg.max_queue_delay_ms)).set(1)

    # engine hooks ------------------------------------------------------------------
    def load(self, running: int, waiting: int, usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(usage)

    def queue_time(self, s: float) -> None:
        self.queue.observe(s)

    def first_token(self, s: float, prompt_tokens: int) -> None:
        self.ttft.observe(s)
        self.prompt_tokens.inc(prompt_tokens)
        self.req_prompt.observe(prompt_tokens)
        self.generation_tokens.inc()

    def inter_token(self, s: float, tokens: int) -> None:
        self.generation_tokens.inc(tokens)
        for _ in range(tokens):
            self.itl.observe(s)

    def finished(self, job, reason: str, c=None) -> None:
        self.success.labels(**self.labels, finished_reason=reason).inc()
        if c is None or job.first is None:
            return
        e2e = job.last - job.arrived
        self.e2e.observe(e2e)
        self.req_gen.observe(c.completion_tokens)
        if c.completion_tokens > 1:
            self.tpot.observe((job.last - job.first) / (c.completion_tokens - 1))

    def iteration(self, tokens: int) -> None:
        self.iteration_tokens.observe(tokens)

    def reject(self, code: int) -> None:
        self.rejected.labels(self.labels["model_name"], str(code)).inc()

    def sample_memory(self) -> None:
        """Device memory now: the accelerator's allocator stats, or on CPU the process RSS
        against the machine's RAM."""
        name = self.labels["model_name"]
        stats = None
        if self.device is not None and self.device.platform != "cpu":
            try:
                stats = self.device.memory_stats()
            except Exception:
                stats = None
        if stats and "bytes_limit" in stats:
            dev = f"{self.device.platform}:{self.device.id}"
            used, limit = stats.get("bytes_in_use", 0), stats["bytes_limit"]
        else:
            dev = "cpu:0"
            used, limit = psutil.Process(os.getpid()).memory_info().rss, psutil.virtual_memory().total
        self.mem_used.labels(name, dev).set(used)
        self.mem_limit.labels(name, dev).set(limit)

"""Load test of an OpenAI-compatible completions server, with vLLM's `vllm bench serve` definitions.

    python bench/serve_load.py --url http://127.0.0.1:PORT --clients N --requests M [--duration-s T]
        [--arrival closed|poisson] [--rate QPS] [--prompt TEXT | --prompt-ids-len L] [--max-tokens K]
        [--temperature 0] [--model NAME] [--api-key KEY] [--server-pid PID] [--warmup W]
        [--out PREFIX] [--label TEXT]
    python bench/serve_load.py --serve-model SRC [--serve-args "--max-batch-size 1 ..."]
        [--compare-batching] --clients N --requests M ...
    python bench/serve_load.py --print-md-header      # the header that PREFIX.md rows go under

Every request is a streamed POST {url}/v1/completions (ignore_eos, usage in the last chunk).
  TTFT: send -> first chunk with non-empty text.   ITL: gaps between successive text chunks.
  E2E: send -> `data: [DONE]`.   TPOT: (E2E - TTFT) / (output tokens - 1), requests with > 1 token.
  Output tokens: the usage chunk's completion_tokens, else the number of text chunks.
  Error: a non-200 status, an {"error": ...} chunk, no [DONE], an exception or the per-request
  timeout. QPS = completed / duration; E2E<=500ms is over all requests sent (errors count as over).
Arrival: `closed` runs N workers that each send the next request when their last one ends;
`poisson` sends at --rate per second with exponential gaps (seeded), at most N in flight. Both stop
after M requests or --duration-s; requests in flight then are awaited (--request-timeout-s each).
As in vLLM, time a poisson arrival waits for a free slot client-side is not part of its TTFT.
The server's VmRSS (/proc/PID/status) is read before and after the load and sampled every 0.5 s.
--serve-model starts `python -m r1jax.serve --model SRC --host 127.0.0.1 --port P SERVE_ARGS`
itself, waits for GET /health, measures, and stops it (SIGTERM, SIGKILL after 20 s), also on
Ctrl-C. --compare-batching measures the same load against the server as given and with
--max-batch-size 1, and prints the ratios. Exit: 0 no errors, 1 errors (or nothing completed), 2 bad
arguments. Needs httpx and numpy. Importable: LoadConfig, `await run_load(cfg)`, summarize(records).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
SLO_MS = 500.0
MD_HEADER = ("| label | arrival | clients | sent | max tokens | completed | errors | duration s | QPS | out tok/s "
             "| total tok/s | TTFT p50/p90/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms | E2E p50/p90/p99 ms "
             "| E2E<=500ms | RSS before/after/peak MiB | cpu avg10 start/end |\n" + "|---" * 18 + "|")


@dataclasses.dataclass
class LoadConfig:
    url: str
    clients: int
    requests: int
    model: str | None = None           # None: the first id of GET /v1/models
    api_key: str | None = None
    duration_s: float = 300.0
    arrival: str = "closed"            # closed | poisson
    rate: float | None = None          # requests per second, poisson only
    prompt: str = DEFAULT_PROMPT
    prompt_ids_len: int | None = None  # send token ids instead of `prompt`
    max_tokens: int = 16
    temperature: float = 0.0
    server_pid: int | None = None
    request_timeout_s: float = 120.0
    warmup: int = 0                    # requests sent (closed, min(clients, warmup) at once) and dropped
    seed: int = 0


def prompt_for(cfg: LoadConfig, index: int) -> str | list[int]:
    if cfg.prompt_ids_len is None:
        return cfg.prompt
    return np.random.default_rng((cfg.seed, index)).integers(3, 200, size=cfg.prompt_ids_len).tolist()


# ---------------------------------------------------------------- one request

async def one_request(client, cfg: LoadConfig, index: int, t0: float) -> dict:
    """Send request `index` and read its stream; the record's times are seconds (start/end from t0)."""
    prompt = prompt_for(cfg, index)
    body = {"model": cfg.model, "prompt": prompt, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    rec = {"index": index, "ok": False, "status": None, "error": None, "ttft": None, "itl": [], "e2e": None,
           "output_tokens": 0, "prompt_tokens": len(prompt) if isinstance(prompt, list) else None}
    sent = time.perf_counter()
    rec["start"] = sent - t0
    try:
        await asyncio.wait_for(_stream(client, cfg.url.rstrip("/") + "/v1/completions", body, headers, rec, sent),
                               cfg.request_timeout_s)
    except asyncio.TimeoutError:
        rec["error"] = f"timeout after {cfg.request_timeout_s:g} s"
    except Exception as e:  # noqa: BLE001 - any failure of one request is that request's error
        rec["error"] = f"{type(e).__name__}: {e}"[:200]
    rec["end"] = time.perf_counter() - t0
    rec["ok"] = rec["error"] is None
    return rec


async def _stream(client, url: str, body: dict, headers: dict, rec: dict, sent: float) -> None:
    chunks, last, usage = 0, None, None
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        rec["status"] = resp.status_code
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            rec["error"] = f"HTTP {resp.status_code}: {' '.join(text.split())[:160]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue                               # blank separators, ": keep-alive" comments
            payload = line[5:].strip()
            now = time.perf_counter()
            if payload == "[DONE]":
                rec["e2e"] = now - sent
                break
            obj = json.loads(payload)
            if "error" in obj:
                err = obj["error"]
                rec["error"] = "error chunk: " + str(err.get("message", err) if isinstance(err, dict) else err)[:160]
                return
            if obj.get("usage"):
                usage = obj["usage"]
            if any(c.get("text") for c in obj.get("choices") or ()):
                chunks += 1
                if last is None:
                    rec["ttft"] = now - sent
                else:
                    rec["itl"].append(now - last)
                last = now
    if rec["e2e"] is None:
        rec["error"] = "stream ended without [DONE]"
        return
    rec["output_tokens"] = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else chunks
    if usage and "prompt_tokens" in usage:
        rec["prompt_tokens"] = int(usage["prompt_tokens"])


# ---------------------------------------------------------------- machine readings

def read_rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


def read_cpu() -> dict:
    """Load average (1 min) and /proc/pressure/cpu `some avg10` (None where the kernel lacks PSI)."""
    avg10 = None
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0].split()
        avg10 = float(dict(kv.split("=") for kv in some[1:])["avg10"])
    except (OSError, ValueError, KeyError, IndexError):
        pass
    return {"loadavg_1m": round(os.getloadavg()[0], 2), "psi_cpu_avg10": avg10}


def warn_if_busy(when: str, cpu: dict) -> None:
    if cpu["psi_cpu_avg10"] is not None and cpu["psi_cpu_avg10"] > 10:
        print(f"WARNING: machine busy at {when}: /proc/pressure/cpu avg10 = {cpu['psi_cpu_avg10']:.1f} "
              f"(load average {cpu['loadavg_1m']}); timings are distorted", flush=True)


async def sample_rss(pid: int, peak: list[float], series: list[list[float]], every_s: float = 10.0) -> None:
    """The peak every 0.5 s; [seconds, MiB] into `series` every `every_s` (a soak's trend)."""
    t0 = last = time.perf_counter()
    while True:
        rss = read_rss_mib(pid)
        if rss is not None:
            peak[0] = max(peak[0], rss)
            if not series or time.perf_counter() - last >= every_s:
                last = time.perf_counter()
                series.append([round(last - t0, 1), round(rss, 2)])
        await asyncio.sleep(0.5)


def rss_halves(series: list[list[float]], after: float | None) -> tuple[float, float] | None:
    """RSS growth (MiB) over the first and the second half of the run: a leak grows in both,
    warm-up growth (allocator pools, caches) only in the first."""
    pts = series + ([[float("inf"), after]] if after is not None else [])
    if len(pts) < 3:
        return None
    mid = pts[len(pts) // 2][1]
    return round(mid - pts[0][1], 2), round(pts[-1][1] - mid, 2)


# ---------------------------------------------------------------- the load

async def _closed(client, cfg: LoadConfig, n_requests: int, workers: int, t0: float, deadline: float,
                  first_index: int = 0) -> list[dict]:
    records, sent = [], 0

    async def worker():
        nonlocal sent
        while sent < n_requests and time.perf_counter() < deadline:
            index, sent = first_index + sent, sent + 1
            records.append(await one_request(client, cfg, index, t0))

    await asyncio.gather(*(worker() for _ in range(workers)))
    return records


async def _poisson(client, cfg: LoadConfig, t0: float, deadline: float) -> list[dict]:
    rng, gate, tasks = np.random.default_rng(cfg.seed), asyncio.Semaphore(cfg.clients), []

    async def send(index):
        async with gate:                                # queued arrivals past the deadline are dropped
            return await one_request(client, cfg, index, t0) if time.perf_counter() < deadline else None

    for index in range(cfg.requests):
        if time.perf_counter() >= deadline:
            break
        tasks.append(asyncio.create_task(send(index)))
        if index + 1 < cfg.requests:
            await asyncio.sleep(min(rng.exponential(1.0 / cfg.rate), max(0.0, deadline - time.perf_counter())))
    return [r for r in await asyncio.gather(*tasks) if r is not None]


async def first_model(client, url: str, headers: dict) -> str:
    resp = await client.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def run_load(cfg: LoadConfig, transport=None) -> dict:
    """Run the load of `cfg`: {"config", "records", "summary", "rss_mib", "cpu_start", "cpu_end"}.
    `transport`: an httpx transport for tests (httpx.MockTransport)."""
    import httpx

    limits = httpx.Limits(max_connections=cfg.clients + 2, max_keepalive_connections=cfg.clients + 2)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport) as client:
        if cfg.model is None:
            auth = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
            try:
                cfg = dataclasses.replace(cfg, model=await first_model(client, cfg.url, auth))
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                raise RuntimeError(f"GET {cfg.url}/v1/models gave no model name ({type(e).__name__}: {e}); "
                                   "pass --model") from e
        warm = []
        if cfg.warmup:
            t = time.perf_counter()
            warm = await _closed(client, cfg, cfg.warmup, min(cfg.clients, cfg.warmup), t, t + cfg.duration_s,
                                 first_index=cfg.requests)      # prompts unlike the measured ones
            bad = sum(not r["ok"] for r in warm)
            print(f"warm-up: {len(warm)} requests, {bad} errors, {time.perf_counter() - t:.1f} s", flush=True)
        cpu_start, rss_before = read_cpu(), read_rss_mib(cfg.server_pid)
        warn_if_busy("start", cpu_start)
        peak, series = [rss_before or 0.0], []
        sampler = asyncio.create_task(sample_rss(cfg.server_pid, peak, series)) if cfg.server_pid else None
        t0 = time.perf_counter()
        try:
            if cfg.arrival == "closed":
                records = await _closed(client, cfg, cfg.requests, cfg.clients, t0, t0 + cfg.duration_s)
            else:
                records = await _poisson(client, cfg, t0, t0 + cfg.duration_s)
            duration = time.perf_counter() - t0
        finally:
            if sampler:
                sampler.cancel()
    rss_after, cpu_end = read_rss_mib(cfg.server_pid), read_cpu()
    warn_if_busy("end", cpu_end)
    records.sort(key=lambda r: r["index"])
    rss = {"before": rss_before, "after": rss_after,
           "peak": max(peak[0], rss_after or 0.0) if cfg.server_pid and rss_before is not None else None,
           "series": series, "halves": rss_halves(series, rss_after)}
    config = {**dataclasses.asdict(cfg), "api_key": "***" if cfg.api_key else None}
    return {"config": config, "records": records, "summary": summarize(records, duration),
            "warmup_errors": sum(not r["ok"] for r in warm), "rss_mib": rss, "cpu_start": cpu_start,
            "cpu_end": cpu_end}


# ---------------------------------------------------------------- numbers

def _pct(values: list[float], q: float, scale: float = 1000.0) -> float | None:
    return round(float(np.percentile(values, q)) * scale, 3) if values else None


def summarize(records: list[dict], duration_s: float | None = None) -> dict:
    """vLLM's serving metrics from per-request records (times in seconds; the summary's in ms).
    `duration_s`: the load's wall time; by default first start to last end of the records."""
    ok = [r for r in records if r["ok"]]
    errors = [r for r in records if not r["ok"]]
    if duration_s is None:
        duration_s = max((r["end"] for r in records), default=0.0) - min((r["start"] for r in records), default=0.0)
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok
            if r["ttft"] is not None and r["output_tokens"] > 1]
    itl = [gap for r in ok for gap in r["itl"]]
    e2e = [r["e2e"] for r in ok]
    messages, by_status = [], {}
    for r in errors:
        key = "no status" if r["status"] is None else str(r["status"])
        by_status[key] = by_status.get(key, 0) + 1
        if r["error"] not in messages and len(messages) < 5:
            messages.append(r["error"])
    per_s = (lambda n: round(n / duration_s, 3)) if duration_s > 0 else (lambda n: None)
    return {
        "sent": len(records), "completed": len(ok), "errors": len(errors), "error_statuses": by_status,
        "error_messages": messages, "duration_s": round(duration_s, 3), "qps": per_s(len(ok)),
        "output_tokens": out_tokens, "prompt_tokens": in_tokens,
        "output_tok_s": per_s(out_tokens), "total_tok_s": per_s(out_tokens + in_tokens),
        "ttft_ms": {"p50": _pct(ttft, 50), "p90": _pct(ttft, 90), "p99": _pct(ttft, 99)},
        "tpot_ms": {"p50": _pct(tpot, 50), "p99": _pct(tpot, 99)},
        "itl_ms": {"p50": _pct(itl, 50), "p99": _pct(itl, 99)},
        "e2e_ms": {"p50": _pct(e2e, 50), "p90": _pct(e2e, 90), "p99": _pct(e2e, 99)},
        "e2e_le_500ms_frac": round(sum(t * 1000 <= SLO_MS for t in e2e) / len(records), 4) if records else None,
    }


def _f(x, digits: int = 1) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def text_summary(run: dict) -> str:
    s, c, rss = run["summary"], run["config"], run["rss_mib"]
    lines = [f"== {run['label'] or c['url']}: {c['arrival']} arrival, {c['clients']} clients"
             + (f", {c['rate']:g} req/s" if c["arrival"] == "poisson" else "") + f", max_tokens {c['max_tokens']}",
             f"requests   {s['completed']} completed, {s['errors']} errors of {s['sent']} sent "
             f"in {s['duration_s']:.2f} s",
             f"throughput {_f(s['qps'], 3)} req/s, {_f(s['output_tok_s'])} output tok/s, "
             f"{_f(s['total_tok_s'])} total tok/s"]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        lines.append(f"{name:<10} " + "  ".join(f"{p} {_f(v)}" for p, v in s[key].items()) + " ms")
    lines.append(f"E2E<=500ms {_f(None if s['e2e_le_500ms_frac'] is None else 100 * s['e2e_le_500ms_frac'])}% of sent")
    lines.append(f"RSS        before {_f(rss['before'])} MiB, after {_f(rss['after'])} MiB, peak {_f(rss['peak'])} MiB"
                 + (f"; growth first half {rss['halves'][0]:+.1f}, second half {rss['halves'][1]:+.1f} MiB"
                    if rss.get("halves") else ""))
    lines.append(f"cpu        load average {run['cpu_start']['loadavg_1m']} -> {run['cpu_end']['loadavg_1m']}, "
                 f"PSI avg10 {run['cpu_start']['psi_cpu_avg10']} -> {run['cpu_end']['psi_cpu_avg10']}")
    lines += [f"error      {m}" for m in s["error_messages"]]
    return "\n".join(lines)


def md_row(run: dict) -> str:
    s, c, rss = run["summary"], run["config"], run["rss_mib"]
    trio = lambda d, *ks: " / ".join(_f(d[k]) for k in ks)  # noqa: E731
    cells = [run["label"] or "—", c["arrival"] + (f" {c['rate']:g}/s" if c["arrival"] == "poisson" else ""),
             c["clients"], s["sent"], c["max_tokens"], s["completed"], s["errors"], _f(s["duration_s"], 2),
             _f(s["qps"], 3), _f(s["output_tok_s"]), _f(s["total_tok_s"]), trio(s["ttft_ms"], "p50", "p90", "p99"),
             trio(s["tpot_ms"], "p50", "p99"), trio(s["itl_ms"], "p50", "p99"), trio(s["e2e_ms"], "p50", "p90", "p99"),
             "—" if s["e2e_le_500ms_frac"] is None else f"{100 * s['e2e_le_500ms_frac']:.1f}%",
             trio(rss, "before", "after", "peak"),
             f"{run['cpu_start']['psi_cpu_avg10']} / {run['cpu_end']['psi_cpu_avg10']}"]
    return "| " + " | ".join(str(x) for x in cells) + " |"


# ---------------------------------------------------------------- a server of our own

def start_server(module: str, src: str, serve_args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    from r1jax.launch import free_port
    port = free_port()
    cmd = [sys.executable, "-m", module, "--model", src, "--host", "127.0.0.1", "--port", str(port), *serve_args]
    print(f"starting: {shlex.join(cmd)} (log {log})", flush=True)
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)   # Ctrl-C reaches us; we stop it
    return proc, f"http://127.0.0.1:{port}"


async def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    import httpx
    t0 = last = time.monotonic()
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode} before /health answered")
            try:
                if (await client.get(url + "/health")).status_code == 200:
                    print(f"server healthy after {time.monotonic() - t0:.1f} s", flush=True)
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - last >= 15:
                last = time.monotonic()
                print(f"  waiting for {url}/health: {last - t0:.0f} s", flush=True)
            await asyncio.sleep(1.0)
    raise RuntimeError(f"server not healthy after {timeout_s:g} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _tail(log: Path, n: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ---------------------------------------------------------------- command line

class _Parser(argparse.ArgumentParser):
    def error(self, message):            # one line, exit 2
        sys.stderr.write(f"serve_load.py: error: {message}\n")
        sys.exit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--print-md-header", action="store_true", help="print the PREFIX.md table header and exit")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--serve-model", help="start `python -m r1jax.serve --model SRC` for the run")
    p.add_argument("--serve-args", default="", help="more arguments for that server (one string)")
    p.add_argument("--serve-module", default="r1jax.serve", help="module that --serve-model runs with -m")
    p.add_argument("--serve-timeout-s", type=float, default=600.0, help="wait this long for GET /health")
    p.add_argument("--compare-batching", action="store_true", help="with --serve-model: also --max-batch-size 1")
    p.add_argument("--model", help="model name in requests (default: first id of GET /v1/models)")
    p.add_argument("--api-key")
    p.add_argument("--clients", type=int, help="concurrent workers (closed) / most in flight (poisson)")
    p.add_argument("--requests", type=int, help="requests to send at most")
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--arrival", default="closed", help="closed or poisson")
    p.add_argument("--rate", type=float, help="poisson: requests per second")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=DEFAULT_PROMPT)
    prompt.add_argument("--prompt-ids-len", type=int, help="send L pseudo-random token ids in [3, 200)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--warmup", type=int, default=0, help="requests sent first and not counted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-pid", type=int, help="pid whose VmRSS to read (with --url)")
    p.add_argument("--out", help="write PREFIX.json and PREFIX.md")
    p.add_argument("--label", default="", help="name of the run in the table")
    a = p.parse_args(argv)
    if a.print_md_header:
        return a
    checks = [
        (a.url is None and a.serve_model is None, "one of --url or --serve-model is required"),
        (a.url is not None and not a.url.startswith(("http://", "https://")),
         "--url: must start with http:// or https://"),
        (a.clients is None or a.clients < 1, "--clients: a whole number >= 1 is required"),
        (a.requests is None or a.requests < 1, "--requests: a whole number >= 1 is required"),
        (not a.duration_s > 0, "--duration-s: must be > 0"),
        (a.arrival not in ("closed", "poisson"), f"--arrival: {a.arrival!r}; allowed: closed, poisson"),
        (a.arrival == "poisson" and not (a.rate or 0) > 0, "--rate: a rate > 0 is required with --arrival poisson"),
        (a.arrival == "closed" and a.rate is not None, "--rate: allowed only with --arrival poisson"),
        (a.prompt_ids_len is not None and a.prompt_ids_len < 1, "--prompt-ids-len: must be >= 1"),
        (a.max_tokens < 1, "--max-tokens: must be >= 1"),
        (a.temperature < 0, "--temperature: must be >= 0"),
        (not a.request_timeout_s > 0, "--request-timeout-s: must be > 0"),
        (a.warmup < 0, "--warmup: must be >= 0"),
        (a.serve_model is None and (a.serve_args or a.compare_batching),
         "--serve-args/--compare-batching: allowed only with --serve-model"),
        (a.serve_model is not None and a.server_pid is not None,
         "--server-pid: not with --serve-model (the started server's pid is used)"),
    ]
    for bad, message in checks:
        if bad:
            p.error(message)
    try:
        a.serve_args = shlex.split(a.serve_args)
    except ValueError as e:
        p.error(f"--serve-args: {e}")
    if a.compare_batching and "--max-batch-size" in a.serve_args:
        p.error("--compare-batching: leave --max-batch-size out of --serve-args (the batched run uses the default)")
    return a


def config_from(a: argparse.Namespace, url: str, pid: int | None) -> LoadConfig:
    return LoadConfig(url=url, clients=a.clients, requests=a.requests, model=a.model, api_key=a.api_key,
                      duration_s=a.duration_s, arrival=a.arrival, rate=a.rate, prompt=a.prompt,
                      prompt_ids_len=a.prompt_ids_len, max_tokens=a.max_tokens, temperature=a.temperature,
                      server_pid=pid, request_timeout_s=a.request_timeout_s, warmup=a.warmup, seed=a.seed)


def measure(a: argparse.Namespace, label: str, serve_args: list[str] | None) -> dict:
    """One run: against --url, or against a server started with `serve_args` and stopped after."""
    if serve_args is None:
        run = asyncio.run(run_load(config_from(a, a.url, a.server_pid)))
    else:
        if a.out:
            log = Path(f"{a.out}.{(label or 'server').replace(' ', '-')}.log")
        else:
            fd, name = tempfile.mkstemp(prefix="serve_load-", suffix=".log")
            os.close(fd)
            log = Path(name)
        proc, url = start_server(a.serve_module, a.serve_model, serve_args, log)
        try:
            asyncio.run(wait_healthy(proc, url, a.serve_timeout_s))
            run = asyncio.run(run_load(config_from(a, url, proc.pid)))
        except Exception:
            print(f"server log tail ({log}):\n{_tail(log)}", file=sys.stderr)
            raise
        finally:
            stop_server(proc)
        run["serve_args"] = serve_args
    run["label"] = label
    print(text_summary(run), flush=True)
    return run


def _sigterm(signum, frame):
    raise KeyboardInterrupt          # so that a server we started is stopped on the way out


def _redacted(argv: list[str]) -> list[str]:
    return ["***" if i and argv[i - 1] == "--api-key" else "--api-key=***" if arg.startswith("--api-key=") else arg
            for i, arg in enumerate(argv)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if a.print_md_header:
        print(MD_HEADER)
        return 0
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        if a.serve_model is None:
            runs = [measure(a, a.label, None)]
        elif not a.compare_batching:
            runs = [measure(a, a.label, a.serve_args)]
        else:
            base = a.label + " " if a.label else ""
            runs = [measure(a, base + "batched", a.serve_args),
                    measure(a, base + "max-batch-size 1", [*a.serve_args, "--max-batch-size", "1"])]
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"serve_load.py: {e}", file=sys.stderr)
        return 1
    result = {"command": shlex.join([sys.executable, "bench/serve_load.py", *_redacted(argv)]),
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), {platform.platform()}, "
                         f"Python {platform.python_version()}", "runs": runs}
    rows = [md_row(r) for r in runs]
    if len(runs) == 2:
        (b, u) = (r["summary"] for r in runs)
        ratio = lambda k: round(b[k] / u[k], 3) if b[k] and u[k] else None  # noqa: E731
        result["batching_ratio"] = {"qps": ratio("qps"), "output_tok_s": ratio("output_tok_s")}
        print(f"batched / max-batch-size 1: QPS x{_f(ratio('qps'), 2)}, output tok/s x{_f(ratio('output_tok_s'), 2)}")
        cells = ["**batched / max-batch-size 1**", *[""] * 7, f"**{_f(ratio('qps'), 2)}x**",
                 f"**{_f(ratio('output_tok_s'), 2)}x**", *[""] * 8]
        rows.append("| " + " | ".join(cells) + " |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        for run in runs:          # per-request ITL lists stay out of the file (the summary has their percentiles)
            run["records"] = [{k: v for k, v in r.items() if k != "itl"} for r in run["records"]]
        Path(f"{a.out}.json").write_text(json.dumps(result, indent=1) + "\n")
        Path(f"{a.out}.md").write_text("".join(row + "\n" for row in rows))
        print(f"wrote {a.out}.json and {a.out}.md")
    return 0 if all(r["summary"]["errors"] == 0 and r["summary"]["completed"] > 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

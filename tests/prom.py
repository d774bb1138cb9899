"""A private Prometheus for tests: Debian's `prometheus` package (installed with apt-get when
missing), started on a free loopback port with its own config and storage in a test directory, and
queried through its HTTP API (urllib only).

    prometheus, promtool = ensure_prometheus()            # skips without root, fails under CI
    base, proc = start_prometheus(["127.0.0.1:8000"], tmp_path, rules=ALERTS)
    try:
        wait_for(base, 'up{job="r1jax"}', lambda r: r and r[0]["value"][1] == "1", timeout=30)
        query(base, "vllm:num_requests_running")           # -> [{"metric": {...}, "value": [t, "0"]}]
    finally:
        stop_prometheus(proc)

Scrapes (and rule evaluations) run every second, under job "r1jax"; Prometheus 2.42 starts its
scrape loops about 5 s after it is ready, so the first sample comes some 6 s after start and a
rate() some 7 s after. Targets should serve the text format (prometheus_client's generate_latest):
prometheus_client 0.26's content negotiation (start_http_server, make_asgi_app) answers 2.42's
OpenMetrics Accept header with `escaping=underscores`, which stores `vllm:x` as `vllm_x`
(client_python issue 1177).

Nothing here uses or needs the package's system service (it may or may not have been started on
install): the instance has its own port, config and TSDB directory.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from r1jax.launch import free_port

PROMETHEUS = Path("/usr/bin/prometheus")
PROMTOOL = Path("/usr/bin/promtool")
READY_TIMEOUT = 60.0

CONFIG = """\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
{rules}
scrape_configs:
  - job_name: {job}
    metrics_path: /metrics
    static_configs:
      - targets: {targets}
"""


class PrometheusError(RuntimeError):
    """An answer of the HTTP API with status "error" (a bad query, for one)."""


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> None:
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(cmd)}: no answer within {timeout} s")
    if p.returncode != 0:
        pytest.fail(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")


def _found() -> tuple[Path, Path] | None:
    if PROMETHEUS.is_file() and PROMTOOL.is_file():
        return PROMETHEUS, PROMTOOL
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    return (Path(prom), Path(tool)) if prom and tool else None


def ensure_prometheus() -> tuple[Path, Path]:
    """Paths of prometheus and promtool; installs Debian's package when they are missing (needs
    root: skips without it, fails when CI is set). One install at a time across processes
    (pytest-xdist workers) through a lock file; dpkg's own lock is waited for too (another test
    may be installing its packages)."""
    if found := _found():
        return found
    if os.geteuid() != 0:
        why = "prometheus is not installed, and installing Debian's package needs root"
        if os.environ.get("CI"):
            pytest.fail(f"{why}, and CI is set: run the suite as root")
        pytest.skip(why)
    with open(Path(tempfile.gettempdir()) / "r1jax-apt-prometheus.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if found := _found():
            return found
        t0 = time.time()
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        wait = ["-o", "DPkg::Lock::Timeout=300"]
        _run(["apt-get", "update", "-qq"], timeout=600, env=env)
        _run(["apt-get", *wait, "install", "-y", "-qq", "prometheus"], timeout=900, env=env)
        print(f"\napt-get install prometheus: {time.time() - t0:.1f} s")
    if found := _found():
        return found
    pytest.fail("apt-get installed prometheus, but prometheus/promtool are not on PATH")


def _get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:          # the API answers bad queries with 400 and a JSON body
        return e.code, e.read()


def _log_tail(proc: subprocess.Popen, n: int = 3000) -> str:
    log = getattr(proc, "log_path", None)
    return log.read_text(errors="replace")[-n:] if log and log.is_file() else ""


def start_prometheus(targets: list[str], workdir: Path, rules: Path | None = None, job: str = "r1jax",
                     timeout: float = READY_TIMEOUT) -> tuple[str, subprocess.Popen]:
    """Starts prometheus scraping `targets` ("127.0.0.1:PORT", every 1 s, job `job`), evaluating
    the rule file `rules` if given, on a free loopback port with config, TSDB and log under
    `workdir`; waits (at most `timeout` s) for /-/ready. Returns its base URL and process (whose
    `log_path` is its log); stop it with stop_prometheus."""
    prometheus, _ = ensure_prometheus()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    rule_files = f"rule_files:\n  - {json.dumps(str(Path(rules).resolve()))}\n" if rules else ""
    config.write_text(CONFIG.format(rules=rule_files, job=job, targets=json.dumps(list(targets))))
    deadline = time.time() + timeout
    for attempt in range(3):                     # another process may take the free port first
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log_path = workdir / f"prometheus-{attempt}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [str(prometheus), f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle",
                 "--storage.tsdb.retention.time=1d", "--log.level=info"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        proc.log_path = log_path
        proc.base_url = base
        while time.time() < deadline and proc.poll() is None:
            try:
                if _get(f"{base}/-/ready", timeout=2)[0] == 200:
                    return base, proc
            except OSError:
                pass
            time.sleep(0.2)
        if proc.poll() is None:                  # out of time
            stop_prometheus(proc)
            raise TimeoutError(f"prometheus at {base} not ready within {timeout} s:\n{_log_tail(proc)}")
        if "address already in use" not in _log_tail(proc):
            break
    raise RuntimeError(f"prometheus exited with {proc.returncode}:\n{_log_tail(proc)}")


def stop_prometheus(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL after `timeout` s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def api(base_url: str, path: str, **params) -> dict:
    """GET base_url + path (e.g. "/api/v1/rules") with query parameters; the answer's "data".
    Raises PrometheusError on status "error"."""
    url = f"{base_url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    code, body = _get(url)
    try:
        answer = json.loads(body)
    except ValueError:
        raise PrometheusError(f"{url}: HTTP {code}, not JSON: {body[:500]!r}") from None
    if answer.get("status") != "success":
        raise PrometheusError(f"{url}: HTTP {code}, {answer.get('errorType')}: {answer.get('error')}")
    return answer["data"]


def query(base_url: str, promql: str, at: float | None = None) -> list:
    """An instant query (/api/v1/query) at `at` (default: now): the result, for a vector a list of
    {"metric": {labels}, "value": [t, "v"]}. Raises PrometheusError if Prometheus rejects it."""
    params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
    return api(base_url, "/api/v1/query", **params)["result"]


def wait_for(base_url: str, promql: str, predicate, timeout: float = 30, every: float = 0.5) -> list:
    """Queries `promql` until predicate(result) holds (returns that result); TimeoutError with the
    last result after `timeout` s. A rejected query raises at once."""
    deadline = time.time() + timeout
    while True:
        result = query(base_url, promql)
        if predicate(result):
            return result
        if time.time() >= deadline:
            raise TimeoutError(f"{promql}: not there within {timeout} s; last result: {result}")
        time.sleep(every)


def value(result: list) -> float | None:
    """The value of a one-sample vector result (None when empty)."""
    if not result:
        return None
    if len(result) > 1:
        raise ValueError(f"more than one sample: {result}")
    return float(result[0]["value"][1])

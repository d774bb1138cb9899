"""launch/monitoring/: the Prometheus rules, config and Grafana dashboard for `python -m r1jax.serve`,
checked with Debian's prometheus 2.42 (installed with apt-get when missing: tests/prom.py).

- promtool accepts alerts.yml and prometheus.yml (whose rule_files path is relative to it, from any
  working directory);
- `promtool test rules alerts_test.yml`: on synthetic series, each alert fires once its condition
  has held for 5 minutes, not before, and not just below its threshold (P99 E2E latency 0.75 s
  fires, 0.496 s does not; device memory 95% fires, 89.9% and a 3-minute spike do not);
- a real Prometheus, scraping a stand-in exporter (the server's metric names and labels, counters
  growing at every scrape) and evaluating alerts.yml: every dashboard query (Grafana's variables
  substituted) is accepted and returns series, and every rule evaluates without error.

Which metrics the dashboard may use is the server's list (vLLM's names plus r1jax's extras), below.
"""
from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from prom import api, ensure_prometheus, query, start_prometheus, stop_prometheus, wait_for

ROOT = Path(__file__).resolve().parents[1]
MON = ROOT / "launch" / "monitoring"
ALERTS = MON / "alerts.yml"
DASHBOARD = MON / "grafana-dashboard.json"

GAUGES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "r1jax:device_memory_used_bytes", "r1jax:device_memory_limit_bytes"}
COUNTERS = {"vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
            "r1jax:requests_rejected_total"}
HISTOGRAMS = {"vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
              "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens",
              "vllm:request_generation_tokens"}
METRICS = GAUGES | COUNTERS | {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}

# words of PromQL that are neither functions (followed by "(") nor metric names
KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right", "inf", "nan"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1m",
                "${model_name}": ".*", "$model_name": ".*"}


def _promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    _, promtool = ensure_prometheus()
    p = subprocess.run([str(promtool), *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"promtool {' '.join(args)}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


def _panels() -> list[dict]:
    def walk(panels):
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))      # panels inside collapsed rows
    return list(walk(json.loads(DASHBOARD.read_text())["panels"]))


def _exprs() -> list[tuple[str, str]]:
    """(panel title, expr) of every query target of the dashboard."""
    return [(p["title"], t["expr"]) for p in _panels() for t in p.get("targets", []) if "expr" in t]


def _substituted(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a Grafana variable left in {expr!r}"
    return expr


def _metric_names(expr: str) -> set[str]:
    """The metric names an expr selects: its identifiers less label matchers, strings, grouping
    clauses, ranges, functions and keywords."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)       # strings (label values, regexes)
    s = re.sub(r"\{[^}]*\}", "", s)                    # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)                   # ranges
    s = GROUPING.sub("", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("(") or m.group().lower() in KEYWORDS:
            continue
        if m.start() > 0 and (s[m.start() - 1].isdigit() or s[m.start() - 1] == "."):
            continue                                   # 1e9, 0.5e-3
        names.add(m.group())
    return names


# ------------------------------------------------------------------------------------ promtool

def test_promtool_accepts_the_rules_and_the_config(tmp_path):
    out = _promtool("check", "rules", str(ALERTS)).stdout
    assert "SUCCESS" in out
    # rule_files: [alerts.yml] resolves against the config's directory, from any working directory
    out = _promtool("check", "config", str(MON / "prometheus.yml"), cwd=tmp_path).stdout
    assert "1 rule files found" in out and str(ALERTS) in out, out

    config = yaml.safe_load((MON / "prometheus.yml").read_text())
    assert config["global"]["scrape_interval"] == "5s"
    assert config["rule_files"] == ["alerts.yml"]
    [job] = config["scrape_configs"]
    assert job["job_name"] == "r1jax"                  # alerts.yml's R1jaxServerDown
    assert job["static_configs"] == [{"targets": ["127.0.0.1:8000"]}]


def test_alert_thresholds_on_synthetic_series():
    rules = yaml.safe_load(ALERTS.read_text())
    [group] = rules["groups"]
    assert group["name"] == "r1jax"
    alerts = {r["alert"]: r for r in group["rules"] if "alert" in r}
    p99 = alerts["R1jaxE2ELatencyP99High"]
    assert " ".join(p99["expr"].split()) == ("histogram_quantile(0.99, sum by (le, model_name) "
                                             "(rate(vllm:e2e_request_latency_seconds_bucket[5m]))) > 0.5")
    assert p99["for"] == "5m"
    assert alerts["R1jaxDeviceMemoryHigh"]["for"] == "5m"
    for rule in alerts.values():
        assert rule["labels"]["severity"] in ("critical", "warning")
        assert {"summary", "description"} <= set(rule["annotations"])

    out = _promtool("test", "rules", str(MON / "alerts_test.yml"), cwd=MON).stdout
    assert "SUCCESS" in out, out


# ------------------------------------------------------------------------------------ dashboard

def test_dashboard_structure_and_metric_names():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 36 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in _panels():
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
    ids = [p["id"] for p in _panels()]
    assert len(ids) == len(set(ids))

    used = set()
    for title, expr in _exprs():
        names = _metric_names(_substituted(expr))
        assert names, f"{title}: no metric in {expr!r}"
        assert names <= METRICS, f"{title}: {expr!r} uses {sorted(names - METRICS)}, not metrics of the server"
        used |= names
    bases = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    wanted = {"vllm:request_success_total", "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:time_per_output_token_seconds", "vllm:generation_tokens_total", "vllm:num_requests_running",
              "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "r1jax:device_memory_used_bytes",
              "r1jax:device_memory_limit_bytes", "r1jax:requests_rejected_total"}
    assert wanted <= bases, f"no panel shows {sorted(wanted - bases)}"

    # the E2E latency graph draws the 0.5 s SLA as a threshold line
    [e2e] = [p for p in _panels() if p["type"] == "timeseries" and any(
        "histogram_quantile(0.99" in t["expr"] and "e2e_request_latency" in t["expr"] for t in p["targets"])]
    defaults = e2e["fieldConfig"]["defaults"]
    assert 0.5 in [s["value"] for s in defaults["thresholds"]["steps"]]
    assert defaults["custom"]["thresholdsStyle"]["mode"] != "off"
    assert defaults["unit"] == "s"


# ------------------------------------------------------------------- a real Prometheus, scraping

class _Exporter(BaseHTTPRequestHandler):
    """The server's /metrics in the Prometheus text format 0.0.4 (as prometheus_client's
    generate_latest writes it), every counter a step higher at each scrape."""
    scrapes = 0
    LABELS = 'model_name="r1",engine="0"'

    def do_GET(self):
        type(self).scrapes += 1
        body = self.exposition(type(self).scrapes).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

    @classmethod
    def exposition(cls, n: int) -> str:
        lab = cls.LABELS
        out = []

        def family(name, kind, *samples):
            out.append(f"# HELP {name} stand-in\n# TYPE {name} {kind}")
            out.extend(samples)
        family("vllm:num_requests_running", "gauge", f"vllm:num_requests_running{{{lab}}} 2.0")
        family("vllm:num_requests_waiting", "gauge", f"vllm:num_requests_waiting{{{lab}}} 1.0")
        family("vllm:kv_cache_usage_perc", "gauge", f"vllm:kv_cache_usage_perc{{{lab}}} 0.25")
        family("vllm:prompt_tokens", "counter", f"vllm:prompt_tokens_total{{{lab}}} {100.0 * n}")
        family("vllm:generation_tokens", "counter", f"vllm:generation_tokens_total{{{lab}}} {50.0 * n}")
        family("vllm:request_success", "counter",
               *(f'vllm:request_success_total{{{lab},finished_reason="{r}"}} {float(k * n)}'
                 for r, k in (("stop", 9), ("length", 1), ("abort", 0))))
        for h in sorted(HISTOGRAMS):                   # 10 requests a scrape: 5 <= 0.1, 9 <= 0.5, 10 <= 1
            family(h, "histogram",
                   *(f'{h}_bucket{{{lab},le="{le}"}} {float(k * n)}'
                     for le, k in (("0.1", 5), ("0.5", 9), ("1.0", 10), ("+Inf", 10))),
                   f"{h}_count{{{lab}}} {10.0 * n}", f"{h}_sum{{{lab}}} {2.5 * n}")
        family("r1jax:device_memory_used_bytes", "gauge",
               'r1jax:device_memory_used_bytes{model_name="r1",device="cpu:0"} 1.0e+09')
        family("r1jax:device_memory_limit_bytes", "gauge",
               'r1jax:device_memory_limit_bytes{model_name="r1",device="cpu:0"} 8.0e+09')
        family("r1jax:requests_rejected", "counter",
               f'r1jax:requests_rejected_total{{model_name="r1",code="429"}} {float(n)}',
               'r1jax:requests_rejected_total{model_name="r1",code="400"} 0.0')
        return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """A Prometheus scraping the stand-in exporter every second and evaluating alerts.yml, once
    two scrapes are in (rate() needs two samples): its base URL."""
    ensure_prometheus()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    t0 = time.time()
    base, proc = start_prometheus([f"127.0.0.1:{server.server_address[1]}"], tmp_path_factory.mktemp("prom"),
                                  rules=ALERTS)
    try:
        # Prometheus 2.x starts its scrape loops some 5 s after start-up
        wait_for(base, 'count(rate(vllm:request_success_total[1m]))', bool, timeout=30)
        print(f"\nprometheus ready, two scrapes in: {time.time() - t0:.1f} s")
        yield base
    finally:
        stop_prometheus(proc)
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_dashboard_queries_run_on_prometheus(prometheus):
    empty = []
    for title, expr in _exprs():
        result = query(prometheus, _substituted(expr))          # raises PrometheusError if rejected
        if not result:
            empty.append((title, expr))
    assert not empty, f"queries without a series on the server's metrics: {empty}"

    # the model_name variable's query: label_values(<metric>, model_name)
    [var] = [v for v in json.loads(DASHBOARD.read_text())["templating"]["list"] if v["name"] == "model_name"]
    m = re.fullmatch(r"label_values\((\S+),\s*model_name\)", var["definition"])
    assert m and m.group(1) in METRICS
    assert api(prometheus, "/api/v1/label/model_name/values", **{"match[]": m.group(1)}) == ["r1"]


def test_rules_evaluate_on_prometheus(prometheus):
    def evaluated(groups):
        rules = [r for g in groups for r in g["rules"]]
        return rules and all(r["lastEvaluation"] > "2000" for r in rules)
    deadline = time.time() + 15
    while not evaluated(groups := api(prometheus, "/api/v1/rules")["groups"]) and time.time() < deadline:
        time.sleep(0.5)
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert len(rules) == sum(1 for r in yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"])
    bad = {name: (r["health"], r.get("lastError")) for name, r in rules.items() if r["health"] != "ok"}
    assert not bad, bad

    # the recording rules on the stand-in's traffic: 9 of every 10 requests within 0.5 s, P99 in (0.5, 1]
    [sla] = wait_for(prometheus, "r1jax:e2e_request_sla_ratio:rate5m", bool, timeout=10)
    assert sla["metric"]["model_name"] == "r1" and float(sla["value"][1]) == pytest.approx(0.9)
    [p99] = query(prometheus, "r1jax:e2e_request_latency_seconds:p99_rate5m")
    assert float(p99["value"][1]) == pytest.approx(0.5 + 0.5 * (0.99 * 10 - 9) / (10 - 9))     # 0.95
    # ... which the alert sees too: pending (it needs 5 minutes), not firing
    [alert] = [a for a in api(prometheus, "/api/v1/alerts")["alerts"]
               if a["labels"]["alertname"] == "R1jaxE2ELatencyP99High"]
    assert alert["state"] == "pending" and alert["labels"]["model_name"] == "r1"

"""Live training metrics: r1jax/train/exporter.py and launch/monitoring/'s training rules, SLURM
scrape config and dashboard, checked with Debian's prometheus 2.42 (tests/prom.py).

- the exporter on its own: names and values after each hook, counters from 0, memory on CPU,
  no GPU series without a GPU, one-line ConfigError on a taken port, close() frees the port;
- promtool accepts training-alerts.yml and prometheus-slurm.yml, and training-alerts_test.yml
  passes (each alert fires after its `for:`, not before, not on the safe side of its threshold);
- the dashboard uses only names the exporter exports (exporter.METRICS), and shows what it must;
- train.sbatch lists each task's host:port in a file_sd file (with stand-ins for srun and
  scontrol), and a Prometheus running prometheus-slurm.yml's scrape config finds and scrapes
  two exporters through that file, evaluating the training rules without error;
- end to end: a real Prometheus scrapes a real tiny training run (a subprocess) and reads its step,
  loss and a bad step (train.inject_faults) back through the HTTP query API; every dashboard
  query is accepted there.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from prom import api, ensure_prometheus, query, start_prometheus, stop_prometheus, value, wait_for
from prometheus_client.parser import text_string_to_metric_families

from r1jax.config import ConfigError
from r1jax.launch import free_port
from r1jax.train.exporter import METRICS, TrainExporter

ROOT = Path(__file__).resolve().parents[1]
MON = ROOT / "launch" / "monitoring"
ALERTS = MON / "training-alerts.yml"
DASHBOARD = MON / "training-dashboard.json"
SLURM_CONFIG = MON / "prometheus-slurm.yml"
SBATCH = ROOT / "launch" / "slurm" / "train.sbatch"
TINY = ROOT / "configs" / "tiny.yaml"

KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1m", "$slurm_job_id": ".*"}


def _scrape(port: int, accept: str | None = None) -> tuple[str, dict[str, list]]:
    """(content type, {sample name: [(labels, value)]}) of GET /metrics."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        ctype, text = r.headers["Content-Type"], r.read().decode()
    samples: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return ctype, samples


def _one(samples: dict, name: str, **labels) -> float:
    [v] = [v for lab, v in samples[name] if labels.items() <= lab.items()]
    return v


def _port_pair() -> int:
    """A free port P with P + 1 free too (process 1 of a host listens on metrics_port + 1)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    pytest.fail("no two consecutive free ports")


def _promtool(*args: str, cwd: Path = ROOT) -> str:
    _, promtool = ensure_prometheus()
    p = subprocess.run([str(promtool), *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"promtool {' '.join(args)}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


def _metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers less strings, label matchers,
    ranges, grouping clauses, functions and keywords."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)
    return {m.group() for m in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", s)
            if not s[m.end():].lstrip().startswith("(") and m.group().lower() not in KEYWORDS}


def _panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def _exprs() -> list[tuple[str, str]]:
    """(panel title, expr with Grafana's variables substituted) of every query of the dashboard."""
    out = []
    for p in _panels():
        for t in p.get("targets", []):
            expr = t["expr"]
            for var, val in GRAFANA_VARS.items():
                expr = expr.replace(var, val)
            assert "$" not in expr, f"{p['title']}: a Grafana variable left in {expr!r}"
            out.append((p["title"], expr))
    return out


# ------------------------------------------------------------------------------------ the exporter

def test_exporter_names_values_and_port(tmp_path):
    for name in METRICS:      # Prometheus's conventions: one prefix, snake_case, no colons, units in names
        assert re.fullmatch(r"r1jax_train_[a-z0-9_]+", name), name
    assert len(set(METRICS)) == len(METRICS)
    port = free_port()
    exp = TrainExporter("127.0.0.1", port, process_index=0, process_count=2, run_dir=str(tmp_path))
    try:
        assert exp.port == port
        _, s = _scrape(port)
        assert set(s) <= set(METRICS), sorted(set(s) - set(METRICS))
        # before any value: no training series (a loss of 0 would be a lie), counters at 0, the machine's memory
        assert "r1jax_train_loss" not in s and "r1jax_train_step" not in s
        assert _one(s, "r1jax_train_rollbacks_total") == 0 and _one(s, "r1jax_train_alerts_total", kind="watchdog") == 0
        assert _one(s, "r1jax_train_info", process="0") == 1
        assert s["r1jax_train_info"][0][0] == {"process": "0", "process_count": "2", "run_dir": str(tmp_path)}
        used = _one(s, "r1jax_train_device_memory_used_bytes", device="cpu", process="0")
        peak = _one(s, "r1jax_train_device_memory_peak_bytes", device="cpu", process="0")
        limit = _one(s, "r1jax_train_device_memory_limit_bytes", device="cpu", process="0")
        assert 10e6 < used <= limit and 10e6 < peak <= limit
        assert not any(n.startswith("r1jax_train_gpu_") for n in s)           # no GPU here: absent, no error

        t0 = time.time()
        exp.step(7)
        exp.log(10, {"loss": 2.5, "lm_loss": 2.25, "lr": 3e-4, "grad_norm": float("nan"), "grad_norm_mean": 1.5,
                     "grad_norm_std": 0.25, "tokens_per_s": 1234.5, "mfu": 0.42, "step_time": 0.125,
                     "data_wait": 0.01, "skipped": 2.0, "expert_imbalance": 2.0, "expert_imbalance_layers": [1.5, 2.0],
                     "param_norm": 30.0, "unknown_key": 1.0})
        exp.log(15, {"loss": 2.0, "skipped": 1.0})                          # a partial record keeps the rest
        exp.eval(15, {"loss": 2.75, "perplexity": 15.6, "tokens": 1024})
        exp.checkpoint_saved(15, 1.5)
        for kind in ("bad_step", "bad_step", "bad_step", "rollback", "spike", "alert_grad_norm_std", "watchdog",
                     "checkpoint_error", "a_new_kind"):
            exp.event(kind)
        ctype, s = _scrape(port, accept="application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5")
        assert ctype.startswith("text/plain; version=0.0.4")       # the text format whatever the Accept header
        assert set(s) <= set(METRICS), sorted(set(s) - set(METRICS))
        expect = {"r1jax_train_step": 7, "r1jax_train_loss": 2.0, "r1jax_train_lm_loss": 2.25,
                  "r1jax_train_learning_rate": 3e-4, "r1jax_train_grad_norm_window_mean": 1.5,
                  "r1jax_train_grad_norm_window_std": 0.25, "r1jax_train_tokens_per_second": 1234.5,
                  "r1jax_train_mfu_ratio": 0.42, "r1jax_train_step_time_seconds": 0.125,
                  "r1jax_train_data_wait_seconds": 0.01, "r1jax_train_expert_imbalance_max": 2.0,
                  "r1jax_train_param_norm": 30.0, "r1jax_train_eval_loss": 2.75, "r1jax_train_eval_perplexity": 15.6,
                  "r1jax_train_checkpoint_save_duration_seconds": 1.5, "r1jax_train_last_checkpoint_step": 15,
                  "r1jax_train_skipped_steps_total": 3, "r1jax_train_bad_steps_total": 3,
                  "r1jax_train_rollbacks_total": 1, "r1jax_train_loss_spikes_total": 1,
                  "r1jax_train_checkpoints_saved_total": 1}
        assert {k: _one(s, k) for k in expect} == pytest.approx(expect)
        assert math.isnan(_one(s, "r1jax_train_grad_norm"))               # as it came
        assert "r1jax_train_mtp_loss" not in s                              # no MTP in the record: absent
        assert {lab["layer"]: v for lab, v in s["r1jax_train_expert_imbalance"]} == {"0": 1.5, "1": 2.0}
        for name in ("r1jax_train_last_step_timestamp_seconds", "r1jax_train_last_checkpoint_timestamp_seconds"):
            assert t0 - 1 <= _one(s, name) <= time.time() + 1
        assert _one(s, "r1jax_train_start_time_seconds") <= t0
        alerts = {lab["kind"]: v for lab, v in s["r1jax_train_alerts_total"]}
        assert alerts == {"bad_step": 3, "rollback": 1, "spike": 1, "alert_grad_norm_std": 1, "watchdog": 1,
                          "checkpoint_error": 1, "a_new_kind": 1}
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
        assert e.value.code == 404

        # the port taken: one line naming the key
        with pytest.raises(ConfigError) as e:
            TrainExporter("127.0.0.1", port, process_index=0, process_count=1, run_dir=str(tmp_path))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"train.metrics_port={port}: ") and "in use" in msg
    finally:
        exp.close()
    exp.close()                                                             # twice is fine
    with pytest.raises(ConnectionRefusedError):                              # nothing listens there now
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with socket.socket() as s:          # and a server may listen there (the scrapes' TIME_WAITs allow SO_REUSEADDR)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()

    # other processes: their devices, not the run (process 0 has it)
    other = TrainExporter("127.0.0.1", port, process_index=1, process_count=2, run_dir=str(tmp_path))
    try:
        other.step(3)
        other.log(5, {"loss": 1.0})
        other.event("rollback")
        _, s = _scrape(port)
        assert set(s) == {"r1jax_train_info", "r1jax_train_device_memory_used_bytes",
                          "r1jax_train_device_memory_peak_bytes", "r1jax_train_device_memory_limit_bytes"}
        assert _one(s, "r1jax_train_device_memory_used_bytes", process="1", device="cpu") > 0
    finally:
        other.close()


# ------------------------------------------------------------------------------------ promtool

def test_promtool_accepts_the_rules_and_config_and_the_rule_tests_pass(tmp_path):
    assert "SUCCESS: 7 rules found" in _promtool("check", "rules", str(ALERTS))
    # rule_files and file_sd globs resolve against the config's directory, from any working directory
    out = _promtool("check", "config", str(SLURM_CONFIG), cwd=tmp_path)
    assert "1 rule files found" in out and str(ALERTS) in out, out
    out = _promtool("test", "rules", str(MON / "training-alerts_test.yml"), cwd=tmp_path)
    assert "SUCCESS" in out, out

    config = yaml.safe_load(SLURM_CONFIG.read_text())
    assert config["rule_files"] == ["training-alerts.yml"]
    [job] = config["scrape_configs"]
    [sd] = job["file_sd_configs"]
    [glob] = sd["files"]
    # the directory train.sbatch writes to by default (<repo>/runs/prometheus-targets)
    assert (MON / glob).resolve() == ROOT / "runs" / "prometheus-targets" / "*.json"
    assert "runs/prometheus-targets" in SBATCH.read_text()

    [group] = yaml.safe_load(ALERTS.read_text())["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert set(alerts) == {"R1jaxTrainDeviceMemoryHigh", "R1jaxTrainGPUUtilizationLow", "R1jaxTrainGradNormUnstable",
                           "R1jaxTrainStalled", "R1jaxTrainCheckpointStale", "R1jaxTrainRolledBack",
                           "R1jaxTrainTargetDown"}
    assert f'up{{job="{job["job_name"]}"}} == 0' in alerts["R1jaxTrainTargetDown"]["expr"]
    assert alerts["R1jaxTrainDeviceMemoryHigh"]["for"] == "5m" and alerts["R1jaxTrainGPUUtilizationLow"]["for"] == "10m"
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert {"summary", "description"} <= set(rule["annotations"]), name
        assert _metric_names(rule["expr"]) <= set(METRICS) | {"up"}, (name, rule["expr"])


# ------------------------------------------------------------------------------------ dashboard

def test_dashboard_uses_the_exporters_names():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 36 and dash["uid"] == "r1jax-train" and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    m = re.fullmatch(r"label_values\((\w+),\s*slurm_job_id\)", variables["slurm_job_id"]["definition"])
    assert m and m.group(1) in METRICS
    ids = [p["id"] for p in _panels()]
    assert len(ids) == len(set(ids))
    used = set()
    for p in _panels():
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
    for title, expr in _exprs():
        names = _metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        assert names <= set(METRICS), f"{title}: {expr!r} uses {sorted(names - set(METRICS))}, not exported"
        used |= names
    wanted = {"r1jax_train_loss", "r1jax_train_eval_loss", "r1jax_train_grad_norm", "r1jax_train_grad_norm_window_mean",
              "r1jax_train_grad_norm_window_std", "r1jax_train_tokens_per_second", "r1jax_train_mfu_ratio",
              "r1jax_train_device_memory_used_bytes", "r1jax_train_device_memory_limit_bytes",
              "r1jax_train_last_checkpoint_timestamp_seconds", "r1jax_train_expert_imbalance",
              "r1jax_train_skipped_steps_total", "r1jax_train_rollbacks_total", "r1jax_train_step_time_seconds",
              "r1jax_train_gpu_utilization_percent", "r1jax_train_last_step_timestamp_seconds"}
    assert wanted <= used, f"no panel shows {sorted(wanted - used)}"

    def panel(title):
        [p] = [p for p in _panels() if p["title"] == title]
        return p["fieldConfig"]
    for title, line in (("Device memory used / limit", 0.9), ("GPU utilisation", 85), ("Gradient-norm window std", 0.5)):
        d = panel(title)["defaults"]
        assert line in [s["value"] for s in d["thresholds"]["steps"]] and d["custom"]["thresholdsStyle"]["mode"] != "off"
    # the gradient-norm band: filled from mean + std down to mean - std
    [band] = [o for o in panel("Gradient norm")["overrides"] if o["matcher"]["options"] == "mean + std"]
    assert {"id": "custom.fillBelowTo", "value": "mean - std"} in band["properties"]


# ------------------------------------------------------------------------------------ SLURM targets

FAKE_SCONTROL = '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && echo 127.0.0.1\n'
# stands in for srun: keeps what the job listed while it runs, and the trainer's arguments
FAKE_SRUN = '#!/bin/bash\ncp -r "$R1JAX_PROMETHEUS_SD_DIR" "$SEEN"\nshift\necho "$*" > "$SEEN/argv"\n'


def test_sbatch_targets_scraped_through_file_sd(tmp_path):
    ensure_prometheus()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    port, sd_dir, seen = _port_pair(), tmp_path / "sd", tmp_path / "seen"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "R1JAX_"))}
    env.update(PATH=f"{bindir}:{env['PATH']}", SLURM_JOB_ID="4242", SLURM_TASKS_PER_NODE="2",
               SLURM_JOB_NODELIST="node1", R1JAX_METRICS_PORT=str(port), R1JAX_PROMETHEUS_SD_DIR=str(sd_dir),
               R1JAX_PYTHON=sys.executable, SEEN=str(seen))
    p = subprocess.run(["bash", str(SBATCH), str(TINY), "--run-dir", str(tmp_path / "run"), "train.steps=3"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    [listed] = seen.glob("*.json")
    assert listed.name == "r1jax-4242.json"
    targets = json.loads(listed.read_text())
    assert targets == [{"targets": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"], "labels": {"slurm_job_id": "4242"}}]
    argv = (seen / "argv").read_text().split()
    assert argv[argv.index("train.steps=3") - 2:] == [f"train.metrics_port={port}", "train.metrics_host=0.0.0.0",
                                                      "train.steps=3"]
    assert not list(sd_dir.glob("*.json"))                  # gone with the job

    # the two processes of that "job", and a Prometheus with prometheus-slurm.yml's scrape config
    exps = [TrainExporter("127.0.0.1", port + i, process_index=i, process_count=2, run_dir=str(tmp_path))
            for i in range(2)]
    exps[0].step(5)
    base, proc = start_prometheus([], tmp_path / "prom", rules=ALERTS)
    try:
        config = yaml.safe_load(SLURM_CONFIG.read_text())
        config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(ALERTS)]
        config["scrape_configs"][0]["file_sd_configs"][0]["files"] = [str(seen / "*.json")]
        (tmp_path / "prom" / "prometheus.yml").write_text(yaml.safe_dump(config))
        with urllib.request.urlopen(urllib.request.Request(f"{base}/-/reload", method="POST"), timeout=10) as r:
            assert r.status == 200
        up = wait_for(base, 'up{job="r1jax-train"} == 1', lambda r: len(r) == 2, timeout=30)
        assert {r["metric"]["instance"] for r in up} == {f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"}
        assert {r["metric"]["slurm_job_id"] for r in up} == {"4242"}
        info = query(base, "r1jax_train_info")
        assert {(r["metric"]["process"], r["metric"]["slurm_job_id"]) for r in info} == {("0", "4242"), ("1", "4242")}
        assert value(query(base, 'r1jax_train_step{slurm_job_id="4242"}')) == 5   # process 0 only

        deadline = time.time() + 15
        while time.time() < deadline:
            rules = [r for g in api(base, "/api/v1/rules")["groups"] for r in g["rules"]]
            if rules and all(r["lastEvaluation"] > "2000" for r in rules):
                break
            time.sleep(0.5)
        assert len(rules) == 7
        assert {r["name"]: (r["health"], r.get("lastError") or "") for r in rules} == {r["name"]: ("ok", "") for r in rules}
        assert not [a for a in api(base, "/api/v1/alerts")["alerts"] if a["state"] == "firing"]
    finally:
        stop_prometheus(proc)
        for e in exps:
            e.close()


# ------------------------------------------------------------------------------------ end to end

@pytest.mark.slow
def test_prometheus_scrapes_a_training_run(tmp_path):
    """A tiny run with train.metrics_port, one bad step injected at step 12; Prometheus (started
    beside it) scrapes it every second and reads the run back through its query API."""
    ensure_prometheus()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "R1JAX_"))}
    # one device and XLA:CPU's quickest compile (tests/conftest.py measures them): the step compiles
    # in about 15 s rather than 30
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", JAX_DISABLE_MOST_OPTIMIZATIONS="1",
               XLA_FLAGS="--xla_cpu_use_fusion_emitters=false", PYTHONUNBUFFERED="1")
    log_path = tmp_path / "train.log"
    t0 = time.time()
    with open(log_path, "w") as log:
        # more steps than the test waits for: the run must outlive the queries (SIGTERM ends it)
        train = subprocess.Popen(
            [sys.executable, "-m", "r1jax.train", "--config", str(TINY), "--run-dir", str(tmp_path / "run"),
             "train.steps=5000", "train.log_every=5", "checkpoint.every=100000", "train.inject_faults=[nan_data@12]",
             f"train.metrics_port={port}"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc = None
    try:
        base, proc = start_prometheus([f"127.0.0.1:{port}"], tmp_path / "prom", rules=ALERTS)

        def running(result):
            assert train.poll() is None, f"training exited with {train.returncode}:\n{log_path.read_text()[-3000:]}"
            return bool(result)
        step = wait_for(base, "r1jax_train_step >= 20", running, timeout=150)
        t_step = time.time() - t0
        assert value(step) >= 20
        # the log window of the bad step has a NaN mean loss (exported as it is); the next ones are finite
        loss = value(wait_for(base, "r1jax_train_loss", lambda r: running(r) and math.isfinite(value(r)), timeout=20))
        assert 0 < loss < 20, loss
        # the bad step of step 12: skipped by the step, counted by the guard, both through Prometheus
        assert value(wait_for(base, "r1jax_train_bad_steps_total", running, timeout=10)) == 1
        assert value(query(base, "r1jax_train_skipped_steps_total")) == 1
        assert value(query(base, 'r1jax_train_alerts_total{kind="bad_step"}')) == 1
        assert value(query(base, 'up{job="r1jax"}')) == 1
        assert value(query(base, 'r1jax_train_device_memory_used_bytes{device="cpu"}')) > 0
        assert value(query(base, "time() - r1jax_train_last_step_timestamp_seconds")) < 30

        # every dashboard query is accepted; those of a CPU run without evals or checkpoints return data
        absent_here = ("gpu_", "eval_", "checkpoint")
        for title, expr in _exprs():
            result = query(base, expr)                       # raises PrometheusError if rejected
            if not any(a in expr for a in absent_here) and "alerts_total" not in expr:
                assert result, f"{title}: {expr!r} has no series on a training run"
        print(f"\ntraining run: step >= 20 read through Prometheus {t_step:.1f} s after its start")
    finally:
        if train.poll() is None:
            train.send_signal(signal.SIGTERM)              # the trainer saves and exits 0
            try:
                train.wait(timeout=60)
            except subprocess.TimeoutExpired:
                train.kill()
                train.wait(timeout=30)
        if proc is not None:
            stop_prometheus(proc)
    assert train.returncode == 0, log_path.read_text()[-3000:]
    assert "preempted at step" in log_path.read_text()

"""`python -m r1jax.bench`: the real CLI on tiny.yaml, r1jax against transformers' PyTorch model
in their own processes. Checks the outputs' shape and sanity and that the two frameworks train
alike on the same weights and batches; no timing assertions (bench/RESULTS.md holds timings)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow      # whole runs, meshes or processes: `make test`, not `make check`

ROOT = Path(__file__).resolve().parents[1]
SAME = ["model.num_nextn_predict_layers=0", "optim.bias_update_rate=0", "loss.seq_aux_loss_alpha=0", "mesh.data=1"]


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1"}
    return subprocess.run([sys.executable, "-m", "r1jax.bench", *args], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=900)


@pytest.mark.slow
def test_bench_compare_torch_outputs_and_parity(tmp_path):
    prefix = tmp_path / "tiny"
    proc = _bench("--config", "configs/tiny.yaml", "--compare", "torch", "--steps", "3", "--warmup", "1",
                  "--out", str(prefix), *SAME)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(prefix.with_suffix(".json").read_text())
    assert prefix.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = prefix.with_suffix(".md").read_text()
    assert "| r1jax | fp32 |" in md and "| torch | fp32 |" in md and "**r1jax / torch**" in md
    assert [r["dtype"] for r in result["runs"]] == ["fp32"]
    assert result["threads"] == len(os.sched_getaffinity(0))
    for run in result["runs"]:
        for side in ("r1jax", "torch"):
            r = run[side]
            assert len(r["step_s"]) == 3 and len(r["losses"]) == 4
            assert r["step_s_median"] > 0 and r["tokens_per_s"] == pytest.approx(8 * 64 / r["step_s_median"])
            assert 0 < r["mfu"] < 1
        assert run["ratio"] == pytest.approx(run["r1jax"]["tokens_per_s"] / run["torch"]["tokens_per_s"])
        mem = run["r1jax"]["memory"]
        assert mem["argument"] > 0 and mem["temp"] > 0 and run["r1jax"]["compile_s"] > 0
        assert run["torch"]["threads"] == result["threads"]
    (fp32,) = result["runs"]
    # the same weights and batches train alike: fp32 per-step losses agree to float32 rounding
    # (measured 4.8e-7 over 4 steps), and they learn
    assert fp32["max_abs_loss_diff"] < 1e-5, fp32["max_abs_loss_diff"]
    assert fp32["r1jax"]["losses"][-1] < fp32["r1jax"]["losses"][0] - 0.1


def test_bench_refuses_what_the_reference_lacks(tmp_path):
    proc = _bench("--config", "configs/tiny.yaml", "--compare", "torch", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert "\n" not in line and "model.num_nextn_predict_layers=1" in line and "MTP" in line
    assert not list(tmp_path.iterdir())
    proc = _bench("--config", "configs/tiny.yaml", "--dtypes", "fp8", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "--dtypes fp8" in proc.stderr and "\n" not in proc.stderr.strip()


def test_bench_generate_against_transformers(tmp_path):
    """--mode generate: both frameworks greedy on the same export and prompts, every experts
    implementation of transformers, speculative r1jax; the JSON carries the ratios the issue
    names and the tokens agree."""
    prefix = tmp_path / "gen"
    proc = _bench("--config", "configs/tiny.yaml", "--compare", "torch", "--mode", "generate", "--batch-sizes", "1",
                  "--prompt-len", "8", "--new-tokens", "6", "--rounds", "1", "--repeats", "1", "--moe-decode", "auto",
                  "--speculative", "--out", str(prefix), "mesh.data=1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(prefix.with_suffix(".json").read_text())
    assert set(result["decode_speedup"]) == {"1"} and all(v > 0 for v in result["decode_speedup"].values())
    assert 0 < result["b1_bandwidth_fraction"] and result["bandwidth_GBps"] > 0
    assert 0 <= result["speculative_b1"]["acceptance"] <= 1
    for row in result["rows"]:
        assert set(row["torch"]) == {"grouped_mm", "eager", "batched_mm"}
        assert row["tokens_equal"] == 1.0
    assert prefix.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "decode_speedup" in proc.stdout and "| r1jax | auto |" in prefix.with_suffix(".md").read_text()

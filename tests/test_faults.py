"""The kill -9 harness, short: tiny.yaml for 16 steps, killed with SIGKILL 3 times (at least once
while a checkpoint is being written) and restarted until done, trains bitwise like the same run
left alone (bench/faults.py; bench/RESULTS.md has a longer run)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow      # whole runs, meshes or processes: `make test`, not `make check`

ROOT = Path(__file__).resolve().parents[1]


def test_killed_and_restarted_run_trains_like_the_one_left_alone(tmp_path):
    # XLA at -O0, as tests/conftest.py sets for the files that compare r1jax with r1jax: both runs
    # compile alike, and the compiles are shorter
    env = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false"}
    out = tmp_path / "faults.json"
    r = subprocess.run([sys.executable, "bench/faults.py", "--kills", "3", "--seed", "0", "--steps", "16",
                        "--out", str(out), "--work", str(tmp_path / "work")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["kills"] == 3 and res["restarts"] == 3 and res["kills_during_write"] >= 1
    assert res["steps_compared"] == 16 and res["not_bitwise_equal"] == 0 and res["max_abs_diff"] == 0
    assert res["fallbacks"] == 0

"""The shipped DeepSeek-V3/R1 config builds abstractly with the published parameter counts, and
training it where it cannot fit fails at once with one clear line."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from r1jax import config as configlib
from r1jax.model.params import count

ROOT = Path(__file__).resolve().parents[1]


def test_deepseek_v3_671b_parameter_counts():
    cfg = configlib.load(ROOT / "configs" / "deepseek_v3_671b.yaml").model
    t0 = time.time()
    n = count(cfg)                    # nnx abstract shapes only: nothing is allocated
    print(f"\nmain {n.main / 1e9:.3f}B, activated {n.activated / 1e9:.3f}B, MTP {n.mtp / 1e9:.3f}B "
          f"(+{2 * cfg.vocab_size * cfg.hidden_size / 1e9:.2f}B shared embedding/head) in {time.time() - t0:.1f}s")
    assert abs(n.main - 671e9) <= 0.01 * 671e9
    assert 37e9 <= n.activated <= 38e9
    assert 11.5e9 <= n.mtp <= 14e9


# the config's DeepSeek layout (2048 GPUs) folded onto this machine's one device
ONE_DEVICE = ["mesh.data=1", "mesh.expert=1", "mesh.pipeline=1", "mesh.dcn_data=1", "mesh.dcn_expert=1",
              "mesh.dcn_pipeline=1", "train.microbatches=1"]


def test_training_671b_on_cpu_fails_fast(tmp_path):
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "r1jax.train", "--config", str(ROOT / "configs" / "deepseek_v3_671b.yaml"),
                        "--run-dir", str(tmp_path / "run"), *ONE_DEVICE],
                       capture_output=True, text=True, timeout=300)
    took = time.time() - t0
    lines = r.stderr.strip().splitlines()
    print(f"\nexit {r.returncode} after {took:.1f}s: {lines[-1] if lines else ''}")
    assert r.returncode == 2
    assert len(lines) == 1 and "682.6B parameters need" in lines[0] and "GiB" in lines[0]
    assert took < 60
    assert not (tmp_path / "run").exists()

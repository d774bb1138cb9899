"""r1jax's side of the bench: build the model and train step as the trainer does, compile it
(lowering and XLA compile timed apart), read `memory_analysis()`, then time each step.

A step's time is measured from dispatch to `block_until_ready` on its metrics, so it holds the
whole step (forward, backward, AdamW) and nothing of the next one; warm-up steps are excluded
and the median of the timed steps is reported."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from r1jax import model as modellib
from r1jax.bench import peak_rss_bytes
from r1jax.config import Config
from r1jax.parallel import mesh as meshlib
from r1jax.train import optim
from r1jax.train import state as statelib
from r1jax.train.step import build


def learning_rates(cfg: Config, n: int) -> list[float]:
    """The lr r1jax's optimizer applies at steps 0..n-1 (the reference replays them)."""
    sched = optim.schedule(cfg.optim, cfg.train.steps)
    return [float(sched(i)) for i in range(n)]


def run(cfg: Config, tokens: np.ndarray, warmup: int, export_hf: Path | None = None) -> dict:
    """Train on `tokens` [n, B, T]: the first `warmup` steps untimed. With `export_hf`, the
    initial weights are written there as an HF checkpoint first (for the reference)."""
    mesh = meshlib.make_mesh(cfg.mesh)
    setup = build(cfg, mesh)
    if export_hf is not None:           # the model in model order, whatever the run's pipeline layout
        from r1jax.convert import hf
        hf.save(statelib.model(setup.graphdef, setup.state, setup.layout), cfg.model, export_hf)
    state, step = setup.state, setup.step
    bs = meshlib.batch_sharding(mesh)
    B, T = tokens.shape[1:]
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))

    def batch(i: int) -> dict:
        return jax.device_put({"ids": tokens[i], "segment_ids": np.ones((B, T), np.int32),
                               "positions": positions}, bs)

    t0 = time.perf_counter()
    lowered = step.lower(state, batch(0))
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    ma = compiled.memory_analysis()
    memory = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")} if ma else {}

    losses, times = [], []
    for i in range(len(tokens)):
        b = batch(i)
        jax.block_until_ready(b)
        s = time.perf_counter()
        state, m = compiled(state, b)
        loss = float(jax.block_until_ready(m["loss"]))
        times.append(time.perf_counter() - s)
        losses.append(loss)
    timed = times[warmup:]
    return {"framework": "r1jax", "lower_s": t1 - t0, "compile_s": t2 - t1, "first_step_s": times[0],
            "step_s": timed, "step_s_median": statistics.median(timed), "step_s_min": min(timed),
            "losses": losses, "memory": memory, "peak_rss_bytes": peak_rss_bytes(),
            "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}",
            "versions": {"jax": jax.__version__}}


def compute_dtype_name(cfg: Config) -> str:
    return jnp.dtype(modellib.COMPUTE_DTYPES[cfg.train.dtype]).name


def main(argv: list[str]) -> int:
    """`python -m r1jax.bench.step_timing SPEC.json RESULT.json` (what r1jax.bench runs)."""
    import json

    from r1jax import config as configlib
    from r1jax.train import mfu

    spec = json.loads(Path(argv[0]).read_text())
    cfg = configlib.from_dict(spec["config"])
    tokens = np.load(spec["tokens"])
    out = run(cfg, tokens, spec["warmup"], Path(spec["export_hf"]) if spec.get("export_hf") else None)
    peak, how = mfu.peak_flops(jax.devices(), cfg.train.dtype)
    out.update(lrs=learning_rates(cfg, len(tokens)), peak_flops=peak, peak_source=how, compute_dtype=compute_dtype_name(cfg))
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))

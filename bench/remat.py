"""Remat policies on the demo config: compiled temp memory and step time of the full train step.

    python bench/remat.py [--config configs/demo.yaml] [--steps 5]

Temp memory is `jit(step).lower(...).compile().memory_analysis().temp_size_in_bytes` (the
activations and workspace the step needs beyond its arguments and outputs). Step time is the
median of `--steps` timed steps after one warm-up, on one device, with a fixed random batch.
Writes bench/results/remat.json and .md and prints the markdown table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

from r1jax.bench import machine_line

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from r1jax import config as configlib
    from r1jax.config import Remat
    from r1jax.parallel.mesh import single_device_mesh
    from r1jax.train.step import build

    rows = []
    for policy in Remat:
        cfg = configlib.load(args.config, [f"train.remat={policy.value}", "mesh.data=1"])
        B, T = cfg.train.global_batch_size, cfg.data.seq_len
        batch = {"ids": jnp.asarray(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, T)), jnp.int32),
                 "segment_ids": jnp.ones((B, T), jnp.int32),
                 "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))}
        setup = build(cfg, single_device_mesh())
        state, step = setup.state, setup.step
        jax.block_until_ready(state)        # initialisation is asynchronous: keep it out of the compile time
        t0 = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        state, m = compiled(state, batch)
        jax.block_until_ready(m)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, m = compiled(state, batch)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t0)
        rows.append({"policy": policy.value, "temp_mib": mem.temp_size_in_bytes / 2**20,
                     "argument_mib": mem.argument_size_in_bytes / 2**20, "compile_s": compile_s,
                     "step_ms_median": 1000 * statistics.median(times), "step_ms_min": 1000 * min(times),
                     "loss": float(m["loss"])})
        print(f"{policy.value}: temp {rows[-1]['temp_mib']:.1f} MiB, step {rows[-1]['step_ms_median']:.0f} ms",
              flush=True)

    base = rows[0]
    table = ["| remat | temp memory | vs none | step time (median) | vs none | compile |", "|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['policy']} | {r['temp_mib']:.1f} MiB | {r['temp_mib'] / base['temp_mib']:.2f}x | "
                     f"{r['step_ms_median']:.0f} ms | {r['step_ms_median'] / base['step_ms_median']:.2f}x | "
                     f"{r['compile_s']:.1f} s |")
    command = "python bench/remat.py " + " ".join(argv if argv is not None else sys.argv[1:])
    machine = machine_line()
    date = datetime.datetime.now().astimezone().isoformat(timespec="minutes")
    print("\n" + "\n".join(table))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "remat.json").write_text(json.dumps({"command": command.strip(), "date": date, "machine": machine,
                                                    "config": args.config, "results": rows}, indent=2) + "\n")
    (RESULTS / "remat.md").write_text(
        f"# Remat policies\n\n`{command.strip()}` on {date}; {machine}. {Path(args.config).name}, fp32, one device, "
        f"the whole train step (forward, backward, AdamW); step time is the median of {args.steps} steps.\n\n"
        + "\n".join(table) + "\n\nAll policies give the same loss (tests/test_step.py checks results to 1e-6). "
        "On CPU `offload` has nowhere to go (device memory is host memory), so it matches `save_attention`.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""LoRA against full fine-tuning: the train step's time, compiled memory and FLOPs.

    python bench/lora.py [--config configs/demo.yaml] [--steps 10] [--rank 16]

The step is built as the trainer builds it (r1jax.train.step.build) on one device for: full
fine-tuning; LoRA rank R on the attention projections (the default targets); the same with the
base frozen in bf16; and LoRA on every target (attention, dense MLP, shared and routed experts).
Each row reports XLA's `memory_analysis` (argument = the donated state and the batch; temp) and
`cost_analysis` FLOPs of the compiled step, the trainable parameters, and the median step time,
the variants timed in turns (one step of each per round) so that load drifts evenly.
Writes bench/results/lora.json and .md.
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
ATTENTION = "[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj]"
ALL = "[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,mlp,shared_experts,experts]"


def variants(rank: int) -> dict[str, list[str]]:
    return {"full fine-tuning": [],
            f"LoRA r{rank} attention": [f"lora.rank={rank}", f"lora.targets={ATTENTION}"],
            f"LoRA r{rank} attention, base bf16": [f"lora.rank={rank}", f"lora.targets={ATTENTION}", "lora.base_dtype=bf16"],
            f"LoRA r{rank} all targets": [f"lora.rank={rank}", f"lora.targets={ALL}"]}


def measure(config: str, rank: int, steps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from r1jax import config as configlib
    from r1jax.parallel.mesh import batch_sharding, single_device_mesh
    from r1jax.train.step import build

    rows, runs = [], []
    for name, over in variants(rank).items():
        cfg = configlib.load(config, [*over, "mesh.data=1", "optim.bias_update_rate=0"])
        setup = build(cfg, single_device_mesh())
        jax.block_until_ready(setup.state)
        B, T = cfg.train.global_batch_size, cfg.data.seq_len
        bs = batch_sharding(setup.mesh)
        ids = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, T))
        batch = jax.device_put({"ids": jnp.asarray(ids, jnp.int32), "segment_ids": jnp.ones((B, T), jnp.int32),
                                "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))}, bs)
        t0 = time.perf_counter()
        compiled = setup.step.lower(setup.state, batch).compile()
        ma, ca = compiled.memory_analysis(), compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, list) else ca
        trainable = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(setup.state["params"]))
        rows.append({"variant": name, "overrides": over, "compile_s": time.perf_counter() - t0,
                     "trainable": trainable, "argument_bytes": int(ma.argument_size_in_bytes),
                     "temp_bytes": int(ma.temp_size_in_bytes), "flops": float(ca.get("flops", 0.0)), "times": []})
        state, m = compiled(setup.state, batch)          # warm-up
        jax.block_until_ready(m)
        runs.append([compiled, state, batch])
    for _ in range(steps):
        for row, run in zip(rows, runs):
            t0 = time.perf_counter()
            run[1], m = run[0](run[1], run[2])
            jax.block_until_ready(m)
            row["times"].append(time.perf_counter() - t0)
            row["loss"] = float(m["loss"])
    for row in rows:
        row["step_ms_median"] = 1000 * statistics.median(row.pop("times"))
    return rows


def report(meta: dict, rows: list[dict]) -> str:
    full = rows[0]
    lines = [f"# LoRA against full fine-tuning: {Path(meta['config']).name}", "",
             f"`{meta['command']}` ({meta['date']}; {meta['machine']}; {meta['pressure']})", "",
             "| variant | trainable | argument (XLA) | temp (XLA) | FLOPs / step | step (median) | vs full |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['trainable']:,} ({100 * r['trainable'] / full['trainable']:.2f}%) | "
                     f"{r['argument_bytes'] / 2**20:,.1f} MiB | {r['temp_bytes'] / 2**20:,.1f} MiB | "
                     f"{r['flops'] / 1e9:,.2f} G ({r['flops'] / full['flops']:.2f}x) | {r['step_ms_median']:,.1f} ms | "
                     f"{r['step_ms_median'] / full['step_ms_median']:.2f}x |")
    lines += ["", "Argument is the donated state plus the batch: with LoRA the optimizer's moments exist for the "
              "adapters only and the frozen base carries no gradient, so it shrinks by about the fp32 moments of "
              "the base; a bf16 base halves the base itself. The FLOPs drop because no weight gradient is formed "
              "for a frozen projection (the unmerged adapter, r1jax/model/lora.py)."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    from r1jax.bench.generation import cpu_pressure
    before = cpu_pressure()
    rows = measure(args.config, args.rank, args.steps)
    after = cpu_pressure()
    busy = max(x or 0 for x in (before, after)) > 10
    meta = {"command": " ".join(["python bench/lora.py", *(sys.argv[1:] if argv is None else argv)]),
            "date": datetime.date.today().isoformat(), "machine": machine_line(), "config": args.config,
            "pressure": f"CPU pressure avg10 {before} -> {after}%" + (": machine busy, times are rough" if busy else "")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lora.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    md = report(meta, rows)
    (RESULTS / "lora.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

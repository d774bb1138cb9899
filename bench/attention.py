"""Attention against sequence length: the train step's memory and time with `kernels.attention=dense`
and `=flash` as one row of a model grows from 512 to 4096 tokens.

    python bench/attention.py [--config bench/configs/dense_small.yaml] [--seq 512 1024 2048 4096]
                              [--block 512] [--steps 3]

For each length both implementations are built in this process from the same seed, compiled
(XLA's `memory_analysis` gives the step's temporary bytes), run once on the same batch (their
first-step losses are compared) and timed: the median of `--steps` steps after that warm-up,
alternating dense and flash step by step so that load on a shared machine hits both alike.
Writes bench/results/attention.json and .md and prints the markdown table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

from r1jax.bench import machine_line

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DENSE_SMALL = ROOT / "bench" / "configs" / "dense_small.yaml"


def measure(config: str | Path, seq: int, block: int, steps: int, overrides: list[str] | tuple = ()) -> dict:
    """Both implementations at one sequence length, one row: temp bytes, step times, losses."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from r1jax import config as configlib
    from r1jax.parallel.mesh import batch_sharding, single_device_mesh
    from r1jax.train.step import build

    runs = {}
    for impl in ("dense", "flash"):
        cfg = configlib.load(config, [*overrides, "mesh.data=1", "train.global_batch_size=1", f"data.seq_len={seq}",
                                      f"model.max_position_embeddings={max(seq, 1024)}", f"kernels.attention={impl}",
                                      f"kernels.attention_block={block}"])
        setup = build(cfg, single_device_mesh())
        mesh, state, step = setup.mesh, setup.state, setup.step
        ids = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (1, seq))
        batch = jax.device_put({"ids": jnp.asarray(ids, jnp.int32), "segment_ids": jnp.ones((1, seq), jnp.int32),
                                "positions": jnp.arange(seq, dtype=jnp.int32)[None]}, batch_sharding(mesh))
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
        state, m = compiled(state, batch)
        runs[impl] = {"compiled": compiled, "state": state, "batch": batch, "compile_s": compile_s,
                      "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
                      "first_loss": float(m["loss"]), "times": []}
    for _ in range(steps):
        for r in runs.values():
            t0 = time.perf_counter()
            r["state"], m = r["compiled"](r["state"], r["batch"])
            jax.block_until_ready(m)
            r["times"].append(time.perf_counter() - t0)
    out = {"seq_len": seq, "block": block}
    for impl, r in runs.items():
        out[impl] = {"temp_bytes": r["temp_bytes"], "compile_s": r["compile_s"], "first_loss": r["first_loss"],
                     "step_ms_median": 1000 * statistics.median(r["times"]), "step_ms": [1000 * t for t in r["times"]]}
    out["loss_rel_diff"] = abs(out["flash"]["first_loss"] - out["dense"]["first_loss"]) / abs(out["dense"]["first_loss"])
    return out


def report(meta: dict, rows: list[dict]) -> str:
    lines = ["# Attention: dense against flash as the sequence grows", "",
             f"`{meta['command']}` on {meta['date']}; {meta['machine']}. {meta['config']}, one row of T tokens, "
             f"fp32, remat none, one device, the whole train step; flash blocks of {meta['block']} positions; step "
             f"time is the median of {meta['steps']} steps (dense and flash alternating) after one.", "",
             "| tokens | dense temp | flash temp | flash / dense | dense step | flash step | flash / dense | "
             "first-step loss rel. diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d, f = r["dense"], r["flash"]
        lines.append(f"| {r['seq_len']:,} | {d['temp_bytes'] / 2**20:,.1f} MiB | {f['temp_bytes'] / 2**20:,.1f} MiB | "
                     f"{f['temp_bytes'] / d['temp_bytes']:.3f}x | {d['step_ms_median']:,.0f} ms | "
                     f"{f['step_ms_median']:,.0f} ms | {f['step_ms_median'] / d['step_ms_median']:.2f}x | "
                     f"{r['loss_rel_diff']:.1e} |")
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        k = b["seq_len"] / a["seq_len"]
        lines += ["", f"From {a['seq_len']:,} to {b['seq_len']:,} tokens ({k:.0f}x): dense temp grows "
                      f"{b['dense']['temp_bytes'] / a['dense']['temp_bytes']:.1f}x, flash temp "
                      f"{b['flash']['temp_bytes'] / a['flash']['temp_bytes']:.1f}x."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(DENSE_SMALL))
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "attention"), help="PREFIX for PREFIX.json and PREFIX.md")
    args = ap.parse_args(argv)
    rows = []
    for T in args.seq:
        rows.append(measure(args.config, T, args.block, args.steps))
        r = rows[-1]
        print(f"T={T}: temp dense {r['dense']['temp_bytes'] / 2**20:.1f} MiB, flash {r['flash']['temp_bytes'] / 2**20:.1f}"
              f" MiB; step dense {r['dense']['step_ms_median']:.0f} ms, flash {r['flash']['step_ms_median']:.0f} ms",
              flush=True)
    config = Path(args.config).resolve()
    meta = {"command": "python bench/attention.py" + ("" if config == DENSE_SMALL else f" --config {args.config}")
                       + ("" if args.seq == [512, 1024, 2048, 4096] else " --seq " + " ".join(map(str, args.seq)))
                       + ("" if args.block == 512 else f" --block {args.block}"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "machine": machine_line(),
            "config": str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config),
            "block": args.block, "steps": args.steps}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = report(meta, rows)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

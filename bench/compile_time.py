"""Compile time of the full train step at 4 and at 32 layers: the layers are scanned, so depth
should cost (almost) nothing.

    python bench/compile_time.py [--config bench/configs/moe_small.yaml] [--layers 4 32] [--runs 2]

Each measurement runs in a fresh process (`--one`) with JAX's persistent compilation cache off,
so neither an in-memory nor an on-disk cache helps. The process builds the model, state and
train step as the trainer does (one device, the config's batch) and times, for the whole step
(forward, backward, AdamW), after the state's (asynchronously dispatched) initialisation has
finished:
  - trace: Python tracing to a jaxpr (`jit(step).trace(state, batch)`),
  - lower: jaxpr -> StableHLO (`traced.lower()`),
  - compile: XLA (`lowered.compile()`),
and counts the program's size: StableHLO lines, and instructions of the optimised HLO.
The table gives the median over `--runs` processes per depth (runs alternate between depths so
that load on a shared machine hits both alike) and the ratios deepest / shallowest.
Writes bench/results/compile_time.json and .md and prints the markdown table.

`measure(config, overrides, compiler_options)` is what tests/test_bench_tables.py imports.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from r1jax.bench import machine_line

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MOE_SMALL = ROOT / "bench" / "configs" / "moe_small.yaml"
LIMIT = 1.5          # the requirement: (lower + compile) at 32 layers <= 1.5x that at 4
MARK = "COMPILE_TIME_RESULT "


def measure(config: str | Path, overrides: Sequence[str] = (), compiler_options: dict | None = None) -> dict:
    """Build `config` + `overrides` on one device as the trainer does and time tracing, lowering
    and compiling its train step (in this process: whatever caches it has stay on)."""
    import jax
    import jax.numpy as jnp

    from r1jax import config as configlib
    from r1jax.parallel import mesh as meshlib
    from r1jax.train.step import build

    t0 = time.perf_counter()
    cfg = configlib.load(config, [*overrides, "mesh.data=1"])
    t = cfg.train
    mesh = meshlib.single_device_mesh()
    setup = build(cfg, mesh)
    state, step = setup.state, setup.step
    # Initialisation is dispatched asynchronously: unless it has finished, its random draws run on
    # the same cores as the tracing and compiling timed below (at 32 layers, seconds of them).
    jax.block_until_ready(state)
    B, T = t.global_batch_size, cfg.data.seq_len
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=meshlib.batch_sharding(mesh))
             for k in ("ids", "segment_ids", "positions")}
    out = {"layers": cfg.model.num_hidden_layers, "dense_layers": cfg.model.first_k_dense_replace,
           "moe_layers": cfg.model.num_moe_layers, "build_s": time.perf_counter() - t0}
    clock = lambda: (time.perf_counter(), time.process_time())     # noqa: E731 - wall, CPU of all threads
    with meshlib.activate(mesh):
        t0 = clock()
        traced = step.fn.trace(state, batch)
        t1 = clock()
        lowered = traced.lower()
        t2 = clock()
        compiled = lowered.compile(compiler_options)
        t3 = clock()
    for i, suffix in enumerate(("_s", "_cpu_s")):
        out.update({"trace" + suffix: t1[i] - t0[i], "lower" + suffix: t2[i] - t1[i], "compile" + suffix: t3[i] - t2[i],
                    "total" + suffix: t3[i] - t0[i]})
    out.update(stablehlo_lines=len(lowered.as_text().splitlines()),
               hlo_instructions=sum(" = " in line for line in compiled.as_text().splitlines()),
               temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes))
    return out


def _one(config: str, layers: int) -> None:
    """Child process: no persistent cache, one measurement, printed as a marked JSON line."""
    import jax
    jax.config.update("jax_enable_compilation_cache", False)
    print(MARK + json.dumps(measure(config, [f"model.num_hidden_layers={layers}"])), flush=True)


def run_fresh(config: str, layers: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    proc = subprocess.run([sys.executable, __file__, "--one", "--config", str(config), "--layers", str(layers)],
                          env=env, capture_output=True, text=True, cwd=ROOT)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(MARK)]
    if proc.returncode or not lines:
        raise RuntimeError(f"--one --layers {layers} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK):])


KEYS = ("trace_s", "lower_s", "compile_s", "total_s", "trace_cpu_s", "lower_cpu_s", "compile_cpu_s", "total_cpu_s",
        "build_s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(MOE_SMALL))
    p.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        _one(args.config, args.layers[0])
        return 0

    t_start = time.perf_counter()
    runs: dict[int, list[dict]] = {n: [] for n in args.layers}
    for i in range(args.runs):
        for n in args.layers:
            r = run_fresh(args.config, n)
            runs[n].append(r)
            print(f"run {i + 1}, {n} layers: trace {r['trace_s']:.1f} s, lower {r['lower_s']:.1f} s, "
                  f"compile {r['compile_s']:.1f} s ({r['compile_cpu_s']:.1f} s CPU), "
                  f"{r['hlo_instructions']} HLO instructions", flush=True)
    med = {n: {**{k: statistics.median(r[k] for r in rs) for k in KEYS},
               **{k: rs[0][k] for k in ("layers", "dense_layers", "moe_layers", "stablehlo_lines", "hlo_instructions",
                                        "temp_bytes")}} for n, rs in runs.items()}
    lo, hi = min(args.layers), max(args.layers)
    ratio = {k: med[hi][k] / med[lo][k] for k in KEYS}
    ratio.update({k: med[hi][k] / med[lo][k] for k in ("stablehlo_lines", "hlo_instructions", "temp_bytes")})

    def cells(m: dict, fmt) -> str:
        return " | ".join([*(fmt(m[k]) for k in ("trace_s", "lower_s", "compile_s")), f"**{fmt(m['total_s'])}**",
                           fmt(m["total_cpu_s"]), *(fmt(m[k], n=True) for k in ("stablehlo_lines", "hlo_instructions"))])
    sec = lambda x, n=False: f"{x:,}" if n else f"{x:.1f} s"       # noqa: E731
    times = lambda x, n=False: f"{x:.2f}x"                           # noqa: E731
    table = ["| layers (dense + MoE) | trace | lower to StableHLO | XLA compile | trace + lower + compile "
             "| the same, CPU time | StableHLO lines | optimised HLO instructions |", "|---|---|---|---|---|---|---|---|"]
    for n in args.layers:
        table.append(f"| {n} ({med[n]['dense_layers']} + {med[n]['moe_layers']}) | " + cells(med[n], sec) + " |")
    table.append(f"| ratio {hi}/{lo} | " + cells(ratio, times) + " |")
    ok = ratio["total_s"] <= LIMIT
    total_s = time.perf_counter() - t_start
    print("\n" + "\n".join(table))
    print(f"ratio {hi}/{lo} layers of trace + lower + compile: {ratio['total_s']:.2f}x wall, "
          f"{ratio['total_cpu_s']:.2f}x CPU ({'<=' if ok else '>'} {LIMIT})")

    command = ("python bench/compile_time.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    machine = machine_line()
    date = datetime.datetime.now().astimezone().isoformat(timespec="minutes")
    diff = med[hi]["total_s"] - med[lo]["total_s"]
    part = max(("trace_s", "lower_s", "compile_s"), key=lambda k: abs(med[hi][k] - med[lo][k]))
    same_program = abs(ratio["hlo_instructions"] - 1) < 0.02 and abs(ratio["stablehlo_lines"] - 1) < 0.02
    spread = {n: (min(r["total_s"] for r in rs), max(r["total_s"] for r in rs)) for n, rs in runs.items()}
    paragraph = [
        f"{hi} layers take {ratio['total_s']:.2f}x the wall time of {lo} to trace, lower and compile the step "
        f"({'within' if ok else 'over'} the {LIMIT}x limit) and {ratio['total_cpu_s']:.2f}x the CPU time; the "
        f"difference, {diff:+.1f} s, is mostly {part.removesuffix('_s').replace('compile', 'XLA compile')} "
        f"({med[hi][part] - med[lo][part]:+.1f} s)."]
    if same_program:
        paragraph.append(
            f"The dense prefix and the MoE stack each run under one `lax.scan`, so the program does not grow with "
            f"depth: the StableHLO is {ratio['stablehlo_lines']:.2f}x and the optimised HLO "
            f"{ratio['hlo_instructions']:.2f}x as long at {hi} layers as at {lo} ({med[lo]['hlo_instructions']:,} "
            f"against {med[hi]['hlo_instructions']:,} instructions: XLA fuses and partitions a few ops differently "
            f"for larger arrays); only the leading `layers` axis of the stacked weights and the scans' trip counts "
            f"change. On these shared cores the spread between runs is of the order of the gap (totals "
            + ", ".join(f"{a:.1f}-{b:.1f} s at {n} layers" for n, (a, b) in spread.items()) + ").")
    else:
        paragraph.append(f"The program changes size with depth (StableHLO {ratio['stablehlo_lines']:.2f}x, optimised "
                         f"HLO {ratio['hlo_instructions']:.2f}x): something outside the scans is unrolled per layer.")
    paragraph.append(
        "The timing starts after the state exists (`jax.block_until_ready`): initialisation is dispatched "
        "asynchronously, and without the wait its random draws (about 5x as many at 32 layers) ran on the same two cores "
        "as the trace and the compile and made lowering look 4x slower at 32 layers. Per-run numbers and the "
        "build time are in compile_time.json.")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compile_time.json").write_text(json.dumps({
        "command": command, "date": date, "machine": machine, "config": _rel(args.config), "limit": LIMIT,
        "ratio": ratio, "within_limit": ok, "median": {str(n): m for n, m in med.items()},
        "runs": {str(n): rs for n, rs in runs.items()}, "total_s": total_s}, indent=2) + "\n")
    (RESULTS / "compile_time.md").write_text(
        f"# Compile time against depth\n\n`{command}` on {date}; {machine}; {total_s:.0f} s in all. "
        f"{Path(args.config).name} (first layer dense, the rest MoE), fp32, one device, the whole train step; "
        f"each number is the median of {args.runs} fresh processes with no compilation cache.\n\n"
        + "\n".join(table) + "\n\n" + " ".join(paragraph) + "\n")
    return 0 if ok else 1


def _rel(path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


if __name__ == "__main__":
    sys.exit(main())

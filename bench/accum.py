"""Gradient accumulation against memory: compiled temp and argument bytes of the whole train step.

    python bench/accum.py [--config bench/configs/moe_small.yaml] [--global-batch 8] [--steps 3]

At a fixed global batch (`--global-batch` rows of seq_len) the train step is built as the
trainer builds it (r1jax.train.step) for train.grad_accum = 1, 2, 4, 8 (remat none), and once
more with train.remat=full at grad_accum 4. Each row reports `compiled.memory_analysis()` of the
step: temp (activations and workspace beyond arguments and outputs) and argument (the state plus
the batch), temp relative to grad_accum 1, and the compile time; with `--steps N` > 0 also the
median of N timed steps after one warm-up (one device, a fixed random batch).
Writes bench/results/accum.json and .md and prints the markdown table; `--report-only` rewrites
the .md from the .json without measuring again.

`measure(config, overrides, accums, steps, compiler_options)` is what tests/test_bench_tables.py imports.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

from r1jax.bench import machine_line

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MOE_SMALL = ROOT / "bench" / "configs" / "moe_small.yaml"
ACCUMS = (1, 2, 4, 8)
REMAT_ACCUM = 4


def measure(config: str | Path, overrides: Sequence[str] = (), accums: Sequence[int] = ACCUMS,
            steps: int = 0, compiler_options: dict | None = None) -> list[dict]:
    """Build the model and state of `config` + `overrides` once on one device (mesh.data=1) and,
    for each grad_accum in `accums`, compile the train step and read its memory analysis; with
    `steps` > 0 also time that many steps after a warm-up. `compiler_options`: XLA options for
    `compile` (the tests lower the optimisation level). One dict per accum value."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from r1jax import config as configlib
    from r1jax.parallel.mesh import batch_sharding, single_device_mesh
    from r1jax.train.step import build, make_train_step

    base = [*overrides, "mesh.data=1"]
    cfg = configlib.load(config, base)
    t = cfg.train
    setup = build(cfg, single_device_mesh())
    mesh, graphdef, state, shardings, tx = setup.mesh, setup.graphdef, setup.state, setup.shardings, setup.tx
    jax.block_until_ready(state)     # the asynchronous init would otherwise share the cores with compile
    param_bytes = sum(a.nbytes for a in jax.tree.leaves(state["params"]))
    B, T = t.global_batch_size, cfg.data.seq_len
    bs = batch_sharding(mesh)
    abstract_batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=bs) for k in ("ids", "segment_ids", "positions")}
    batch = None
    if steps > 0:
        ids = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, T))
        batch = jax.device_put({"ids": jnp.asarray(ids, jnp.int32), "segment_ids": jnp.ones((B, T), jnp.int32),
                                "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))}, bs)

    rows = []
    for a in accums:
        acfg = configlib.load(config, [*base, f"train.grad_accum={a}"])
        step = make_train_step(graphdef, tx, acfg, mesh, shardings)
        t0 = time.perf_counter()
        compiled = step.lower(state, abstract_batch).compile(compiler_options)
        row = {"grad_accum": a, "microbatch_rows": B // a, "seq_len": T, "vocab_size": acfg.model.vocab_size,
               "remat": acfg.train.remat.value, "compile_s": time.perf_counter() - t0, "param_bytes": param_bytes}
        ma = compiled.memory_analysis()
        for k in ("temp", "argument", "output", "alias", "generated_code"):
            row[f"{k}_bytes"] = int(getattr(ma, f"{k}_size_in_bytes"))
        if steps > 0:
            state, m = compiled(state, batch)     # donates the state; the next accum lowers the new one
            jax.block_until_ready(m)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                state, m = compiled(state, batch)
                jax.block_until_ready(m)
                times.append(time.perf_counter() - t0)
            row.update(step_ms_median=1000 * statistics.median(times), loss=float(m["loss"]))
        rows.append(row)
        del compiled, step
    return rows


def fit_fixed_and_scaling(rows: list[dict]) -> tuple[float, float]:
    """Least-squares (F, S) of temp = F + S / grad_accum over `rows` (same remat policy)."""
    xs = [1 / r["grad_accum"] for r in rows]
    ys = [r["temp_bytes"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    s = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - s * mx, s


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def report(meta: dict, rows: list[dict]) -> str:
    """The markdown of bench/results/accum.md from the JSON's `meta` (command, date, machine, config,
    global_batch_size, steps, total_s) and measured `rows`."""
    base = rows[0]
    timed = "step_ms_median" in base
    head = "| grad_accum | microbatch | remat | temp (XLA) | vs accum 1 | argument (XLA) | compile |"
    table = [head + (" step time (median) | vs accum 1 |" if timed else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if timed else "")]
    for r in rows:
        mb = r["microbatch_rows"]
        table.append(f"| {r['grad_accum']} | {mb} row{'s' * (mb != 1)} | {r['remat']} | {_mib(r['temp_bytes'])} | "
                     f"{r['temp_bytes'] / base['temp_bytes']:.2f}x | {_mib(r['argument_bytes'])} | "
                     f"{r['compile_s']:.0f} s |" + (f" {r['step_ms_median']:,.0f} ms | "
                                                     f"{r['step_ms_median'] / base['step_ms_median']:.2f}x |"
                                                     if timed else ""))
    none_rows = [r for r in rows if r["remat"] == "none"]
    fixed, scaling = fit_fixed_and_scaling(none_rows)
    P = base["param_bytes"]
    full = next(r for r in rows if r["remat"] == "full")
    same = next(r for r in none_rows if r["grad_accum"] == full["grad_accum"])
    last = none_rows[-1]
    logits = full["microbatch_rows"] * full["seq_len"] * full["vocab_size"] * 4
    text = [
        f"At a fixed global batch the activations of one microbatch shrink as 1/grad_accum, while the gradient "
        f"accumulator (an fp32 copy of every parameter carried through the `lax.scan` over microbatches, into "
        f"which the stacks' backward adds each layer's gradients in place) does not. A least-squares fit temp = F + S/grad_accum over the "
        f"remat-none rows gives S = {_mib(scaling)} (activations and workspace of the whole batch) and "
        f"F = {_mib(fixed)} fixed, {fixed / P:.1f}x the {_mib(P)} of fp32 parameters; so temp falls "
        f"{base['temp_bytes'] / last['temp_bytes']:.2f}x from grad_accum 1 to {last['grad_accum']}, not "
        f"{last['grad_accum']}x, and flattens as S/grad_accum nears F.",
        f"Remat full at grad_accum {full['grad_accum']} keeps only each layer's input and takes temp from "
        f"{_mib(same['temp_bytes'])} to {_mib(full['temp_bytes'])} ({full['temp_bytes'] / same['temp_bytes']:.2f}x). "
        f"The {_mib(full['temp_bytes'] - fixed)} it keeps above F is of the order of what lives outside the scanned "
        f"layers, where remat does not reach: one microbatch's fp32 logits over the {full['vocab_size']:,}-token "
        f"vocabulary are {_mib(logits)}, and the backward needs their gradient too.",
        "Argument bytes (the state and the batch) do not depend on grad_accum."]
    if timed:
        steps = ", ".join(f"{r['step_ms_median']:,.0f}" for r in none_rows)
        text.append(
            f"Step times ({steps} ms for grad_accum {', '.join(str(r['grad_accum']) for r in none_rows)}) are the "
            f"same FLOPs cut into smaller matmuls. They are not monotone, and the machine was shared (load average "
            f"{meta['machine'].split('load average ')[-1]} on 2 cores), so they support no conclusion about speed.")
    return (f"# Gradient accumulation and memory\n\n`{meta['command']}` on {meta['date']}; {meta['machine']}; "
            f"{meta['total_s']:.0f} s in all. {Path(meta['config']).name}, fp32, one device, global batch "
            f"{meta['global_batch_size']} x {base['seq_len']} tokens fixed, split into grad_accum microbatches; temp "
            f"and argument are `compiled.memory_analysis()` of the whole train step (forward, backward, accumulation, "
            f"AdamW)" + (f"; step time is the median of {meta['steps']} steps after a warm-up" if timed else "")
            + ".\n\n" + "\n".join(table) + "\n\n" + " ".join(text) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(MOE_SMALL))
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed steps per row after one warm-up; 0: compile only")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite accum.md from the measurements already in accum.json")
    args = p.parse_args(argv)
    if args.report_only:
        saved = json.loads((RESULTS / "accum.json").read_text())
        (RESULTS / "accum.md").write_text(report(saved, saved["results"]))
        print((RESULTS / "accum.md").read_text())
        return 0

    t_start = time.perf_counter()
    ov = [f"train.global_batch_size={args.global_batch}"]
    rows = []
    for ovs, accums in (([*ov, "train.remat=none"], ACCUMS), ([*ov, "train.remat=full"], (REMAT_ACCUM,))):
        for r in measure(args.config, ovs, accums, args.steps):
            rows.append(r)
            print(f"grad_accum {r['grad_accum']} remat {r['remat']}: temp {_mib(r['temp_bytes'])}, argument "
                  f"{_mib(r['argument_bytes'])}, compile {r['compile_s']:.1f} s"
                  + (f", step {r['step_ms_median']:.0f} ms" if "step_ms_median" in r else ""), flush=True)
    fixed, scaling = fit_fixed_and_scaling([r for r in rows if r["remat"] == "none"])
    meta = {"command": ("python bench/accum.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="minutes"),
            "machine": machine_line(),
            "config": _rel(args.config), "global_batch_size": args.global_batch, "steps": args.steps,
            "fit_temp_fixed_bytes": fixed, "fit_temp_per_batch_bytes": scaling,
            "total_s": time.perf_counter() - t_start}
    text = report(meta, rows)
    print("\n" + text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "accum.json").write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")
    (RESULTS / "accum.md").write_text(text)
    return 0


def _rel(path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


if __name__ == "__main__":
    sys.exit(main())

"""Routed experts at decode: `grouped` over separate expert arrays against the stacked dispatches.

    python bench/moe_decode.py [--config bench/configs/moe_small.yaml] [--rounds 4]

One process, one thread pool: a Generator per variant on the same random weights (fp32, fp32
cache), 64-token prompts and 64 new tokens, greedy, EOS ignored; per variant the decode time is
(t(64 new) - t(1 new)) / 63, the best of `--rounds` rounds with the variants alternating. `grouped`
is `infer.moe_decode=auto` with the experts as separate arrays (what the generator holds without
expert parallelism); the others run `infer.moe_decode=KIND` with the experts kept stacked
(`Generator(split_experts=False)`, what an expert-sharded mesh holds). Writes
bench/results/moe_decode.json and .md and prints the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

from r1jax.bench import machine_line

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BUCKETS = {1: ["gather", "dense"], 8: ["dense", "dropless"], 32: ["dropless", "dense"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "bench" / "configs" / "moe_small.yaml"))
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)

    import numpy as np
    from flax import nnx

    from r1jax import config as configlib, weights
    from r1jax.bench.generation import cpu_pressure
    from r1jax.config import DType, MoEDispatch
    from r1jax.infer.generator import Generator, Request

    cfg = configlib.load(args.config)
    m = cfg.model
    state = nnx.state(weights.create(m))
    P, N = 64, 64
    rows = []
    for B, stacked in BUCKETS.items():
        gens = {}
        for kind in ["grouped", *stacked]:
            infer = dataclasses.replace(cfg.infer, batch_size=B, cache_dtype=DType.fp32, dtype=DType.fp32,
                                        moe_decode=MoEDispatch.auto if kind == "grouped" else MoEDispatch(kind))
            gens[kind] = Generator(m, state, infer, eos_id=None, split_experts=kind == "grouped")
        x = np.random.default_rng(B).integers(3, m.vocab_size, (B, P))
        reqs = lambda n: [Request(tuple(r.tolist()), max_new_tokens=n, ignore_eos=True) for r in x]
        tokens = {}
        for kind, g in gens.items():            # compile every step each variant needs
            tokens[kind] = [c.completion_ids for c in g.generate(reqs(N))]
            g.generate(reqs(1))
        best = {k: float("inf") for k in gens}
        for _ in range(args.rounds):
            for kind, g in gens.items():
                t = time.perf_counter()
                g.generate(reqs(1))
                t1 = time.perf_counter() - t
                t = time.perf_counter()
                g.generate(reqs(N))
                best[kind] = min(best[kind], (time.perf_counter() - t - t1) / (N - 1))
        same = all(t == tokens["grouped"] for t in tokens.values())
        for kind in gens:
            rows.append({"batch": B, "dispatch": kind, "layout": "separate" if kind == "grouped" else "stacked",
                         "ms_per_step": 1000 * best[kind], "tokens_per_s": B / best[kind],
                         "vs_grouped": best["grouped"] / best[kind], "same_tokens": same})
            print(f"batch {B} {kind}: {1000 * best[kind]:.2f} ms a step", flush=True)

    table = ["| batch | dispatch | experts | ms a step | tokens/s | speed vs grouped | same greedy tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['batch']} | {r['dispatch']} | {r['layout']} | {r['ms_per_step']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['vs_grouped']:.2f}x | {'yes' if r['same_tokens'] else 'no'} |")
    command = "python bench/moe_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
    pressure = cpu_pressure()
    machine = machine_line() + ("" if pressure is None else f", CPU pressure avg10 {pressure:.2f}")
    busy = pressure is not None and pressure > 10
    date = datetime.datetime.now().astimezone().isoformat(timespec="minutes")
    print("\n" + "\n".join(table))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "moe_decode.json").write_text(json.dumps(
        {"command": command.strip(), "date": date, "machine": machine, "busy": busy, "config": args.config,
         "results": rows}, indent=2) + "\n")
    (RESULTS / "moe_decode.md").write_text(
        f"# Routed experts at decode\n\n`{command.strip()}` on {date}; {machine}"
        f"{' (a busy machine: timings are unreliable)' if busy else ''}. {Path(args.config).name}, fp32, one "
        f"device, 64-token prompts, best of {args.rounds} alternating rounds of (t(64 new) - t(1 new)) / 63.\n\n"
        + "\n".join(table) + "\n\n`grouped` reads each selected expert's separate weight arrays in place; "
        "the stacked dispatches are what an expert-sharded mesh runs (`gather` copies the selected "
        "experts out, `dense` runs every expert, dropless copies an expert per tile).\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

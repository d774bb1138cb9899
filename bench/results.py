"""Regenerate bench/RESULTS.md; with `--run`, first rerun every benchmark that feeds it.

    python bench/results.py --run     # every benchmark, then RESULTS.md: about an hour on 2 CPU cores
    python bench/results.py           # only reassemble RESULTS.md from bench/results/*.md (a second)

`--run` runs, in this order and each in its own process: bench/data_pipeline.py, bench/remat.py,
bench/accum.py, bench/compile_time.py, bench/moe_decode.py, bench/memory.py (the longest, ~25 minutes),
bench/scale_state.py,
bench/lora.py, bench/grpo_trl.py (it needs `pip install -e '.[test,trl]'`), then
`python -m r1jax.bench --config bench/configs/{dense_small,moe_small}.yaml --compare torch` and the
bf16 comparison of dense_small (3 steps). A benchmark that fails is reported and
the others still run; the exit status is then 1. Each writes bench/results/NAME.md and .json
(r1jax.bench: bench_<config>.md); RESULTS.md is those tables in ORDER (NAME, then NAME_*), then
any others alphabetically, each followed by bench/results/NAME.notes.md when it exists: what was
written by hand about a run (earlier runs, causes, caveats), which a rerun keeps.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
ORDER = ["bench", "generate", "moe_decode", "data_pipeline", "remat", "attention", "accum", "memory", "scale_state",
         "compile_time", "lora", "grpo_trl"]
SCRIPTS = ["data_pipeline", "remat", "attention", "accum", "compile_time", "moe_decode", "memory", "scale_state", "lora", "grpo_trl"]
NOTES = ".notes"                 # bench/results/NAME.notes.md: hand-written notes after NAME's table
COMPARE_CONFIGS = ["bench/configs/dense_small.yaml", "bench/configs/moe_small.yaml"]

HEADER = """# r1jax benchmark results

Every table below was produced by the command printed above it. `python bench/results.py --run`
reruns every benchmark and regenerates this file (about an hour on 2 shared CPU cores, 25 minutes
of it bench/memory.py); `python bench/results.py` only reassembles it from `bench/results/*.md`.
A note written by hand about a table lives in `bench/results/NAME.notes.md` and follows the table.
Timings are from shared 2-core CPU machines: compare rows within one table (measured side by side
in one run), not across tables.
"""


def commands() -> list[list[str]]:
    """The benchmark commands `--run` executes, in order (r1jax.bench only where it exists)."""
    cmds = [[sys.executable, str(BENCH / f"{name}.py")] for name in SCRIPTS]
    cmds += [[sys.executable, "-m", "r1jax.bench", "--config", c, "--compare", "torch"] for c in COMPARE_CONFIGS]
    # bf16 on a CPU without native bf16 matmuls: torch takes ~40 s a step, so 3 steps
    cmds.append([sys.executable, "-m", "r1jax.bench", "--config", COMPARE_CONFIGS[0], "--compare", "torch",
                 "--dtypes", "bf16", "--steps", "2", "--warmup", "1", "--out", "bench/results/bench_dense_small_bf16"])
    cmds.append([sys.executable, "-m", "r1jax.bench", "--config", COMPARE_CONFIGS[1], "--compare", "torch",
                 "--mode", "generate", "--batch-sizes", "1,8,32", "--prompt-len", "64", "--new-tokens", "64",
                 "--context", "2048", "--rounds", "3", "--repeats", "3", "--out", "bench/results/generate_moe_small"])
    return cmds


def run_all() -> list[str]:
    """Run every benchmark; return the commands that failed."""
    failed = []
    for cmd in commands():
        shown = " ".join(["python", *cmd[1:]]).replace(str(ROOT) + "/", "")
        print(f"$ {shown}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        print(f"  exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(shown)
    return failed


def assemble(bench: Path = BENCH) -> Path:
    """Write bench/RESULTS.md from bench/results/*.md; returns its path."""
    parts = [HEADER]
    stems = sorted(p.stem for p in (bench / "results").glob("*.md") if not p.stem.endswith(NOTES))
    # each ORDER entry brings its own table and its variants (bench_moe_small after bench)
    names = [s for o in ORDER for s in stems if s == o or s.startswith(o + "_")]
    names += [s for s in stems if s not in names]
    for name in names:
        path = bench / "results" / f"{name}.md"
        if path.is_file():
            text = path.read_text().replace("\n# ", "\n## ").replace("# ", "## ", 1)
            notes = bench / "results" / f"{name}{NOTES}.md"
            if notes.is_file():
                text += "\n" + notes.read_text()
            parts.append(text.replace("](bench_", "](results/bench_"))      # plots sit beside the tables
    out = bench / "RESULTS.md"
    out.write_text("\n".join(parts))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", action="store_true", help="rerun every benchmark before reassembling")
    args = p.parse_args(argv)
    failed = run_all() if args.run else []
    print(f"wrote {assemble()}")
    if failed:
        print("failed: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

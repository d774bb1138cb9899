"""python -m r1jax.bench --config C [--compare torch] [--steps N] [--warmup W] [--threads N]
                         [--dtypes fp32,bf16] [--out PREFIX] [section.key=value ...]

Times r1jax's training step on the config's model and batch (median over N steps after W
warm-up steps; lowering and compile reported apart), with tokens/s, MFU and XLA's memory
analysis. With `--compare torch`, transformers' DeepseekV3ForCausalLM trains the same initial
weights (exported by r1jax as an HF checkpoint) on the same batches in a separate process, and
both get the same table and the ratio. Every run (each framework, each dtype) is its own process
pinned to the same N CPUs: torch gets torch.set_num_threads(N), XLA sizes its thread pools from
the affinity mask. Writes PREFIX.json, PREFIX.png and PREFIX.md.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

from r1jax import config as configlib
from r1jax.bench import worker
from r1jax.config import ConfigError, DType
from r1jax.train import mfu


def _check_comparable(cfg: configlib.Config) -> None:
    """The reference trains DeepseekV3ForCausalLM alone: refuse what it does not have."""
    for key, value, why in (("model.num_nextn_predict_layers", cfg.model.num_nextn_predict_layers, "has no MTP modules"),
                            ("optim.bias_update_rate", cfg.optim.bias_update_rate, "does not update router biases"),
                            ("loss.seq_aux_loss_alpha", cfg.loss.seq_aux_loss_alpha, "has no sequence balance loss")):
        if value:
            raise ConfigError(f"{key}={value}: --compare torch needs 0 (transformers' DeepseekV3ForCausalLM {why})")
    if cfg.train.grad_accum != 1 or cfg.train.dtype is DType.fp16:
        raise ConfigError("--compare torch: compares train.grad_accum=1 with train.dtype fp32 or bf16 only")
    missing = [p for p in ("torch", "transformers") if importlib.util.find_spec(p) is None]
    if missing:
        raise ConfigError(f"--compare torch: {', '.join(missing)} not installed (pip install -e '.[test]')")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m r1jax.bench", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--compare", choices=["torch"])
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--threads", type=int, default=0, help="CPUs for every run (0: all this process may use)")
    p.add_argument("--dtypes", default="", help="comma-separated train.dtype values to run (default: the config's)")
    p.add_argument("--out", default="", help="output prefix (default bench/results/bench_<config name>)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic batches")
    p.add_argument("--mode", choices=["train", "generate"], default="train",
                   help="generate: r1jax's generator against transformers' generate (r1jax/bench/generation.py)")
    p.add_argument("--batch-sizes", default="1,8,32", help="generate: batch sizes")
    p.add_argument("--prompt-len", type=int, default=64, help="generate: prompt tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="generate: new tokens per row")
    p.add_argument("--context", type=int, default=0, help="generate: also a batch-1 row with this prompt length")
    p.add_argument("--speculative", action="store_true", help="generate: also r1jax with MTP speculation")
    p.add_argument("--weights", default=None, help="generate: SRC of trained weights (run dir, orbax:, hf:)")
    # best of 9 runs a side: on 2 shared cores one r1jax batch-1 run varies by 15% (2.38-2.72 ms a
    # step in one bench run, 2026-12-07), so a best of 4 moved the bandwidth fraction by as much
    p.add_argument("--rounds", type=int, default=3, help="generate: alternating rounds (best kept)")
    p.add_argument("--repeats", type=int, default=3, help="generate: timed repeats per process (best kept)")
    p.add_argument("--moe-decode", default="auto", help="generate: r1jax infer.moe_decode variants (comma-separated)")
    p.add_argument("--quantize", default="none",
                   help="generate: r1jax weight quantisation variants, comma-separated from none,int8,fp8")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    args = p.parse_args(argv)
    try:
        if args.steps < 1 or args.warmup < 0:
            raise ConfigError(f"--steps {args.steps} --warmup {args.warmup}: need steps >= 1 and warmup >= 0")
        cfg = configlib.load(args.config, args.overrides)
        dtypes = [d for d in args.dtypes.split(",") if d] or [cfg.train.dtype.value]
        bad = [d for d in dtypes if d not in {x.value for x in DType}]
        if bad:
            raise ConfigError(f"--dtypes {bad[0]}: allowed {', '.join(x.value for x in DType)}")
        bad = [q for q in args.quantize.split(",") if q not in ("none", "int8", "fp8")]
        if bad or not args.quantize:
            raise ConfigError(f"--quantize {args.quantize}: give comma-separated values from none, int8, fp8")
        if args.compare and args.mode == "train":
            _check_comparable(cfg)
        cpus = sorted(os.sched_getaffinity(0))
        if args.threads > len(cpus) or args.threads < 0:
            raise ConfigError(f"--threads {args.threads}: this process may use {len(cpus)} CPUs")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    threads = args.threads or len(cpus)
    os.sched_setaffinity(0, cpus[:threads])     # inherited by every worker process
    if args.mode == "generate":
        from r1jax.bench import generation
        prefix = Path(args.out) if args.out else Path("bench") / "results" / f"generate_{Path(args.config).stem}"
        result = generation.run(args, cfg, threads, cpus)
        result.update(machine=f"{mfu.cpu_model()}, {os.cpu_count()} CPUs", config_name=Path(args.config).name,
                      date=datetime.datetime.now().astimezone().isoformat(timespec="minutes"),
                      command="python -m r1jax.bench " + " ".join(argv if argv is not None else sys.argv[1:]))
        paths = generation.write(result, prefix)
        print("\n" + generation.table(result))
        print("\ndecode_speedup " + json.dumps({k: round(v, 2) for k, v in result["decode_speedup"].items()})
              + (f"; b1_bandwidth_fraction {result['b1_bandwidth_fraction']:.2f}" if "b1_bandwidth_fraction" in result else "")
              + (f"; speculative b1 {json.dumps(result['speculative_b1'])}" if "speculative_b1" in result else ""))
        print("wrote " + ", ".join(map(str, paths)))
        return 0

    from r1jax.bench import report
    from r1jax.bench.workload import batches

    stem = Path(args.config).stem
    prefix = Path(args.out) if args.out else Path("bench") / "results" / f"bench_{stem}"
    B, T = cfg.train.global_batch_size, cfg.data.seq_len
    n = args.warmup + args.steps
    tokens = batches(cfg.model.vocab_size, B, T, n, args.seed)
    flops_token = mfu.flops_per_token(cfg.model, T)
    runs = []
    with tempfile.TemporaryDirectory(prefix="r1jax-bench-") as tmp:
        work = Path(tmp)
        np_path = work / "tokens.npy"
        import numpy as np
        np.save(np_path, tokens)
        hf_dir = work / "hf"
        for dtype in dtypes:
            c = configlib.load(args.config, [*args.overrides, f"train.dtype={dtype}"])
            run = {"dtype": dtype}
            print(f"r1jax {dtype}: compiling and timing {n} steps ...", flush=True)
            export = str(hf_dir) if args.compare and not hf_dir.exists() else None
            run["r1jax"] = worker.run("r1jax.bench.step_timing", {"config": configlib.to_dict(c), "tokens": str(np_path),
                                                               "warmup": args.warmup, "export_hf": export},
                                   work, f"r1jax_{dtype}")
            if args.compare:
                print(f"torch {dtype}: timing {n} steps ...", flush=True)
                run["torch"] = worker.run("r1jax.bench.torch_ref", {
                    "hf_dir": str(hf_dir), "tokens": str(np_path), "warmup": args.warmup, "threads": threads,
                    "dtype": dtype, "lrs": run["r1jax"]["lrs"],
                    "optim": configlib.to_dict(c.optim)}, work, f"torch_{dtype}")
            runs.append(run)
    peak = runs[0]["r1jax"]["peak_flops"]
    for run in runs:
        for side in ("r1jax", "torch"):
            if side in run:
                r = run[side]
                r["tokens_per_s"] = B * T / r["step_s_median"]
                r["mfu"] = flops_token * r["tokens_per_s"] / peak
        if "torch" in run:
            run["ratio"] = run["r1jax"]["tokens_per_s"] / run["torch"]["tokens_per_s"]
            diffs = [abs(a - b) for a, b in zip(run["r1jax"]["losses"], run["torch"]["losses"])]
            run["max_abs_loss_diff"] = max(diffs)
    first = runs[0]["r1jax"]
    peak_note = f"{peak / 1e12:.3f} TFLOP/s ({first['peak_source']})" if peak < 1e13 else \
        f"{peak / 1e12:.0f} TFLOP/s ({first['peak_source']})"
    if args.compare and "matmul_flops" in runs[0].get("torch", {}):
        peak_note += f"; torch's own 1024^3 fp32 matmul reaches {runs[0]['torch']['matmul_flops'] / 1e9:.0f} GFLOP/s"
    threads_note = f"{threads} for every run (CPUs {cpus[:threads]} by affinity"
    if args.compare:
        t = runs[0]["torch"]
        threads_note += (f"; torch.set_num_threads({t['threads']}); transformers' attn_implementation="
                         f"{t['attn_implementation']}, experts_implementation={t['experts_implementation']}")
    threads_note += ")"
    versions = {**first["versions"], **(runs[0].get("torch", {}).get("versions", {}))}
    result = {
        "command": "python -m r1jax.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="minutes"),
        "config": args.config, "config_name": Path(args.config).name, "overrides": args.overrides,
        "machine": f"{mfu.cpu_model()}, {os.cpu_count()} CPUs, {first['devices']}, "
                   + ", ".join(f"{k} {v}" for k, v in versions.items()),
        "threads": threads, "threads_note": threads_note, "batch": [B, T], "tokens_per_step": B * T,
        "warmup": args.warmup, "steps": args.steps, "flops_per_token": flops_token, "peak_flops": peak,
        "peak_note": peak_note, "png_name": prefix.with_suffix(".png").name, "runs": runs}
    paths = report.write(result, prefix)
    print("\n" + report.table(result) + "\n\n" + "\n".join(report.notes(result)))
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

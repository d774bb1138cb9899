"""`python -m r1jax.bench --mode generate`: r1jax's generator against transformers' `generate`.

Same weights (r1jax's HF export of the config's initial weights, or of `--weights SRC`), same
random prompts, greedy with EOS ignored, fp32 (the cache too, as transformers keeps it). Every
measurement is its own process pinned to the same CPUs (torch.set_num_threads(N); XLA sizes its
pools from the affinity mask); frameworks alternate within each batch size, and every
transformers experts implementation runs (`grouped_mm` is its default), the fastest being the
baseline. Per run of N new tokens: t1 = time to the first new token (prefill), tN = time to all
N, both from that one run (measured in separate runs, noise once made tN - t1 negative on the
tiny model); decode tokens/s = B (N - 1) / (tN - t1); per-token latency (tN - t1) / (N - 1); the
run with the shortest decode time of `repeats` counts.

The batch-1 bandwidth fraction is the bytes a decode step must read (every weight except the
embedding table and the routed experts a token does not select, plus the cache at the mean
context) x steps/s over the memory bandwidth measured in the same run: the larger of a 512 MiB
numpy copy (read + write bytes/s, one thread) and an XLA sum over 512 MiB (read bytes/s, every
thread the runs get). The load average is printed; `/proc/pressure/cpu` decides whether
the machine was quiet.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from r1jax.bench import worker

HF_EXPERTS = ("grouped_mm", "eager", "batched_mm")


def cpu_pressure() -> float | None:
    """avg10 of /proc/pressure/cpu 'some' (percent of time something waited for a CPU)."""
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(first.split("avg10=")[1].split()[0])
    except (OSError, IndexError, ValueError):
        return None


def prompts(vocab: int, B: int, T: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(1000 * seed + B).integers(3, vocab, (B, T)).astype(np.int32)


# ---------------------------------------------------------------------------------- workers
def _r1jax_worker(spec: dict) -> dict:
    """r1jax's generator on the export: compiled first, then t1 and tN, the best of `repeats`."""
    import dataclasses

    import jax
    from r1jax import config as configlib
    from r1jax.config import DType
    from r1jax.infer import cache as cachelib
    from r1jax.infer import source as sourcelib
    from r1jax.infer import quant
    from r1jax.infer.generator import Generator, Request
    from r1jax.parallel import mesh as meshlib
    src = sourcelib.resolve(f"hf:{spec['hf_dir']}")
    m = src.cfg.model
    infer = dataclasses.replace(configlib.from_dict({"infer": spec["infer"]}).infer, batch_size=spec["B"])
    if spec.get("compare", True):    # as transformers computes and caches: fp32
        infer = dataclasses.replace(infer, cache_dtype=DType.fp32, dtype=DType.fp32)
    mesh = meshlib.single_device_mesh()
    q = spec.get("quantize", "none")
    gen = Generator(m, src.load(mesh, quantize=q), infer, mesh=mesh, eos_id=None, quantize=q)
    x = prompts(m.vocab_size, spec["B"], spec["prompt_len"], spec["seed"])
    reqs = lambda n: [Request(tuple(r.tolist()), max_new_tokens=n, ignore_eos=True) for r in x]
    N, spec_on = spec["new_tokens"], spec["speculative"]
    t = time.perf_counter()
    gen.generate(reqs(N), speculative=spec_on)                   # compiles every step this run needs
    gen.generate(reqs(1), speculative=spec_on)
    compile_s = time.perf_counter() - t
    runs = []                       # (t1, tN) of one run each: tN - t1 is that run's decode time
    for _ in range(spec["repeats"]):
        gen.stats.update(drafted=0, accepted=0)
        t = time.perf_counter()
        out = gen.generate(reqs(N), speculative=spec_on)
        runs.append((gen.stats["first_token_s"], time.perf_counter() - t))
    t1, tN = min(runs, key=lambda r: r[1] - r[0])
    S = gen.shapes_for(reqs(N))[2]
    return {"t1": t1, "tN": tN, "compile_s": compile_s, "tokens": [c.completion_ids for c in out],
            "accepted": gen.stats["accepted"], "drafted": gen.stats["drafted"],
            "cache_bytes_per_token": cachelib.bytes_per_token(m, gen.cache_dtype),
            "cache_bytes_per_token_bf16": cachelib.bytes_per_token(m, "bfloat16"),
            "mha_bytes_per_token": cachelib.mha_bytes_per_token(m, gen.cache_dtype), "cache_len": S,
            "moe_decode": infer.moe_decode.value, "jax": jax.__version__, "quantize": q,
            "dtype": infer.dtype.value, "weight_bytes": quant.weight_bytes(gen.params)["total"]}


def _bandwidth_worker(spec: dict) -> dict:
    """Two measures of the memory bandwidth: a 512 MiB numpy copy (one thread; read + write
    bytes) and an XLA sum over 512 MiB (read bytes, on every thread the worker may use, as
    decode runs). The bound the bench divides by is the larger."""
    import jax
    import jax.numpy as jnp
    n = 2**29 // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        ts.append(time.perf_counter() - t)
    x = jnp.asarray(src.reshape(64, -1))
    total = jax.jit(lambda a: a.sum(axis=1))
    total(x).block_until_ready()
    tr = []
    for _ in range(5):
        t = time.perf_counter()
        total(x).block_until_ready()
        tr.append(time.perf_counter() - t)
    copy, read = 2 * 2**29 / min(ts) / 1e9, 2**29 / min(tr) / 1e9
    return {"copy_GBps": copy, "read_GBps": read, "bound_GBps": max(copy, read)}


def _export_worker(spec: dict) -> dict:
    """The HF directory both sides load: the config's fresh weights, or those of `weights`."""
    from r1jax import config as configlib
    from r1jax import weights
    from r1jax.convert import hf
    from r1jax.infer import source as sourcelib
    from r1jax.parallel import mesh as meshlib
    cfg = configlib.from_dict(spec["config"])
    if spec.get("weights"):
        src = sourcelib.resolve(spec["weights"])
        cfg, state = src.cfg, src.load(meshlib.single_device_mesh())
        from flax import nnx
        model = nnx.merge(weights.graph(cfg)[0], state)
    else:
        model = weights.create(cfg.model, seed=cfg.train.seed)
    hf.save(model, cfg.model, spec["hf_dir"])
    return {}


WORKERS = {"r1jax": _r1jax_worker, "bandwidth": _bandwidth_worker, "export": _export_worker}


def _spawn(role: str, spec: dict, work: Path, name: str) -> dict:
    # the reference runs in its own module: its imports are the `compare` extra
    module = "r1jax.bench.torch_generate" if role == "torch" else "r1jax.bench.generation"
    return worker.run(module, {**spec, "role": role}, work, name)


# ---------------------------------------------------------------------------------- bytes
def decode_bytes(m, context: float, dtype_bytes: int = 4) -> dict:
    """Bytes one batch-1 decode step must read: weights (without the embedding table, with the
    k selected routed experts of each MoE layer) and the cache at `context` positions."""
    from r1jax.infer import cache as cachelib
    from r1jax.model import abstract
    import jax
    from flax import nnx
    _, state = abstract(m)
    total = expert = embed = 0
    for path, var in nnx.to_flat_state(state):
        n = int(np.prod(var.get_value().shape))
        name = "/".join(map(str, path))
        if name.startswith("mtp"):
            continue
        total += n
        if any(k in name for k in ("gate_EDF", "up_EDF", "down_EFD")):
            expert += n
        if "embedding_WD" in name and not m.tie_word_embeddings:
            embed += n
    E, k = m.n_routed_experts, m.num_experts_per_tok
    weights_b = (total - embed - expert + expert * k / max(E, 1)) * dtype_bytes
    cache_b = context * cachelib.bytes_per_token(m, "float32")
    return {"weights": weights_b, "cache": cache_b, "total": weights_b + cache_b}


# ---------------------------------------------------------------------------------- parent
def run(args, cfg, threads: int, cpus: list[int]) -> dict:
    from r1jax import config as configlib
    sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    work_ctx = tempfile.TemporaryDirectory(prefix="r1jax-bench-gen-")
    work = Path(work_ctx.name)
    hf_dir = work / "hf"
    print("exporting the weights both sides load ...", flush=True)
    _spawn("export", {"config": configlib.to_dict(cfg), "weights": args.weights, "hf_dir": str(hf_dir)}, work, "export")
    bw = _spawn("bandwidth", {}, work, "bandwidth")
    print(f"bandwidth: copy {bw['copy_GBps']:.1f} GB/s, read {bw['read_GBps']:.1f} GB/s; load average {os.getloadavg()[0]:.2f}; "
          f"cpu pressure {cpu_pressure()}", flush=True)
    cases = [(B, args.prompt_len) for B in sizes] + ([(1, args.context)] if args.context else [])
    variants = [v for v in args.moe_decode.split(",") if v]
    quants = [q for q in getattr(args, "quantize", "none").split(",") if q] or ["none"]
    common = {"hf_dir": str(hf_dir), "new_tokens": args.new_tokens, "repeats": args.repeats, "seed": args.seed,
              "threads": threads, "compare": bool(args.compare)}
    hf_experts = HF_EXPERTS if args.compare else ()
    rows = []
    for B, P in cases:
        row = {"batch": B, "prompt_len": P, "r1jax": {}, "torch": {}}
        for rnd in range(args.rounds):
            jobs = [("r1jax", v, False, q) for v in variants for q in quants] + \
                [("torch", e, False, "none") for e in hf_experts]
            if args.speculative:
                jobs.append(("r1jax", variants[0], True, quants[0]))
            if rnd % 2:
                jobs.reverse()
            for side, what, spec_on, q in jobs:
                key = what + ("" if q == "none" else f"+{q}") + ("+speculative" if spec_on else "")
                spec = {**common, "B": B, "prompt_len": P}
                if side == "r1jax":
                    spec.update(infer={**configlib.to_dict(cfg.infer), "moe_decode": what}, speculative=spec_on,
                                quantize=q)
                else:
                    spec.update(experts=what)
                r = _spawn(side, spec, work, f"{side}_{key}_{B}_{P}_{rnd}")
                r["decode_tok_s"] = B * (args.new_tokens - 1) / (r["tN"] - r["t1"])
                r["prefill_tok_s"] = B * P / r["t1"]
                r["ms_per_token"] = 1000 * (r["tN"] - r["t1"]) / (args.new_tokens - 1)
                best = row[side].get(key)
                if best is None or r["decode_tok_s"] > best["decode_tok_s"]:
                    row[side][key] = r
                print(f"[round {rnd}] B={B} P={P} {side} {key}: ttft {1000 * r['t1']:.1f} ms, decode "
                      f"{r['decode_tok_s']:.1f} tok/s ({r['ms_per_token']:.2f} ms/token), load {os.getloadavg()[0]:.2f}",
                      flush=True)
        plain = {k: v for k, v in row["r1jax"].items() if not k.endswith("+speculative")}
        # r1jax's own best (what transformers is compared with) among the unquantised variants
        plain = {k: v for k, v in plain.items() if v.get("quantize", "none") == "none"} or plain
        ours_key = max(plain, key=lambda k: plain[k]["decode_tok_s"])
        row["best_r1jax"] = ours_key
        if row["torch"]:
            base_key = max(row["torch"], key=lambda k: row["torch"][k]["decode_tok_s"])
            row["baseline"] = base_key
            row["speedup"] = row["r1jax"][ours_key]["decode_tok_s"] / row["torch"][base_key]["decode_tok_s"]
            row["tokens_equal"] = float(np.mean(np.asarray(row["r1jax"][ours_key]["tokens"]) ==
                                                np.asarray(row["torch"][base_key]["tokens"])))
        for side in ("r1jax", "torch"):             # compared above; too bulky for the JSON
            for v in row[side].values():
                v.pop("tokens", None)
        rows.append(row)
    work_ctx.cleanup()
    m = cfg.model
    b1 = next(r for r in rows if r["batch"] == 1 and r["prompt_len"] == args.prompt_len) if 1 in sizes else None
    result = {"command": "python -m r1jax.bench " + " ".join(sys.argv[1:]), "bandwidth_GBps": bw["bound_GBps"],
              "copy_GBps": bw["copy_GBps"], "read_GBps": bw["read_GBps"],
              "threads": threads, "cpus": cpus[:threads], "rows": rows,
              "decode_speedup": {str(r["batch"]): r["speedup"] for r in rows
                                 if r["prompt_len"] == args.prompt_len and "speedup" in r},
              "load_average_end": os.getloadavg()[0], "cpu_pressure_avg10_end": cpu_pressure()}
    if args.context and args.compare:
        result["context_row"] = {"prompt_len": args.context,
                                 "speedup": next(r["speedup"] for r in rows if r["prompt_len"] == args.context)}
    if b1 is not None:
        r = b1["r1jax"][b1["best_r1jax"]]
        need = decode_bytes(m, args.prompt_len + args.new_tokens / 2)
        result["b1_bytes_per_step"] = need
        result["b1_bandwidth_fraction"] = need["total"] * (1000 / r["ms_per_token"]) / (bw["bound_GBps"] * 1e9)
        spec_key = next((k for k in b1["r1jax"] if k.endswith("+speculative")), None)
        if spec_key:
            s = b1["r1jax"][spec_key]
            result["speculative_b1"] = {"decode_tok_s": s["decode_tok_s"], "plain_tok_s": r["decode_tok_s"],
                                        "speedup": s["decode_tok_s"] / r["decode_tok_s"],
                                        "acceptance": s["accepted"] / max(s["drafted"], 1)}
    return result


def table(result: dict) -> str:
    lines = ["| batch | prompt | framework | variant | TTFT | prefill tok/s | decode tok/s | ms/token | vs fastest transformers |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        base = row["torch"][row["baseline"]]["decode_tok_s"] if row["torch"] else None
        for side in ("r1jax", "torch"):
            for k, r in row[side].items():
                mark = " (baseline)" if side == "torch" and k == row["baseline"] else ""
                ratio = f"{r['decode_tok_s'] / base:.2f}x" if base else "—"
                lines.append(f"| {row['batch']} | {row['prompt_len']} | {side} | {k}{mark} | {1000 * r['t1']:.1f} ms | "
                             f"{r['prefill_tok_s']:,.0f} | {r['decode_tok_s']:,.1f} | {r['ms_per_token']:.2f} | {ratio} |")
    return "\n".join(lines)


def notes(result: dict) -> list[str]:
    if "read_GBps" in result:
        bw = (f"memory bandwidth {result['bandwidth_GBps']:.1f} GB/s, the larger of a 512 MiB numpy copy "
              f"({result['copy_GBps']:.1f}, read + write, one thread) and an XLA sum over 512 MiB "
              f"({result['read_GBps']:.1f}, read), same run.")
    else:                                    # results recorded before the read measure existed
        bw = f"copy bandwidth {result['bandwidth_GBps']:.1f} GB/s (read + write, 512 MiB numpy copy, same run)."
    out = [f"Machine: {result['machine']}; {result['threads']} threads for every run (CPUs {result['cpus']}), each "
           f"run its own process, frameworks alternating; load average {result['load_average_end']:.2f} and CPU "
           f"pressure avg10 {result['cpu_pressure_avg10_end']} at the end; " + bw]
    if result["decode_speedup"]:
        out.append("- decode_speedup (r1jax over the fastest transformers experts implementation): "
                   + ", ".join(f"batch {k}: {v:.2f}x" for k, v in result["decode_speedup"].items()))
    if "context_row" in result:
        out.append(f"- batch 1 at a {result['context_row']['prompt_len']}-token context: "
                   f"{result['context_row']['speedup']:.2f}x")
    if "b1_bandwidth_fraction" in result:
        b = result["b1_bytes_per_step"]
        out.append(f"- batch 1: a decode step must read {b['total'] / 1e6:.1f} MB (weights {b['weights'] / 1e6:.1f}, "
                   f"cache {b['cache'] / 1e6:.2f}); at r1jax's rate that is {result['b1_bandwidth_fraction']:.0%} of "
                   "the memory bandwidth")
    if "speculative_b1" in result:
        s = result["speculative_b1"]
        out.append(f"- speculative (MTP drafts) at batch 1: {s['decode_tok_s']:.1f} against {s['plain_tok_s']:.1f} "
                   f"tokens/s ({s['speedup']:.2f}x), {s['acceptance']:.0%} of drafts accepted")
    r = next(iter(result["rows"]))["r1jax"]
    one = next(iter(r.values()))
    if any(v.get("quantize", "none") != "none" for v in r.values()):
        out.append("- weights resident in the generator: " + ", ".join(
            f"{k} {v['weight_bytes'] / 2**20:.2f} MiB ({v['quantize']}, compute {v['dtype']})" for k, v in r.items()))
    out.append(f"- cache: {one['cache_bytes_per_token_bf16']:,} B per token in bf16 "
               f"({one['cache_bytes_per_token']:,} in the fp32 cache measured here); per-head K/V would take "
               f"{one['mha_bytes_per_token']:,} B per token at fp32")
    return out


def write(result: dict, prefix: Path) -> list[Path]:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = [prefix.with_suffix(".json"), prefix.with_suffix(".md"), prefix.with_suffix(".png")]
    paths[0].write_text(json.dumps(result, indent=1))
    vs = " against transformers' generate" if any(row.get("torch") for row in result["rows"]) else ""
    variants = next(iter(result["rows"]))["r1jax"].values()
    if any(v.get("quantize", "none") != "none" for v in variants):      # the --quantize comparisons
        vs += f", quantised weights, {next(iter(variants)).get('dtype', 'fp32')} compute"
    paths[1].write_text("\n\n".join([f"# Generation: {result['config_name']}{vs}",
                                      f"`{result['command']}` on {result['date']}.", table(result),
                                      "\n".join(notes(result)), f"![decode tokens/s]({paths[2].name})"]) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(rows), 3.6))
    labels = [f"B={r['batch']}\nP={r['prompt_len']}" for r in rows]
    x = np.arange(len(rows))
    ours = [r["r1jax"][r["best_r1jax"]]["decode_tok_s"] for r in rows]
    theirs = [r["torch"][r["baseline"]]["decode_tok_s"] if r["torch"] else 0 for r in rows]
    ax.bar(x - 0.2, theirs, 0.4, label="transformers (fastest experts impl.)")
    ax.bar(x + 0.2, ours, 0.4, label="r1jax")
    for i, r in enumerate(rows):
        if "speedup" in r:
            ax.text(x[i] + 0.2, ours[i], f"{r['speedup']:.1f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, labels)
    ax.set_ylabel("decode tokens/s")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("greedy decode, fp32, same weights and prompts", fontsize=9)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=120)
    return paths


def _main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = WORKERS[spec.pop("role")](spec)
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    _main()

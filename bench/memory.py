"""Per-device memory of the compiled train step under each mesh, on 8 fake CPU devices.

    python bench/memory.py [--config configs/tiny.yaml] [--fsdp-config configs/demo.yaml]

For each mesh the model, optimizer state and train step are built exactly as the trainer builds
them (r1jax.train.trainer / r1jax.train.step), the step is lowered for a (global_batch_size,
seq_len) batch and compiled, and the table reports:
  - param+opt / device: the bytes one device holds of the state's params, router biases and optax
    state, i.e. the sum over those arrays of one addressable shard each;
  - argument: `compiled.memory_analysis().argument_size_in_bytes` (per device; the whole state
    plus the batch shard, for cross-checking the column before);
  - temp: `memory_analysis().temp_size_in_bytes`, the activations and workspace of the step;
  - for pipeline meshes: the schedule, pipeline microbatches M, repeats R and the lockstep bubble
    (`r1jax.parallel.pipeline.bubble`: (P-1)/(M*R+P-1), 1f1b (2P-2)/(M+2P-2)).
Then two pipeline schedules, gpipe and 1f1b, on (pipeline 4, data 2) at M=4 and M=8 with the
microbatch fixed at 8 rows (global batch 8M), to show how their temp memory grows with M; and the
(fsdp 8) / (data 8) ratio of per-device param+opt bytes on `--config` and on `--fsdp-config`
(a config whose attention low-rank matrices are a small share of the weights; built, not
compiled, as the ratio needs only the state's shards).
Writes bench/results/memory.json and .md and prints the markdown tables.

`measure(overrides, config=...)` is what tests/test_bench_memory.py imports.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))

import jax.numpy as jnp

from r1jax.bench import machine_line

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TINY = ROOT / "configs" / "tiny.yaml"
DEMO = ROOT / "configs" / "demo.yaml"

MESHES: dict[str, list[str]] = {
    "data8": ["mesh.data=8"],
    "fsdp8": ["mesh.data=1", "mesh.fsdp=8"],
    "data2_tensor4": ["mesh.data=2", "mesh.tensor=4"],
    "data2_fsdp2_tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "expert4_data2": ["mesh.data=2", "mesh.expert=4"],
    "pipeline2_data4 gpipe": ["mesh.data=4", "mesh.pipeline=2", "train.microbatches=2"],
    "pipeline4_data2 1f1b": ["mesh.data=2", "mesh.pipeline=4", "train.microbatches=1", "pipeline.schedule=1f1b"],
    "pipeline2_tensor2_data2 circular": ["mesh.data=2", "mesh.tensor=2", "mesh.pipeline=2", "train.microbatches=2",
                                         "pipeline.schedule=circular", "pipeline.repeats=2"],
}
# gpipe vs 1f1b on (pipeline 4, data 2) at M microbatches of 8 rows each (4 per data shard: 1f1b shares
# the epilogue over the 4 stages by rows)
SCHEDULE_MS = (4, 8)


def schedule_overrides(schedule: str, m: int) -> list[str]:
    return ["mesh.data=2", "mesh.pipeline=4", f"train.microbatches={m}", f"train.global_batch_size={8 * m}",
            f"pipeline.schedule={schedule}"]


def _path(p: tuple) -> str:
    return "/".join(map(str, p))


def _shard_nbytes(arr) -> int:
    """Bytes of one device's shard of `arr` (a jax.Array)."""
    return int(arr.addressable_shards[0].data.nbytes)


def _full_nbytes(arr) -> int:
    return int(math.prod(arr.shape)) * arr.dtype.itemsize


def _error_line(e: BaseException) -> str:
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def measure(overrides: list[str], config: str | Path = TINY, compile: bool = True) -> dict:
    """Build the model, state and train step of `config` + `overrides` on all devices as the
    trainer does, compile the step and return its per-device memory. Exceptions from building or
    compiling are returned as {"error": "..."} rather than raised."""
    from flax import nnx

    from r1jax import config as configlib
    from r1jax import logical
    from r1jax.parallel import mesh as meshlib
    from r1jax.parallel import pipeline
    from r1jax.train.step import build

    out: dict = {"config": _rel(config),
                 "overrides": list(overrides)}
    try:
        cfg = configlib.load(config, list(overrides))
        mesh = meshlib.make_mesh(cfg.mesh)
        out["mesh"] = {k: int(v) for k, v in mesh.shape.items() if v > 1} or {"data": 1}
        layout = pipeline.mesh_layout(cfg, mesh)
        t = cfg.train
        if mesh.shape["pipeline"] > 1:
            P = mesh.shape["pipeline"]
            R = layout.repeats if layout is not None else 1
            out["pipeline"] = {"schedule": cfg.pipeline.schedule.value, "stages": P, "microbatches": t.microbatches,
                               "repeats": R, "bubble": pipeline.bubble(P, t.microbatches, R, cfg.pipeline.schedule),
                               "moe_layers": cfg.model.num_moe_layers, "slots": layout.slots if layout is not None else None}
        setup = build(cfg, mesh)
        state, step = setup.state, setup.step

        held = {k: state[k] for k in ("params", "rest", "opt")}
        out["param_opt_bytes"] = sum(_shard_nbytes(a) for a in jax.tree.leaves(held))
        out["param_opt_bytes_global"] = sum(_full_nbytes(a) for a in jax.tree.leaves(held))
        variables = [*nnx.to_flat_state(state["params"]), *nnx.to_flat_state(state["rest"])]
        out["param_bytes"] = sum(_shard_nbytes(v.get_value()) for _, v in variables)
        out["arrays"] = {_path(p): {"shape": list(a.shape), "logical": list(logical.names_of(v)),
                                    "spec": [s if s is None or isinstance(s, str) else list(s) for s in a.sharding.spec],
                                    "shard_bytes": _shard_nbytes(a), "bytes": _full_nbytes(a)}
                         for p, v in variables for a in [v.get_value()]}

        if compile:
            B, T = t.global_batch_size, cfg.data.seq_len
            bs = meshlib.batch_sharding(mesh)
            batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=bs) for k in ("ids", "segment_ids", "positions")}
            jax.block_until_ready(state)    # initialisation is asynchronous: keep it out of the compile time
            t0 = time.perf_counter()
            compiled = step.lower(state, batch).compile()
            out["compile_s"] = time.perf_counter() - t0
            ma = compiled.memory_analysis()
            for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                      "generated_code_size_in_bytes"):
                out[k.removesuffix("_size_in_bytes") + "_bytes"] = int(getattr(ma, k))
            ca = compiled.cost_analysis()
            out["flops"] = float((ca[0] if isinstance(ca, list) else ca).get("flops", 0.0))
            out["batch_bytes_per_device"] = 3 * (B // math.prod(bs.mesh.shape[a] for a in ("data", "fsdp", "expert",
                                                                                          "pipeline"))) * T * 4
            del compiled, step
        del state
    except Exception as e:  # noqa: BLE001 - recorded in the table, the bench goes on
        out["error"] = _error_line(e)
    return out


def replicated(result: dict) -> dict[str, int]:
    """Arrays of a measured mesh that every device holds whole: path -> bytes."""
    return {p: a["bytes"] for p, a in result.get("arrays", {}).items() if a["shard_bytes"] == a["bytes"]}


def fsdp_ratio(data8: dict, fsdp8: dict) -> float:
    return data8["param_opt_bytes"] / fsdp8["param_opt_bytes"]


# ------------------------------------------------------------------------------ report
def _kib(n: float | None) -> str:
    return "—" if n is None else f"{n / 2**10:,.0f} KiB"


def _mesh_str(r: dict) -> str:
    return " ".join(f"{k} {v}" for k, v in r.get("mesh", {}).items()) or "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(TINY))
    p.add_argument("--fsdp-config", default=str(DEMO),
                   help="second config for the fsdp8/data8 ratio, used when --config's is under 7")
    args = p.parse_args(argv)
    assert len(jax.devices()) == 8, f"needs 8 devices, has {len(jax.devices())} (JAX_NUM_CPU_DEVICES)"
    t_start = time.perf_counter()

    rows = {}
    for name, ov in MESHES.items():
        r = measure(ov, args.config)
        rows[name] = r
        print(f"{name}: " + (r["error"] if "error" in r else
                             f"param+opt {_kib(r['param_opt_bytes'])}/device, argument {_kib(r['argument_bytes'])}, "
                             f"temp {_kib(r['temp_bytes'])}, compile {r['compile_s']:.1f} s"), flush=True)

    sched = []
    for m in SCHEDULE_MS:
        for s in ("gpipe", "1f1b"):
            ov = schedule_overrides(s, m)
            same = next((r for r in rows.values() if "error" not in r and _same_config(r["overrides"], ov, args.config)),
                        None)
            r = same or measure(ov, args.config)
            sched.append({"schedule": s, "microbatches": m, "global_batch_size": 8 * m, **r})
            print(f"pipeline4_data2 {s} M={m}: " + (r["error"] if "error" in r else f"temp {_kib(r['temp_bytes'])}"),
                  flush=True)

    # fsdp8 vs data8 on --config, and on --fsdp-config when --config falls short of 7x
    base = rows["data8"]
    ratios = []
    if "error" not in base and "error" not in rows["fsdp8"]:
        ratios.append({"config": rows["fsdp8"]["config"], "data8": base, "fsdp8": rows["fsdp8"]})
    if not ratios or fsdp_ratio(ratios[0]["data8"], ratios[0]["fsdp8"]) < 7:
        # state arrays only (no compile): the ratio needs what each device holds, not the step
        d, f = (measure(MESHES[n], args.fsdp_config, compile=False) for n in ("data8", "fsdp8"))
        ratios.append({"config": f.get("config", args.fsdp_config), "data8": d, "fsdp8": f})
    for r in ratios:
        if "error" in r["data8"] or "error" in r["fsdp8"]:
            r["error"] = r["data8"].get("error") or r["fsdp8"].get("error")
            print(f"fsdp8/data8 on {r['config']}: {r['error']}")
            continue
        rep = replicated(r["fsdp8"])
        r.update(ratio=fsdp_ratio(r["data8"], r["fsdp8"]), replicated_in_fsdp8=rep,
                 replicated_fraction=sum(rep.values()) / sum(a["bytes"] for a in r["fsdp8"]["arrays"].values()))
        print(f"fsdp8/data8 per-device param+opt bytes on {r['config']}: {r['data8']['param_opt_bytes']:,} / "
              f"{r['fsdp8']['param_opt_bytes']:,} = {r['ratio']:.2f}x (target >= 7); fsdp8 keeps "
              f"{len(rep)} parameter arrays whole on every device ({100 * r['replicated_fraction']:.1f}% of the "
              f"parameter bytes)", flush=True)

    # ---- tables
    table = [("| mesh | shape | param+opt / device | vs data8 | argument (XLA) | temp (XLA) | schedule | M | R | bubble "
              "| compile |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "error" in r:
            table.append(f"| {name} | {_mesh_str(r)} | error: {r['error'].replace('|', '/')} ||||||||| ")
            continue
        pp = r.get("pipeline")
        vs = (f"{r['param_opt_bytes'] / base['param_opt_bytes']:.3f}x" if "error" not in base else "—")
        table.append(f"| {name} | {_mesh_str(r)} | {_kib(r['param_opt_bytes'])} | {vs} | {_kib(r['argument_bytes'])} | "
                     f"{_kib(r['temp_bytes'])} | " + (f"{pp['schedule']} | {pp['microbatches']} | {pp['repeats']} | "
                                                      f"{pp['bubble']:.3f}" if pp else "— | — | — | —")
                     + f" | {r['compile_s']:.0f} s |")
    stable = ["| schedule | M | global batch | temp (XLA) | temp / M | bubble | compile |", "|---|---|---|---|---|---|---|"]
    for r in sched:
        if "error" in r:
            stable.append(f"| {r['schedule']} | {r['microbatches']} | {r['global_batch_size']} | error: "
                          f"{r['error'].replace('|', '/')} |||| ")
            continue
        stable.append(f"| {r['schedule']} | {r['microbatches']} | {r['global_batch_size']} | {_kib(r['temp_bytes'])} | "
                      f"{_kib(r['temp_bytes'] / r['microbatches'])} | {r['pipeline']['bubble']:.3f} | "
                      f"{r['compile_s']:.0f} s |")
    growth = {}
    for s in ("gpipe", "1f1b"):
        pts = {r["microbatches"]: r["temp_bytes"] for r in sched if r["schedule"] == s and "error" not in r}
        if len(pts) == len(SCHEDULE_MS):
            growth[s] = pts[SCHEDULE_MS[-1]] / pts[SCHEDULE_MS[0]]
    rtable = [("| config | data8 param+opt / device | fsdp8 param+opt / device | ratio | arrays fsdp8 keeps whole "
               "| their share of the parameter bytes |"), "|---|---|---|---|---|---|"]
    for r in ratios:
        if "error" in r:
            rtable.append(f"| {r['config']} | error: {r['error'].replace('|', '/')} ||||| ")
            continue
        rtable.append(f"| {r['config']} | {_kib(r['data8']['param_opt_bytes'])} | {_kib(r['fsdp8']['param_opt_bytes'])} "
                      f"| **{r['ratio']:.2f}x** | {len(r['replicated_in_fsdp8'])} | {100 * r['replicated_fraction']:.1f}% |")

    print("\n" + "\n".join(table) + "\n\n" + "\n".join(stable) + "\n\n" + "\n".join(rtable))
    for r in ratios:
        if "ratio" in r:
            print(f"fsdp8/data8 ratio ({r['config']}): {r['ratio']:.2f}x {'>=' if r['ratio'] >= 7 else '<'} 7")

    # ---- files
    cfg_name = Path(args.config).name
    command = ("python bench/memory.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    machine = machine_line()
    date = datetime.datetime.now().astimezone().isoformat(timespec="minutes")
    errors = [n for n, r in rows.items() if "error" in r] + [f"{r['schedule']} M={r['microbatches']}" for r in sched
                                                              if "error" in r]
    ok = [r for r in ratios if "ratio" in r]
    kinds = sorted({_kind(p) for r in ok for p in r["replicated_in_fsdp8"]})
    text = [(f"# Memory per mesh\n\n`{command}` on {date}; {machine}; {time.perf_counter() - t_start:.0f} s in all. "
             f"{cfg_name}, fp32, 8 fake CPU devices; every column is per device. param+opt: one shard of each "
             "parameter, router bias and AdamW state array; argument and temp: "
             "`compiled.memory_analysis()` of the whole train step (argument = the state plus this device's batch "
             "rows; temp = activations and workspace). Bubble: (P-1)/(M*R+P-1); 1f1b (2P-2)/(M+2P-2).\n"),
            "\n".join(table) + "\n",
            f"Pipeline schedules on (pipeline 4, data 2), {cfg_name}, microbatches of 8 rows (global batch 8M):\n",
            "\n".join(stable) + "\n",
            "(fsdp 8) against (data 8), per-device param+opt bytes (a second config's state is built, not compiled):\n",
            "\n".join(rtable) + "\n"]
    summary = []
    if ok:
        first = ok[0]
        summary.append(
            f"Sharding the state over fsdp 8 cuts per-device param+opt bytes {first['ratio']:.2f}x on {first['config']}"
            + (f" and {ok[-1]['ratio']:.2f}x on {ok[-1]['config']}" if len(ok) > 1 else "") + "; what keeps it under "
            f"8x is the arrays the logical rules leave replicated ({', '.join(kinds)}), which every device holds "
            f"whole" + (f": {100 * first['replicated_fraction']:.1f}% of {Path(first['config']).name}'s parameter bytes against "
                        f"{100 * ok[-1]['replicated_fraction']:.1f}% of {Path(ok[-1]['config']).name}'s."
                        if len(ok) > 1 else "."))
    pp_rows = [r for r in rows.values() if "pipeline" in r and "error" not in r and "error" not in base
               and set(r["mesh"]) <= {"data", "pipeline"}]
    if pp_rows:
        lo, hi = (f(r["param_opt_bytes"] / base["param_opt_bytes"] for r in pp_rows) for f in (min, max))
        span = f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"
        pads = [r for r in pp_rows if r["pipeline"]["slots"] and r["pipeline"]["slots"] > r["pipeline"]["moe_layers"]]
        summary.append(
            f"Pipeline stages split the MoE stack into their slots and shard the embedding, dense prefix, head and "
            f"MTP over `pipeline` as fsdp does, so (data x pipeline) meshes hold {span} of data8's state per device"
            + (f"; with {pads[0]['pipeline']['moe_layers']} MoE layers in {pads[0]['pipeline']['slots']} slots, "
               f"{pads[0]['pipeline']['slots'] - pads[0]['pipeline']['moe_layers']} slots are zero pads." if pads else "."))
    if growth:
        summary.append(f"From M={SCHEDULE_MS[0]} to M={SCHEDULE_MS[-1]} microbatches of 8 rows (so twice the global "
                       "batch) temp memory grows " + " and ".join(f"{g:.2f}x under {s}" for s, g in growth.items())
                       + f" while GPipe's bubble shrinks from {pipeline_bubble(4, SCHEDULE_MS[0]):.3f} to "
                       f"{pipeline_bubble(4, SCHEDULE_MS[-1]):.3f}: GPipe keeps every microbatch's residuals until "
                       "the backward, 1F1B at most 2P-1 stage inputs.")
    if errors:
        summary.append(f"Failed to build or compile: {', '.join(errors)} (the error is in the row).")
    text.append(" ".join(summary) + "\n")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory.md").write_text("\n".join(text))
    slim = lambda r: {k: v for k, v in r.items() if k != "arrays"}
    (RESULTS / "memory.json").write_text(json.dumps({
        "command": command, "date": date, "machine": machine, "config": _rel(args.config),
        "meshes": {n: slim(r) for n, r in rows.items()}, "schedules": [slim(r) for r in sched],
        "schedule_temp_growth_M4_to_M8": growth,
        "fsdp8_vs_data8": [{"config": r["config"], **({"error": r["error"]} if "error" in r else {
            "data8_param_opt_bytes": r["data8"]["param_opt_bytes"], "fsdp8_param_opt_bytes": r["fsdp8"]["param_opt_bytes"],
            "ratio": r["ratio"], "replicated_in_fsdp8": r["replicated_in_fsdp8"],
            "replicated_fraction": r["replicated_fraction"]})} for r in ratios]}, indent=2) + "\n")
    return 0


def _rel(path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _same_config(a: list[str], b: list[str], config) -> bool:
    from r1jax import config as configlib
    try:
        return configlib.load(config, a) == configlib.load(config, b)
    except Exception:  # noqa: BLE001
        return False


def pipeline_bubble(stages: int, m: int, repeats: int = 1) -> float:
    from r1jax.parallel.pipeline import bubble
    return bubble(stages, m, repeats)


def _kind(path: str) -> str:
    """A replicated array's kind, for the summary line."""
    leaf = path.split("/")[-2] if path.endswith("/weight") else path.split("/")[-1]
    return {"wq_b_QNH": "wq_b (q_lora x heads x head_dim)", "wk_b_CNK": "wk_b (kv_lora x heads x nope_dim)",
            "wv_b_CNV": "wv_b (kv_lora x heads x v_dim)", "router_bias_E": "router biases"}.get(leaf, "norm weights" if "norm" in leaf else leaf)


if __name__ == "__main__":
    sys.exit(main())

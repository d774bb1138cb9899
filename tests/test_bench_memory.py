"""(fsdp 8) cuts per-device parameter+optimizer bytes at least 7x against (data 8), measured by
bench/memory.py's `measure` on configs/demo.yaml (state built as the trainer builds it, not
compiled), and fsdp shards every array the logical rules let it shard.

The rules map `embed` (hidden_size) and, for MLA's wq_b and wkv_b, the latent input axes
(`q_lora_in`, `kv_lora_in`) to fsdp; only the norm weights and router biases stay whole on every
device. This test pins which arrays those are, so a new unsharded array shows up here."""
from __future__ import annotations

import pytest

import importlib.util
import sys
from pathlib import Path

pytestmark = pytest.mark.slow      # whole runs, meshes or processes: `make test`, not `make check`

ROOT = Path(__file__).resolve().parents[1]
# the logical axes LOGICAL_RULES maps to fsdp; arrays without one may stay whole
FSDP_LOGICAL = {"embed", "q_lora_in", "kv_lora_in"}
# the kinds of arrays that have none of them (leaf names; norms are `<name>/weight`)
WHOLE_KINDS = {"router_bias_E"}


def _bench():
    name = "bench_memory"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "memory.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _kind(path: str) -> str:
    parts = path.split("/")
    return "norm" if parts[-1] == "weight" and "norm" in parts[-2] else parts[-1]


def test_fsdp8_cuts_param_and_optimizer_bytes_7x():
    bench = _bench()
    config = ROOT / "configs" / "demo.yaml"
    data8 = bench.measure(bench.MESHES["data8"], config, compile=False)
    fsdp8 = bench.measure(bench.MESHES["fsdp8"], config, compile=False)
    assert "error" not in data8, data8["error"]
    assert "error" not in fsdp8, fsdp8["error"]
    assert data8["mesh"] == {"data": 8} and fsdp8["mesh"] == {"fsdp": 8}

    ratio = bench.fsdp_ratio(data8, fsdp8)
    whole = bench.replicated(fsdp8)
    share = sum(whole.values()) / sum(a["bytes"] for a in fsdp8["arrays"].values())
    print(f"\nper-device param+opt bytes: data8 {data8['param_opt_bytes']:,}, fsdp8 {fsdp8['param_opt_bytes']:,}, "
          f"ratio {ratio:.2f}x; fsdp8 keeps {len(whole)} arrays whole ({100 * share:.1f}% of the parameter bytes)")
    assert ratio >= 7

    # data 8 replicates everything; the state is the same on both meshes
    assert all(a["shard_bytes"] == a["bytes"] for a in data8["arrays"].values())
    assert data8["param_opt_bytes"] == data8["param_opt_bytes_global"] == fsdp8["param_opt_bytes_global"]
    # each device holds exactly 1/8 of every array with an fsdp-mapped axis, and all of the others
    for path, a in fsdp8["arrays"].items():
        if FSDP_LOGICAL & set(a["logical"]):
            axes = {x for e in a["spec"] for x in (e if isinstance(e, list) else [e])}     # ["fsdp", "pipeline"]
            assert "fsdp" in axes and a["shard_bytes"] * 8 == a["bytes"], (path, a)
        else:
            assert a["shard_bytes"] == a["bytes"], (path, a)
            assert _kind(path) in WHOLE_KINDS | {"norm"}, f"{path} {a['logical']}: a new array fsdp cannot shard"
    # the AdamW moments are sharded like their params: mu + nu + params ~ 3x the params' shards
    # (the router biases in `rest` have no moments; the optax counts are a few scalars)
    assert fsdp8["param_opt_bytes"] <= 3 * fsdp8["param_bytes"] + 1024

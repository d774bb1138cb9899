"""HF safetensors <-> r1jax: exact round trips, transformers loads what r1jax writes, sharded
checkpoints, FP8 checkpoints, the CLI both ways, bounded memory, and bad checkpoints refused."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from hf_ref import hf_model
from r1jax import model as modellib
from r1jax.config import ModelConfig
from r1jax.convert import hf, safetensors_io
from r1jax.convert.mapping import main_entries

ROOT = Path(__file__).resolve().parents[1]


def _tensors(directory) -> dict[str, np.ndarray]:
    r = safetensors_io.Reader(directory)
    return {k: r.read(k) for k in r.keys()}


def _logits(model_dir, ids):
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return m(ids).logits.numpy()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    hf_model(seed=4).save_pretrained(d)
    return d


def test_round_trip_is_exact_and_transformers_loads_it(hf_dir, tmp_path):
    cfg, model = hf.load(hf_dir)
    hf.save(model, cfg, tmp_path / "back")
    a, b = _tensors(hf_dir), _tensors(tmp_path / "back")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ref, back = _logits(hf_dir, ids), _logits(tmp_path / "back", ids)
    ours = np.asarray(model(jnp.asarray(ids.numpy(), jnp.int32)).logits)
    print(f"\nreloaded-by-transformers max|dlogits| = {np.abs(back - ref).max():.1e}; "
          f"r1jax vs transformers {np.abs(ours - ref).max():.1e}")
    assert np.array_equal(back, ref)
    assert np.abs(ours - ref).max() <= 2e-5


def test_sharded_checkpoint_with_index(hf_dir, tmp_path):
    cfg, model = hf.load(hf_dir)
    hf.save(model, cfg, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / safetensors_io.INDEX).read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 3 and all((tmp_path / "sharded" / f).is_file() for f in files)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    assert np.array_equal(_logits(tmp_path / "sharded", ids), _logits(hf_dir, ids))
    _, again = hf.load(tmp_path / "sharded")
    for p, v in modellib.leaves(nnx.state(model)).items():
        assert np.array_equal(np.asarray(v), np.asarray(modellib.leaves(nnx.state(again))[p])), p


def test_bf16_checkpoint_loads(hf_dir, tmp_path):
    cfg, model = hf.load(hf_dir)
    hf.save(model, cfg, tmp_path / "bf16", dtype=ml_dtypes.bfloat16)
    t = _tensors(tmp_path / "bf16")
    assert t["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == ml_dtypes.bfloat16
    assert t["model.layers.1.mlp.gate.weight"].dtype == np.float32            # router stays fp32
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    _, m16 = hf.load(tmp_path / "bf16")
    w = np.asarray(modellib.leaves(nnx.state(model))[("embed", "embedding_WD")])
    w16 = np.asarray(modellib.leaves(nnx.state(m16))[("embed", "embedding_WD")])
    assert np.array_equal(w.astype(ml_dtypes.bfloat16).astype(np.float32), w16)


def test_fp8_block_scaled_checkpoint_is_dequantised(hf_dir, tmp_path):
    """DeepSeek's release format: e4m3 weights with a float32 `weight_scale_inv` per block."""
    block = (16, 16)
    src = _tensors(hf_dir)
    out, expect = {}, {}
    for k, w in src.items():
        quantise = k.endswith("proj.weight") and w.ndim == 2 and "mlp.gate." not in k
        if not quantise:
            out[k] = w
            continue
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        scale = np.zeros((rows, cols), np.float32)
        q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
        for i in range(rows):
            for j in range(cols):
                blk = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
                s = np.abs(blk).max() / 448.0
                scale[i, j] = s
                q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (blk / s).astype(q.dtype)
        out[k], out[k + "_scale_inv"] = q, scale
        deq = np.zeros(w.shape, np.float32)
        for i in range(rows):
            for j in range(cols):
                sl = np.s_[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
                deq[sl] = q[sl].astype(np.float32) * scale[i, j]
        expect[k] = deq
    d = tmp_path / "fp8"
    safetensors_io.write(d, [(k, v.shape, v.dtype) for k, v in out.items()], lambda k: out[k])
    cfgj = json.loads((hf_dir / "config.json").read_text())
    cfgj["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (d / "config.json").write_text(json.dumps(cfgj))
    cfg, model = hf.load(d)
    got = modellib.leaves(nnx.state(model))
    checked = 0
    for e in main_entries(cfg):
        if e.key in expect:
            assert np.array_equal(e.gather(got.__getitem__), expect[e.key]), e.key
            checked += 1
    assert checked > 10


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "r1jax.convert", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def test_cli_round_trip_through_orbax(hf_dir, tmp_path):
    r = _run("hf-to-orbax", hf_dir, tmp_path / "orbax")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "orbax" / "0" / "params").is_dir()
    assert (tmp_path / "orbax" / "model_config.json").is_file()
    r = _run("orbax-to-hf", tmp_path / "orbax", tmp_path / "hf2")
    assert r.returncode == 0, r.stderr
    a, b = _tensors(hf_dir), _tensors(tmp_path / "hf2")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # a non-empty destination is refused and left alone
    before = sorted(p.name for p in (tmp_path / "hf2").iterdir())
    r = _run("orbax-to-hf", tmp_path / "orbax", tmp_path / "hf2")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "not empty" in r.stderr
    assert sorted(p.name for p in (tmp_path / "hf2").iterdir()) == before


@pytest.mark.parametrize("damage,expect", [
    ("drop", "tensor model.layers.1.mlp.experts.3.up_proj.weight is missing"),
    ("reshape", "model.layers.0.self_attn.kv_b_proj.weight: shape"),
    ("extra", "unexpected tensor model.layers.0.mlp.bogus.weight"),
    ("truncate", "truncated"),
])
def test_bad_checkpoints_are_refused_in_one_line(hf_dir, tmp_path, damage, expect):
    t = _tensors(hf_dir)
    if damage == "drop":
        del t["model.layers.1.mlp.experts.3.up_proj.weight"]
    elif damage == "reshape":
        w = t["model.layers.0.self_attn.kv_b_proj.weight"]
        t["model.layers.0.self_attn.kv_b_proj.weight"] = np.ascontiguousarray(w[:-4])
    elif damage == "extra":
        t["model.layers.0.mlp.bogus.weight"] = np.zeros((2, 2), np.float32)
    d = tmp_path / "bad"
    safetensors_io.write(d, [(k, v.shape, v.dtype) for k, v in t.items()], lambda k: t[k])
    (d / "config.json").write_text((hf_dir / "config.json").read_text())
    if damage == "truncate":
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-1000])
    r = _run("hf-to-orbax", d, tmp_path / "out")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], lines
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


MEMORY_PROBE = textwrap.dedent("""
    import sys, psutil
    import jax, orbax.checkpoint, r1jax.convert.hf, r1jax.convert.__main__ as cli
    jax.numpy.zeros(1).block_until_ready()
    base = psutil.Process().memory_info().rss // 1024    # resident now, after imports
    rc = cli.main(sys.argv[1:])
    # VmHWM, this address space's peak: getrusage's ru_maxrss also keeps the forking parent's
    # resident size at exec (a pytest worker that compiled models reads as a 2 GB "peak")
    peak = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM:")))
    print("EXTRA_KIB", peak - base, "BASE_KIB", base)
    sys.exit(rc)
""")


@pytest.mark.slow
def test_conversion_peak_memory_is_model_plus_largest_tensor(tmp_path):
    """Both directions, in fresh processes: peak RSS above the post-import baseline must stay under
    the model's size plus its largest tensor (the conversion never holds two copies)."""
    cfg = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=1024,
                      num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=8,
                      num_key_value_heads=8, n_routed_experts=8, n_group=1, topk_group=1,
                      num_experts_per_tok=2, q_lora_rank=256, kv_lora_rank=256, qk_rope_head_dim=32,
                      qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=512,
                      num_nextn_predict_layers=1)
    rng = np.random.default_rng(0)
    specs = [(e.key, e.hf_shape, np.dtype(np.float32)) for e in hf.entries(cfg)]
    model_bytes = sum(int(np.prod(s)) * 4 for _, s, _ in specs)
    largest = max(int(np.prod(s)) * 4 for _, s, _ in specs)
    src = tmp_path / "src"
    safetensors_io.write(src, specs, lambda k: rng.standard_normal(
        next(s for n, s, _ in specs if n == k), dtype=np.float32), max_shard_bytes=2**28)
    from r1jax.config import hf_config_dict
    (src / "config.json").write_text(json.dumps(hf_config_dict(cfg)))

    limit_kib = (model_bytes + largest) // 1024
    extra = {}
    for direction, a, b in (("hf-to-orbax", src, tmp_path / "orbax"), ("orbax-to-hf", tmp_path / "orbax", tmp_path / "hf")):
        r = subprocess.run([sys.executable, "-c", MEMORY_PROBE, direction, str(a), str(b)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        extra[direction] = int(r.stdout.split("EXTRA_KIB")[1].split()[0])
    print(f"\nmodel {model_bytes / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB; peak above baseline: "
          + ", ".join(f"{k} {v / 1024:.0f} MiB" for k, v in extra.items()))
    for direction, kib in extra.items():
        assert kib <= limit_kib, (direction, kib, limit_kib)
    a = safetensors_io.Reader(src)
    b = safetensors_io.Reader(tmp_path / "hf")
    for k in ("model.embed_tokens.weight", "model.layers.2.mlp.experts.5.down_proj.weight", "lm_head.weight"):
        assert np.array_equal(a.read(k), b.read(k)), k

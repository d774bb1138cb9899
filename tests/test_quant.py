"""Weight-only quantisation (r1jax/infer/quant.py) on tiny.yaml: int8's per-channel error bound,
fp8's block format against an independent ml_dtypes implementation, the generator's int8
outputs against fp32 and against the teacher-forced forward on the same quantised weights,
weight bytes, DeepSeek-format FP8 checkpoints loading into fp8 without dequantising (and
dequantised without --quantize), and `python -m r1jax.eval`'s three measures and errors."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from r1jax import config as configlib
from r1jax import model as modellib
from r1jax import weights
from r1jax.config import DType, InferConfig
from r1jax.convert import hf, safetensors_io
from r1jax.data import tokenizer as toklib
from r1jax.infer import quant
from r1jax.infer import source as sourcelib
from r1jax.infer.generator import Generator, Request
from r1jax.parallel import mesh as meshlib

ROOT = Path(__file__).resolve().parents[1]
FP32 = InferConfig(cache_dtype=DType.fp32, batch_size=4, decode_chunk=4, max_len=64)
E4M3 = ml_dtypes.float8_e4m3fn


@pytest.fixture(scope="module")
def tiny():
    m = configlib.load(ROOT / "configs" / "tiny.yaml", ["mesh.data=1"]).model
    return m, nnx.state(weights.create(m, seed=3))


@pytest.fixture(scope="module")
def gens(tiny):
    m, state = tiny
    return {k: Generator(m, state, FP32, eos_id=None, quantize=k) for k in ("none", "int8", "fp8")}


# ---------------------------------------------------------------------- formats
def test_int8_is_per_output_channel_within_half_a_step():
    w = np.random.default_rng(0).standard_normal((3, 48, 4, 24)).astype(np.float32)   # [L, Q, N, H]: in = Q
    qa = quant.quantize(w, "int8", n_in=1, n_out=2)
    assert qa.q.dtype == jnp.int8 and qa.scale.shape == (3, 4, 24)
    np.testing.assert_allclose(qa.scale, np.abs(w).max(axis=1) / 127, rtol=1e-6)
    deq = np.asarray(qa[...])
    step = np.asarray(qa.scale)[:, None]
    assert np.all(np.abs(deq - w) <= 0.5 * step * (1 + 1e-5))
    rel = np.linalg.norm(deq - w) / np.linalg.norm(w)
    assert rel < 0.01, rel                      # measured 0.0057 (Gaussian, 48 inputs a channel)
    # an integer index takes a layer, still quantised
    assert np.array_equal(np.asarray(qa[1][...]), deq[1]) and qa[1].q.dtype == jnp.int8


def _ds_fp8(w_out_in: np.ndarray, block=(128, 128)):
    """DeepSeek's format with numpy/ml_dtypes: e4m3 [out, in], scale_inv [ceil(out/bo), ceil(in/bi)]."""
    bo, bi = block
    O, I = w_out_in.shape
    s = np.ones((-(-O // bo), -(-I // bi)), np.float32)
    for a in range(s.shape[0]):
        for b in range(s.shape[1]):
            amax = np.abs(w_out_in[a * bo:(a + 1) * bo, b * bi:(b + 1) * bi]).max()
            s[a, b] = amax / np.float32(448) if amax > 0 else 1.0
    full = np.repeat(np.repeat(s, bo, 0), bi, 1)[:O, :I]
    return np.clip(w_out_in / full, -448, 448).astype(E4M3), s


def test_fp8_blocks_are_deepseeks_format():
    w = (np.random.default_rng(1).standard_normal((300, 200)) * 0.02).astype(np.float32)   # [in, out]
    w[:128, :128] *= 50                                                   # blocks of very different ranges
    qa = quant.quantize(w, "fp8", n_in=1, n_out=1)
    q_ds, s_ds = _ds_fp8(w.T)
    assert qa.q.dtype == jnp.float8_e4m3fn and qa.scale.shape == (3, 2)
    np.testing.assert_array_equal(np.asarray(qa.q).view(np.uint8), q_ds.T.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(qa.scale), s_ds.T)
    deq = np.asarray(qa[...])
    full = np.repeat(np.repeat(s_ds.T, 128, 0), 128, 1)[:300, :200]
    np.testing.assert_array_equal(deq, q_ds.T.astype(np.float32) * full)
    # e4m3: 3 mantissa bits (half an ulp = 2^-4 relative), subnormals below 2^-6 in steps of 2^-9
    assert np.all(np.abs(deq - w) <= np.maximum(np.abs(w) * 2.0 ** -4, full * 2.0 ** -10) * (1 + 1e-6))


# ---------------------------------------------------------------------- generator
def _prompts(m, lengths, seed=0):
    r = np.random.default_rng(seed)
    return [tuple(int(t) for t in r.integers(3, m.vocab_size, n)) for n in lengths]


def test_weight_bytes_shrink(gens):
    b = {k: quant.weight_bytes(g.params) for k, g in gens.items()}
    matmul_fp32 = b["none"]["total"] - b["int8"]["float"]         # the same float leaves stay
    assert b["int8"]["float"] == b["fp8"]["float"] and b["none"]["quantized"] == 0
    # int8: 1 byte a weight + one fp32 scale per output channel (tiny: 16-128 inputs a channel)
    assert 3.5 < matmul_fp32 / b["int8"]["quantized"] < 4.0, b   # measured 3.71
    assert 3.9 < matmul_fp32 / b["fp8"]["quantized"] <= 4.0, b   # measured 3.99 (one scale per 128x128)
    assert b["none"]["total"] / b["int8"]["total"] > 2.8        # measured 2.90: the fp32 embedding table stays


def test_int8_generator_is_close_to_fp32_and_equals_its_own_forward(tiny, gens):
    m, state = tiny
    reqs = [Request(p, max_new_tokens=8, logprobs=20) for p in _prompts(m, (5, 16, 9, 11))]
    out = {k: gens[k].generate(reqs) for k in ("none", "int8")}
    # logprobs of the 20 most likely tokens, at every step until the greedy paths part
    diffs, same = [], []
    for a, b in zip(out["none"], out["int8"]):
        n = next((i for i, (x, y) in enumerate(zip(a.completion_ids, b.completion_ids)) if x != y), len(a.completion_ids))
        same += [x == y for x, y in zip(a.completion_ids, b.completion_ids)]
        for i in range(min(n + 1, len(a.completion_ids))):
            diffs += [abs(a.top_logprobs[i][t] - b.top_logprobs[i][t]) for t in a.top_logprobs[i] if t in b.top_logprobs[i]]
    assert max(diffs) < 0.015, max(diffs)      # measured 0.0055 (fp32 logprobs; fp8 gives 0.069)
    assert np.mean(same) >= 0.7, np.mean(same)  # measured 0.84 (fp8: 0.50); random-init logits are flat
    # the generator's int8 path (QArrays read in the step, experts dequantised inside `grouped`)
    # computes the training forward over the dequantised weights: greedy = its argmax
    qstate = quant.quantize_state(state, "int8")
    graphdef = modellib.abstract(m)[0]
    forward = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids).logits[0])
    for r, c in zip(reqs[:2], out["int8"][:2]):
        ids = list(r.prompt_ids)
        for _ in range(r.max_new_tokens):
            ids.append(int(jnp.argmax(forward(qstate, jnp.asarray([ids + [0] * (32 - len(ids))], jnp.int32))[len(ids) - 1])))
        assert ids[len(r.prompt_ids):] == c.completion_ids


def test_fp8_generator_runs_and_none_is_the_float_model(tiny, gens):
    m, state = tiny
    reqs = [Request(p, max_new_tokens=6) for p in _prompts(m, (7, 12), seed=2)]
    assert all(len(c.completion_ids) == 6 for c in gens["fp8"].generate(reqs))
    assert gens["none"].quantize == "none" and not any(
        isinstance(x, quant.QArray) for x in jax.tree.leaves(gens["none"].params, is_leaf=lambda x: isinstance(x, quant.QArray)))
    with pytest.raises(ValueError, match="--quantize int4: allowed none, int8, fp8"):
        Generator(m, state, FP32, quantize="int4")


# ---------------------------------------------------------------------- DeepSeek FP8 checkpoints
def _fp8_checkpoint(m, state, d: Path, block):
    """An HF directory in DeepSeek's FP8 release format, made with numpy/ml_dtypes: every Linear
    of the decoder layers in e4m3 with `weight_scale_inv`; embedding, head, router, norms, MTP's
    eh_proj in float, as DeepSeek-V3's checkpoints are."""
    dense = d / "dense"
    hf.save(nnx.merge(modellib.abstract(m)[0], state), m, dense)
    r = safetensors_io.Reader(dense)
    specs, tensors = [], {}
    for k in r.keys():
        x = r.read(k)
        if "_proj" in k and k.endswith(".weight") and ".layers." in k and "eh_proj" not in k:
            q, s = _ds_fp8(x, block)
            tensors[k], tensors[k + "_scale_inv"] = q, s
        else:
            tensors[k] = x
    specs = [(k, v.shape, v.dtype) for k, v in tensors.items()]
    safetensors_io.write(d / "fp8", specs, lambda k: tensors[k])
    cfg = json.loads((dense / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": list(block)}
    (d / "fp8" / "config.json").write_text(json.dumps(cfg))
    return d / "fp8"


def test_fp8_checkpoint_loads_as_fp8_equal_to_quantising_the_dense_weights(tiny, tmp_path):
    m, state = tiny
    d = _fp8_checkpoint(m, state, tmp_path, (8, 8))
    src = sourcelib.resolve(f"hf:{d}", ["mesh.data=1"])
    mesh = meshlib.single_device_mesh()
    logs = []
    loaded = src.load(mesh, logs.append, quantize="fp8")
    assert any("kept in fp8" in s for s in logs) and not any("line up" in s for s in logs)
    kept = {p: v for p, v in modellib.leaves(loaded).items() if isinstance(v, quant.QArray)}
    # every decoder-layer matmul weight, as stored; the head and eh_proj were float in the file
    assert len(kept) == sum(1 for p in modellib.leaves(state) if p[-1] in quant.MATMULS) - 1 - m.num_nextn_predict_layers
    direct = modellib.leaves(quant.quantize_state(state, "fp8", block=(8, 8)))
    for p, qa in kept.items():
        assert qa.q.dtype == jnp.float8_e4m3fn and qa.block == (8, 8)
        np.testing.assert_array_equal(np.asarray(qa.q).view(np.uint8), np.asarray(direct[p].q).view(np.uint8), err_msg=str(p))
        np.testing.assert_array_equal(np.asarray(qa.scale), np.asarray(direct[p].scale), err_msg=str(p))
    # without --quantize fp8 the same file reads dequantised: the fp8 leaves' own values
    plain = modellib.leaves(src.load(mesh))
    for p, qa in kept.items():
        np.testing.assert_array_equal(np.asarray(plain[p]), np.asarray(qa[...]), err_msg=str(p))
    # the generator keeps the loaded fp8 leaves and quantises the float ones (head, eh_proj)
    g = Generator(m, loaded, FP32, mesh=mesh, eos_id=None, quantize="fp8")
    out = g.generate([Request(p, max_new_tokens=4) for p in _prompts(m, (6, 9))])
    assert [len(c.completion_ids) for c in out] == [4, 4]
    assert isinstance(g.params[0]["lm_head_DW"].get_value(), quant.QArray)


def test_fp8_blocks_that_a_split_cuts_are_read_dequantised(tiny, tmp_path):
    """kv_a_proj_with_mqa's 40 rows (latent 32, rope key 8) in 12-row blocks: rows 32-39 span
    two blocks, so wk_rope_DR cannot keep them; it is read dequantised (then quantised again)."""
    m, state = tiny
    d = _fp8_checkpoint(m, state, tmp_path, (12, 12))
    logs = []
    loaded = sourcelib.resolve(f"hf:{d}", ["mesh.data=1"]).load(meshlib.single_device_mesh(), logs.append, "fp8")
    assert any("kv_a_proj_with_mqa.weight" in s and "line up" in s for s in logs)
    leaves = modellib.leaves(loaded)
    assert not isinstance(leaves[("dense_layers", "layers", "attn", "wk_rope_DR")], quant.QArray)
    assert isinstance(leaves[("dense_layers", "layers", "attn", "wkv_a_DC")], quant.QArray)
    w = np.asarray(modellib.leaves(state)[("dense_layers", "layers", "attn", "wk_rope_DR")])
    got = np.asarray(leaves[("dense_layers", "layers", "attn", "wk_rope_DR")])
    assert np.abs(got - w).max() <= np.abs(w).max() * 2.0 ** -4


# ---------------------------------------------------------------------- python -m r1jax.eval
@pytest.fixture(scope="module")
def hf_dir(tiny, tmp_path_factory):
    m, state = tiny
    d = tmp_path_factory.mktemp("evalhf")
    hf.save(nnx.merge(modellib.abstract(m)[0], state), m, d)
    text = ["def f(x):\n    return x + 1\n", "import os\nprint('hello world')\n"] * 200
    toklib.train(text, m.vocab_size).save(str(d / "tokenizer.json"))
    (d / "held_out.txt").write_text("def g(y):\n    return y * 2\n" * 40)
    return d


def test_eval_prints_perplexity_kl_and_agreement(hf_dir, tmp_path, capsys):
    from r1jax import eval as evallib
    args = ["--model", f"hf:{hf_dir}", "--data", str(hf_dir / "held_out.txt"), "--max-tokens", "200",
            "--set", "data.seq_len=32", "train.global_batch_size=8"]
    assert evallib.main(args + ["--quantize", "int8", "--out", str(tmp_path / "int8.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [s.split(":")[0] for s in lines[:3]] == ["perplexity", "kl", "top1_agreement"]
    r = json.loads((tmp_path / "int8.json").read_text())
    assert 150 < r["tokens"] <= 200 and 0 < r["kl"] < 0.01 and r["top1_agreement"] > 0.8
    assert abs(r["perplexity_change"]) < 0.01 and r["weight_bytes"] < r["weight_bytes_unquantized"] / 2.5
    assert evallib.main(args + ["--quantize", "none", "--out", str(tmp_path / "none.json")]) == 0
    n = json.loads((tmp_path / "none.json").read_text())
    assert n["kl"] == 0 and n["top1_agreement"] == 1 and n["perplexity"] == r["perplexity_unquantized"]


def test_eval_and_generate_refuse_a_bad_quantize_in_one_line(hf_dir, capsys):
    from r1jax import eval as evallib
    from r1jax import generate
    assert evallib.main(["--model", f"hf:{hf_dir}", "--quantize", "int4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --quantize int4: allowed none, int8, fp8"
    assert generate.main(["--model", f"hf:{hf_dir}", "--prompt", "hi", "--quantize", "q4"]) == 2
    assert capsys.readouterr().err.strip() == "error: --quantize q4: allowed none, int8, fp8"
    assert evallib.main(["--model", f"hf:{hf_dir}"]) == 2
    assert "not a run directory" in capsys.readouterr().err

"""LoRA (r1jax/model/lora.py, r1jax/convert/peft.py): fresh adapters leave the model unchanged;
merged equals unmerged; `lora-to-peft` writes an adapter that peft loads over transformers'
DeepseekV3ForCausalLM with r1jax's logits (attention Linear targets and the routed experts'
target_parameters, with and without rsLoRA); `orbax-to-hf` writes the merged model; peft's
known bug with dense-MLP / shared-expert targets (issue 3711) is shown, not hidden; training
moves only the adapters (the base never changes, the optimizer holds only adapter state), and
on a 3-D mesh of 8 fake devices it equals 1 device."""
from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from peft import PeftModel
from transformers import DeepseekV3ForCausalLM

import hf_ref
from r1jax import config as configlib
from r1jax import model as modellib
from r1jax import weights
from r1jax.checkpoint import params as ckpt
from r1jax.convert import hf
from r1jax.convert.__main__ import main as convert_main
from r1jax.model import layers
from r1jax.model import lora as loralib
from r1jax.train import trainer
from runs import TINY, train_tiny

ROOT = TINY.parents[1]

ATTENTION = list(configlib.LORA_ATTENTION)
# measured (at -O0, as tests/conftest.py compiles this file): 1.8e-6 (attention), 9.4e-7 (experts)
# between peft's fp32 logits and r1jax's; 4.1e-6 for orbax-to-hf's merged model in transformers
TOL = 1e-4


def _model_cfg():
    return configlib.model_from_dict({**hf_ref.TINY, "num_nextn_predict_layers": 0})


def _lora_checkpoint(tmp, targets, rslora=False, seed=0):
    """A tiny model with random (non-zero) adapters on `targets`, as a LoRA run's checkpoint
    directory (params + model_config.json + lora_config.json) -> (model, leaves, directory)."""
    m = _model_cfg()
    lo = configlib.LoraConfig(rank=4, alpha=8.0, targets=targets, rslora=rslora)
    model = modellib.Transformer(m, lora=lo, rngs=weights.rngs(seed))
    state = nnx.state(model)
    rng = np.random.default_rng(seed)
    flat = {p: (rng.normal(size=v.shape).astype(np.float32) * 0.3 if loralib.is_lora(p) else np.asarray(v))
            for p, v in modellib.leaves(state).items()}
    nnx.update(model, modellib.with_leaves(state, flat))
    d = tmp / "ckpt"
    ckpt.save_params_lazy(d, 0, {p: ckpt.LazyLeaf(v.shape, np.dtype(np.float32), (lambda v=v: v))
                                 for p, v in flat.items()}, m)
    ckpt.write_lora_config(d, lo)
    return model, flat, d


def _ids(m, seed=1):
    return np.random.default_rng(seed).integers(0, m.vocab_size, (2, 12))


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def _base_dir(tmp, m, flat):
    d = tmp / "base"
    hf.write_hf(d, m, lambda p: flat[p])
    return d


def test_fresh_adapters_leave_the_model_unchanged_and_merge_exactly(tmp_path):
    m = _model_cfg()
    lo = configlib.LoraConfig(rank=4, targets=[*ATTENTION, "mlp", "shared_experts", "experts"])
    ids = jnp.asarray(_ids(m), jnp.int32)
    plain = modellib.Transformer(m, rngs=weights.rngs(0))
    fresh = modellib.Transformer(m, lora=lo, rngs=weights.rngs(0))
    plain_logits = np.asarray(plain(ids).logits)      # computed once: the reference for both checks
    # the adapters draw from their own stream and b starts at zero: the very same model
    np.testing.assert_array_equal(plain_logits, np.asarray(fresh(ids).logits))

    model, flat, d = _lora_checkpoint(tmp_path, [*ATTENTION, "mlp", "shared_experts", "experts"])
    reader = ckpt.ParamsReader(d)                    # reads adapted weights merged
    assert not any(loralib.is_lora(k) for k in reader.shapes)
    merged = modellib.Transformer(m, rngs=weights.rngs(0))
    st = nnx.state(merged)
    nnx.update(merged, modellib.with_leaves(st, {p: reader.read(p) for p in modellib.leaves(st)}))
    a, b = np.asarray(model(ids).logits), np.asarray(merged(ids).logits)
    assert np.abs(a - plain_logits).max() > 0.1                         # the adapters do something
    np.testing.assert_allclose(b, a, atol=2e-5)      # measured 2.6e-6


@pytest.mark.parametrize("targets,rslora", [(ATTENTION, False), (["q_a_proj", "kv_b_proj", "experts"], True)])
def test_peft_loads_the_exported_adapter_with_the_same_logits(tmp_path, targets, rslora, capsys):
    m = _model_cfg()
    model, flat, d = _lora_checkpoint(tmp_path, targets, rslora)
    out = tmp_path / "peft"
    assert convert_main(["lora-to-peft", str(d), str(out), "--base", "tiny-base"]) == 0
    assert "lora-to-peft:" in capsys.readouterr().out
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["use_rslora"] == rslora
    assert conf["base_model_name_or_path"] == "tiny-base"
    base = DeepseekV3ForCausalLM.from_pretrained(_base_dir(tmp_path, m, flat), attn_implementation="eager").eval()
    peft_model = PeftModel.from_pretrained(base, out).eval()
    ids = _ids(m)
    got = _torch_logits(peft_model, ids)
    want = np.asarray(model(jnp.asarray(ids, jnp.int32)).logits)
    np.testing.assert_allclose(got, want, atol=TOL)


def test_orbax_to_hf_writes_the_merged_model(tmp_path):
    m = _model_cfg()
    model, flat, d = _lora_checkpoint(tmp_path, [*ATTENTION, "experts"])
    out = tmp_path / "hf"
    assert convert_main(["orbax-to-hf", str(d), str(out)]) == 0
    ids = _ids(m)
    got = _torch_logits(DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager").eval(), ids)
    np.testing.assert_allclose(got, np.asarray(model(jnp.asarray(ids, jnp.int32)).logits), atol=TOL)


def test_peft_bug_with_dense_mlp_and_shared_expert_targets_is_known(tmp_path, capsys):
    """peft <= 0.21.2 under transformers 5 rewrites gate_proj/up_proj/down_proj targets onto the
    routed experts (peft issue 3711): the export warns, and peft's model is NOT r1jax's. When a
    peft release fixes it, this test fails: then pin that release and turn it into a parity test."""
    import peft
    m = _model_cfg()
    model, flat, d = _lora_checkpoint(tmp_path, ["q_a_proj", "mlp", "shared_experts"])
    out = tmp_path / "peft"
    assert convert_main(["lora-to-peft", str(d), str(out)]) == 0
    assert "peft issue 3711" in capsys.readouterr().out
    base = DeepseekV3ForCausalLM.from_pretrained(_base_dir(tmp_path, m, flat), attn_implementation="eager").eval()
    ids = _ids(m)
    got = _torch_logits(PeftModel.from_pretrained(base, out).eval(), ids)
    want = np.asarray(model(jnp.asarray(ids, jnp.int32)).logits)
    assert peft.__version__ == "0.21.2"
    assert np.abs(got - want).max() > 0.1


def test_lora_to_peft_refuses_a_checkpoint_without_adapters(tmp_path, capsys):
    _, flat, d = _lora_checkpoint(tmp_path, ATTENTION)
    (d / ckpt.LORA_CONFIG).unlink()
    out = tmp_path / "out"
    assert convert_main(["lora-to-peft", str(d), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no LoRA adapters" in err[0]
    assert not out.exists()


def test_config_refuses_bad_lora_keys():
    for bad, says in ((["lora.rank=4", "lora.targets=[q_a_proj,wq_a]"], "'wq_a' is not a target"),
                      (["lora.rank=4", "lora.targets=[q_proj]"], "q_proj exists only with model.q_lora_rank=null"),
                      (["lora.rank=4", "lora.alpha=0"], "lora.alpha=0.0: must be > 0"),
                      (["lora.rank=-1"], "lora.rank=-1"),
                      (["lora.rank=4", "lora.dropout=0.1", "lora.targets=[o_proj,experts]"], "not with lora.targets experts")):
        with pytest.raises(configlib.ConfigError, match=says.replace("[", r"\[")):
            configlib.load(TINY, bad)


LORA_ALL = ["lora.rank=4", "lora.targets=[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,mlp,shared_experts,experts]",
            "lora.base_dtype=bf16", "optim.eps=1e-6", "optim.bias_update_rate=0"]


@pytest.fixture(scope="module")
def lora_reference():
    """3 fp32 steps of tiny.yaml with adapters everywhere, on 1 device, and the weights they start from."""
    cfg = configlib.load(TINY, LORA_ALL)
    model = weights.create(cfg.model, seed=cfg.train.seed, lora=cfg.lora)
    start = {p: np.asarray(v) for p, v in modellib.leaves(nnx.state(model)).items()}
    _, _, state, _, losses = train_tiny(LORA_ALL + ["mesh.data=1"], jax.devices()[:1], 3, model)
    return model, start, state, losses


@pytest.mark.slow
def test_training_moves_only_the_adapters(lora_reference):
    model, start, state, losses = lora_reference
    params = modellib.leaves(state["params"])
    assert params and all(loralib.is_lora(p) for p in params)               # only adapters are trainable
    # the optimizer's moments exist for the adapters alone
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(state["params"]))
    n_opt = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(state["opt"]) if a.ndim)
    assert n_opt == 2 * n_params
    rest = modellib.leaves(state["rest"])
    for p, v in rest.items():                                   # frozen, stored in bf16
        if p[-1] != "router_bias_E":
            assert v.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(v), start[p].astype(jnp.bfloat16), err_msg="/".join(map(str, p)))
    moved = [p for p, v in params.items() if p[-2] == "b" or p[-3] == "b"]
    assert all(np.abs(np.asarray(params[p])).max() > 0 for p in moved)     # every b left zero
    assert np.isfinite(losses).all()
    cfg = configlib.load(TINY, LORA_ALL)
    line = trainer.trainable_line(cfg, state)
    assert "LoRA rank 4" in line and "% of" in line and "frozen in bf16" in line


@pytest.mark.slow
def test_lora_on_a_3d_mesh_equals_one_device(lora_reference):
    model, _, ref_state, ref_losses = lora_reference
    _, _, state, _, losses = train_tiny(LORA_ALL + ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
                                        jax.devices()[:8], 3, model)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    want = modellib.leaves(ref_state["params"])
    for p, v in modellib.leaves(state["params"]).items():
        np.testing.assert_allclose(np.asarray(v), np.asarray(want[p]), atol=1e-5, err_msg="/".join(map(str, p)))


def test_dropout_drops_the_adapter_input_and_is_unbiased():
    """PEFT's lora_dropout: y = x W + scale * (drop(x) a) b, where drop zeroes each entry at rate p
    and scales the rest by 1 / (1 - p), one mask per module; the base projection sees x whole;
    no dropout outside a train step's context."""
    lo = configlib.LoraConfig(rank=4, alpha=8.0, targets=["mlp"], dropout=0.3)
    mlp = layers.MLP(16, 32, 0.1, jnp.float32, lo, "mlp", rngs=weights.rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 16)), jnp.float32)
    key = jax.random.key(5)
    with loralib.dropout(key, 0.3):
        kept = loralib.drop_input(jnp.ones((200, 100)), "gate_proj")
        fresh = mlp(x)                                          # b = 0: the adapters add nothing, dropped or not
    np.testing.assert_allclose(np.unique(np.asarray(kept)), [0.0, 1 / 0.7], rtol=1e-6)
    assert abs(float((kept == 0).mean()) - 0.3) < 0.01                      # 20,000 draws: std 0.0032
    np.testing.assert_array_equal(np.asarray(fresh), np.asarray(mlp(x)))
    mean = np.mean([np.asarray(_drop_with(jax.random.key(k), x)) for k in range(2000)], 0)
    # each entry's mean of 2,000 draws against its standard error |x| sqrt(p / (1 - p) / 2000):
    # at most 3.6 of them measured over the 256 entries; 5 allowed
    assert (np.abs(mean - np.asarray(x)) <= 5 * np.abs(np.asarray(x)) * (0.3 / 0.7 / 2000) ** 0.5).all()

    rng = np.random.default_rng(1)
    for adapter in mlp.lora.values():
        for w in adapter.b.values():
            w[...] = jnp.asarray(rng.normal(size=w.shape) * 0.5, jnp.float32)
    gate = mlp.lora["gate_proj"]
    with loralib.dropout(key, 0.3):
        got = loralib.project(mlp, x, "gate_DF", layers.dense, layers.cast, target="gate_proj")
        dropped = loralib.drop_input(x, "gate_proj")
        again = mlp(x)
        with loralib.dropout(None, 0.3):
            clean = mlp(x)
    want = x @ mlp.gate_DF[...] + lo.scale * (dropped @ gate.a[...]) @ gate.b["gate_DF"][...]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=0)   # measured: equal
    with loralib.dropout(key, 0.3):
        np.testing.assert_array_equal(np.asarray(mlp(x)), np.asarray(again))    # the same key, the same masks
    with loralib.dropout(jax.random.key(6), 0.3):
        assert np.abs(np.asarray(mlp(x)) - np.asarray(again)).max() > 1e-2
    assert np.abs(np.asarray(again) - np.asarray(clean)).max() > 1e-2
    np.testing.assert_array_equal(np.asarray(clean), np.asarray(mlp(x)))


def _drop_with(key, x):
    with loralib.dropout(key, 0.3):
        return loralib.drop_input(x, "up_proj")


LORA_DROPOUT = ["lora.rank=4", "lora.targets=[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,mlp,shared_experts]",
                "optim.eps=1e-6", "optim.bias_update_rate=0"]


@pytest.mark.slow
def test_dropout_trains_reproducibly_and_equals_one_device_on_a_3d_mesh():
    """lora.dropout=0.2: a row's masks come from train.seed, the step and the row's number in the
    step's batch, so two runs agree exactly, and 8 fake devices on (data 2, fsdp 2, tensor 2)
    with grad_accum 2 under remat full, and the MoE stack pipelined over 2 stages (GPipe on data 4, 1F1B on data 2 x
    tensor 2, each stage drawing its layers' masks) all give 1 device's steps; the run differs
    from one without dropout once the adapters are non-zero (after step 1)."""
    cfg = configlib.load(TINY, LORA_DROPOUT)
    model = weights.create(cfg.model, seed=cfg.train.seed, lora=cfg.lora)
    runs = {}
    drop = ["lora.dropout=0.2"]
    pipe = [*drop, "mesh.pipeline=2", "train.microbatches=2"]
    for name, extra, devs in (("off", ["lora.dropout=0", "mesh.data=1"], 1), ("one", [*drop, "mesh.data=1"], 1),
                              ("again", [*drop, "mesh.data=1"], 1),
                              ("3d", [*drop, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.grad_accum=2",
                                      "train.remat=full"], 8),
                              # (remat full: the stage's backward recomputes each layer with the
                              # dropout context its forward had, accumulate.scan_into)
                              ("gpipe", [*pipe, "mesh.data=4", "train.remat=full"], 8),
                              ("1f1b", [*pipe, "mesh.data=2", "mesh.tensor=2", "pipeline.schedule=1f1b"], 8)):
        _, _, state, _, losses = train_tiny(LORA_DROPOUT + extra, jax.devices()[:devs], 3, model)
        runs[name] = (losses, modellib.leaves(state["params"]))
    assert runs["one"][0][0] == runs["off"][0][0]          # step 0: b = 0, dropout changes no output
    assert abs(runs["one"][0][2] - runs["off"][0][2]) > 1e-6
    assert runs["again"][0] == runs["one"][0]
    for p, v in runs["one"][1].items():
        np.testing.assert_array_equal(np.asarray(runs["again"][1][p]), np.asarray(v))
    # the 3-D mesh test's tolerances above; measured (losses relative, weights absolute): 3d 4.7e-7 /
    # 1.5e-7 (grad_accum 2 on one device alone: 3.6e-7 / 5.2e-8), GPipe 4.7e-7 / 9.7e-8, 1F1B 3.5e-7 / 8.3e-8
    for name in ("3d", "gpipe", "1f1b"):
        np.testing.assert_allclose(runs[name][0], runs["one"][0], rtol=1e-5, err_msg=name)
        for p, v in runs[name][1].items():
            np.testing.assert_allclose(np.asarray(v), np.asarray(runs["one"][1][p]), atol=1e-5,
                                       err_msg=f"{name} {'/'.join(map(str, p))}")


# DeepSeek's template keeps only what follows </think> in an assistant turn (written here from
# its documented behaviour, shortened); SFT must not train through it (data/sft.py)
STRIPPING_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
                      "{% elif m['role'] == 'assistant' %}{% set c = m['content'] %}{% if '</think>' in c %}"
                      "{% set c = c.split('</think>')[-1] %}{% endif %}<｜Assistant｜>{{ c }}{{ eos_token }}{% endif %}"
                      "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")


def _hf_checkpoint(d, m):
    """A tiny HF DeepseekV3 directory with a tokenizer (R1's chat markers single tokens) and
    DeepSeek's kind of chat template."""
    from r1jax.data import chat
    from r1jax.data import tokenizer as toklib
    hf_ref.hf_model(0, num_nextn_predict_layers=0).save_pretrained(d)
    texts = [f"what is {a} plus {b}? {a + b}" for a in range(30) for b in range(10)]
    toklib.train(texts, m.vocab_size, chat.MARKERS, chat.THINK).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": STRIPPING_TEMPLATE,
                                                         "bos_token": chat.BOS, "eos_token": chat.EOS}))


@pytest.mark.slow
def test_lora_yaml_fine_tunes_an_hf_checkpoint_and_exports_it(tmp_path):
    """configs/lora.yaml as its first line runs it (no architecture keys; the HF directory gives the
    model, weights, tokenizer and template), on chat records: its
    checkpoint exports to PEFT, which peft loads over the original HF directory with the logits of
    the merged export; restarting with other LoRA settings is refused in one line."""
    m = _model_cfg()
    src = tmp_path / "hf_src"
    _hf_checkpoint(src, m)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"what is {a} plus {b}?"},
        {"role": "assistant", "content": f"<think>\n{a} plus {b}\n</think>\n\n{a + b}"}]}) + "\n"
        for a in range(12) for b in range(8)))
    run = tmp_path / "run"
    over = [f"model.hf_config={src}", f"model.init_from=hf:{src}", f"data.paths=[{data}]", "data.seq_len=64",
            "train.steps=3", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "lora.rank=2",
            "optim.lr=1e-2"]
    cfg = configlib.load(ROOT / "configs" / "lora.yaml", over)
    final = trainer.train(cfg, run)
    assert np.isfinite(final["loss"])
    ck = run / "checkpoints"
    assert json.loads((ck / ckpt.LORA_CONFIG).read_text())["rank"] == 2
    assert (run / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    assert convert_main(["lora-to-peft", str(ck), str(tmp_path / "peft")]) == 0
    assert convert_main(["orbax-to-hf", str(ck), str(tmp_path / "merged")]) == 0
    ids = _ids(m)
    base = DeepseekV3ForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
    before = _torch_logits(base, ids)
    got = _torch_logits(PeftModel.from_pretrained(base, tmp_path / "peft").eval(), ids)
    merged = _torch_logits(DeepseekV3ForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager"
                                                                 ).eval(), ids)
    assert np.abs(got - before).max() > 1e-3                  # the adapters trained
    np.testing.assert_allclose(got, merged, atol=TOL)
    with pytest.raises(configlib.ConfigError, match="resume with the same lora settings"):
        trainer.train(configlib.load(ROOT / "configs" / "lora.yaml", [*over, "train.steps=4", "lora.rank=4"]), run)
    shutil.rmtree(run)

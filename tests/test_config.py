"""Configs: YAML + dotted overrides, HF config.json in both spellings, and bad input rejected
with one line naming the key and exit code 2 before anything compiles."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from r1jax import config as configlib
from r1jax.config import ConfigError, DType, RopeType
from r1jax.train.__main__ import main as train_main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")

BAD = {
    "unknown key": (["model.hiden_size=64"], "model.hiden_size: unknown key; did you mean hidden_size?"),
    "unknown section": (["trainer.steps=3"], "trainer"),
    "wrong type": (["train.steps=many"], "train.steps"),
    "float for int": (["model.hidden_size=64.5"], "model.hidden_size"),
    "bad enum": (["train.dtype=fp8"], "train.dtype"),
    "experts not divisible by groups": (["model.n_routed_experts=10", "model.n_group=4"], "model.n_routed_experts"),
    "top-k beyond kept groups": (["model.num_experts_per_tok=5"], "model.num_experts_per_tok"),
    "topk_group above n_group": (["model.topk_group=3"], "model.topk_group"),
    "heads not divisible by tensor": (["mesh.tensor=3"], "mesh.tensor"),
    "experts not divisible by expert axis": (["mesh.expert=3"], "mesh.expert"),
    "kv heads differ": (["model.num_key_value_heads=2"], "model.num_key_value_heads"),
    "odd rope dim": (["model.qk_rope_head_dim=7"], "model.qk_rope_head_dim"),
    "seq_len beyond positions": (["data.seq_len=4096"], "data.seq_len"),
    "batch not divisible by shards": (["mesh.data=3"], "train.global_batch_size"),
    "two free mesh axes": (["mesh.fsdp=-1"], "mesh"),
    "latent not divisible by fsdp x pipeline": (["mesh.data=1", "mesh.fsdp=2", "mesh.pipeline=4", "model.q_lora_rank=36"],
                                               "mesh.fsdp x mesh.pipeline = 8: must divide model.q_lora_rank (36)"),
    "negative lr": (["optim.lr=-1"], "optim.lr"),
    "fp16 Adam moments": (["optim.moment_dtype=fp16"], "optim.moment_dtype=fp16: must be fp32 or bf16"),
    "zero attention block": (["kernels.attention_block=0"], "kernels.attention_block=0: must be a positive integer"),
    "FP8 exchange without an exchange that sends rows": (
        ["kernels.moe_exchange_fp8=true"], "kernels.moe_exchange_fp8=true: only for moe_dispatch=alltoall or hierarchical"),
    "hierarchical nodes not dividing the expert axis": (
        ["mesh.data=2", "mesh.expert=4", "kernels.moe_dispatch=hierarchical", "kernels.moe_nodes=3"],
        "kernels.moe_nodes=3: must divide mesh.expert (4)"),
    "epilogue chunks not dividing a device's rows": (["mesh.data=4", "train.epilogue_chunks=4"],
                                                     "train.epilogue_chunks=4: each of the 1 microbatches"),
    "epilogue chunks under 1f1b": (["mesh.data=1", "mesh.pipeline=2", "train.microbatches=2", "pipeline.schedule=1f1b",
                                    "train.epilogue_chunks=2"], "train.epilogue_chunks=2: pipeline.schedule=1f1b"),
    "inference-only dispatch for training": (["kernels.moe_dispatch=grouped"],
                                             "kernels.moe_dispatch=grouped: inference only"),
    "zero steps": (["train.steps=0"], "train.steps"),
    "text source without paths": (["data.source=text"], "data.paths"),
    "dense prefix beyond depth": (["model.first_k_dense_replace=9"], "model.first_k_dense_replace"),
    "override without =": (["train.steps"], "train.steps"),
    "mesh product differs from devices": (["mesh.data=2", "mesh.tensor=2"], "mesh"),
    "kernel key in the model section": (["model.moe_dispatch=dropless"],
                                        "model.moe_dispatch: moved to kernels.moe_dispatch"),
    "loss key in the model section": (["model.mtp_loss_weight=0.5"], "model.mtp_loss_weight: moved to loss.mtp_loss_weight"),
    "bias rate in the model section": (["model.bias_update_rate=0"],
                                       "model.bias_update_rate: moved to optim.bias_update_rate"),
    "unknown objective": (["loss.objective=dpo"], "loss.objective"),
    "routing replay without MoE": (["loss.objective=grpo", "grpo.task=reverse", "grpo.routing_replay=true",
                                    "model.first_k_dense_replace=3"], "grpo.routing_replay=true: the model has no MoE"),
    "resampling without dynamic sampling": (["loss.objective=grpo", "grpo.resample_rounds=2"],
                                            "grpo.resample_rounds=2: replaces the groups dynamic sampling drops"),
    "loss target without evals": (["train.stop_at_eval_loss=0.5"], "train.stop_at_eval_loss=0.5: needs evals during the run"),
    "loss target for grpo": (["loss.objective=grpo", "train.stop_at_eval_loss=0.5", "train.eval_every=10"],
                             "train.stop_at_eval_loss: GRPO's evals score rewards"),
    "task difficulty without a task": (["data.task_difficulty.digits=3"],
                                       "data.task_difficulty: only used with data.source=task"),
    "task difficulty the task lacks": (["loss.objective=sft", "data.source=task", "data.task_difficulty.bits=3"],
                                       "data.task_difficulty={'bits': 3}: reverse: unknown difficulty bits; known: digits"),
    "grpo difficulty out of range": (["loss.objective=grpo", "grpo.task_difficulty.digits=[5,3]"],
                                     "grpo.task_difficulty={'digits': [5, 3]}: digits: want an int >= 1 or a range"),
    "grpo difficulty too small for the eval": (["loss.objective=grpo", "grpo.task_difficulty.digits=1"],
                                               "eval split has too few distinct problems"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_is_one_line_and_exit_2(case, capsys, tmp_path):
    overrides, key = BAD[case]
    rc = train_main(["--config", TINY, "--run-dir", str(tmp_path / "run"), *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1, err
    assert key in err[0], err[0]
    assert not (tmp_path / "run" / "checkpoints").exists()
    print(f"\n{case}: {err[0]}")


@pytest.mark.parametrize("text,key", [("model: [1, 2", "not valid YAML"), ("- a\n- b\n", "top level"),
                                      ("model:\n  attention: flash\n", "model.attention: moved to kernels.attention")])
def test_bad_yaml_file(text, key, tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    assert train_main(["--config", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0]


def test_missing_config_file_exits_2_from_the_real_cli(tmp_path):
    r = subprocess.run([sys.executable, "-m", "r1jax.train", "--config", str(tmp_path / "nope.yaml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"config error: --config {tmp_path / 'nope.yaml'}: no such file"]


def test_real_cli_unknown_key(tmp_path):
    r = subprocess.run([sys.executable, "-m", "r1jax.train", "--config", TINY, "optim.learning_rate=1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "optim.learning_rate: unknown key; allowed: lr, min_lr_ratio" in lines[0]


def test_overrides_and_types():
    cfg = configlib.load(TINY, ["train.dtype=bf16", "model.q_lora_rank=null", "train.steps=7",
                                "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4"])
    assert cfg.train.dtype is DType.bf16 and cfg.model.q_lora_rank is None and cfg.train.steps == 7
    assert cfg.model.rope_scaling.type is RopeType.yarn and cfg.model.rope_scaling.factor == 4.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 3  # type: ignore[misc]
    again = configlib.from_dict(configlib.to_dict(cfg))
    assert again == cfg


@pytest.mark.parametrize("name", ["tiny", "demo", "deepseek_v3_671b"])
def test_shipped_configs_load_and_name_their_command(name):
    path = ROOT / "configs" / f"{name}.yaml"
    configlib.load(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# python -m r1jax.train --config configs/") and f"{name}.yaml" in first


OFFICIAL_4X = {  # official DeepSeek-V3 config.json spelling (transformers 4.x): rope_scaling + rope_theta
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
    "rope_theta": 10000, "max_position_embeddings": 163840, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
HF_5X = {  # what transformers 5.x save_pretrained writes: rope_parameters with rope_theta inside
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
    "max_position_embeddings": 163840, "num_mtp_layers": 1, "q_lora_rank": 1536, "head_dim": 64,
    "rope_parameters": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                        "original_max_position_embeddings": 4096, "rope_theta": 10000, "rope_type": "yarn",
                        "type": "yarn"},
}


def test_hf_config_json_both_spellings(tmp_path):
    cfgs = []
    for i, d in enumerate((OFFICIAL_4X, HF_5X)):
        p = tmp_path / f"c{i}" / "config.json"
        p.parent.mkdir()
        p.write_text(json.dumps(d))
        cfgs.append(configlib.model_from_dict(configlib.model_dict_from_hf(p.parent)))
    assert cfgs[0] == cfgs[1]
    assert cfgs[0].rope_scaling.type is RopeType.yarn and cfgs[0].rope_scaling.factor == 40.0
    assert cfgs[0].rope_theta == 10000.0 and cfgs[0].num_nextn_predict_layers == 1


def test_model_from_hf_config_with_overrides(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(HF_5X))
    cfg = configlib.load(None, [f"model.hf_config={p}", "model.num_hidden_layers=4",
                                "model.first_k_dense_replace=1", "data.seq_len=128"])
    assert cfg.model.hidden_size == 7168 and cfg.model.num_hidden_layers == 4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**HF_5X, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="model.hf_config: model_type 'llama'"):
        configlib.load(None, [f"model.hf_config={bad}"])


def test_mesh_resolution():
    m = configlib.MeshConfig(data=-1, tensor=2)
    assert configlib.resolve_mesh_shape(m, 8) == {"data": 4, "fsdp": 1, "tensor": 2, "expert": 1, "pipeline": 1}
    with pytest.raises(ConfigError, match="mesh.data=-1"):
        configlib.resolve_mesh_shape(configlib.MeshConfig(data=-1, tensor=3), 8)

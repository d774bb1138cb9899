"""Logit distillation (loss.objective=kd, train/objectives.LogitKD): the three divergences and the
whole loss against NumPy formulas (TRL GKD's generalised JSD convention), masked to the chat
records' assistant tokens; and whole runs: a student that starts as its teacher has zero KD loss
(the teacher's logits reach the step aligned with the batch), a smaller fresh student's KD loss
falls, and a teacher with another vocabulary is refused in one line."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from r1jax import config as configlib
from r1jax.config import KDLoss
from r1jax.model import Output
from r1jax.train import trainer
from r1jax.train.objectives import LogitKD, divergence
from runs import TINY


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl(p_log, q_log):
    return (np.exp(p_log) * (p_log - q_log)).sum(-1)


def _numpy_divergence(s_log, t_log, kind, beta):
    if kind == "forward_kl":
        return _kl(t_log, s_log)
    if kind == "reverse_kl":
        return _kl(s_log, t_log)
    m = np.log(beta * np.exp(t_log) + (1 - beta) * np.exp(s_log))
    return beta * _kl(t_log, m) + (1 - beta) * _kl(s_log, m)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_divergences_equal_numpy(kind):
    rng = np.random.default_rng(0)
    s, t = _log_softmax(rng.normal(size=(3, 5, 17)) * 2), _log_softmax(rng.normal(size=(3, 5, 17)) * 2)
    got = np.asarray(divergence(jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32), KDLoss(kind), 0.3))
    np.testing.assert_allclose(got, _numpy_divergence(s, t, kind, 0.3), rtol=1e-5, atol=1e-7)
    assert (got >= -1e-7).all()
    if kind == "jsd":     # the generalised JSD tends to the forward / reverse KL (scaled) at its ends
        near0 = np.asarray(divergence(jnp.asarray(s), jnp.asarray(t), KDLoss.jsd, 1e-4)) / 1e-4
        np.testing.assert_allclose(near0, _kl(t, s), rtol=2e-2)


@pytest.mark.parametrize("kind,T,alpha", [("forward_kl", 2.0, 1.0), ("reverse_kl", 1.0, 0.7), ("jsd", 0.5, 0.5)])
def test_kd_loss_equals_numpy_on_the_completion_tokens(kind, T, alpha):
    rng = np.random.default_rng(1)
    B, L, W = 2, 9, 13
    ids = rng.integers(0, W, (B, L)).astype(np.int32)
    seg = np.array([[1] * 5 + [2] * 4, [1] * 7 + [0] * 2], np.int32)
    mask = np.array([[0, 0, 1, 1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 0, 0]], np.int32)
    s_logits, t_logits = rng.normal(size=(B, L, W)) * 3, rng.normal(size=(B, L, W)) * 3
    obj = LogitKD(KDLoss(kind), T, 0.4, alpha)
    batch = {"ids": ids, "segment_ids": seg, "loss_mask": mask, "teacher_logits": jnp.asarray(t_logits, jnp.float32)}
    loss, n, metrics = obj(Output(jnp.asarray(s_logits, jnp.float32), None, {}), batch)
    # position t counts when token t+1 is a completion token of t's own segment
    valid = np.zeros((B, L), bool)
    valid[:, :-1] = (mask[:, 1:] == 1) & (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] != 0)
    d = _numpy_divergence(_log_softmax(s_logits / T), _log_softmax(t_logits / T), kind, 0.4)
    ce = -np.take_along_axis(_log_softmax(s_logits), np.roll(ids, -1, 1)[..., None], -1)[..., 0]
    want = alpha * T * T * d[valid].sum() + (1 - alpha) * ce[valid].sum()
    assert float(n) == valid.sum() == float(obj.tokens(batch))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["kd_loss"][0]), d[valid].sum(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["lm_loss"][0]), ce[valid].sum(), rtol=1e-5)


def _chat(path):
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"reverse {a}{b}{c}"},
        {"role": "assistant", "content": f"<think>\nreverse\n</think>\n<answer>\n{c}{b}{a}\n</answer>"}]}) + "\n"
        for a in range(10) for b in range(5) for c in range(4)))
    return path


CHAT = ["loss.objective=sft", "data.source=jsonl", "data.seq_len=64", "train.log_every=1", "train.eval_batches=1",
        "optim.bias_update_rate=0", "loss.mtp_loss_weight=0"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    d = tmp_path_factory.mktemp("kd")
    data = _chat(d / "chat.jsonl")
    run = d / "teacher"
    trainer.train(configlib.load(TINY, [*CHAT, f"data.paths=[{data}]", "train.steps=6"]), run)
    return data, run


def _kd(run, data, teacher_run, extra):
    cfg = configlib.load(TINY, [*CHAT, f"data.paths=[{data}]", "loss.objective=kd",
                                f"distill.teacher=orbax:{teacher_run / 'checkpoints'}", *extra])
    trainer.train(cfg, run)
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "kd_loss" in r
            and r.get("split") != "eval"]


@pytest.mark.slow
def test_a_student_that_is_its_teacher_has_zero_kd_loss(teacher, tmp_path):
    data, run = teacher
    recs = _kd(tmp_path / "s", data, run, ["train.steps=1", f"model.init_from=orbax:{run / 'checkpoints'}",
                                           "distill.temperature=2"])
    assert recs[0]["kd_loss"] < 1e-6 and recs[0]["lm_loss"] > 0.1


@pytest.mark.slow
def test_a_smaller_student_learns_the_teacher(teacher, tmp_path):
    data, run = teacher
    recs = _kd(tmp_path / "s", data, run, ["train.steps=12", "model.num_hidden_layers=2", "optim.lr=1e-2"])
    first, last = recs[0]["kd_loss"], recs[-1]["kd_loss"]
    assert last < 0.5 * first, (first, last)
    # tokenizer: the teacher run's, found through distill.teacher
    assert (tmp_path / "s" / "tokenizer.json").read_text() == (run / "tokenizer.json").read_text()


@pytest.mark.slow
def test_a_teacher_with_another_vocabulary_is_refused(teacher, tmp_path):
    data, run = teacher
    with pytest.raises(configlib.ConfigError, match="same vocabulary"):
        _kd(tmp_path / "s", data, run, ["train.steps=1", "model.vocab_size=600", "data.tokenizer_train_mb=0.1"])

"""A run's records survive its processes, and the rough edges a new user hit stay fixed.

One tiny.yaml run (1 device) is killed (SIGKILL, past its last checkpoint, so the next process
logs some steps again), resumed and preempted (SIGTERM), resumed to the end, then started once
more on the finished run. On it: metrics.jsonl keeps every process's records; final.json and the
loss curves come from the whole run, one record per step; the last line prints the train
next-token loss beside the eval loss; the ETA after a resume leaves the compiling step out; the
CPU peak MFU divides by is measured once per host and said to be approximate. Beside it:
`orbax-to-hf` of a truncated checkpoint (one line, nothing left in DST), the tokenizer that goes
with an export, and a JSONL corpus without `data.text_field`'s key."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from r1jax import config as configlib
from r1jax.config import DataConfig, DataSource
from r1jax.data.sources import open_corpus
from r1jax.train import metrics as metricslib
from r1jax.train import mfu

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
STEPS = 24
# the first two processes are stopped by signals long before train.steps; the third ends the run
ARGS = ["train.log_every=1", "checkpoint.every=4", "train.eval_every=8", "train.eval_batches=1"]


def _train(run: Path, steps: int, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "r1jax.train", "--config", str(TINY), "--run-dir", str(run),
                             f"train.steps={steps}", *ARGS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _train_steps(run: Path) -> list[int]:
    """The train steps metrics.jsonl holds, in the order written (a line being written is skipped)."""
    path = run / "metrics.jsonl"
    return [r["step"] for r in metricslib.read_records(path)[0] if "split" not in r] if path.is_file() else []


def _committed(run: Path) -> list[int]:
    d = run / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def _pause_when(proc: subprocess.Popen, ready, timeout: float = 300) -> None:
    """SIGSTOP `proc` at a moment `ready()` holds (checked again while it is stopped)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if ready():
            proc.send_signal(signal.SIGSTOP)
            if ready():
                return
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the run never got there")


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    base = tmp_path_factory.mktemp("records")
    run = base / "run"
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1", "XDG_CACHE_HOME": str(base / "cache")}
    t0 = time.time()
    # 1. killed with steps logged after its last checkpoint (a later process logs them again)
    a = _train(run, 1000, env)
    _pause_when(a, lambda: len(_train_steps(run)) >= 6 and _committed(run)
                and max(_train_steps(run)) > max(_committed(run)))
    logged_a, ckpt_a = max(_train_steps(run)), max(_committed(run))
    a.kill()
    a.communicate()
    took = [time.time() - t0]
    # 2. resumed, then preempted the way SLURM does it
    n_a = len(_train_steps(run))
    b = _train(run, 1000, env)
    _pause_when(b, lambda: len(_train_steps(run)) >= n_a + 2)
    b.send_signal(signal.SIGTERM)
    b.send_signal(signal.SIGCONT)
    out_b, err_b = b.communicate(timeout=300)
    assert b.returncode == 0 and "preempted at step" in out_b, err_b[-3000:]
    took.append(time.time() - t0 - sum(took))
    # 3. resumed to the end
    c = _train(run, STEPS, env)
    out_c, err_c = c.communicate(timeout=300)
    assert c.returncode == 0, err_c[-3000:]
    took.append(time.time() - t0 - sum(took))
    files = {n: (run / n).read_bytes() for n in ("final.json", "loss.png", "metrics.jsonl")}
    # 4. the same command on the finished run
    d = _train(run, STEPS, env)
    out_d, err_d = d.communicate(timeout=300)
    took.append(time.time() - t0 - sum(took))
    print(f"\nkilled after logging step {logged_a} (checkpoint {ckpt_a}); "
          f"{next(l for l in out_b.splitlines() if 'preempted' in l)}; processes took "
          f"{', '.join(f'{t:.0f}' for t in took)} s")
    return dict(run=run, base=base, logged_a=logged_a, ckpt_a=ckpt_a, out_c=out_c, files=files,
                rc_d=d.returncode, out_d=out_d, err_d=err_d)


def test_metrics_jsonl_keeps_every_process_and_final_json_the_whole_run(story):
    run = story["run"]
    steps = _train_steps(run)
    again = list(range(story["ckpt_a"] + 1, story["logged_a"] + 1))
    assert again and all(steps.count(s) == 2 for s in again)           # logged by the killed run and again
    assert sorted(set(steps)) == list(range(1, STEPS + 1))
    records, events = metricslib.read_records(run / "metrics.jsonl")
    train = metricslib.per_step(records, "train")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    last_of = {}
    for r in records:
        if "split" not in r:
            last_of[r["step"]] = r
    assert train == [last_of[s] for s in range(1, STEPS + 1)]        # the later record of a step logged twice
    assert [r["step"] for r in metricslib.per_step(records, "eval")] == [8, 16, 24]
    final = json.loads((run / "final.json").read_text())
    assert final["step"] == STEPS and final["stopped"] is None
    assert final["lm_loss"] == last_of[STEPS]["lm_loss"] and final["loss"] == last_of[STEPS]["loss"]
    assert final["eval_loss"] == [r for r in records if r.get("split") == "eval"][-1]["loss"]


def test_the_plot_draws_every_step_of_the_run(story, tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.axes import Axes
    drawn = {}
    real_plot = Axes.plot

    def plot(self, x, y, *a, label=None, **kw):
        drawn[label] = list(x)
        return real_plot(self, x, y, *a, label=label, **kw)
    monkeypatch.setattr(Axes, "plot", plot)
    shutil.copy(story["run"] / "metrics.jsonl", tmp_path / "metrics.jsonl")
    w = metricslib.MetricsWriter(tmp_path, STEPS)
    w.plot(tmp_path / "loss.png")
    w.close()
    assert drawn["train next-token loss"] == list(range(1, STEPS + 1))
    assert drawn["train MTP loss"] == list(range(1, STEPS + 1))
    assert drawn["eval loss"] == [8, 16, 24]
    assert (tmp_path / "loss.png").stat().st_size > 10_000


def test_starting_a_finished_run_again_changes_nothing(story):
    assert story["rc_d"] == 0, story["err_d"][-3000:]
    assert "already complete" in story["out_d"]
    for name, data in story["files"].items():
        assert (story["run"] / name).read_bytes() == data, name


def test_the_last_line_compares_next_token_losses(story):
    final = json.loads((story["run"] / "final.json").read_text())
    line = next(l for l in story["out_c"].splitlines() if l.startswith("final "))
    assert line == (f"final next-token loss: train {final['lm_loss']:.4f} (last logged steps), eval "
                    f"{final['eval_loss']:.4f} (held-out, perplexity {final['eval_perplexity']:.2f}); objective "
                    f"with 0.3 x MTP + 0.0001 x balance loss: {final['loss']:.4f}")


def test_result_line_per_objective():
    from r1jax.train.__main__ import result_line
    lm = configlib.load(TINY, [])
    final = {"loss": 5.8246, "lm_loss": 5.0911, "mtp_loss": 5.31, "balance_loss": 3.0, "eval_loss": 5.0092,
             "eval_perplexity": 149.8}
    assert result_line(final, lm) == (
        "final next-token loss: train 5.0911 (last logged steps), eval 5.0092 (held-out, perplexity 149.80); "
        "objective with 0.3 x MTP + 0.0001 x balance loss: 5.8246")
    plain = {"loss": 4.0, "lm_loss": 4.0, "eval_loss": 4.1, "eval_perplexity": 60.3}
    assert result_line(plain, lm) == "final next-token loss: train 4.0000 (last logged steps), eval 4.1000 " \
        "(held-out, perplexity 60.30)"
    grpo = configlib.load(ROOT / "configs" / "r1_grpo.yaml", [])
    assert result_line({"loss": 0.1, "lm_loss": 9.0, "eval_reward_mean": 0.25}, grpo) == \
        "final loss 0.1000 (eval reward_mean 0.2500)"


def test_eta_after_a_resume_leaves_the_compiling_step_out(story, monkeypatch, capsys):
    # in the real resumed run: no estimate at the first step, numbers after it
    out = story["out_c"].splitlines()
    resumed = next(i for i, l in enumerate(out) if l.startswith("resumed from"))
    lines = [l for l in out[resumed:] if l.startswith("step ")]
    assert lines[0].endswith("eta ?") and all(l.rsplit("eta ", 1)[1].endswith("s") for l in lines[1:])
    assert all(" | mfu ~" in l for l in lines[1:])                      # approximate on CPU
    assert "tok/s" not in lines[0] and "mfu" not in lines[0]          # a window of only the compiling step
    # the arithmetic, on a clock: 40 s compiling the first step after resuming at 100, then 0.5 s a step
    now = [1000.0]
    monkeypatch.setattr(metricslib, "time", SimpleNamespace(time=lambda: now[0]))
    p = metricslib.Progress(total=200, start=100)
    vals = {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0, "mfu": 0.5}
    now[0] += 40.0
    p.update(101, None)
    p.log(101, vals)
    for s in range(102, 111):
        now[0] += 0.5
        p.update(s, None)
    p.log(110, vals)
    first, tenth = capsys.readouterr().out.splitlines()
    assert first.endswith("eta ?") and tenth.endswith("eta 45s")       # 0.5 s x 90 steps left
    now[0] += 0.5                                                      # a rollback to step 104 restarts the clock
    p.update(105, None)
    assert p.eta(105) is None


def test_cpu_peak_is_measured_once_per_host_and_said_to_be_approximate(story, tmp_path, monkeypatch):
    import jax
    from r1jax.config import DType
    # the run's four processes: the first measured, the others read the cache
    table = json.loads((story["base"] / "cache" / "r1jax" / "cpu_peak.json").read_text())
    (key, entry), = table.items()
    assert f"jax {jax.__version__}" in key and "cores" in key
    final = json.loads((story["run"] / "final.json").read_text())
    assert final["mfu_peak_flops"] == entry["flops"] and final["mfu_peak"].startswith("approximate")
    # in process, with the measurement counted
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls, measure = [], mfu.measured_cpu_peak
    monkeypatch.setattr(mfu, "measured_cpu_peak", lambda: calls.append(1) or 1e11 * len(calls))
    first = mfu.peak_flops(jax.devices(), DType.fp32)
    assert mfu.peak_flops(jax.devices(), DType.fp32) == first and first[0] == 1e11 and len(calls) == 1
    (tmp_path / "r1jax" / "cpu_peak.json").write_text("{not json")      # a broken cache costs a measurement
    assert mfu.peak_flops(jax.devices(), DType.fp32)[0] == 2e11
    assert measure(trials=2, seconds=0.01) > 1e8


def test_truncated_checkpoint_export_leaves_nothing_and_says_what(story, tmp_path, capsys):
    from r1jax.convert.__main__ import main as convert_main
    src = tmp_path / "ckpts"
    shutil.copytree(story["run"] / "checkpoints", src)
    data = max((p for p in (src / str(STEPS) / "params").rglob("*") if p.parent.name == "d"),
               key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    new = tmp_path / "out" / "hf"                       # neither it nor its parent exists
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    for dst, extra in ((new, []), (kept, ["--force"])):
        capsys.readouterr()
        assert convert_main(["orbax-to-hf", str(src), str(dst), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {src} step {STEPS}: parameter "), err
        assert "truncated or corrupted" in err[0] and f"nothing was written to {dst}" in err[0]
    assert not (tmp_path / "out").exists()
    assert [p.name for p in kept.iterdir()] == ["notes.txt"] and (kept / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpts", "kept"]          # no staging left behind


def test_export_carries_the_runs_tokenizer(story, tmp_path):
    from r1jax.convert.__main__ import main as convert_main
    run = story["run"]
    assert convert_main(["orbax-to-hf", str(run / "checkpoints"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "hf").iterdir()}


def test_export_carries_the_chat_template_the_run_trained_with(tmp_path):
    from r1jax.convert import output
    hf_tok = tmp_path / "hf_tok"
    hf_tok.mkdir()
    (hf_tok / "tokenizer.json").write_text("{}")
    (hf_tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "tokenizer.json").write_text('{"the": "run\'s"}')
    (run / "config.yaml").write_text(f"data:\n  tokenizer: {hf_tok}\n")
    out = tmp_path / "out"
    out.mkdir()
    assert output.copy_tokenizer(run / "checkpoints", out) == ["tokenizer.json", "tokenizer_config.json"]
    assert (out / "tokenizer.json").read_text() == '{"the": "run\'s"}'
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == "{{ messages }}"
    # a checkpoint directory that is no run's, with nothing beside it, copies nothing
    assert output.copy_tokenizer(hf_tok.parent / "nowhere", out) == []


def test_jsonl_without_the_text_field_names_it(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"body": "some text", "id": 1}) + "\n")
    with pytest.raises(configlib.ConfigError) as e:
        open_corpus(DataConfig(source=DataSource.jsonl, paths=[str(path)]))
    assert str(e.value).endswith(f"1 bad (first: {path}:1: no \"text\" key (data.text_field=text); "
                                 f"its keys: body, id)")
    # the user's command line says which key to name instead
    from r1jax.train.__main__ import main as train_main
    assert train_main(["--config", str(TINY), "--run-dir", str(tmp_path / "run"), "data.source=jsonl",
                       f"data.paths=[{path}]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.text_field=text" in err[0] and "its keys: body, id" in err[0]
    c = open_corpus(DataConfig(source=DataSource.jsonl, paths=[str(path)], text_field="body"))
    assert c[0] == "some text"


def test_records_survive_a_line_cut_short_and_name_each_steps_last(tmp_path):
    lines = [{"step": s, "loss": 10.0 - s, "lm_loss": 9.0 - s} for s in range(1, 7)]        # process 1: to 6
    lines += [{"step": 4, "split": "eval", "loss": 7.5}]
    lines += [{"step": s, "loss": 20.0 + s, "lm_loss": 19.0 + s} for s in (5, 6, 7)]        # process 2 from 4
    lines += [{"step": 7, "event": "spike", "ratio": 9.0}, {"step": 8, "event": "rollback", "to_step": 4}]
    lines += [{"step": 5, "loss": 30.0, "lm_loss": 29.0}]                                   # after the rollback
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 6, "loss": 3'          # killed mid-line
    (tmp_path / "metrics.jsonl").write_text(text)
    w = metricslib.MetricsWriter(tmp_path, 10)
    assert [e["event"] for e in w.events] == ["spike", "rollback"]
    assert [(r["step"], r["loss"]) for r in w.series()] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 30.0)]
    assert [r["step"] for r in w.series("eval")] == [4]
    w.write(6, {"loss": 31.0, "lm_loss": 30.0})
    w.write(6, {"loss": 4.2}, prefix="eval")
    w.event(6, "alert", {"what": "test"})
    assert w.last() == {"step": 6, "loss": 31.0, "lm_loss": 30.0}
    assert w.last("eval") == {"step": 6, "split": "eval", "loss": 4.2}
    assert w.records[-1] == w.last("eval") and metricslib.MetricsWriter.last.__doc__
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.axes import Axes
    lines, axvline = [], Axes.axvline
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Axes, "axvline", lambda self, x, *a, **kw: lines.append(x) or axvline(self, x, *a, **kw))
        w.plot(tmp_path / "loss.png")
    assert lines == [4]                    # where the rollback took the run back to
    w.close()
    records, events = metricslib.read_records(tmp_path / "metrics.jsonl")
    assert records[-2:] == [{"step": 6, "loss": 31.0, "lm_loss": 30.0}, {"step": 6, "split": "eval", "loss": 4.2}]
    assert [e["event"] for e in events] == ["spike", "rollback", "alert"]
    assert [r["step"] for r in metricslib.per_step(records)] == [1, 2, 3, 4, 5, 6]


def test_stop_at_eval_loss_ends_the_run_done_and_a_lower_target_trains_on(tmp_path):
    """train.stop_at_eval_loss: the first eval at or below it ends the run with a checkpoint and a
    final.json that says so (with that eval's loss); started again it is complete; with a target
    it has not met it resumes, here to train.steps."""
    from r1jax.train import trainer
    run = tmp_path / "run"
    base = ["loss.objective=sft", "data.source=task", "data.task_examples=400", "data.eval_fraction=0.1",
            "train.steps=10", "train.eval_every=5", "train.eval_batches=1", "checkpoint.every=100"]
    final = trainer.train(configlib.load(TINY, [*base, "train.stop_at_eval_loss=100"]), run)
    rec = json.loads((run / "final.json").read_text())
    evals = [json.loads(line) for line in open(run / "metrics.jsonl") if '"eval"' in line]
    assert rec["step"] == 5 and rec["stopped"] == "train.stop_at_eval_loss"
    assert [e["step"] for e in evals] == [5] and rec["eval_loss"] == evals[0]["loss"] == final["eval_loss"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["5"]
    again = trainer.train(configlib.load(TINY, [*base, "train.stop_at_eval_loss=100"]), run)
    assert again["already_complete"] and json.loads((run / "final.json").read_text()) == rec
    lower = trainer.train(configlib.load(TINY, [*base, f"train.stop_at_eval_loss={rec['eval_loss'] / 100}"]), run)
    rec = json.loads((run / "final.json").read_text())
    assert rec["step"] == 10 and rec["stopped"] is None and "eval_loss" in lower

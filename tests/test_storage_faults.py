"""Storage faults, on real filesystems (a tmpfs mounted per test) and through the real CLI:

- a checkpoint directory that fills up or turns read-only gives one line naming the step; with
  checkpoint.on_error=stop the run ends (exit 1) with the previous checkpoints intact, with
  `continue` it logs and the next save tries again (and succeeds once there is room); a failed
  write never lists as a step and leaves no partial directory;
- a truncated, byte-flipped or incomplete latest checkpoint is detected before it is read: the
  run falls back to the one before with one line, resumes bitwise where the first run was, and
  keeps the corrupted step (as `<step>.corrupt`), bytes untouched;
- without the recorded sizes and CRC32s, Orbax catches a truncation but restores a flipped byte
  in a compressed chunk as other numbers (why the manifest exists);
- a checkpoint of another model (its model_config.json lying) is refused with one line naming
  the first array whose shape differs (exit 2).

Mounting needs root (as here and in CI); elsewhere these tests skip, saying so, unless CI is set.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from r1jax import config as configlib
from r1jax import weights
from r1jax.checkpoint import params as ckpt_params
from r1jax.checkpoint.manager import CheckpointCorrupt, Checkpointer, CheckpointWriteError
from r1jax.config import OnError
from r1jax.parallel import mesh as meshlib
from r1jax.train import optim
from r1jax.train import state as statelib

pytestmark = pytest.mark.slow      # real mounts and whole runs: `make test`, not `make check`

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
TMP = ".orbax-checkpoint-tmp"


# ----------------------------------------------------------------------------- filesystems
def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode:
        why = f"`mount {' '.join(args)}` failed as uid {os.geteuid()}: {r.stderr.strip()}"
        if os.geteuid() == 0 or os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(f"{why}; these tests mount a tmpfs and need root")


@contextlib.contextmanager
def tmpfs(path: Path, size: str | int):
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, opts: str) -> None:
    _mount("-o", f"remount,{opts}", str(path))


def tmp_dirs(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if TMP in p.name)


# ----------------------------------------------------------------------------- the API
@pytest.fixture(scope="module")
def tiny():
    """(cfg, abstract state, state_of(step)): a state whose floats are noise (a trained state's
    size on disk: zstd leaves noise as it is; a fresh one's zero moments would take nothing)."""
    cfg = configlib.load(TINY, [])
    mesh = meshlib.make_mesh(cfg.mesh)
    tx = optim.make(cfg.optim, cfg.train.steps)
    _, target = weights.target(cfg, mesh, None)
    abstract, _ = statelib.abstract(target, tx, cfg, mesh)
    state, _ = statelib.create(weights.fresh(cfg, mesh), tx, cfg, mesh)

    def state_of(step: int) -> dict:
        rng = np.random.default_rng(step)

        def noise(x):
            if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim:
                return jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding)
            return x
        out = jax.tree.map(noise, state)
        out["step"] = jax.device_put(jnp.int32(step), state["step"].sharding)
        return out
    return cfg, abstract, state_of


def data_iter():
    return iter(grain.MapDataset.range(100).to_iter_dataset())


def checkpointer(cfg, d: Path, on_error=OnError.stop, keep: int = 3) -> Checkpointer:
    return Checkpointer(d, every=1, keep=keep, model_cfg=cfg.model, layout=None, on_error=on_error)


def assert_restores(ck: Checkpointer, step: int, abstract, state_of) -> None:
    got, meta, _ = ck.restore(step, abstract, data_iter())
    want = state_of(step)
    same = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), got, want))
    assert meta["step"] == step and all(same), f"step {step} restored other values"


def test_async_write_failure_is_reported_at_the_next_save_and_stops(tiny, tmp_path):
    """A tmpfs smaller than one checkpoint: the first save fails in Orbax's background thread;
    the next save reports it, naming that step, before writing anything."""
    cfg, abstract, state_of = tiny
    with tmpfs(tmp_path / "ckpt", "2m") as d:
        ck = checkpointer(cfg, d)
        ck.save(state_of(1), data_iter())
        with pytest.raises(CheckpointWriteError) as e:
            ck.save(state_of(2), data_iter())
        line = str(e.value)
        print(f"\n{line}")
        assert "\n" not in line and "step 1 could not be written" in line and "No space left on device" in line
        assert "there is no checkpoint yet" in line and "on_error=stop" in line
        assert ck.steps() == [] and tmp_dirs(d) == []
        ck.close()


def test_continue_logs_each_failed_step_and_the_next_save_succeeds(tiny, tmp_path, capsys):
    """on_error=continue: each failed step is one logged line; once the filesystem has room
    (grown in place) the next save commits and restores."""
    cfg, abstract, state_of = tiny
    with tmpfs(tmp_path / "ckpt", "2m") as d:
        ck = checkpointer(cfg, d, OnError.continue_)
        ck.save(state_of(1), data_iter())
        ck.save(state_of(2), data_iter())          # reports step 1; step 2 fails in turn...
        ck.wait()                                  # ... reported here
        remount(d, "size=64m")
        ck.save(state_of(3), data_iter())
        ck.close()
        lines = [l for l in capsys.readouterr().out.splitlines() if "could not be written" in l]
        print("\n" + "\n".join(lines))
        assert len(lines) == 2 and "step 1 " in lines[0] and "step 2 " in lines[1]
        assert all("No space left on device" in l and "next save tries again" in l for l in lines)
        assert ck.steps() == [3] and tmp_dirs(d) == []
        assert_restores(checkpointer(cfg, d), 3, abstract, state_of)


def test_read_only_directory_is_refused_at_once(tiny, tmp_path, capsys):
    """Orbax alone waits 300 s for a step directory it cannot create (measured), then raises a
    TimeoutError that does not say why. The probe before each save says it at once."""
    cfg, abstract, state_of = tiny
    with tmpfs(tmp_path / "ckpt", "64m") as d:
        ck = checkpointer(cfg, d)
        ck.save(state_of(1), data_iter())
        ck.wait()
        remount(d, "ro")
        t0 = time.time()
        with pytest.raises(CheckpointWriteError) as e:
            ck.save(state_of(2), data_iter())
        print(f"\n{e.value} ({time.time() - t0:.2f} s)")
        assert time.time() - t0 < 10
        assert "step 2 could not be written" in str(e.value) and "Read-only file system" in str(e.value)
        assert "the last checkpoint is step 1" in str(e.value)
        ck.on_error = OnError.continue_
        ck.save(state_of(3), data_iter())
        assert "step 3 could not be written" in capsys.readouterr().out
        remount(d, "rw")
        ck.save(state_of(4), data_iter())
        ck.close()
        assert ck.steps() == [4, 1] and tmp_dirs(d) == []
        fresh = checkpointer(cfg, d)
        for step in (4, 1):
            assert_restores(fresh, step, abstract, state_of)


def _largest(d: Path) -> Path:
    return max((p for p in (d / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p: Path, at: float = 0.5) -> None:
    b = bytearray(p.read_bytes())
    b[int(len(b) * at)] ^= 0x10
    p.write_bytes(bytes(b))


FAULTS = {
    "truncated params file": (lambda d: _truncate(_largest(d)), "(truncated or overwritten)"),
    "flipped byte in a params chunk": (lambda d: _flip(_largest(d)), "CRC32 differs"),
    "meta item deleted": (lambda d: shutil.rmtree(d / "meta"), "meta/metadata: missing"),
    "data state deleted": (lambda d: (d / "data" / "process_0-of-1.json").unlink(), "process_0-of-1.json: missing"),
}


@pytest.fixture(scope="module")
def two_steps(tiny, tmp_path_factory):
    cfg, _, state_of = tiny
    d = tmp_path_factory.mktemp("two") / "ckpt"
    ck = checkpointer(cfg, d)
    for step in (1, 2):
        ck.save(state_of(step), data_iter())
    ck.close()
    return d


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_corrupted_latest_is_detected_and_left_as_it_is(tiny, two_steps, tmp_path, fault):
    cfg, abstract, state_of = tiny
    d = tmp_path / "ckpt"
    shutil.copytree(two_steps, d)
    damage, expect = FAULTS[fault]
    damage(d / "2")
    before = _snapshot(d / "2")
    ck = checkpointer(cfg, d)
    with pytest.raises(CheckpointCorrupt) as e:
        ck.meta(2)                    # what a resume reads first
    with pytest.raises(CheckpointCorrupt):
        ck.restore(2, abstract, data_iter())
    print(f"\n{fault}: {e.value}")
    assert expect in str(e.value) and "\n" not in str(e.value)
    assert ck.steps() == [2, 1] and _snapshot(d / "2") == before
    assert_restores(ck, 1, abstract, state_of)
    ck.close()


def test_without_the_manifest_a_truncation_is_caught_and_a_flipped_byte_is_not(tiny, two_steps, tmp_path):
    """A step as Orbax alone leaves it (no r1jax_files.*): a truncated data file fails the read
    (and is reported as CheckpointCorrupt); a byte flipped inside a zstd chunk's compressed data
    decodes to other numbers without an error. (A flip that lands on a zstd block header fails the
    read instead; which one a given offset hits depends on how the chunks were laid out, which
    varies from run to run, so the flips walk offsets until one lands in data: a CI run's middle
    byte once hit a header.)"""
    cfg, abstract, state_of = tiny

    def bare(name):
        d = tmp_path / name
        shutil.copytree(two_steps, d)
        for m in (d / "2").glob("r1jax_files.*"):
            m.unlink()
        return d

    d = bare("truncated")
    _truncate(_largest(d / "2"))
    ck = checkpointer(cfg, d)
    with pytest.raises(CheckpointCorrupt) as e:
        ck.restore(2, abstract, data_iter())
    ck.close()
    print(f"\ntruncated, no manifest: {e.value}")
    assert str(e.value).startswith("params: ") and "\n" not in str(e.value)
    caught = []
    for at in (0.5, 0.375, 0.625, 0.25, 0.75):
        d = bare(f"flipped_{at}")
        _flip(_largest(d / "2"), at)
        ck = checkpointer(cfg, d)
        try:
            got, _, _ = ck.restore(2, abstract, data_iter())
        except CheckpointCorrupt as err:                # a zstd header: the read fails
            caught.append(f"{at}: {err}")
            continue
        finally:
            ck.close()
        differ = [jax.tree_util.keystr(p) for p, same in jax.tree_util.tree_leaves_with_path(jax.tree.map(
            lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), got, state_of(2))) if not same]
        print(f"flipped at {at} of the file, no manifest: restored without an error; differs in {differ} "
              f"({len(caught)} earlier offsets failed the read)")
        assert len(differ) == 1
        return
    pytest.fail(f"every flip failed the read: {caught}")


# ----------------------------------------------------------------------------- the CLI
# as tests/conftest.py does for its BACKEND_O0 files (bitwise the same losses, much shorter
# compiles); one CPU device: these runs test storage, not meshes
CLI_ENV = {"JAX_NUM_CPU_DEVICES": "1", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
           "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "PYTHONUNBUFFERED": "1"}
RUN = ["train.log_every=1", "train.eval_batches=0", "checkpoint.every=2", "checkpoint.keep=3"]


def train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "R1JAX_"))}
    r = subprocess.run([sys.executable, "-m", "r1jax.train", "--config", str(TINY), "--run-dir", str(run_dir),
                        *RUN, *overrides], cwd=ROOT, env={**env, **CLI_ENV}, capture_output=True, text=True,
                       timeout=600)
    print(f"\n$ train {' '.join(overrides)} -> exit {r.returncode}\n"
          + "\n".join(l for l in (r.stdout + r.stderr).splitlines() if "checkpoint" in l or "resumed" in l or
                      l.startswith(("error", "config error"))))
    return r


def error_line(r: subprocess.CompletedProcess) -> str:
    lines = [l for l in r.stderr.splitlines() if l.startswith(("error:", "config error:"))]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


def losses(run_dir: Path) -> dict[int, float]:
    """The last record of each step (a resumed run appends the steps it repeats)."""
    out = {}
    for rec in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        if "split" not in rec:
            out[rec["step"]] = rec["loss"]
    return out


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """6 of 8 steps (train.stop_at: the learning-rate schedule of an 8-step run), checkpoints at
    2, 4 and 6."""
    run = tmp_path_factory.mktemp("base") / "run"
    r = train(run, "train.steps=8", "train.stop_at=6")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4, 6]
    return run


def test_cli_falls_back_from_a_truncated_latest_checkpoint(base_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    bad = _largest(run / "checkpoints" / "6")
    _truncate(bad)
    truncated = bad.read_bytes()
    r = train(run, "train.steps=8")
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(l for l in r.stdout.splitlines() if "cannot be restored" in l)
    assert "step 6" in line and bad.name in line and "falling back to step 4" in line
    assert "kept as" in r.stdout and "6.corrupt (not deleted)" in r.stdout
    assert f"resumed from {run / 'checkpoints' / '4'} (step 4)" in r.stdout
    # the steps run again are bitwise the first run's; the corrupted step is kept, untouched
    first, again = losses(base_run), losses(run)
    assert [again[s] for s in (5, 6)] == [first[s] for s in (5, 6)]
    kept = run / "checkpoints" / "6.corrupt"
    assert (kept / bad.relative_to(run / "checkpoints" / "6")).read_bytes() == truncated
    ck = Checkpointer(run / "checkpoints", every=2, keep=3, model_cfg=configlib.load(TINY, []).model, layout=None)
    assert ck.steps() == [8, 6, 4]
    ck.close()


def test_cli_refuses_a_checkpoint_of_another_model(base_run, tmp_path):
    """model_config.json rewritten to match the run (it no longer tells the truth): the arrays'
    shapes still do."""
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    other = configlib.load(TINY, ["model.q_lora_rank=32"])
    ckpt_params.write_model_config(run / "checkpoints", other.model)
    r = train(run, "train.steps=8", "model.q_lora_rank=32")
    assert r.returncode == 2
    line = error_line(r)
    assert line.startswith("config error: checkpoint step 6: params/dense_layers/layers/attn/q_norm/weight is (1, 48) "
                           "in the checkpoint, (1, 32) in this run's model"), line


def _step_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def test_cli_full_disk_stops_or_goes_on_as_configured(base_run, tmp_path):
    """checkpoints/ on a tmpfs with room for two and a half steps, keep=2: steps 2 and 4 land;
    step 6 does not fit. on_error=stop: exit 1 with one line, 2 and 4 intact. Then
    on_error=continue on the same directory: resumes from 4, one line for each of 6 and 8, and
    the run completes."""
    run = tmp_path / "run"
    size = int(2.5 * _step_bytes(base_run / "checkpoints" / "4"))
    with tmpfs(run / "checkpoints", size) as d:
        r = train(run, "train.steps=8", "checkpoint.keep=2")
        assert r.returncode == 1
        line = error_line(r)
        assert line.startswith("error: checkpoint: step 6 could not be written") and "No space left on device" in line
        assert "the last checkpoint is step 4" in line and "on_error=stop" in line
        assert sorted(p.name for p in d.iterdir() if p.name.isdigit()) == ["2", "4"] and tmp_dirs(d) == []

        r = train(run, "train.steps=8", "checkpoint.keep=2", "checkpoint.on_error=continue")
        assert r.returncode == 0, r.stderr[-3000:]
        lines = [l for l in r.stdout.splitlines() if "could not be written" in l]
        assert [l.split()[2] for l in lines] == ["6", "8"] and all("next save tries again" in l for l in lines)
        assert (run / "final.json").is_file() and tmp_dirs(d) == []
        ck = Checkpointer(d, every=2, keep=2, model_cfg=configlib.load(TINY, []).model, layout=None)
        assert ck.steps() == [4, 2]
        for step in (4, 2):
            ck.meta(step)             # checks every file against what was written
        ck.close()


def test_cli_read_only_checkpoints_resume_then_stop_at_the_first_save(base_run, tmp_path):
    """A run resumed from a read-only checkpoint directory restores, trains, and stops at its
    first save with one line (at once, not after Orbax's 300 s)."""
    run = tmp_path / "run"
    shutil.copytree(base_run, run, ignore=shutil.ignore_patterns("checkpoints"))
    with tmpfs(run / "checkpoints", "64m") as d:
        shutil.copytree(base_run / "checkpoints", d, dirs_exist_ok=True)
        remount(d, "ro")
        t0 = time.time()
        r = train(run, "train.steps=8")
        assert r.returncode == 1 and time.time() - t0 < 240
        assert "resumed from" in r.stdout and "(step 6)" in r.stdout
        line = error_line(r)
        assert line.startswith("error: checkpoint: step 8 could not be written") and "Read-only file system" in line
        assert "the last checkpoint is step 6" in line


def test_two_processes_agree_on_a_fault_only_one_of_them_sees(tmp_path):
    """2 processes (python -m r1jax.launch): process 1's data state of step 6 truncated. Only
    process 1 checks its own files, so only it finds the fault; the decision is shared (the
    coordination service's key-value store), so both fall back to step 4 together (apart, one
    would wait for the other in Orbax's next barrier) and the run finishes bitwise as before."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "R1JAX_"))}
    launch = [sys.executable, "-m", "r1jax.launch", "--local", "2", "--devices-per-process", "1", "--",
              "--config", str(TINY), "--run-dir", str(run), *RUN, "train.steps=8"]

    def go(*extra: str) -> subprocess.CompletedProcess:
        r = subprocess.run([*launch, *extra], cwd=ROOT, env={**env, **CLI_ENV}, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        return r
    go("train.stop_at=6")
    first = losses(run)
    bad = run / "checkpoints" / "6" / "data" / "process_1-of-2.json"
    _truncate(bad)
    out = go().stdout
    line = next(l for l in out.splitlines() if "cannot be restored" in l)
    print(f"\n{line}")
    assert "step 6" in line and "(process 1: data/process_1-of-2.json: " in line and "falling back to step 4" in line
    assert "resumed from" in out and "(step 4)" in out
    again = losses(run)
    assert [again[s] for s in (5, 6)] == [first[s] for s in (5, 6)] and max(again) == 8

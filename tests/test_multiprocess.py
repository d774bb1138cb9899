"""Several processes on one machine (python -m r1jax.launch), with real processes and gloo:

- 2 processes x 4 CPU devices train like 1 process x 8 devices reading the same two data shards
  (per-step loss and final parameters within 1e-5), on the default mesh and on node-aware ones
  (mesh.dcn_*): expert across the processes (the hierarchical exchange), and a pipeline across them (GPipe, 1F1B, and the
  seeds' tensor x data x pipeline layout);
- the data shards are disjoint and complete, document by document, through the real pipeline;
- a process whose peer never starts exits 1 with one line within distributed.init_timeout_s;
- a stop signal sent to one process stops both at the same step, and resuming from there is
  bitwise the straight run;
- a 2-process checkpoint resumes in 1 process: parameters bitwise, data stream restarted (one line).

Each run is a subprocess (SLURM_* removed, so an outer SLURM job is never picked up). Small
compiles are cached too (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0): Orbax's first save compiles
one slice per array and replica, which otherwise costs each process about 20 s.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from r1jax import config as configlib
from r1jax.data import tokenizer as toklib
from r1jax.data.sources import open_corpus
from r1jax.data.pipeline import ShardsIterator, lm_batches
from r1jax.launch import ChatterFilter, free_port
from r1jax.checkpoint.params import ParamsReader

pytestmark = pytest.mark.slow      # whole runs, meshes or processes: `make test`, not `make check`

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
STEPS = 6
ARGS = [f"train.steps={STEPS}", "train.log_every=1", "train.eval_batches=0", "checkpoint.every=3"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "R1JAX_"))}
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONUNBUFFERED="1", **extra)
    return env


def kill_tree(pid: int) -> None:
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def run(cmd: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str, str, float]:
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        out, err = p.communicate()
        pytest.fail(f"{' '.join(cmd[:4])} ran over {timeout} s:\n{err.decode()[-3000:]}")
    return p.returncode, out.decode(errors="replace"), err.decode(errors="replace"), time.time() - t0


def launch(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "r1jax.launch", "--local", "2", "--devices-per-process", "4", "--",
            "--config", TINY, "--run-dir", str(run_dir), *ARGS, *extra]


def single(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "r1jax.train", "--config", TINY, "--run-dir", str(run_dir), *ARGS, *extra]


def losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "split" not in r}


def params(run_dir: Path, step: int | None = None) -> dict[tuple, np.ndarray]:
    reader = ParamsReader(run_dir / "checkpoints", step)
    return {k: reader.read(k) for k in reader.shapes}


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    """2 processes x 4 devices (mesh data=8), through the launcher."""
    d = tmp_path_factory.mktemp("two") / "run"
    rc, out, err, secs = run(launch(d), clean_env())
    assert rc == 0, err[-3000:]
    print(f"\n2 processes x 4 devices, {STEPS} steps: {secs:.1f} s")
    assert "[0] step 1/" in out and "[1] step" not in out          # progress from process 0 only
    assert "[Gloo]" not in out
    return d


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    """1 process x 8 devices reading the same 2 data shards side by side."""
    d = tmp_path_factory.mktemp("one") / "run"
    rc, out, err, secs = run(single(d, "distributed.data_shards=2"), clean_env(JAX_NUM_CPU_DEVICES="8"))
    assert rc == 0, err[-3000:]
    print(f"\n1 process x 8 devices, {STEPS} steps: {secs:.1f} s")
    return d


def differences(run_dir: Path, ref: Path) -> tuple[float, float]:
    """(per-step loss max relative difference, final parameters max abs difference) of a run
    against the reference run, which logged the same steps and holds the same arrays."""
    a, b = losses(run_dir), losses(ref)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    pa, pb = params(run_dir), params(ref)
    assert pa.keys() == pb.keys()
    return (max(abs(a[s] - b[s]) / abs(b[s]) for s in a),
            max(float(np.max(np.abs(pa[k] - pb[k]))) for k in pa))


def test_two_processes_train_like_one(two, one):
    rel, diff = differences(two, one)
    print(f"\n2x4 vs 1x8: per-step loss max rel diff {rel:.2e}, final params max abs diff {diff:.2e}")
    assert rel <= 1e-5 and diff <= 1e-5
    assert json.loads((two / "final.json").read_text())["step"] == STEPS
    assert sorted(p.name for p in (two / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "6"]
    assert sorted(p.name for p in (two / "checkpoints" / "6" / "data").glob("process_*")) == [
        "process_0-of-2.json", "process_1-of-2.json"]


@pytest.mark.parametrize("name,extra,across", [
    # expert 4 spans the two processes (2 devices in each), data 2 stays inside each: the
    # opposite of the default order (data outermost); the hierarchical exchange sends each token
    # once to the other process when its experts are there, then on inside it (exact buffers)
    ("data 2 inside x expert 4 across, hierarchical exchange",
     ["mesh.data=2", "mesh.expert=4", "mesh.dcn_expert=2", "kernels.moe_dispatch=hierarchical"], "expert 2"),
    # each process one pipeline stage, reading only the rows its devices hold (outside the
    # stages the batch is sharded over pipeline too)
    ("pipeline across, gpipe, data 4 inside", ["mesh.data=4", "mesh.pipeline=2", "mesh.dcn_pipeline=2",
                                               "train.microbatches=2"], "pipeline 2"),
    # (one microbatch: 1F1B shares the epilogue over the stages by a data shard's rows, 2 here)
    ("pipeline across, 1f1b, data 4 inside", ["mesh.data=4", "mesh.pipeline=2", "mesh.dcn_pipeline=2",
                                              "train.microbatches=1", "pipeline.schedule=1f1b"], "pipeline 2"),
    # the case: expert parallelism inside stages that span the processes
    ("pipeline across, gpipe, expert 2 x data 2 inside", ["mesh.data=2", "mesh.expert=2", "mesh.pipeline=2",
                                                         "mesh.dcn_pipeline=2", "train.microbatches=2"], "pipeline 2"),
    # the 256-GPU plan's layout scaled down: circular stages across, and FSDP inside them
    # (mesh.expert_fsdp: the non-expert weights sharded over the expert group too)
    ("pipeline across, circular, expert 2 x data 2 inside, expert_fsdp",
     ["mesh.data=2", "mesh.expert=2", "mesh.pipeline=2", "mesh.dcn_pipeline=2", "train.microbatches=2",
      "pipeline.schedule=circular", "pipeline.repeats=2", "mesh.expert_fsdp=true"], "pipeline 2"),
    ("pipeline across, gpipe, tensor 2 x data 2 inside (the seeds' layout)",
     ["mesh.data=2", "mesh.tensor=2", "mesh.pipeline=2", "mesh.dcn_pipeline=2", "train.microbatches=2"], "pipeline 2"),
])
def test_node_aware_mesh_trains_like_one(one, tmp_path, name, extra, across):
    """A node-aware mesh (mesh.dcn_<axis>: each process a node) over 2 processes x 4 devices
    trains like 1 process x 8 devices without it."""
    d = tmp_path / "run"
    rc, out, err, secs = run(launch(d, *extra), clean_env())
    assert rc == 0, err[-3000:]
    assert f"across processes: {across}\n" in out, out[-2000:]
    rel, diff = differences(d, one)
    print(f"\n2 processes, {name} ({secs:.1f} s) vs 1 x 8: per-step loss max rel diff {rel:.2e}, "
          f"final params max abs diff {diff:.2e}")
    assert rel <= 1e-5 and diff <= 1e-5


def test_data_shards_are_disjoint_and_complete():
    """Every document lands in exactly one of the shards (the real pipeline, decoded back to
    text), and a process reading shards 0 and 1 side by side gets exactly the rows of both."""
    cfg = configlib.load(TINY)
    docs = open_corpus(cfg.data)
    tok = toklib.train((docs[i] for i in range(40)), 512)
    eos = toklib.eos_id(tok)
    idx = list(range(0, 240, 2))

    def shard(i, n, **kw):
        return lm_batches(docs, idx, tok, eos, seq_len=64, batch_size=2, seed=3, shard_index=i, shard_count=n, **kw)

    def documents(i, n):
        rows = [r for b in shard(i, n, epochs=1, shuffle_rows=0) for r in zip(b["ids"], b["segment_ids"])]
        flat = np.concatenate([ids[seg > 0] for ids, seg in rows])      # rows in order: the token stream
        ends = np.flatnonzero(flat == eos)
        return [tok.decode(flat[a + 1 if k else 0:e].tolist()) for k, (a, e) in enumerate(zip([0, *ends], ends))]

    for n in (2, 3):
        got = [documents(i, n) for i in range(n)]
        seen = [d for g in got for d in g]
        assert sorted(seen) == sorted(docs[i] for i in idx)             # complete, and nothing twice
        assert all(len(g) in (len(idx) // n, len(idx) // n + 1) for g in got)
    print(f"\n{len(idx)} documents: shards of 2 and of 3 are disjoint and complete")

    both, a, b = ShardsIterator([iter(shard(0, 2)), iter(shard(1, 2))]), iter(shard(0, 2)), iter(shard(1, 2))
    for _ in range(5):
        x, ra, rb = next(both), next(a), next(b)
        assert np.array_equal(x["ids"], np.concatenate([ra["ids"], rb["ids"]]))
    state = both.get_state()
    again = ShardsIterator([iter(shard(0, 2)), iter(shard(1, 2))])
    again.set_state(json.loads(json.dumps(state)))
    assert np.array_equal(next(again)["ids"], next(both)["ids"])


def test_missing_peer_exits_with_one_line_within_the_timeout(tmp_path):
    """Process 0 of 2 alone (the coordinator, nobody joins) and process 1 of 2 alone (no coordinator)."""
    timeout = 6
    procs = []
    for pid in (0, 1):
        env = clean_env(R1JAX_COORDINATOR=f"127.0.0.1:{free_port()}", R1JAX_NUM_PROCESSES="2",
                        R1JAX_PROCESS_ID=str(pid), JAX_NUM_CPU_DEVICES="4")
        cmd = single(tmp_path / f"run{pid}", f"distributed.init_timeout_s={timeout}")
        procs.append((time.time(), subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE)))
    for pid, (t0, p) in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            kill_tree(p.pid)
            pytest.fail(f"process {pid} alone did not exit")
        secs = time.time() - t0
        lines = [line for line in err.decode().splitlines() if line.strip()]
        print(f"\nprocess {pid} of 2 alone: exit {p.returncode} after {secs:.1f} s: {lines}")
        assert p.returncode == 1
        assert len(lines) == 1 and lines[0].startswith(f"error: process {pid} of 2: not every process joined")
        assert f"within {timeout} s" in lines[0]
        assert secs < timeout + 20        # the timeout plus interpreter and JAX start-up, not 2x the timeout


BEAT_AND_EXIT = """
import time
from r1jax.parallel import distributed


class Fast(distributed.Heartbeat):     # beat all the time, so exit finds a beat inside the client
    def __init__(self, timeout_s):
        super().__init__(timeout_s, interval_s=0.0005)


distributed.Heartbeat = Fast
distributed.initialize(60, 30)
import jax
print("up", jax.process_index(), flush=True)
time.sleep(0.3)
"""


def test_processes_that_finish_exit_0_while_the_heartbeat_beats():
    """Two processes join, beat every 0.5 ms and return at once, four times over. Before the
    heartbeat was stopped at exit, 11 of 20 such processes aborted (exit 134, "FATAL: exception
    not rethrown"): CPython unwound the beat inside the client's C++ frame while finalising."""
    for attempt in range(4):
        port, procs = free_port(), []
        for pid in (0, 1):
            env = clean_env(R1JAX_COORDINATOR=f"127.0.0.1:{port}", R1JAX_NUM_PROCESSES="2",
                            R1JAX_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu")
            procs.append(subprocess.Popen([sys.executable, "-c", BEAT_AND_EXIT], cwd=ROOT, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        for pid, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                kill_tree(p.pid)
                pytest.fail(f"attempt {attempt}: process {pid} did not exit")
            assert (p.returncode, out.decode()) == (0, f"up {pid}\n"), \
                f"attempt {attempt}: process {pid}: exit {p.returncode}: {err.decode()[-500:]}"


def test_peer_killed_mid_run_stops_the_survivor_with_one_line(tmp_path):
    """SIGKILL of process 1 of 2 after step 3 (not through the launcher, which would stop the other
    itself; srun does not by default): process 0 exits 1 within distributed.heartbeat_timeout_s,
    naming process 1, instead of hanging in its next all-reduce."""
    hb, port = 10, free_port()
    procs = []
    for pid in (0, 1):
        env = clean_env(R1JAX_COORDINATOR=f"127.0.0.1:{port}", R1JAX_NUM_PROCESSES="2", R1JAX_PROCESS_ID=str(pid),
                        JAX_NUM_CPU_DEVICES="4")
        cmd = [sys.executable, "-m", "r1jax.train", "--config", TINY, "--run-dir", str(tmp_path / "run"),
               "train.steps=1000", "train.log_every=1", "checkpoint.every=1000", f"distributed.heartbeat_timeout_s={hb}"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    survivor, victim = procs
    try:
        deadline = time.time() + 240
        for line in survivor.stdout:         # process 0 logs; wait for its step 3
            if line.startswith("step 3/") or time.time() > deadline:
                break
        assert time.time() < deadline, "no step 3 within 240 s"
        os.killpg(victim.pid, signal.SIGKILL)
        t_kill = time.time()
        try:
            err = survivor.communicate(timeout=hb + 60)[1]
        except subprocess.TimeoutExpired:
            pytest.fail("the survivor hangs")
        secs = time.time() - t_kill
    finally:
        for p in procs:
            kill_tree(p.pid)
    lines = [x for x in err.splitlines() if x.strip() and "Warning" not in x and "warnings.warn" not in x]
    print(f"\nprocess 1 killed after step 3: process 0 exit {survivor.returncode} after {secs:.1f} s: {lines}")
    assert survivor.returncode == 1
    assert lines == [next(x for x in lines if x.startswith("error: process 0: process 1 of 2 has sent no heartbeat"))]
    assert f"distributed.heartbeat_timeout_s={hb}" in lines[0]
    assert secs < hb + 5                       # the timeout plus one beat, not JAX's own abort


def _child(launcher: subprocess.Popen, index: int) -> psutil.Process:
    deadline = time.time() + 60
    while time.time() < deadline:
        for c in psutil.Process(launcher.pid).children():
            try:
                if c.environ().get("R1JAX_PROCESS_ID") == str(index):
                    return c
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.2)
    raise AssertionError(f"launcher started no process {index}")


def test_signal_to_one_process_stops_both_at_one_step_and_resumes_bitwise(two, tmp_path):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(launch(run_dir), cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    try:
        child = _child(launcher, 1)
        deadline = time.time() + 240
        while time.time() < deadline and launcher.poll() is None:
            m = run_dir / "metrics.jsonl"
            if m.is_file() and m.read_text().strip():
                break
            time.sleep(0.1)
        child.send_signal(signal.SIGUSR1)       # only process 1 is told
        out, err = launcher.communicate(timeout=240)
    finally:
        kill_tree(launcher.pid)
    out, err = out.decode(), err.decode()
    assert launcher.returncode == 0, err[-3000:]
    line = next(l for l in out.splitlines() if "preempted at step" in l)
    step = int(line.split("preempted at step")[1].split()[0])
    print(f"\nSIGUSR1 to process 1 only: {line.strip()}")
    assert line.startswith("[0] ") and "SIGUSR1" in line and 1 <= step < STEPS
    assert (run_dir / "checkpoints" / str(step) / "params").is_dir()
    for i in (0, 1):                           # both saved their data iterator at that same step
        assert (run_dir / "checkpoints" / str(step) / "data" / f"process_{i}-of-2.json").is_file()
    assert json.loads((run_dir / "final.json").read_text())["stopped"] == "SIGUSR1"

    rc, out, err, secs = run(launch(run_dir), clean_env())
    assert rc == 0, err[-3000:]
    assert "resumed from" in out and "restarting the data stream" not in out
    a, b = losses(two), losses(run_dir)
    assert a == b, (a, b)
    pa, pb = params(two), params(run_dir)
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)
    print(f"stopped at {step}, resumed to {STEPS} in {secs:.1f} s: per-step losses and {len(pa)} parameter "
          f"arrays bitwise equal to the straight 2-process run")


def test_two_process_checkpoint_resumes_on_one_process(two, tmp_path):
    """Parameters restore bitwise (a step at lr 0 with router biases frozen changes nothing), and
    the data stream, whose Grain state was kept per process, restarts deterministically."""
    ckpt_dir = two / "checkpoints"
    firsts = []
    for k, extra in enumerate((["optim.lr=0", "optim.bias_update_rate=0"], [])):
        run_dir = tmp_path / f"one{k}"
        shutil.copytree(two, run_dir, ignore=shutil.ignore_patterns("metrics.jsonl", "final.json"))
        rc, out, err, secs = run(single(run_dir, f"train.steps={STEPS + 1}", *extra),
                                 clean_env(JAX_NUM_CPU_DEVICES="8"))
        assert rc == 0, err[-3000:]
        line = next(l for l in out.splitlines() if l.startswith("data: "))
        print(f"\n1-process resume of the 2-process checkpoint ({secs:.1f} s): {line}")
        assert (f"checkpoint step {STEPS} read the data as 2 shards on 2 processes" in line
                and f"restarting the data stream at step {STEPS}" in line)
        firsts.append(losses(run_dir)[STEPS + 1])
        if k == 0:
            before, after = params(two, STEPS), params(run_dir, STEPS + 1)
            assert all(np.array_equal(before[key], after[key]) for key in before)
        meta = json.loads((run_dir / "checkpoints" / str(STEPS + 1) / "meta" / "metadata").read_text())
        assert meta["data_shards"] == 1 and str(meta["data_seed"]) in line
    assert firsts[0] == firsts[1]             # the same restarted stream: the same first batch
    assert sorted(p.name for p in (ckpt_dir / str(STEPS) / "data").glob("process_*")) == [
        "process_0-of-2.json", "process_1-of-2.json"]


def test_launcher_drops_gloo_chatter_however_its_pieces_interleave():
    """Lines as a CI run printed them: three communicators connecting at once in one process."""
    keep = ChatterFilter()
    seen = [keep(line) for line in (
        "[Gloo] Rank 1[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : "
        "[Gloo] Rank  is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
        "1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
        "1\n",
        "model: 0.3M parameters\n",
        "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
        "[Gloo] Rank 0step 1/6 | loss 8.1250\n",      # a piece left in the buffer, then a real line
        "12\n",                                       # bare digits after a real line are real
        "\n")]
    assert seen == [None, None, None, "model: 0.3M parameters\n", None, "step 1/6 | loss 8.1250\n", "12\n", "\n"]

"""launch/slurm/train.sbatch on a real single-node SLURM started here (slurmctld, slurmd and munged on
localhost; Debian's slurm-wlm and munge, installed with apt-get when missing):

- SIGUSR1, from `scancel --signal=USR1` or from the script's own `--signal=USR1@120` near the time
  limit, reaches the srun-started processes and not the batch shell; after a preempted run the
  script requeues the job, which comes back with the same arguments and run directory (with a
  stand-in trainer, so that this costs seconds, not two JAX start-ups);
- a submission of the tiny config as 2 tasks x 4 CPU devices (one 8-device JAX job across two
  srun-started processes, in the seeds' layout: pipeline across them) trains to train.stop_at, checkpoints with each process's data iterator
  state, writes its log to logs/<job name>-<job id>.out and is not requeued;
- a second submission on the same run directory resumes from that checkpoint on the default mesh
  (data 8) and trains the rest: every step exactly once.

Needs root (package install, daemons): skipped without it, unless CI is set, where it fails. The
cluster is private to the test: its slurm.conf, state, logs and ports live in a temporary
directory (clients find it through SLURM_CONF), so an existing SLURM installation is left alone;
munged is shared, and started (and later stopped) only when none is running.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from r1jax.launch import free_port

pytestmark = pytest.mark.slow      # whole runs, meshes or processes: `make test`, not `make check`

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "launch" / "slurm" / "train.sbatch"
TINY = ROOT / "configs" / "tiny.yaml"
# the same step as tests/test_multiprocess.py: in one session, process 0 finds it compiled
STEPS, STOP_AT = 6, 3
ARGS = [f"train.steps={STEPS}", "checkpoint.every=3", "train.log_every=1", "train.eval_batches=0"]
SEED_LAYOUT = ["mesh.data=2", "mesh.tensor=2", "mesh.pipeline=2", "mesh.dcn_pipeline=2", "train.microbatches=2"]
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
        "PREEMPTED"}
JOB_TIMEOUT = 900

SLURM_CONF = """\
ClusterName=r1jaxtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits cred_expire seconds before it may start again (default 120)
AuthInfo=cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# the node's CPU count is taken from here, not from the machine: 2 tasks fit even on 1 core
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _require_root() -> None:
    if os.geteuid() == 0:
        return
    why = "needs root to install slurm-wlm/munge and start slurmctld, slurmd and munged"
    if os.environ.get("CI"):
        pytest.fail(f"{why}, and CI is set: run the suite as root")
    pytest.skip(why)


def _sh(cmd: list[str], env: dict | None = None, timeout: float = 10, check: bool = True, **kw):
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        if check:
            pytest.fail(f"{' '.join(cmd)}: no answer within {timeout} s")
        return None
    if check and p.returncode != 0:
        pytest.fail(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p


def _munge_ok() -> bool:
    p = _sh(["munge", "-n"], timeout=5, check=False, stdin=subprocess.DEVNULL)
    return p is not None and p.returncode == 0


class Cluster:
    def __init__(self, d: Path):
        self.d = d
        self.conf = d / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list = []
        self.jobs: list[str] = []

    def env(self, **extra: str) -> dict[str, str]:
        """For the SLURM commands; sbatch passes it on to the job, so srun and scontrol there find this cluster too."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "R1JAX_"))}
        env.update(SLURM_CONF=str(self.conf), **extra)
        return env

    def _daemon(self, name: str, cmd: list[str], **kw) -> None:
        log = open(self.d / f"{name}.stdout", "w")
        self.logs.append(log)
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kw)

    def start(self) -> None:
        if not _munge_ok():
            key = Path("/etc/munge/munge.key")
            if not key.is_file() or key.stat().st_size == 0:
                key.write_bytes(os.urandom(1024))
                shutil.chown(key, "munge", "munge")
                key.chmod(0o400)
            run = Path("/run/munge")
            run.mkdir(parents=True, exist_ok=True)
            shutil.chown(run, "munge", "munge")
            run.chmod(0o755)
            self._daemon("munged", ["/usr/sbin/munged", "--foreground"], user="munge", group="munge",
                         extra_groups=[])
            deadline = time.time() + 20
            while not _munge_ok():
                if time.time() > deadline or self.procs["munged"].poll() is not None:
                    pytest.fail(f"munged did not start: {(self.d / 'munged.stdout').read_text()[-2000:]}")
                time.sleep(0.2)
        for sub in ("state", "spool"):
            (self.d / sub).mkdir()
        ctld_port = free_port()
        slurmd_port = next(p for p in iter(free_port, None) if p != ctld_port)
        self.conf.write_text(SLURM_CONF.format(d=self.d, ctld_port=ctld_port, slurmd_port=slurmd_port,
                                               cpus=max(4, os.cpu_count() or 1)))
        self._daemon("slurmctld", ["/usr/sbin/slurmctld", "-D", "-f", str(self.conf)])
        self._daemon("slurmd", ["/usr/sbin/slurmd", "-D", "-N", "localhost", "-f", str(self.conf)])
        deadline = time.time() + 60
        while True:
            p = _sh(["sinfo", "-h", "-o", "%T"], env=self.env(), timeout=5, check=False)
            if p is not None and p.returncode == 0 and p.stdout.strip() in ("idle", "mixed", "allocated"):
                return
            dead = [n for n, pr in self.procs.items() if pr.poll() is not None]
            if dead or time.time() > deadline:
                logs = "\n".join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(self.d.glob("*.log")))
                pytest.fail(f"the node did not come up (exited: {dead}; sinfo: {p and p.stdout!r})\n{logs}")
            time.sleep(0.5)

    def stop(self) -> None:
        env = self.env()
        if self.jobs:
            _sh(["scancel", "--signal=KILL", "--full", *self.jobs], env=env, timeout=10, check=False)
            deadline = time.time() + 30
            while time.time() < deadline:
                p = _sh(["squeue", "-h", "-j", ",".join(self.jobs)], env=env, timeout=5, check=False)
                if p is None or not p.stdout.strip():
                    break
                time.sleep(0.5)
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            _sh(["scontrol", "shutdown"], env=env, timeout=10, check=False)   # slurmctld and slurmd
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None:
                continue
            try:
                if name == "munged":
                    p.terminate()
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in self.logs:
            log.close()

    def job(self, jid: str) -> dict[str, str]:
        p = _sh(["scontrol", "show", "job", "-o", jid], env=self.env(), timeout=5, check=False)
        if p is None or p.returncode != 0:
            return {}
        return dict(kv.split("=", 1) for kv in p.stdout.split() if "=" in kv)

    def submit(self, workdir: Path, *args: str, opts: tuple[str, ...] = (), **env: str) -> str:
        cmd = ["sbatch", "--parsable", f"--chdir={workdir}", "-N1", "-n2", *opts, str(SBATCH), str(TINY), *args]
        p = _sh(cmd, env=self.env(**env), timeout=30, cwd=ROOT)   # submitted from the repository, as documented
        jid = p.stdout.strip().split(";")[0]
        self.jobs.append(jid)
        return jid

    def wait(self, jid: str, log: Path, timeout: float = JOB_TIMEOUT) -> dict[str, str]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job(jid)
            if info.get("JobState") in DONE:
                return info
            time.sleep(0.5)
        _sh(["scancel", "--signal=KILL", "--full", jid], env=self.env(), timeout=10, check=False)
        tail = log.read_text()[-3000:] if log.is_file() else "(no log)"
        pytest.fail(f"job {jid} not done within {timeout} s: {self.job(jid)}\n{tail}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    _require_root()
    t0 = time.time()
    if not Path("/usr/sbin/slurmctld").is_file():
        _sh(["apt-get", "update", "-qq"], timeout=600)
        _sh(["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"],
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, timeout=900)
        print(f"\napt-get install slurm-wlm munge: {time.time() - t0:.1f} s")
    t1 = time.time()
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        print(f"\nSLURM up (slurmctld, slurmd{', munged' if 'munged' in cluster.procs else ''}): "
              f"{time.time() - t1:.1f} s")
        yield cluster
    finally:
        t2 = time.time()
        cluster.stop()
        print(f"\nSLURM down: {time.time() - t2:.1f} s")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("work")
    (d / "logs").mkdir()        # sbatch does not create the --output directory
    return d


def _env() -> dict[str, str]:
    env = {"JAX_NUM_CPU_DEVICES": "4", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "PYTHONUNBUFFERED": "1"}
    venv = ROOT / ".venv" / "bin" / "python"
    if not venv.is_file() or Path(os.path.abspath(sys.executable)) != venv:
        env["R1JAX_PYTHON"] = sys.executable          # else the script finds <repo>/.venv/bin/python itself
    return env


def _steps(run_dir: Path) -> list[int]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in recs if "split" not in r]


def _final(run_dir: Path) -> dict:
    return json.loads((run_dir / "final.json").read_text())


FAKE_TRAINER = """\
#!{python}
# Stands in for `python -m r1jax.train` as the script runs it (R1JAX_PYTHON=this file): ready once
# its SIGUSR1 handler is in place; the first attempt waits for the signal, then behaves as the
# trainer does when preempted (process 0 writes final.json with "stopped": "SIGUSR1", all exit 0);
# a requeued attempt finishes at once.
import json, os, signal, sys, time
from pathlib import Path
argv = sys.argv[1:]
run_dir = Path(argv[argv.index("--run-dir") + 1])
rank, attempt = os.environ["SLURM_PROCID"], int(os.environ.get("SLURM_RESTART_COUNT", "0"))
got = []
signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
(run_dir / f"argv-{{attempt}}-{{rank}}.json").write_text(json.dumps(argv))
t0 = time.time()
while attempt == 0 and not got and time.time() < t0 + 240:
    time.sleep(0.05)
stopped = "SIGUSR1" if got else None
if rank == "0":
    (run_dir / "final.json").write_text(json.dumps({{"step": attempt, "stopped": stopped}}, indent=2))
print(f"fake trainer {{rank}}, attempt {{attempt}}: {{'preempted at step 0 (SIGUSR1)' if got else 'done'}} "
      f"after {{time.time() - t0:.1f}} s", flush=True)
"""


@pytest.mark.parametrize("how", ["scancel", "time-limit"])
def test_sigusr1_reaches_the_processes_and_the_job_requeues(slurm, workdir, how):
    """SIGUSR1 from `scancel --signal=USR1 JOB`, or from the script's own --signal=USR1@120 under
    --time=1 (SLURM sends it at its next time-limit check, less than a minute in): it reaches the
    srun-started processes, the batch shell survives it, sees "stopped": "SIGUSR1" in final.json,
    requeues the job, and the job comes back with the same arguments and run directory. The
    trainer's own side (save, stop, resume) is tested with real training in test_multiprocess.py."""
    fake = workdir / "fake_trainer"
    fake.write_text(FAKE_TRAINER.format(python=sys.executable))
    fake.chmod(0o755)
    overrides = ["train.steps=5", "model.hidden_size=32"]
    t0 = time.time()
    if how == "scancel":
        run_dir = workdir / "fake-scancel"
        jid = slurm.submit(workdir, "--run-dir", str(run_dir), *overrides, R1JAX_PYTHON=str(fake))
        deadline = time.time() + 60
        while not all((run_dir / f"argv-0-{rank}.json").is_file() for rank in (0, 1)):
            if time.time() > deadline:
                pytest.fail(f"job {jid}: the fake trainer did not start: {slurm.job(jid)}")
            time.sleep(0.1)
        _sh(["scancel", "--signal=USR1", jid], env=slurm.env())
    else:       # the default run dir, runs/<config name>-<job id> under the job's working directory
        jid = slurm.submit(workdir, *overrides, opts=("--time=1",), R1JAX_PYTHON=str(fake))
        run_dir = workdir / "runs" / f"tiny-{jid}"
    log = workdir / "logs" / f"r1jax-{jid}.out"
    info = slurm.wait(jid, log, timeout=240)
    secs = time.time() - t0
    text = log.read_text()
    print(f"\nfake trainer, SIGUSR1 by {how}: {info['JobState']}, requeued {info['Restarts']}x, {secs:.1f} s")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-3000:])
    assert info["Restarts"] == "1", text[-3000:]
    for rank in (0, 1):
        assert f"fake trainer {rank}, attempt 0: preempted at step 0 (SIGUSR1)" in text
        assert f"fake trainer {rank}, attempt 1: done" in text
    assert f"requeueing job {jid} to resume there" in text
    assert f"job {jid} (r1jax), restart 0:" in text and f"job {jid} (r1jax), restart 1:" in text
    assert "training exited with code 0" in text
    expected = ["-m", "r1jax.train", "--config", str(TINY), "--run-dir", str(run_dir), *overrides]
    if how != "scancel":
        expected[5] = f"runs/tiny-{jid}"
    for attempt in (0, 1):
        for rank in (0, 1):
            assert json.loads((run_dir / f"argv-{attempt}-{rank}.json").read_text()) == expected
    assert json.loads((run_dir / "final.json").read_text()) == {"step": 1, "stopped": None}


@pytest.fixture(scope="module")
def first(slurm, workdir):
    """2 tasks x 4 CPU devices, stopping after STOP_AT steps (train.stop_at: a stop that is not
    requeued), in the seeds' layout scaled down: a pipeline across the tasks (nodes), tensor x data
    inside each. The second submission resumes on the default mesh (data 8)."""
    run_dir = workdir / "run"
    t0 = time.time()
    jid = slurm.submit(workdir, "--run-dir", str(run_dir), *ARGS, f"train.stop_at={STOP_AT}", *SEED_LAYOUT, **_env())
    log = workdir / "logs" / f"r1jax-{jid}.out"
    info = slurm.wait(jid, log)
    print(f"\njob {jid} (2 tasks x 4 devices, {STOP_AT} steps): {info.get('JobState')} in {time.time() - t0:.1f} s")
    return jid, info, log, run_dir


def test_sbatch_trains_and_checkpoints(first):
    jid, info, log, run_dir = first
    text = log.read_text() if log.is_file() else ""
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-3000:])
    assert info["Restarts"] == "0" and "requeueing" not in text
    assert f"job {jid} (r1jax), restart 0: 2 tasks on 1 node(s)" in text
    # one mesh over both processes' 4 devices, each process one pipeline stage
    assert "'data': 2, 'fsdp': 1, 'tensor': 2, 'expert': 1, 'pipeline': 2}; across processes: pipeline 2" in text
    assert f"stopped at step {STOP_AT} (train.stop_at)" in text
    assert "training exited with code 0" in text
    assert _steps(run_dir) == list(range(1, STOP_AT + 1))
    final = _final(run_dir)
    assert final["step"] == STOP_AT and final["stopped"] == "train.stop_at"
    data = run_dir / "checkpoints" / str(STOP_AT) / "data"
    assert sorted(p.name for p in data.glob("*.json")) == ["process_0-of-2.json", "process_1-of-2.json"]


def test_second_submission_resumes(slurm, workdir, first):
    """A new job on the same run directory continues from the first one's checkpoint to train.steps."""
    _, info, _, run_dir = first
    assert info["JobState"] == "COMPLETED"
    t0 = time.time()
    jid = slurm.submit(workdir, "--run-dir", str(run_dir), *ARGS, **_env())
    log = workdir / "logs" / f"r1jax-{jid}.out"
    info = slurm.wait(jid, log)
    print(f"\njob {jid} (resumed at step {STOP_AT}, to {STEPS}): {info.get('JobState')} in {time.time() - t0:.1f} s")
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-3000:])
    assert info["Restarts"] == "0" and "requeueing" not in text
    assert f"resumed from {run_dir / 'checkpoints' / str(STOP_AT)} (step {STOP_AT})" in text
    assert "restarting the data stream" not in text     # each process restored its own data state
    assert _steps(run_dir) == list(range(1, STEPS + 1))          # every step exactly once, in order
    final = _final(run_dir)
    assert final["step"] == STEPS and final["stopped"] is None
    data = run_dir / "checkpoints" / str(STEPS) / "data"
    assert sorted(p.name for p in data.glob("*.json")) == ["process_0-of-2.json", "process_1-of-2.json"]

"""Multi-process start-up (`jax.distributed`) and the one cross-process vote the loop needs.

Where the processes come from decides how they meet:
- `python -m r1jax.launch --local N` sets R1JAX_COORDINATOR / R1JAX_NUM_PROCESSES /
  R1JAX_PROCESS_ID (and R1JAX_LOCAL_DEVICE_IDS with --devices-per-process): explicit start-up;
- `srun` with more than one task: JAX reads SLURM_* itself (coordinator = first node of the step,
  port 61440 + job id % 4096 unless JAX_COORDINATOR_PORT is set);
- anything else, including the batch step of an sbatch script run without srun when the job has
  one task, is a single process and starts nothing.

A process whose peers do not all join within `distributed.init_timeout_s` prints one line and
exits 1. JAX itself would abort only after about twice that, with a C++ CHECK failure and a stack.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading

from r1jax.config import ConfigError

EXIT_NO_PEERS = 1
ENV_COORDINATOR, ENV_NUM, ENV_ID, ENV_DEVICES = (
    "R1JAX_COORDINATOR", "R1JAX_NUM_PROCESSES", "R1JAX_PROCESS_ID", "R1JAX_LOCAL_DEVICE_IDS")


def _int_env(env, name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise ConfigError(f"{name}={env.get(name)!r}: must be set to an integer "
                          f"(with {ENV_COORDINATOR}; see python -m r1jax.launch)") from None


def plan(env: dict[str, str] | None = None) -> dict | None:
    """How this process starts: None (single process) or the keyword arguments of
    `jax.distributed.initialize` (empty for SLURM auto-detection). Pure, for tests."""
    env = os.environ if env is None else env
    if env.get(ENV_COORDINATOR):
        num, pid = _int_env(env, ENV_NUM), _int_env(env, ENV_ID)
        if not 0 <= pid < num:
            raise ConfigError(f"{ENV_ID}={pid}: must be in [0, {ENV_NUM}={num})")
        kw = {"coordinator_address": env[ENV_COORDINATOR], "num_processes": num, "process_id": pid}
        if env.get(ENV_DEVICES):
            kw["local_device_ids"] = [int(x) for x in env[ENV_DEVICES].split(",")]
        return kw if num > 1 else None
    if "SLURM_JOB_ID" not in env:
        return None
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    if tasks <= 1:
        return None
    if "SLURM_STEP_NODELIST" not in env:
        # the batch script itself (or an salloc shell): one process of a job that asked for several
        raise ConfigError(f"SLURM job {env['SLURM_JOB_ID']} has {tasks} tasks but this process was not started "
                          f"by srun; run `srun python -m r1jax.train ...` (see launch/slurm/train.sbatch)")
    kw: dict = {}
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible and not env.get("JAX_LOCAL_DEVICE_IDS"):
        # JAX would restrict each task to GPU number SLURM_LOCALID, which is wrong both for one task
        # per node (it would see 1 of 8 GPUs) and for --gpus-per-task=1 (SLURM already left it one GPU)
        kw["local_device_ids"] = list(range(len(visible.split(","))))
    return kw


def initialize(timeout_s: int, heartbeat_timeout_s: int = 100) -> None:
    """Join the other processes (if any) before anything touches the JAX backend, then watch them
    (`Heartbeat`)."""
    kw = plan()
    if kw is None:
        return
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = kw.get("coordinator_address") or "the SLURM step's first node"
    who = (f"process {kw['process_id']} of {kw['num_processes']}" if "process_id" in kw
           else f"task {os.environ.get('SLURM_PROCID')} of {os.environ.get('SLURM_STEP_NUM_TASKS') or os.environ.get('SLURM_NTASKS')}")
    joined = threading.Event()

    def watchdog():   # connect() releases the GIL, so this thread runs while it blocks
        if not joined.wait(timeout_s):
            print(f"error: {who}: not every process joined the coordinator at {where} within {timeout_s} s "
                  f"(distributed.init_timeout_s); did they all start?", file=sys.stderr, flush=True)
            os._exit(EXIT_NO_PEERS)
    threading.Thread(target=watchdog, name="r1jax-join-watchdog", daemon=True).start()
    try:
        # JAX's own deadlines are later than ours, so our clear lines come first
        jax.distributed.initialize(initialization_timeout=timeout_s + 60,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s + HEARTBEAT_MARGIN_S, **kw)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"distributed start-up ({who}, coordinator {where}): "
                          f"{str(e).strip().splitlines()[0]}") from None
    finally:
        joined.set()
    _HEARTBEAT["beat"] = Heartbeat(heartbeat_timeout_s)
    _HEARTBEAT["beat"].start()


HEARTBEAT_MARGIN_S = 30
_HEARTBEAT: dict = {}


def await_peers_verdict() -> None:
    """After a collective failed (gloo: "Connection reset by peer" when a peer died mid-step): give
    the heartbeat the time it needs to name the missing process (it exits the process with that
    line); return when it found every peer alive, so the caller reports the error itself."""
    import time
    beat = _HEARTBEAT.get("beat")
    if beat is not None:
        time.sleep(beat.timeout_s + 2 * beat.interval_s)


class Heartbeat:
    """Every process beats into the coordination service's key-value store and reads everyone
    else's beats; a peer silent for `timeout_s` (distributed.heartbeat_timeout_s) is taken as dead,
    and so is the coordinator when it stops answering. Then this process prints one line naming
    the missing process and exits 1.

    Why not leave it to JAX: its service notices too (after its own heartbeat timeout, set
    HEARTBEAT_MARGIN_S later), but it aborts the process with a C++ CHECK failure and a stack
    trace; and gloo's collectives never notice a dead peer, so without either the survivors hang
    in their next all-reduce. The beat is a thread: XLA releases the GIL while it computes or
    compiles, so a busy process still beats, and one that is truly stuck is reported as such.

    The thread is stopped and joined at exit (`stop`, an atexit hook that runs before JAX's own,
    which shuts the client down). Left running, a beat that returns from the client while CPython
    finalises is unwound inside the binding's C++ frame, and the process aborts with "FATAL:
    exception not rethrown" (exit 134) after a run that finished: 11 of 20 processes did with a
    0.5 ms beat before this hook."""

    def __init__(self, timeout_s: float, interval_s: float | None = None):
        import jax
        from jax._src import distributed as jd
        self.client, self.me, self.n = jd.global_state.client, jax.process_index(), jax.process_count()
        self.timeout_s = timeout_s
        self.interval_s = interval_s or max(0.5, min(5.0, timeout_s / 5))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="r1jax-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()
        atexit.register(self.stop)       # atexit runs the latest first: before JAX's client shutdown

    def stop(self) -> None:
        """End the beat and wait for it; a beat stuck on an unreachable coordinator is given up
        on after `timeout_s`."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.timeout_s)

    def _run(self) -> None:
        import time
        beat, seen, answered = 0, {}, time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                self.client.key_value_set(f"r1jax/heartbeat/{self.me}", str(beat), allow_overwrite=True)
                beats = dict(self.client.key_value_dir_get("r1jax/heartbeat/"))
                answered = now
            except Exception:        # the coordinator (process 0) is gone or unreachable
                if self.me != 0 and now - answered > self.timeout_s:
                    self._die(f"the coordinator (process 0 of {self.n}) has not answered for {now - answered:.0f} s")
                beats = None
            if beats is not None:
                for i in range(self.n):
                    value = beats.get(f"r1jax/heartbeat/{i}")
                    last = seen.get(i)
                    if last is None or last[0] != value:
                        seen[i] = (value, now)
                    elif i != self.me and value is not None and now - last[1] > self.timeout_s:
                        self._die(f"process {i} of {self.n} has sent no heartbeat for {now - last[1]:.0f} s")
            beat += 1
            self._stop.wait(self.interval_s)

    def _die(self, why: str) -> None:
        print(f"error: process {self.me}: {why} (distributed.heartbeat_timeout_s={self.timeout_s:g}); it died or "
              f"hangs, stopping", file=sys.stderr, flush=True)
        os._exit(EXIT_NO_PEERS)


def barrier(name: str, timeout_s: int = 3600) -> None:
    """Wait until every process gets here, through the coordination service rather than a device
    collective: gloo gives a process only 30 s to join a collective it has not run before."""
    import jax
    if jax.process_count() > 1:
        import orbax.checkpoint as ocp
        ocp.multihost.get_barrier_sync_fn()(key=name, timeout_ms=timeout_s * 1000)


class StopVote:
    """Every process learns, at the same step, whether any of them was asked to stop.

    Each call contributes this process's signal number (0: none) to a max over all devices and
    returns the result of the previous call's vote: reading it one step late keeps the host from
    waiting on the step just dispatched, and every process reads the same vote at the same step."""

    def __init__(self):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        self._jax, self._np = jax, np
        mesh = Mesh(np.asarray(jax.devices()), ("all",))
        self._in = NamedSharding(mesh, P("all"))
        self._shape = (jax.device_count(),)
        self._local = jax.local_device_count()
        self._max = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))
        self._pending = None

    def __call__(self, signum: int) -> int:
        flags = self._np.full((self._local,), signum, self._np.int32)
        vote = self._max(self._jax.make_array_from_process_local_data(self._in, flags, self._shape))
        previous, self._pending = self._pending, vote
        return 0 if previous is None else int(previous)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name

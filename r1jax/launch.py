"""python -m r1jax.launch --local N [--devices-per-process K] [--timeout S] -- TRAIN ARGS

Starts N processes of `python -m r1jax.train TRAIN ARGS` on this machine that form one JAX
job (a coordinator on a free local port; see r1jax/parallel/distributed.py). Each output line is
prefixed with its process number; gloo's connection chatter is dropped (see ChatterFilter). SLURM_* variables are
removed from the children's environment, so a launch inside a SLURM allocation stays local.

The launcher waits for all of them. The first to exit non-zero is reported in one line, the
others are killed (a job missing a process cannot progress), and that code is returned; 0 when
all succeed. SIGTERM, SIGUSR1 and SIGINT are passed on to every process (the trainer saves
and stops on the first two).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

# Gloo prints "[Gloo] Rank R is connected to P peer ranks. Expected number of connected peer ranks
# is : E" with std::cout, one `<<` at a time, from one thread per communicator. Threads share the
# C stdio buffer, so concurrent connects interleave the pieces within and across lines (seen in
# CI: "[Gloo] Rank 1[Gloo] Rank 1 is connected to ...", then a line that is just "1").
GLOO_PIECE = re.compile(r"(?:\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer "
                        r"ranks is :)[ \d]*")
DIGITS = re.compile(r"[\s\d]*")
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(i: int, n: int, port: int, devices: int | None, base: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
    env.update(R1JAX_COORDINATOR=f"127.0.0.1:{port}", R1JAX_NUM_PROCESSES=str(n), R1JAX_PROCESS_ID=str(i),
               R1JAX_LOCAL_RANK=str(i), PYTHONUNBUFFERED="1")     # all on this host: rank = process id
    if devices:
        env["JAX_NUM_CPU_DEVICES"] = str(devices)      # CPU: K virtual devices per process
        env["R1JAX_LOCAL_DEVICE_IDS"] = ",".join(str(i * devices + k) for k in range(devices))  # GPU: its own K
    return env


class ChatterFilter:
    """Drops gloo's connection chatter from a stream, line by line, however its pieces interleave.

    A line made only of gloo's fixed pieces, rank numbers and spaces is dropped, and so is a line of
    bare digits that follows one (a number whose text went to an earlier line). Pieces glued to a
    real line are cut out of it and the rest is kept.
    """

    def __init__(self) -> None:
        self.in_chatter = False

    def __call__(self, line: str) -> str | None:
        rest = GLOO_PIECE.sub("", line)
        if DIGITS.fullmatch(rest) and (rest != line or self.in_chatter):
            self.in_chatter = True
            return None
        self.in_chatter = False
        return rest


def _pump(stream, out, prefix: str) -> None:
    keep = ChatterFilter()
    for raw in iter(stream.readline, b""):
        line = keep(raw.decode(errors="replace"))
        if line is not None:
            out.write(prefix + line)
            out.flush()
    stream.close()


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)   # its own session: Grain workers go with it
            except ProcessLookupError:
                pass


def launch(n: int, train_args: list[str], devices: int | None = None, timeout: int | None = None) -> int:
    port = free_port()
    if timeout:
        train_args = [*train_args, f"distributed.init_timeout_s={timeout}"]
    cmd = [sys.executable, "-m", "r1jax.train", *train_args]
    procs, pumps = [], []
    old = {s: signal.getsignal(s) for s in FORWARDED}

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    for s in FORWARDED:
        signal.signal(s, forward)
    try:
        for i in range(n):
            p = subprocess.Popen(cmd, env=child_env(i, n, port, devices), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True)
            procs.append(p)
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, out, f"[{i}] "), daemon=True)
                t.start()
                pumps.append(t)
        rc = 0
        while any(p.poll() is None for p in procs):
            failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                i, rc = failed[0]
                print(f"launch: process {i} exited with code {rc}; stopping the other {n - 1}",
                      file=sys.stderr, flush=True)
                _kill(procs)
                break
            time.sleep(0.1)
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=5)
        if rc == 0:
            rc = next((p.returncode for p in procs if p.returncode != 0), 0)
        return 128 - rc if rc < 0 else rc       # killed by a signal: the shell's convention
    finally:
        _kill(procs)
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="python -m r1jax.launch",
                                 usage="python -m r1jax.launch --local N [--devices-per-process K] [--timeout S] "
                                       "-- --config FILE [--run-dir DIR] [key=value ...]",
                                 description="Run python -m r1jax.train as N processes of one JAX job on this machine.")
    ap.add_argument("--local", type=int, required=True, metavar="N", help="number of processes")
    ap.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                    help="CPU: K virtual devices each (JAX_NUM_CPU_DEVICES); GPU: process i gets GPUs iK..iK+K-1")
    ap.add_argument("--timeout", type=int, default=None, metavar="S",
                    help="seconds for all processes to join (sets distributed.init_timeout_s)")
    args = ap.parse_args(ours)
    for name, value in (("--local", args.local), ("--devices-per-process", args.devices_per_process),
                        ("--timeout", args.timeout)):
        if value is not None and value < 1:
            print(f"launch: {name}={value}: must be a positive integer", file=sys.stderr)
            return 2
    if "--config" not in train_args and not any(a.startswith("--config=") for a in train_args):
        print("launch: nothing to train; put the trainer's arguments after --, e.g. -- --config configs/tiny.yaml",
              file=sys.stderr)
        return 2
    return launch(args.local, train_args, args.devices_per_process, args.timeout)


if __name__ == "__main__":
    sys.exit(main())

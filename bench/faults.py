"""Kill -9: a training run killed with SIGKILL at random moments and restarted until it finishes
trains exactly like the same run left alone.

    python bench/faults.py --kills 7 --seed 0 [--steps 24] [--every 2] [--out bench/results/faults.json]

A run of tiny.yaml (`--steps` steps, a checkpoint every `--every`) is killed `--kills` times
(seeded) and restarted after each kill until it finishes. Each kill falls within its share of the
steps left: about half of the kills (and the first) wait until a step drawn from that share is
logged and a checkpoint write is in progress (Orbax's `<step>.orbax-checkpoint-tmp` under
checkpoints/) and kill then; the others at a uniformly random moment of the time the run is
expected to take to the end of that share, start-up included (timed on the runs before). A kill
counts as during a write when the temporary directory is still there after it. Then the same
run, left alone, in another directory; every step's loss in the two metrics.jsonl (the last
record of each step: a resumed run logs again the steps after its checkpoint) is compared
bitwise.

Prints and writes (`--out`, and the markdown table beside it): kills, kills during a checkpoint
write, restarts, the steps each restart resumed from, steps compared, max |loss difference| and
how many losses are not bitwise equal. Exits 1 when a loss differs or a run fails on its own.
One CPU device; `JAX_COMPILATION_CACHE_DIR` is shared by all runs (a temporary one unless set).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
TMP = ".orbax-checkpoint-tmp"


def command(run_dir: Path, steps: int, every: int) -> list[str]:
    return [sys.executable, "-m", "r1jax.train", "--config", str(TINY), "--run-dir", str(run_dir),
            f"train.steps={steps}", f"checkpoint.every={every}", "train.log_every=1", "train.eval_batches=0"]


def environment(cache: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "R1JAX_"))}
    env.update(JAX_NUM_CPU_DEVICES="1", JAX_COMPILATION_CACHE_DIR=cache, PYTHONUNBUFFERED="1",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return env


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss, from its last record (a killed run may leave a torn last line)."""
    out = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "split" not in rec and "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def writing(ckpt: Path) -> bool:
    return ckpt.is_dir() and any(TMP in p.name for p in ckpt.iterdir())


class Run:
    """One training process in its own session (its process group is what a kill ends), and
    when it logged each step."""

    def __init__(self, run_dir: Path, cmd: list[str], env: dict, log: Path):
        self.run_dir = run_dir
        self.log = open(log, "w")
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.records0, self.times = self._records(), []

    def _records(self) -> int:
        p = self.run_dir / "metrics.jsonl"
        return len(p.read_text().splitlines()) if p.is_file() else 0

    def poll(self) -> bool:
        """Still running? Notes the time of each record it logged since the last poll."""
        alive = self.proc.poll() is None
        n = self._records() - self.records0
        self.times += [time.time() - self.t0] * (n - len(self.times))
        return alive

    def timing(self) -> tuple[float | None, float | None]:
        """(seconds to its first logged step, seconds a step) as observed, None where unseen."""
        first = self.times[0] if self.times else None
        per = (self.times[-1] - self.times[0]) / (len(self.times) - 1) if len(self.times) > 1 else None
        return first, per

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()

    def finish(self, timeout: float) -> int:
        deadline = time.time() + timeout
        while self.poll() and time.time() < deadline:
            time.sleep(0.05)
        if self.proc.poll() is None:
            self.kill()
            return -9
        self.log.close()
        return self.proc.returncode


def killed_runs(work: Path, args, env) -> dict:
    """The run killed args.kills times and restarted after each; returns what happened. The first
    kill waits for a checkpoint write (and so for the run to get going, which also times its
    start-up and steps: the moments of the later kills are drawn over the life that leaves)."""
    rng = random.Random(args.seed)
    run_dir, ckpt = work / "killed", work / "killed" / "checkpoints"
    cmd = command(run_dir, args.steps, args.every)
    events, kills, n, startup, per_step = [], 0, 0, None, None
    while True:
        n += 1
        log = work / f"killed.{n}.log"
        run = Run(run_dir, cmd, env, log)
        if kills < args.kills:
            done = max(losses(run_dir), default=0)
            kind = "write" if kills == 0 or rng.random() < 0.5 else "moment"
            # this kill falls within its share of the steps left before the last checkpoint, so that
            # the run cannot finish before the later kills: a write, at the first checkpoint written
            # once a step drawn from that share is logged; a moment, anywhere in the time it takes
            # to get there, start-up included
            window = max(1, (args.steps - args.every - done) // (args.kills - kills))
            target = rng.randrange(done + 1, done + 1 + window)
            at = rng.uniform(0.0, (startup or 10.0) + window * (per_step or 1.0)) if kind == "moment" else None
            while run.poll():
                if kind == "moment" and time.time() - run.t0 >= at:
                    break
                if kind == "write" and run.times and max(losses(run_dir), default=0) >= target and writing(ckpt):
                    time.sleep(rng.uniform(0.0, 0.05))
                    break
                time.sleep(0.002 if kind == "write" else 0.01)
            first, per = run.timing()
            startup, per_step = first or startup, per or per_step
            if run.proc.poll() is None:
                run.kill()
                kills += 1
                events.append({"kill": kills, "kind": kind, "after_s": round(time.time() - run.t0, 2),
                               "last_logged_step": max(losses(run_dir), default=0),
                               # (before its first step a run may still see the last kill's leftovers)
                               "during_write": bool(run.times) and writing(ckpt)})
                e = events[-1]
                during = ", during a checkpoint write" if e["during_write"] else ""
                print(f"kill {kills}: {kind}, {e['after_s']} s into run {n}, last logged step "
                      f"{e['last_logged_step']}{during}", flush=True)
                continue
        rc = run.finish(timeout=600)
        if rc:
            raise SystemExit(f"run {n} exited {rc} without being killed; see {log}")
        break
    # every restart's log: where it resumed, and any fallback from a checkpoint that would not restore
    resumed, fallbacks = [], 0
    for i in range(2, n + 1):
        text = (work / f"killed.{i}.log").read_text()
        m = re.search(r"resumed from .* \(step (\d+)\)", text)
        # no such line: it started afresh (no checkpoint yet), or was killed before it got that far
        resumed.append(int(m.group(1)) if m else 0 if re.search(r"^step \d+/", text, re.M) else None)
        fallbacks += text.count("cannot be restored")
    return {"events": events, "kills": kills, "kills_during_write": sum(e["during_write"] for e in events),
            "restarts": n - 1, "resumed_from": resumed, "fallbacks": fallbacks, "losses": losses(run_dir),
            "startup_s": startup, "per_step_s": per_step}


def reference(work: Path, args, env) -> dict[int, float]:
    """The same run left alone."""
    run_dir = work / "reference"
    run = Run(run_dir, command(run_dir, args.steps, args.every), env, work / "reference.log")
    rc = run.finish(timeout=600)
    if rc:
        raise SystemExit(f"the reference run failed (exit {rc}); see {work / 'reference.log'}")
    return losses(run_dir)


def cpu_name() -> str:
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def markdown(r: dict) -> str:
    rows = [("kills", r["kills"]), ("kills during a checkpoint write", r["kills_during_write"]),
            ("restarts", r["restarts"]),
            ("step each restart resumed from (0: from scratch; —: killed before it resumed)",
             ", ".join("—" if s is None else str(s) for s in r["resumed_from"])),
            ("checkpoints that would not restore (fallbacks)", r["fallbacks"]),
            ("steps compared", r["steps_compared"]), ("largest loss difference (absolute)", f"{r['max_abs_diff']:.3g}"),
            ("losses not bitwise equal", r["not_bitwise_equal"])]
    return "\n".join([
        "# Faults (kill -9)", "",
        f"`{r['command']}` on {r['date']}, {r['wall_s']:.0f} s.", "",
        "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], "",
        f"Machine: {r['machine']}. tiny.yaml, {r['steps']} steps, a checkpoint every {r['every']} "
        f"(checkpoint.keep 2), one CPU device; a restart took about {r['startup_s']:.1f} s to its first "
        f"step, then {r['per_step_s']:.2f} s a step. Kill moments: seeded (--seed {r['seed']}), each within "
        f"its share of the steps left; about half wait for a checkpoint write in progress, the others fall "
        f"anywhere in the time to the end of their share, start-up included.", ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "faults.json")
    ap.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    args = ap.parse_args(argv)
    t0 = time.time()
    work = args.work or Path(tempfile.mkdtemp(prefix="r1jax-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    for d in ("reference", "killed"):
        shutil.rmtree(work / d, ignore_errors=True)
    env = environment(os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(work / "jit-cache"))
    r = killed_runs(work, args, env)
    got = r.pop("losses")
    want = reference(work, args, env)
    steps = sorted(set(want) | set(got))
    diffs = [abs(got[s] - want[s]) if s in got and s in want else float("inf") for s in steps]
    shown = " ".join(["python", "bench/faults.py", *(argv if argv is not None else sys.argv[1:])])
    r.update(command=shown, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
             machine=f"{cpu_name()}, {len(os.sched_getaffinity(0))} CPUs, Python {platform.python_version()}",
             seed=args.seed, steps=args.steps, every=args.every,
             steps_compared=len(steps), max_abs_diff=max(diffs, default=0.0),
             not_bitwise_equal=sum(d != 0 for d in diffs), wall_s=time.time() - t0)
    md = markdown(r)
    print(md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(r, indent=2))
        args.out.with_suffix(".md").write_text(md)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    ok = r["not_bitwise_equal"] == 0 and len(steps) == args.steps
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

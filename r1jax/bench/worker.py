"""One benchmark measurement in its own process: `python -m MODULE SPEC.json RESULT.json`.

Every run (each framework, dtype, batch size) gets a fresh interpreter, so that no run inherits
another's threads, caches or allocator state, and the reference's imports stay out of r1jax's.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run(module: str, spec: dict, workdir: Path, name: str) -> dict:
    """MODULE's result for `spec` (written as workdir/NAME.spec.json); a failure raises with the
    last lines the process printed."""
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", module, str(spec_path), str(out_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not out_path.is_file():
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise RuntimeError(f"{module} ({name}) failed with exit code {proc.returncode}:\n{tail}")
    return json.loads(out_path.read_text())

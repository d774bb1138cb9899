"""What a checkpoint step held when it was written, checked before it is read back.

Orbax checksums only its OCDBT index: a byte flipped inside a compressed chunk of a data file
decodes to other numbers and restores without an error (measured: tiny.yaml, a flip in the
middle of the MoE stack's data file changed `gate_EDF` silently). So each process records the
size and CRC32 of the files it wrote (`r1jax_files.process_<i>.json` in the step directory) and a
restore compares them first, each process a share of the manifests. Process 0's is written while
the step is still Orbax's temporary directory (Orbax runs that callback on process 0 only), so it commits
with the step; another process's is written once the step has committed, so a kill in between
leaves that process's files unchecked, not the step refused. A step without manifests (written
before them, or by another tool) is read unchecked. Cost, measured on a 76M-parameter state
(808 MiB in 32 files, 2 shared cores): recording 0.26 s (from the page cache, in the background),
checking 0.30 s warm and 0.66 s cold, against 2.8 s to save and 3-4 s to restore.

Which process wrote a file follows Orbax's layout: `ocdbt.process_<i>/`,
`array_metadatas/process_<i>` and Grain's `process_<i>-of-<n>.json` are process i's; the rest
(tree metadata, the merged OCDBT root, the meta item) are process 0's.

`agree` makes a per-process finding collective: with several processes, one that finds a fault
alone would otherwise take another path than its peers and leave them waiting in Orbax's next
barrier.
"""
from __future__ import annotations

import errno
import itertools
import json
import os
import re
import zlib
from pathlib import Path

MANIFEST = "r1jax_files.process_{}.json"
_MANIFEST_RE = re.compile(r"r1jax_files\.process_(\d+)\.json$")
# written by Orbax after the manifest (at the rename), or never read by a restore
_UNRECORDED = {"commit_success.txt", "_CHECKPOINT_METADATA"}
_OWNER_RE = re.compile(r"(?:^|/)(?:ocdbt\.)?process_(\d+)(?:-of-\d+\.json)?(?:/|$)")
_CHUNK = 16 << 20
# the causes worth naming, as the C library (and so tensorstore's messages) spells them
_CAUSES = [os.strerror(e) for e in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO)]


def owner(rel: str) -> int:
    m = _OWNER_RE.search(rel)
    return int(m.group(1)) if m else 0


def crc32(path: Path) -> int:
    c = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            c = zlib.crc32(chunk, c)
    return c


def _files(step_dir: Path):
    for p in sorted(step_dir.rglob("*")):
        if p.is_file() and p.name not in _UNRECORDED and not _MANIFEST_RE.match(p.name):
            yield p.relative_to(step_dir).as_posix(), p


def record(step_dir: Path, process: int, processes: int) -> int:
    """Write process `process`'s manifest into `step_dir`; returns the bytes it covers."""
    files = {rel: [p.stat().st_size, crc32(p)] for rel, p in _files(step_dir) if owner(rel) == process}
    out = step_dir / MANIFEST.format(process)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"processes": processes, "files": files}))
    os.replace(tmp, out)
    return sum(size for size, _ in files.values())


def recorded_bytes(step_dir: Path, process: int) -> int:
    """The bytes process `process` wrote for a step, as its manifest says (0 without one)."""
    try:
        files = json.loads((step_dir / MANIFEST.format(process)).read_text())["files"]
        return sum(size for size, _ in files.values())
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def verify(step_dir: Path, process: int, processes: int) -> str | None:
    """The first difference between `step_dir` and its manifests (this process's share of them:
    those of saving processes i with i % processes == process), or None. None too for a step
    without manifests."""
    found = {int(m.group(1)): p for p in step_dir.glob(MANIFEST.format("*"))
             if (m := _MANIFEST_RE.match(p.name))}
    if not found:
        return None
    for i in sorted(found):
        if i % processes != process:
            continue
        try:
            manifest = json.loads(found[i].read_text())
            files = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{found[i].name}: unreadable ({type(e).__name__}: {first_line(e)})"
        for rel, (size, crc) in files.items():
            p = step_dir / rel
            try:
                have = p.stat().st_size
                if have != size:
                    return f"{rel}: {have} bytes, {size} when written (truncated or overwritten)"
                if crc32(p) != crc:
                    return f"{rel}: its contents changed since it was written (CRC32 differs)"
            except FileNotFoundError:
                return f"{rel}: missing"
            except OSError as e:
                return f"{rel}: {e.strerror or first_line(e)}"
    return None


def first_line(e: BaseException) -> str:
    s = str(e).strip()
    return (s.splitlines()[0] if s else type(e).__name__)[:300]


def cause(e: BaseException) -> str:
    """One line for an exception from a write or read: the OS's reason when its message (or one
    it was raised from) carries one, else its first line."""
    while e is not None:
        if isinstance(e, OSError) and e.strerror:
            return e.strerror
        text = str(e)
        for c in _CAUSES:
            if c in text:
                return c
        nxt = e.__cause__ or e.__context__
        if nxt is None:
            break
        e = nxt
    return f"{type(e).__name__}: {first_line(e)}"


_ROUNDS = itertools.count()


def agree(problem: str | None) -> str | None:
    """Every process's `problem` (None: none) -> the first one found, as every process sees it.
    Collective: every process calls it at the same point. One process: `problem` itself."""
    import jax
    n = jax.process_count()
    if n == 1:
        return problem
    from jax._src import distributed as jd

    from r1jax.parallel import distributed
    client = jd.global_state.client
    key = f"r1jax/checkpoint/agree/{next(_ROUNDS)}"
    client.key_value_set(f"{key}/{jax.process_index()}", "" if problem is None else problem)
    distributed.barrier(f"{key}/barrier", timeout_s=600)
    found = dict(client.key_value_dir_get(f"{key}/"))
    for i in range(n):
        v = found.get(f"{key}/{i}", "")
        if v:
            return f"process {i}: {v}"
    return None

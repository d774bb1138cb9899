"""Streaming safetensors reader and writer with bounded memory.

The `safetensors` package memory-maps files (every page read stays in the process's RSS while
the map lives) and serialises a whole dict at once. Conversion of a checkpoint larger than RAM
needs neither: this reader `readinto`s one tensor at a time, and the writer lays out the header
from shapes alone, then asks for each tensor's bytes in order. Sharded checkpoints
(`model.safetensors.index.json`) work both ways. bf16 and fp8 go through `ml_dtypes`.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
CODES = {v: k for k, v in DTYPES.items()}
FP8 = (DTYPES["F8_E4M3"], DTYPES["F8_E5M2"])
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message is one line."""


class Reader:
    """Tensors of a safetensors checkpoint directory (one file, or shards with an index)."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        self.dir = d
        if (d / INDEX).is_file():
            weight_map = json.loads((d / INDEX).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (d / SINGLE).is_file():
            files = [SINGLE]
        else:
            files = sorted(p.name for p in d.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{d}: no {SINGLE}, {INDEX} or *.safetensors files")
        self._entries: dict[str, tuple[Path, int, tuple[int, ...], np.dtype]] = {}
        for name in files:
            path = d / name
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in {INDEX} but missing")
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) != 8:
                    raise CheckpointError(f"{path}: truncated safetensors header")
                (n,) = struct.unpack("<Q", raw)
                try:
                    header = json.loads(f.read(n))
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise CheckpointError(f"{path}: unreadable safetensors header") from None
            size = path.stat().st_size
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                if info["dtype"] not in DTYPES:
                    raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {info['dtype']}")
                begin, end = info["data_offsets"]
                dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
                if 8 + n + end > size or end - begin != int(np.prod(shape)) * dtype.itemsize:
                    raise CheckpointError(f"{path}: tensor {key} runs past the end of the file (truncated?)")
                self._entries[key] = (path, 8 + n + begin, shape, dtype)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][2]

    def dtype(self, key: str) -> np.dtype:
        return self._entries[key][3]

    def read(self, key: str) -> np.ndarray:
        try:
            path, offset, shape, dtype = self._entries[key]
        except KeyError:
            raise CheckpointError(f"{self.dir}: tensor {key} is missing") from None
        out = np.empty(shape, dtype)
        with open(path, "rb") as f:
            f.seek(offset)
            f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
        return out


def _plan_shards(specs: list[tuple[str, tuple[int, ...], np.dtype]], max_bytes: int):
    shards, cur, cur_bytes = [], [], 0
    for spec in specs:
        nbytes = int(np.prod(spec[1])) * np.dtype(spec[2]).itemsize
        if cur and cur_bytes + nbytes > max_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(spec)
        cur_bytes += nbytes
    if cur:
        shards.append(cur)
    return shards


def write(directory: str | Path, specs: Iterable[tuple[str, tuple[int, ...], np.dtype]],
          produce: Callable[[str], np.ndarray], max_shard_bytes: int = 5 * 2**30, single: str = SINGLE) -> list[str]:
    """Write tensors `specs` (name, shape, dtype), fetching each with `produce(name)` just in time.

    Returns the file names written (`single` when one shard does); more than one shard also
    writes the HF index file."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(list(specs), max_shard_bytes)
    names = [single] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, shape, dtype in shard:
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            header[key] = {"dtype": CODES[np.dtype(dtype)], "shape": list(shape),
                           "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[key] = fname
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        tmp = d / (fname + ".tmp")
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for key, shape, dtype in shard:
                arr = np.ascontiguousarray(produce(key), dtype=dtype)
                if arr.shape != tuple(shape):
                    raise ValueError(f"{key}: produced shape {arr.shape}, planned {tuple(shape)}")
                f.write(memoryview(arr.reshape(-1).view(np.uint8)))
                del arr
        os.replace(tmp, d / fname)
        total += offset
    if len(names) > 1:
        (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                          indent=2))
    return names

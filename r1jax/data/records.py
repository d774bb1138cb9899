"""Columnar and record files as document sources: Parquet (a text column) and ArrayRecord
(records of UTF-8 text or JSON objects).

Both keep an index of the non-blank documents' global row/record numbers, built in one scan at
open, so Grain can shuffle and shard by document. ArrayRecord is made for random access. Parquet
is read a row group at a time, so an LRU cache of decoded row groups (256 MB per process) serves
the reads. A corpus larger than that pays one row-group read for most documents under a global
shuffle, so write such Parquet with small row groups (about 1-10k rows) or convert it to ArrayRecord.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np

from r1jax.config import ConfigError
from r1jax.data import text as textlib
from r1jax.data.corpus import Corpus, Scan

_CHUNK = 4096          # records per read while scanning
_CACHE_BYTES = 256 << 20  # decoded Parquet text kept per process (and per Grain worker)


def _open_parquet(path: str):
    import pyarrow.parquet as pq
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError with multi-line messages
        raise ConfigError(f"data.paths: {path} is not a Parquet file ({str(e).splitlines()[0]})") from None


class ParquetDocs(Corpus):
    """Documents = non-null, non-blank values of one text column across Parquet files."""

    def __init__(self, files: list[str], groups: np.ndarray, group_start: np.ndarray, rows: np.ndarray,
                 field: str, stats: dict[str, Any], clean: bool):
        self.files, self.groups, self.group_start, self.rows = files, groups, group_start, rows
        self.field, self.stats, self.clean = field, stats, clean
        self._reset()

    def _reset(self) -> None:
        self._handles: dict[int, Any] = {}
        self._cache: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()  # Grain reads with several threads; the LRU is not thread-safe

    @classmethod
    def scan(cls, files: list[Path], field: str, clean: bool) -> "ParquetDocs":
        import pyarrow as pa
        s, groups, group_start, rows, n = Scan(files=len(files)), [], [], [], 0
        for fi, path in enumerate(files):
            pf = _open_parquet(str(path))
            if field not in pf.schema_arrow.names:
                raise ConfigError(f"data.text_field: column '{field}' is not in {path} "
                                  f"(columns: {', '.join(pf.schema_arrow.names)})")
            kind = pf.schema_arrow.field(field).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
                    or pa.types.is_large_binary(kind)):
                raise ConfigError(f"data.text_field: column '{field}' in {path} is {kind}, not text")
            for g in range(pf.num_row_groups):
                groups.append((fi, g))
                group_start.append(n)
                for j, value in enumerate(pf.read_row_group(g, columns=[field]).column(0).to_pylist()):
                    if value is None:
                        s.skipped_empty += 1
                    elif s.text(value, clean) is not None:
                        rows.append(n + j)
                n += pf.metadata.row_group(g).num_rows
        return cls([str(p) for p in files], np.asarray(groups, np.int64).reshape(-1, 2),
                   np.asarray(group_start, np.int64), np.asarray(rows, np.int64), field,
                   dataclasses.asdict(s), clean)

    def __getstate__(self) -> dict[str, Any]:
        # Open files, cached columns and the lock stay behind when Grain ships the source to a worker.
        return {k: v for k, v in self.__dict__.items() if k in ("files", "groups", "group_start", "rows",
                                                                 "field", "stats", "clean")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __len__(self) -> int:
        return len(self.rows)

    def _group(self, k: int):
        with self._lock:
            return self._load(k)

    def _load(self, k: int):
        if k in self._cache:
            self._cache.move_to_end(k)
            return self._cache[k]
        fi, g = (int(x) for x in self.groups[k])
        if fi not in self._handles:
            self._handles[fi] = _open_parquet(self.files[fi])
        column = self._handles[fi].read_row_group(g, columns=[self.field]).column(0).combine_chunks()
        self._cache[k] = column
        self._cached_bytes += column.nbytes
        while len(self._cache) > 1 and self._cached_bytes > _CACHE_BYTES:
            self._cached_bytes -= self._cache.popitem(last=False)[1].nbytes
        return column

    def _text(self, i: int) -> str:
        row = int(self.rows[i])
        k = int(np.searchsorted(self.group_start, row, side="right")) - 1
        value = self._group(k)[row - int(self.group_start[k])].as_py()
        return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


class ArrayRecordDocs(Corpus):
    """Documents = non-blank records. The first non-blank record decides the format for all: a
    JSON object means JSON records with the text under `field`, anything else means UTF-8 text."""

    def __init__(self, files: list[str], keys: np.ndarray, field: str | None, stats: dict[str, Any],
                 clean: bool):
        import grain
        self.files, self.keys, self.field, self.stats, self.clean = files, keys, field, stats, clean
        self.source = grain.sources.ArrayRecordDataSource(files)

    @classmethod
    def scan(cls, files: list[Path], field: str, clean: bool) -> "ArrayRecordDocs":
        from array_record.python.array_record_module import ArrayRecordReader
        s, keys, base, fmt = Scan(files=len(files)), [], 0, None
        for path in files:
            try:
                reader = ArrayRecordReader(str(path))
                count = reader.num_records()
            except Exception as e:  # the C++ reader raises bare RuntimeErrors/ValueErrors
                raise ConfigError(f"data.paths: {path} is not an ArrayRecord file "
                                  f"({str(e).splitlines()[0]})") from None
            for start in range(0, count, _CHUNK):
                for j, raw in enumerate(reader.read(start, min(start + _CHUNK, count)), start):
                    if fmt is None and not textlib.blank(textlib.decode(raw)[0]):
                        fmt = "json" if _is_json_object(raw) else "text"
                    if fmt == "json":
                        text = s.json_text(raw, field, clean, f"{path}:record {j}")
                    else:
                        text = s.text(raw, clean)
                    if text is not None:
                        keys.append(base + j)
            reader.close()
            base += count
        s_dict = dataclasses.asdict(s) | {"format": fmt or "text"}
        return cls([str(p) for p in files], np.asarray(keys, np.int64), field if fmt == "json" else None,
                   s_dict, clean)

    def __len__(self) -> int:
        return len(self.keys)

    def _text(self, i: int) -> str:
        raw = self.source[int(self.keys[i])]
        if self.field is None:
            return raw.decode("utf-8", errors="replace")
        return textlib.unsurrogate(json.loads(raw.decode("utf-8", errors="replace"))[self.field])[0]


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(textlib.decode(raw)[0]), dict)
    except json.JSONDecodeError:
        return False

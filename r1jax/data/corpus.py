"""Corpora: random-access sequences of documents that Grain shuffles and shards by index.

`Corpus` is the interface; `TextFiles` (one document per file) and `LineDocs` (one per
non-empty line, or per JSON Lines object with the text under `data.text_field`) are the text
sources; Parquet and ArrayRecord live in `records.py`; `sources.open_corpus` picks one from the
config. Each source scans its files once
when opened: that builds the index random access needs (byte offsets, row numbers) and counts what
was wrong with the data -- bytes that were not UTF-8, empty documents, malformed JSON lines -- so a
bad corpus is visible in `stats` rather than silently shrunk. Documents are read lazily afterwards.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from r1jax.data import text as textlib


@dataclasses.dataclass
class Scan:
    """What one pass over the data found; becomes `Corpus.stats`."""
    files: int = 0
    documents: int = 0
    skipped_empty: int = 0
    replaced_chars: int = 0   # U+FFFD introduced for undecodable bytes (pre-existing ones excluded)
    bad_records: int = 0      # JSON lines/records that do not parse or lack the text field
    first_bad: str | None = None      # where the first one is (file:line, file:record N)
    first_bad_why: str | None = None  # what is wrong with it, naming data.text_field where it counts
    bytes: int = 0            # UTF-8 bytes of the kept documents

    def text(self, raw: bytes | str, clean: bool, replaced: int = 0) -> str | None:
        """The document's text, or None (counted) when it is blank. Replacements count only in kept
        documents: that is the damage training sees."""
        text, fixed = textlib.decode(raw) if isinstance(raw, bytes) else textlib.unsurrogate(raw)
        if clean:
            text = textlib.clean(text)
        if textlib.blank(text):
            self.skipped_empty += 1
            return None
        self.documents += 1
        self.replaced_chars += replaced + fixed
        self.bytes += len(raw) if isinstance(raw, bytes) else len(text.encode())
        return text

    def json_text(self, raw: bytes, field: str, clean: bool, where: str) -> str | None:
        """The text under `field` of a JSON object, or None (counted) when blank or malformed."""
        text, replaced = textlib.decode(raw)
        if textlib.blank(text):       # a blank line between records is spacing, not a bad record
            self.skipped_empty += 1
            return None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            self.bad(where, "not JSON")
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
            self.bad(where, _why(obj, field))
            return None
        return self.text(obj[field], clean, replaced)

    def bad(self, where: str, why: str | None = None) -> None:
        self.bad_records += 1
        if self.first_bad is None:
            self.first_bad, self.first_bad_why = where, why


def _why(obj: Any, field: str) -> str:
    """What keeps a parsed JSON record from being a document: it is not an object, or its text
    field (data.text_field) is missing or not a string."""
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__}, not an object"
    if field not in obj:
        keys = list(obj)
        shown = ", ".join(map(str, keys[:10])) + (f", ... ({len(keys)} keys)" if len(keys) > 10 else "")
        return f"no \"{field}\" key (data.text_field={field}); its keys: {shown or 'none'}"
    return f"\"{field}\" (data.text_field) holds a {type(obj[field]).__name__}, not a string"


class Corpus:
    """Random-access documents; subclasses implement `__len__` and `_text(i)` (raw, before cleaning)."""
    stats: dict[str, Any]
    clean: bool = False

    def __len__(self) -> int:
        raise NotImplementedError

    def _text(self, i: int) -> str:
        raise NotImplementedError

    def __getitem__(self, i: int) -> str:
        text = self._text(int(i))
        return textlib.clean(text) if self.clean else text

    def total_bytes(self) -> int:
        return self.stats["bytes"]

    @property
    def skipped_empty(self) -> int:
        return self.stats["skipped_empty"]


class TextFiles(Corpus):
    """Documents = whole files."""

    def __init__(self, paths: list[Path], stats: dict[str, Any], clean: bool = False):
        self.paths, self.stats, self.clean = paths, stats, clean

    @classmethod
    def scan(cls, files: list[Path], clean: bool) -> "TextFiles":
        s, kept = Scan(files=len(files)), []
        for p in files:
            if s.text(p.read_bytes(), clean) is not None:
                kept.append(p)
        return cls(kept, dataclasses.asdict(s), clean)

    def __len__(self) -> int:
        return len(self.paths)

    def _text(self, i: int) -> str:
        return self.paths[i].read_bytes().decode("utf-8", errors="replace")


class LineDocs(Corpus):
    """Documents = lines of files, found through a byte-offset index built once. With `field`
    set, each line is a JSON object whose `field` holds the text (JSON Lines)."""

    def __init__(self, files: list[str], starts: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                 field: str | None, stats: dict[str, Any], clean: bool):
        self.files, self.starts, self.offsets, self.lengths = files, starts, offsets, lengths
        self.field, self.stats, self.clean = field, stats, clean

    @classmethod
    def scan(cls, files: list[Path], field: str | None, clean: bool) -> "LineDocs":
        s = Scan(files=len(files))
        starts, offsets, lengths = [], [], []
        for path in files:
            starts.append(len(offsets))
            offset = 0
            with open(path, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    line = raw.rstrip(b"\r\n")
                    if field is None:
                        keep = s.text(line, clean) is not None
                    else:
                        keep = s.json_text(line, field, clean, f"{path}:{lineno}") is not None
                    if keep:
                        offsets.append(offset)
                        lengths.append(len(line))
                    offset += len(raw)
        return cls([str(p) for p in files], np.asarray(starts, np.int64), np.asarray(offsets, np.int64),
                   np.asarray(lengths, np.int64), field, dataclasses.asdict(s), clean)

    def __len__(self) -> int:
        return len(self.offsets)

    def _text(self, i: int) -> str:
        f = int(np.searchsorted(self.starts, i, side="right")) - 1
        with open(self.files[f], "rb") as fh:
            fh.seek(int(self.offsets[i]))
            raw = fh.read(int(self.lengths[i]))
        text = raw.decode("utf-8", errors="replace")
        return text if self.field is None else textlib.unsurrogate(json.loads(text)[self.field])[0]

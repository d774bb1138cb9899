"""Document sources: the Python standard library's own sources, or user text files / globs.

A source is a random-access sequence of documents (one per file) that Grain can shuffle and
shard by index. Files are read lazily; undecodable bytes become U+FFFD and empty files are
skipped, both counted so a bad corpus is visible rather than silently shrunk.
"""
from __future__ import annotations

import dataclasses
import glob
import sysconfig
from pathlib import Path
from typing import Sequence

from r1jax.config import ConfigError, DataConfig, DataSource


def stdlib_files() -> list[Path]:
    """The stdlib's *.py files (site-packages excluded): on every machine, fetched from nowhere."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def expand(patterns: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for pat in patterns:
        hits = sorted(Path(p) for p in glob.glob(pat, recursive=True))
        if not hits and Path(pat).is_file():
            hits = [Path(pat)]
        if not hits:
            raise ConfigError(f"data.paths: '{pat}' matches no file")
        files += [h for h in hits if h.is_file()]
    return files


@dataclasses.dataclass
class TextFiles:
    """Documents = files; `skipped_empty` counts files of zero bytes left out."""
    paths: list[Path]
    skipped_empty: int = 0

    @classmethod
    def from_config(cls, d: DataConfig) -> "TextFiles":
        paths = stdlib_files() if d.source is DataSource.stdlib else expand(d.paths)
        kept = [p for p in paths if p.stat().st_size > 0]
        if not kept:
            raise ConfigError(f"data: the corpus is empty ({len(paths)} files, all empty)"
                              if paths else "data: the corpus has no files")
        return cls(kept, len(paths) - len(kept))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> str:
        return self.paths[i].read_bytes().decode("utf-8", errors="replace")

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)

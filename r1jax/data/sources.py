"""The configured document source: `open_corpus(data_config)` finds the files, scans them with
the source `data.source` names (corpus.py, records.py) and refuses an empty corpus in one line;
`describe` is the start-up line saying how much was read and what was wrong with it."""
from __future__ import annotations

import glob
import sysconfig
from pathlib import Path
from typing import Sequence

from r1jax.config import ConfigError, DataConfig, DataSource, TextMode
from r1jax.data.corpus import Corpus, LineDocs, TextFiles


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


def _scan(d: DataConfig, files: list[Path]) -> Corpus:
    if d.source in (DataSource.stdlib, DataSource.text):
        if d.text_mode is TextMode.document:
            return TextFiles.scan(files, d.clean)
        return LineDocs.scan(files, None, d.clean)
    if d.source is DataSource.jsonl:
        return LineDocs.scan(files, d.text_field, d.clean)
    from r1jax.data import records  # pyarrow and array_record load only when asked for
    opener = records.ParquetDocs if d.source is DataSource.parquet else records.ArrayRecordDocs
    return opener.scan(files, d.text_field, d.clean)


def open_corpus(d: DataConfig) -> Corpus:
    """The documents `d` names; ConfigError (one line) when there are none."""
    files = stdlib_files() if d.source is DataSource.stdlib else expand(d.paths)
    try:
        corpus = _scan(d, files)
    except OSError as e:
        raise ConfigError(f"data.paths: cannot read {e.filename} ({e.strerror})") from None
    if len(corpus) == 0:
        s = corpus.stats
        where = "data.source=stdlib" if d.source is DataSource.stdlib else f"data.paths ({d.source.value})"
        bad = f", {s['bad_records']} bad (first: {_first_bad(s)})" if s["bad_records"] else ""
        raise ConfigError(f"{where}: the corpus is empty: {s['files']} files, {s['skipped_empty']} empty "
                          f"documents{bad}")
    return corpus


def _first_bad(stats: dict) -> str:
    """Where the first bad record is and, when known, what is wrong with it."""
    why = stats.get("first_bad_why")
    return f"{stats['first_bad']}: {why}" if why else stats["first_bad"]


def describe(corpus: Corpus) -> str:
    """One log line: how much was read and what was wrong with it."""
    s = corpus.stats
    line = (f"{s['documents']} documents from {s['files']} files ({s['bytes'] / 2**20:.1f} MB); "
            f"skipped {s['skipped_empty']} empty")
    if s["bad_records"]:
        line += f", {s['bad_records']} malformed (first: {_first_bad(s)})"
    if s["replaced_chars"]:
        line += f"; {s['replaced_chars']} undecodable byte sequences became U+FFFD"
    return line

"""Where a conversion writes: whole or not at all, with the tokenizer that goes with the weights.

`staged(dst)` hands out a fresh directory beside DST and moves what was written there into DST
only when the conversion returns, so one that fails part way (a truncated checkpoint, a full
disk, Ctrl-C) leaves DST as it was, with no half-written shard in it. `copy_tokenizer` puts the
tokenizer files of the source (an HF directory, an r1jax checkpoint directory, or the training
run around a run's `checkpoints/`) beside the weights, so the output loads as a model with its
tokenizer (and chat template, where the source has one) as it is.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

# HF's tokenizer files: the vocabulary and merges; the chat template with the special tokens'
# roles (tokenizer_config.json, as chat.for_directory reads it); the newer separate template file
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@contextlib.contextmanager
def staged(dst: str | Path) -> Iterator[Path]:
    """A fresh, empty directory to write DST's files into. On a normal exit its entries move into
    DST (made if missing; an entry of the same name is replaced, as --force asks); on an exception
    it is removed with whatever it holds, and so are the parents of DST this made."""
    dst = Path(dst).absolute()
    made = [p for p in (dst.parent, *dst.parent.parents) if not p.exists()]
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in made:                       # deepest first
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    dst.mkdir(exist_ok=True)
    for entry in sorted(tmp.iterdir()):
        target = dst / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(entry, target)            # same filesystem: a rename
    tmp.rmdir()


def tokenizer_dir(src: str | Path) -> Path | None:
    """The directory whose tokenizer goes with `src`'s weights: `src` itself when it holds a
    tokenizer.json, else the training run around a run's checkpoints/ (its config.yaml beside)."""
    src = Path(src)
    for d in (src, src.parent):
        if (d / "tokenizer.json").is_file() and (d == src or (d / "config.yaml").is_file()):
            return d
    return None


def _template_dir(run: Path) -> Path | None:
    """Where a training run took its tokenizer from, when not trained by the run: data.tokenizer,
    else model.init_from's HF directory (r1jax/train/trainer.py `_tokenizer`). Its chat template
    (tokenizer_config.json) is the one the run trained with (chat.for_directory)."""
    import yaml
    try:
        cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    tok = (cfg.get("data") or {}).get("tokenizer")
    init = (cfg.get("model") or {}).get("init_from") or ""
    if tok:
        return Path(tok) if Path(tok).is_dir() else Path(tok).parent
    return Path(init[3:]) if init.startswith("hf:") else None


def copy_tokenizer(src: str | Path, out: str | Path) -> list[str]:
    """Copy the tokenizer files of `src` (see `tokenizer_dir`) into `out`, with the chat template
    of the directory a training run took its tokenizer from; the names copied."""
    d = tokenizer_dir(src)
    if d is None:
        return []
    found = {n: d / n for n in TOKENIZER_FILES if (d / n).is_file()}
    origin = _template_dir(d) if (d / "config.yaml").is_file() else None
    if origin is not None and "tokenizer_config.json" not in found:
        found.update({n: origin / n for n in TOKENIZER_FILES[1:] if (origin / n).is_file()})
    for n, p in found.items():
        shutil.copyfile(p, Path(out) / n)
    return sorted(found)

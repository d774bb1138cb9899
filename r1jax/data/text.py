"""Bytes -> text for every source: UTF-8 decoding that counts the bytes it had to replace, a
blank test, and the optional `data.clean` normalisation."""
from __future__ import annotations

import re
import unicodedata

_FFFD = b"\xef\xbf\xbd"  # U+FFFD already in the data is text, not damage: it is not counted

_SURROGATE = re.compile("[\ud800-\udfff]")
# Unicode category Cc is C0 + DEL + C1; \t and \n carry layout, the rest is noise in training text.
_CONTROL = {c: None for c in [*range(0x20), *range(0x7F, 0xA0)] if chr(c) not in "\t\n"}


def decode(raw: bytes) -> tuple[str, int]:
    """UTF-8 text with undecodable bytes as U+FFFD, and how many U+FFFD the decoding introduced."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        # Invalid bytes never swallow a valid EF BF BD, so the difference is exactly the damage.
        return text, text.count("\ufffd") - raw.count(_FFFD)


def unsurrogate(text: str) -> tuple[str, int]:
    """Lone surrogates (JSON can escape them) as U+FFFD, and how many: the tokenizer wants UTF-8."""
    return _SURROGATE.subn("\ufffd", text)


def clean(text: str) -> str:
    """NFC, \\r\\n and \\r -> \\n, no control characters but \\t and \\n, no trailing blanks per line."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.translate(_CONTROL).split("\n"))


def blank(text: str) -> bool:
    """Empty or whitespace only: a document that would teach nothing but an EOS."""
    return not text or text.isspace()

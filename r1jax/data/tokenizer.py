"""Byte-level BPE tokenizer (HF `tokenizers`): train one on the corpus, or load a tokenizer.json
(e.g. from a DeepSeek checkpoint directory). Special tokens sit at the ids the model config
expects by default: <|bos|> 0, <|eos|> 1, <|pad|> 2."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from r1jax.config import ConfigError

SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")


def train(texts: Iterable[str], vocab_size: int, extra_specials: Sequence[str] = (),
          extra_tokens: Sequence[str] = ()) -> Tokenizer:
    """A byte-level BPE of `vocab_size` entries on `texts`. `extra_specials` (R1's chat markers for
    SFT data) become special tokens after SPECIALS and `extra_tokens` (the think tags) ordinary
    ones at the end: each is one token, matched whole in any text encoded; decoding drops the
    special ones only."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # a chat tokenizer (R1's markers given) keeps each digit its own token, as LLaMA's does: the
    # generated tasks' arithmetic and digit reversal are then digit by digit
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if extra_specials else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(extra_tokens), special_tokens=[*SPECIALS, *extra_specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    if extra_tokens:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in extra_tokens])
    return tok


def train_on(docs: Sequence[str], vocab_size: int, megabytes: float, extra_specials: Sequence[str] = (),
             extra_tokens: Sequence[str] = ()) -> Tokenizer:
    """Train on the corpus's documents in order until `megabytes` of text (as data.tokenizer_train_mb)."""
    def texts():
        seen = 0
        for i in range(len(docs)):
            text = docs[i]
            yield text
            seen += len(text)
            if seen >= megabytes * 2**20:
                return
    return train(texts(), vocab_size, extra_specials, extra_tokens)


def load(path: str | Path) -> Tokenizer:
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ConfigError(f"data.tokenizer: {p} does not exist")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ConfigError(f"data.tokenizer: {p} is not a tokenizers JSON file ({str(e).splitlines()[0]})") from None


def eos_id(tok: Tokenizer) -> int | None:
    for name in ("<|eos|>", "<｜end▁of▁sentence｜>", "</s>", "<|endoftext|>"):
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None

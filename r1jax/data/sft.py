"""Supervised fine-tuning data: chat JSONL -> token ids + completion loss mask -> packed Grain batches.

Records are `{"messages": [...]}`, `{"prompt": str, "completion": str}` or TRL's conversational
`{"prompt": [messages], "completion": [assistant messages]}`; each becomes a message list that
ends with the assistant turn to train (`read`).

An example is encoded as generation will see it (`encode`): the prompt is the chat template's
rendering of every message before the trained turn *with the generation prompt* (R1's format ends
it with `<｜Assistant｜><think>\\n`), tokenized exactly as serving tokenizes a chat request
(`tok.encode(text, add_special_tokens=False)`: the BOS comes from the template's text, never from
the tokenizer's post-processor, so there is one). The completion is the turn's raw content,
reasoning included, tokenized on its own, then the tokenizer's EOS id (the id the generator stops
on). Rendering the whole conversation instead would lose the reasoning: R1's template, and
DeepSeek's HF template, keep only what follows `</think>` in every assistant turn, and their
generation prompt is not a prefix of such a rendering (notes/posttraining.md §3). The loss mask is
built from these lengths (1 on completion tokens and the EOS), never from pad ids: DeepSeek's pad
is its EOS.

`turns="all"` also trains the earlier assistant turns *as the template renders them in the
context*. The token ids are the same as with `turns="last"`; only the mask grows. With R1's format
an earlier turn in context is its answer without reasoning, then `<｜end▁of▁sentence｜>` as text
(after the `<｜Assistant｜>` header, which stays 0), so "all" trains every earlier answer without
reasoning and only the last turn with it.

Batches (`sft_batches`) pack whole examples into rows with Grain's best-fit packer: an example is
never split across rows (one longer than seq_len is cut to its first seq_len tokens, counted by
`stats`), `segment_ids` are 1..k per row and 0 on padding, `positions` restart per example, and
padding has loss_mask 0.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

import grain
import numpy as np
from tokenizers import Tokenizer

from r1jax.config import ConfigError
from r1jax.data import chat
from r1jax.data import tokenizer as toklib

TURNS = ("last", "all")
_FORMS = ('each line must be a JSON object: {"messages": [...]}, {"prompt": str, "completion": str} '
          'or {"prompt": [messages], "completion": [assistant messages]}')


# ------------------------------------------------------------------------------------- reading

def _record(line: str) -> dict:
    """One JSONL line as {"messages": [...]}, or a ValueError saying what is wrong."""
    try:
        r = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(r, dict):
        raise ValueError(_FORMS)
    if "messages" in r:
        if "prompt" in r or "completion" in r:
            raise ValueError("has both 'messages' and 'prompt'/'completion'; give one form")
        msgs = chat.check(r["messages"])
    elif "prompt" in r and "completion" in r:
        p, c = r["prompt"], r["completion"]
        if isinstance(p, str) and isinstance(c, str):
            msgs = [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
        elif isinstance(p, list) and isinstance(c, list):
            try:
                prompt = chat.check(p)
            except chat.ChatError as e:
                raise ValueError(f"prompt: {e}") from None
            try:
                completion = chat.check(c)
            except chat.ChatError as e:
                raise ValueError(f"completion: {e}") from None
            if any(m["role"] != "assistant" for m in completion):
                raise ValueError("completion messages must have role assistant")
            msgs = prompt + completion
        else:
            raise ValueError("'prompt' and 'completion' must both be strings or both be lists of messages")
    else:
        raise ValueError(_FORMS)
    if msgs[-1]["role"] != "assistant":
        raise ValueError("the last message must have role assistant")
    if len(msgs) < 2:
        raise ValueError("the assistant message needs a system or user message before it")
    return {"messages": msgs}


def read(paths: Sequence[str]) -> list[dict]:
    """Every record of the JSONL files `paths`, in order, as {"messages": [{role, content}, ...]}
    ending with the assistant turn to train. Blank lines are skipped; anything else that is not a
    record is a one-line ConfigError naming the file and line."""
    if not paths:
        raise ConfigError("data.paths: no files given (SFT reads JSON Lines of chat records)")
    out: list[dict] = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"data.paths: {path} does not exist")
        first = len(out)
        with p.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                    if line.strip():
                        out.append(_record(line))
                except ValueError as e:        # JSON, UTF-8 and ChatError are all ValueErrors
                    msg = " ".join(str(e).split())
                    raise ConfigError(f"data.paths: {path} line {lineno}: {msg}") from None
        if len(out) == first:
            raise ConfigError(f"data.paths: {path} has no records; {_FORMS}")
    return out


# ------------------------------------------------------------------------------------ encoding

def eos_id(tokenizer: Tokenizer) -> int:
    """The id every completion ends with: the tokenizer's EOS, which the generator stops on."""
    i = toklib.eos_id(tokenizer)
    if i is None:
        raise ConfigError("data.tokenizer: has no EOS token (<|eos|>, <｜end▁of▁sentence｜>, </s> or "
                          "<|endoftext|>); SFT ends every completion with it")
    return i


def _completion(context: list[dict], prompt: str, content: str, template: chat.Template) -> str:
    """`content` minus an opening that the generation prompt already ends with: R1's prompt ends
    `<think>\\n`, and content that starts `<think>\\n` (or `<think>`) would open it twice.

    Only the text the generation prompt adds is searched, from a `<` on (a tag), so content that
    merely starts like the prompt's whitespace is kept."""
    bare = template.render(context, add_generation_prompt=False)
    added = prompt[len(bare):] if prompt.startswith(bare) else prompt
    cut = 0
    for i in (k for k, ch in enumerate(added) if ch == "<"):
        for tail in (added[i:], added[i:].rstrip()):
            if tail and len(tail) > cut and content.startswith(tail):
                cut = len(tail)
    return content[cut:]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _earlier_turns(context: list[dict], template: chat.Template, prompt: str) -> list[tuple[int, int]]:
    """[start, end) character spans in `prompt` of each assistant turn in `context` as the
    template renders it there (its header excluded, its end-of-turn text included).

    Turn j's end is the length of the rendering of context[:j+1]; its start is where that rendering
    departs from the generation prompt of context[:j] (the header both share), backed off to the
    `<` where the generation prompt's own addition starts (R1's `<think>`), so an answer that itself
    opens with `<` is not cut. An assistant turn that opens the conversation has no prompt and
    stays context."""
    spans = []
    for j, m in enumerate(context):
        if m["role"] != "assistant" or j == 0:
            continue
        before = template.render(context[:j], add_generation_prompt=False)
        gen = template.render(context[:j], add_generation_prompt=True)
        turn = template.render(context[:j + 1], add_generation_prompt=False)
        if not (gen.startswith(before) and turn.startswith(before) and prompt.startswith(turn)):
            raise chat.ChatError("turns=all: this chat template does not render the first turns of a "
                                 "conversation as a prefix of the whole conversation; train with turns=last")
        head, body = gen[len(before):], turn[len(before):]
        k = _common_prefix(head, body)
        if k < len(head):
            k = max((i for i in range(k + 1) if head.startswith("<", i)), default=k)
        spans.append((len(before) + k, len(turn)))
    return spans


def encode(example: dict, tokenizer: Tokenizer, template: chat.Template, *,
           turns: str = "last") -> tuple[np.ndarray, np.ndarray]:
    """(ids, loss_mask), both int32 [n]: the prompt's tokens (mask 0) then the last assistant turn's
    tokens, reasoning included, and the EOS id (mask 1). loss_mask[t] says token t is a target.

    ids[:len(prompt ids)] == tok.encode(template.render(messages[:-1]), add_special_tokens=False),
    what serving feeds for the same conversation. `turns="all"`: the same ids, and the mask also
    covers each earlier assistant turn's tokens in the context (module docstring); a token counts
    for a turn when its last character lies in the turn's text. A ChatError when the template
    cannot render the messages."""
    if turns not in TURNS:
        raise ConfigError(f"turns={turns!r}: must be one of {', '.join(TURNS)}")
    msgs = chat.check(example["messages"])
    context, last = msgs[:-1], msgs[-1]
    prompt = template.render(context, add_generation_prompt=True)
    completion = _completion(context, prompt, last["content"], template)
    enc = tokenizer.encode(prompt, add_special_tokens=False)
    done = tokenizer.encode(completion, add_special_tokens=False).ids if completion else []
    n = len(enc.ids)
    ids = np.asarray(enc.ids + done + [eos_id(tokenizer)], np.int32)
    mask = np.zeros(len(ids), np.int32)
    mask[n:] = 1
    if turns == "all":
        ends = np.asarray([e for _, e in enc.offsets], np.int64).reshape(n)
        for a, b in _earlier_turns(context, template, prompt):
            mask[:n][(ends > a) & (ends <= b)] = 1
    return ids, mask


@dataclasses.dataclass(frozen=True)
class Stats:
    """What SFT will train on at this seq_len (token counts after truncation)."""
    examples: int
    truncated: int        # longer than seq_len: cut to their first seq_len tokens
    no_target: int        # left without any loss token after the cut (the prompt fills seq_len)
    tokens: int
    target_tokens: int    # loss_mask == 1
    longest: int          # the longest example before the cut

    def line(self) -> str:
        return (f"sft data: {self.examples} examples, {self.tokens} tokens of which {self.target_tokens} "
                f"trained; {self.truncated} longer than seq_len cut ({self.no_target} left with no "
                f"target), longest {self.longest}")


def stats(examples: Sequence[dict], tokenizer: Tokenizer, template: chat.Template, seq_len: int, *,
          turns: str = "last") -> Stats:
    """Counts over every example (this encodes them all, so a template that fails on one fails here,
    before training starts)."""
    truncated = no_target = tokens = targets = longest = 0
    for ex in examples:
        ids, mask = encode(ex, tokenizer, template, turns=turns)
        longest = max(longest, len(ids))
        truncated += len(ids) > seq_len
        kept = int(mask[:seq_len].sum())
        no_target += kept == 0
        tokens += min(len(ids), seq_len)
        targets += kept
    return Stats(len(examples), truncated, no_target, tokens, targets, longest)


# ----------------------------------------------------------------------------------- batching

class _Encode(grain.transforms.Map):
    def __init__(self, tokenizer: Tokenizer, template: chat.Template, seq_len: int, turns: str):
        self.tok, self.template, self.seq_len, self.turns = tokenizer, template, seq_len, turns

    def map(self, example: dict) -> dict[str, np.ndarray]:
        ids, mask = encode(example, self.tok, self.template, turns=self.turns)
        return {"ids": ids[:self.seq_len], "loss_mask": mask[:self.seq_len]}


def _rename(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"ids": row["ids"], "segment_ids": row["ids_segment_ids"].astype(np.int32),
            "positions": row["ids_positions"].astype(np.int32), "loss_mask": row["loss_mask"].astype(np.int32)}


def sft_batches(examples: Sequence[dict], tokenizer: Tokenizer, template: chat.Template, *, seq_len: int,
                batch_size: int, seed: int, shard_index: int = 0, shard_count: int = 1,
                epochs: int | None = None, turns: str = "last", pack_bins: int = 0) -> grain.IterDataset:
    """An IterDataset of {'ids','segment_ids','positions','loss_mask'} int32 [batch_size, seq_len].

    Examples (as `read` returns them) are shuffled by `seed` each epoch, this shard takes
    `[shard_index::shard_count]` of them, each is encoded (`encode`) and cut to seq_len, and whole
    examples are packed into rows (best fit over `pack_bins` rows at a time, default batch_size).
    `epochs=None` repeats forever and drops nothing but never yields a partial batch; `epochs=1`
    passes over every example once and yields the last, partial batch (eval). The iterator's state
    (get_state/set_state, JSON-safe) resumes with the next batch."""
    if turns not in TURNS:
        raise ConfigError(f"turns={turns!r}: must be one of {', '.join(TURNS)}")
    ds = grain.MapDataset.source(list(examples))
    ds = ds.seed(seed).shuffle().repeat(epochs)[shard_index::shard_count]
    ds = ds.map(_Encode(tokenizer, template, seq_len, turns))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=16))
    it = grain.experimental.BestFitPackIterDataset(
        it, length_struct={"ids": seq_len, "loss_mask": seq_len}, num_packing_bins=pack_bins or batch_size,
        seed=seed)
    return it.map(_rename).batch(batch_size, drop_remainder=epochs is None)

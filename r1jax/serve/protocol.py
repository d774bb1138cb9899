"""OpenAI request bodies to generator Requests, and Completion objects to OpenAI responses.

Shapes follow the `openai` client's types: `Completion` / `ChatCompletion`, their stream chunks
(`text_completion` / `chat.completion.chunk`, the chat stream opening with a `role` delta per
choice, a last chunk per choice carrying `finish_reason`, then a usage chunk with no choices),
and errors as `{"error": {"message", "type", "param", "code"}}`. vLLM's extra sampling fields
are accepted too: `top_k`, `min_p`, `ignore_eos`, `stop_token_ids`.

Every check names the field and what it allows; nothing here touches the engine.
"""
from __future__ import annotations

import dataclasses
import time
import uuid

from r1jax.infer.generator import MAX_STOP_IDS, Completion, Request

MAX_N = 8
MAX_STOPS = 8
COMPLETIONS_MAX_LOGPROBS = 5        # the legacy completions API's limit
CHAT_MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


@dataclasses.dataclass(frozen=True)
class Limits:
    max_model_len: int
    max_tokens: int                 # per request, also bounded by max_model_len - prompt
    max_n: int = MAX_N


@dataclasses.dataclass
class Parsed:
    """One API call: its prompts (token ids), sampling per choice, and how to answer."""
    chat: bool
    model: str
    prompts: list[list[int]]
    requests: list[Request]         # len(prompts) * n, prompt-major
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None            # completions: top N; chat: top_logprobs when logprobs is true


# ------------------------------------------------------------------------ field readers
def _get(body: dict, key: str, kind, default, *, lo=None, hi=None, nullable=True):
    v = body.get(key, default)
    if v is None:
        if not nullable and default is not None:
            raise bad(key, f"'{key}' must not be null")
        return default
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if kind is int and isinstance(v, bool) or not isinstance(v, kind):
        raise bad(key, f"'{key}' must be {kind.__name__ if kind is not float else 'a number'}, not {type(v).__name__}")
    if lo is not None and v < lo or hi is not None and v > hi:
        raise bad(key, f"'{key}' must be in [{lo}, {hi}], not {v}")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop", "'stop' must be a string or a list of strings")
    if len(v) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} stop strings, not {len(v)}")
    return tuple(s for s in v if s)


def _token_ids(v, param: str, vocab: int) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad(param, f"'{param}' token ids must be integers")
    if any(t < 0 or t >= vocab for t in v):
        raise bad(param, f"'{param}' token ids must be in [0, {vocab})")
    return list(v)


def _prompts(body: dict, tokenizer, vocab: int) -> list[list[int]]:
    if "prompt" not in body:
        raise bad("prompt", "missing required field 'prompt'")
    p = body["prompt"]
    if isinstance(p, str):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        items = p
    else:
        raise bad("prompt", "'prompt' must be a string, a list of token ids, or a non-empty list of either")
    out = []
    for x in items:
        if isinstance(x, str):
            if tokenizer is None:
                raise bad("prompt", "this model has no tokenizer: give the prompt as token ids")
            ids = tokenizer.encode(x).ids
        else:
            ids = _token_ids(x, "prompt", vocab)
        if not ids:
            raise bad("prompt", "the prompt is empty")
        out.append(ids)
    return out


def _unsupported(body: dict) -> None:
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise bad(key, f"'{key}' is not supported (only 0)")
    if body.get("echo"):
        raise bad("echo", "'echo' is not supported")
    if body.get("best_of") not in (None, 1) and body.get("best_of") != body.get("n"):
        raise bad("best_of", "'best_of' must equal 'n'")


def parse(body, *, chat: bool, tokenizer, template, vocab: int, limits: Limits) -> Parsed:
    """The call's Parsed form, or an APIError (400) naming the field."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    if "model" not in body:
        raise bad("model", "missing required field 'model'")
    model = body["model"]
    if not isinstance(model, str):
        raise bad("model", "'model' must be a string")
    _unsupported(body)
    if chat:
        if "messages" not in body:
            raise bad("messages", "missing required field 'messages'")
        if tokenizer is None:
            raise bad("messages", "this model has no tokenizer: chat needs one")
        from r1jax.data.chat import ChatError
        try:
            text = template.render(body["messages"], add_generation_prompt=True)
        except ChatError as e:
            raise bad("messages", str(e)) from None
        prompts = [tokenizer.encode(text, add_special_tokens=False).ids]
    else:
        prompts = _prompts(body, tokenizer, vocab)
    n = _get(body, "n", int, 1, lo=1, hi=limits.max_n)
    stream = _get(body, "stream", bool, False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options", "'stream_options' must be an object")
    include_usage = bool((opts or {}).get("include_usage", True))
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, key, int, None, lo=1, hi=limits.max_tokens)
    temperature = _get(body, "temperature", float, 1.0, lo=0.0, hi=2.0)
    top_p = _get(body, "top_p", float, 1.0, lo=0.0, hi=1.0)
    if top_p == 0:
        raise bad("top_p", "'top_p' must be in (0, 1]")
    top_k = _get(body, "top_k", int, 0, lo=-1, hi=1 << 30)
    min_p = _get(body, "min_p", float, 0.0, lo=0.0, hi=1.0)
    seed = _get(body, "seed", int, None, lo=-(1 << 63), hi=(1 << 64) - 1)
    ignore_eos = _get(body, "ignore_eos", bool, False)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise bad("stop_token_ids", "'stop_token_ids' must be a list of token ids")
    stop_ids = _token_ids(stop_ids, "stop_token_ids", vocab)
    if len(stop_ids) >= MAX_STOP_IDS:
        raise bad("stop_token_ids", f"at most {MAX_STOP_IDS - 1} stop token ids")
    if chat:
        want = _get(body, "logprobs", bool, False)
        top = _get(body, "top_logprobs", int, 0, lo=0, hi=CHAT_MAX_TOP_LOGPROBS)
        logprobs = top if want else None
    else:
        logprobs = _get(body, "logprobs", int, None, lo=0, hi=COMPLETIONS_MAX_LOGPROBS)
    stop = _stop(body)
    # per choice a seed of its own (n samples of one prompt differ); no seed: a fresh one
    base = seed if seed is not None else uuid.uuid4().int & 0xFFFFFFFF
    reqs = []
    for p in prompts:
        room = limits.max_model_len - len(p)
        if room < 1:
            raise bad("prompt" if not chat else "messages",
                      f"the prompt has {len(p)} tokens; this model's maximum context length is "
                      f"{limits.max_model_len} tokens")
        mt = room if max_tokens is None else max_tokens
        if mt > room:
            raise bad(key, f"this model's maximum context length is {limits.max_model_len} tokens; the prompt "
                           f"has {len(p)} and {key} asks for {mt}")
        mt = min(mt, limits.max_tokens)
        for i in range(n):
            reqs.append(Request(tuple(p), max_new_tokens=mt, temperature=temperature, top_p=top_p,
                                top_k=max(top_k, 0), min_p=min_p, seed=(base + i) & 0xFFFFFFFF, stop=stop,
                                stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos, logprobs=logprobs))
    return Parsed(chat, model, prompts, reqs, n, stream, include_usage, logprobs)


# ------------------------------------------------------------------------ responses
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def _token_str(tokenizer, t: int) -> str:
    return f"token_id:{t}" if tokenizer is None else tokenizer.decode([t], skip_special_tokens=False)


def logprobs_block(ids, lps, tops, chat: bool, top: int, tokenizer, offset: int = 0) -> dict | None:
    """Log-probs of tokens `ids` in OpenAI's chat or legacy completions shape (None without)."""
    if lps is None:
        return None
    tops = tops or [{} for _ in ids]
    best = [sorted(d.items(), key=lambda kv: -kv[1])[:top] for d in tops]
    if chat:
        def entry(t, lp):
            s = _token_str(tokenizer, t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in alts]}
                            for t, lp, alts in zip(ids, lps, best)]}
    strs = [_token_str(tokenizer, t) for t in ids]
    offsets, o = [], offset
    for s in strs:
        offsets.append(o)
        o += len(s)
    return {"tokens": strs, "token_logprobs": list(lps),
            "top_logprobs": [{_token_str(tokenizer, a): b for a, b in alts} for alts in best],
            "text_offset": offsets}


def usage(prompts: list[list[int]], n: int, completions: list[Completion]) -> dict:
    p = sum(len(x) for x in prompts) * n
    c = sum(x.completion_tokens for x in completions)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def response(parsed: Parsed, rid: str, name: str, completions: list[Completion], tokenizer) -> dict:
    created = int(time.time())
    choices = []
    for i, c in enumerate(completions):
        text = c.completion if c.completion is not None else ""
        lp = logprobs_block(c.completion_ids, c.logprobs, c.top_logprobs, parsed.chat, parsed.logprobs or 0, tokenizer)
        if parsed.chat:
            choice = {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                      "finish_reason": c.finish_reason}
        else:
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
        if tokenizer is None:
            choice["token_ids"] = c.completion_ids
        choices.append(choice)
    return {"id": rid, "object": "chat.completion" if parsed.chat else "text_completion", "created": created,
            "model": name, "choices": choices, "usage": usage(parsed.prompts, parsed.n, completions)}


def chunk(parsed: Parsed, rid: str, name: str, created: int, index: int, *, text: str | None = None,
          role: bool = False, finish: str | None = None, logprobs: dict | None = None) -> dict:
    """One stream chunk for choice `index`: a text delta (with its tokens' log-probs), the chat
    role opener, or the finish."""
    if parsed.chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": name, "choices": [choice]}
    if parsed.include_usage:
        out["usage"] = None
    return out


def usage_chunk(parsed: Parsed, rid: str, name: str, created: int, completions: list[Completion]) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if parsed.chat else "text_completion", "created": created,
            "model": name, "choices": [], "usage": usage(parsed.prompts, parsed.n, completions)}

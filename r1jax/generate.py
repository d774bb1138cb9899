"""python -m r1jax.generate --model SRC (--input IN.jsonl --output OUT.jsonl | --prompt TEXT) [flags]

SRC: a run directory, orbax:DIR (an r1jax checkpoint) or hf:DIR (an HF DeepseekV3 directory).
Input lines: {"prompt": "text"} (needs a tokenizer) or {"prompt_ids": [ints]}, optionally with
per-line sampling fields (REQUEST_FIELDS); the flags give their defaults. Output: one line per
input, in input order. `--prompt` streams one completion to stdout. Everything else (cache
sizes, timings, speculative acceptance) goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# line field -> (type check, what is allowed)
REQUEST_FIELDS = {
    "max_new_tokens": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "temperature": (lambda v: _num(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _num(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0: off)"),
    "min_p": (lambda v: _num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "seed": (lambda v: _int(v) and 0 <= v < 2**32, "an integer in [0, 2^32)"),
    "stop": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
             "a string or a list of strings"),
    "stop_token_ids": (lambda v: isinstance(v, list) and all(_int(t) for t in v), "a list of token ids"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "logprobs": (lambda v: _int(v) and 0 <= v <= 20, "an integer in [0, 20] (alternatives per token)"),
}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class InputError(ValueError):
    pass


def parse_line(text: str, where: str, vocab: int, tokenizer, defaults: dict):
    """One input line -> (prompt ids, request fields); InputError naming what is wrong."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: must be a JSON object with \"prompt\" or \"prompt_ids\"")
    unknown = sorted(set(obj) - set(REQUEST_FIELDS) - {"prompt", "prompt_ids"})
    if unknown:
        raise InputError(f"{where}: unknown field \"{unknown[0]}\" (allowed: prompt, prompt_ids, "
                         f"{', '.join(REQUEST_FIELDS)})")
    if ("prompt" in obj) == ("prompt_ids" in obj):
        raise InputError(f"{where}: needs exactly one of \"prompt\" (text) and \"prompt_ids\" (token ids)")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise InputError(f"{where}: \"prompt\" must be a non-empty string")
        if tokenizer is None:
            raise InputError(f"{where}: \"prompt\" is text but the model has no tokenizer.json; "
                             "give \"prompt_ids\"")
        ids = tokenizer.encode(obj["prompt"]).ids
    else:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not ids or not all(_int(t) and 0 <= t < vocab for t in ids):
            raise InputError(f"{where}: \"prompt_ids\" must be a non-empty list of token ids in [0, {vocab})")
    fields = dict(defaults)
    for k, (ok, allowed) in REQUEST_FIELDS.items():
        if k in obj:
            if not ok(obj[k]):
                raise InputError(f"{where}: \"{k}\"={json.dumps(obj[k])}: must be {allowed}")
            fields[k] = obj[k]
    if any(not 0 <= t < vocab for t in fields.get("stop_token_ids", ())):
        raise InputError(f"{where}: \"stop_token_ids\" must be token ids in [0, {vocab})")
    return ids, fields


def _request(ids, f):
    from r1jax.infer.generator import Request
    stop = f.get("stop") or ()
    return Request(prompt_ids=tuple(ids), max_new_tokens=f["max_new_tokens"], temperature=float(f["temperature"]),
                   top_p=float(f["top_p"]), top_k=int(f["top_k"]), min_p=float(f["min_p"]), seed=int(f["seed"]),
                   stop=(stop,) if isinstance(stop, str) else tuple(stop),
                   stop_token_ids=tuple(f.get("stop_token_ids") or ()), ignore_eos=bool(f["ignore_eos"]),
                   logprobs=f.get("logprobs"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m r1jax.generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a run directory, orbax:DIR or hf:DIR")
    ap.add_argument("--input", help="JSONL of requests")
    ap.add_argument("--output", help="JSONL of completions (one line per input line, in order)")
    ap.add_argument("--prompt", help="one prompt; its completion streams to stdout")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", nargs="+", default=[], metavar="STR", help="stop strings (not in the output)")
    ap.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    ap.add_argument("--logprobs", type=int, default=None, help="also return log-probs (and N alternatives)")
    ap.add_argument("--batch-size", type=int, default=None, help="rows decoded together (infer.batch_size)")
    ap.add_argument("--speculative", action="store_true", help="draft with the MTP module, verify in one pass")
    ap.add_argument("--quantize", default="none",
                    help="weights: none, int8 (per output channel) or fp8 (e4m3, 128x128 blocks; DeepSeek's FP8 "
                         "checkpoints load as they are)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. infer.cache_dtype=fp32 mesh.tensor=2")
    a = ap.parse_args(argv)

    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    if (a.prompt is None) == (a.input is None):
        return fail("give --prompt TEXT or --input IN.jsonl (with --output OUT.jsonl)")
    if a.input is not None and not a.output:
        return fail("--input needs --output OUT.jsonl")
    from r1jax.infer import quant
    if a.quantize not in quant.KINDS:
        return fail(f"--quantize {a.quantize}: allowed {', '.join(quant.KINDS)}")
    flags = {"max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k,
             "min_p": a.min_p, "seed": a.seed, "stop": list(a.stop), "ignore_eos": a.ignore_eos}
    if a.logprobs is not None:
        flags["logprobs"] = a.logprobs
    for k, v in flags.items():
        if k in REQUEST_FIELDS and not REQUEST_FIELDS[k][0](v):
            return fail(f"--{k.replace('_', '-')} {v}: must be {REQUEST_FIELDS[k][1]}")
    overrides = list(a.set) + ([f"infer.batch_size={a.batch_size}"] if a.batch_size is not None else [])

    from r1jax.config import ConfigError
    from r1jax.infer import source as sourcelib
    try:
        src = sourcelib.resolve(a.model, overrides)
        tokenizer = src.tokenizer()
    except ConfigError as e:
        return fail(str(e))
    m = src.cfg.model
    if a.speculative and m.num_nextn_predict_layers < 1:
        return fail(f"--speculative: {a.model} has no MTP module (num_nextn_predict_layers=0)")
    if a.speculative and src.mtp_fresh:
        return fail(f"--speculative: {a.model} carries no MTP weights to draft with")

    # every input line is checked before anything compiles
    try:
        if a.prompt is not None:
            if tokenizer is None:
                raise InputError(f"--prompt: {a.model} has no tokenizer.json; use --input with prompt_ids")
            items = [parse_line(json.dumps({"prompt": a.prompt}), "--prompt", m.vocab_size, tokenizer, flags)]
        else:
            path = Path(a.input)
            if not path.is_file():
                raise InputError(f"--input {path}: no such file")
            items = []
            for n, line in enumerate(path.read_text().splitlines(), start=1):
                if line.strip():
                    items.append(parse_line(line, f"{path} line {n}", m.vocab_size, tokenizer, flags))
            if not items:
                raise InputError(f"--input {path}: no requests")
    except InputError as e:
        return fail(str(e))

    log = lambda s: print(s, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        gen = src.generator(tokenizer, log, quantize=a.quantize)
    except ConfigError as e:
        return fail(str(e))
    cfg = src.cfg
    requests = [_request(ids, f) for ids, f in items]
    rows, _, S = gen.shapes_for(requests[:cfg.infer.batch_size])
    wb = quant.weight_bytes(gen.params)
    log(f"loaded {a.model} in {time.perf_counter() - t0:.1f}s; weights {wb['total'] / 2**20:.1f} MiB "
        f"({a.quantize}, compute {cfg.infer.dtype.value}); {gen.cache_line(rows, S)}")

    t0 = time.perf_counter()
    if a.prompt is not None:
        out = gen.generate(requests, speculative=a.speculative,
                           on_text=lambda i, d: (sys.stdout.write(d), sys.stdout.flush()))
        sys.stdout.write("\n")
    else:
        out = gen.generate(requests, speculative=a.speculative)
        with open(a.output, "w") as f:
            for c in out:
                rec = {"completion_ids": c.completion_ids}
                if c.completion is not None:
                    rec["completion"] = c.completion
                rec.update(finish_reason=c.finish_reason, prompt_tokens=c.prompt_tokens,
                           completion_tokens=c.completion_tokens)
                if c.logprobs is not None:
                    rec["logprobs"] = c.logprobs
                if c.top_logprobs is not None:
                    rec["top_logprobs"] = [{str(k): v for k, v in d.items()} for d in c.top_logprobs]
                f.write(json.dumps(rec) + "\n")
    dt = time.perf_counter() - t0
    toks = sum(c.completion_tokens for c in out)
    msg = f"{len(out)} completions, {toks} tokens in {dt:.1f}s (compiles included)"
    if a.speculative and gen.stats["drafted"]:
        msg += f"; MTP drafts accepted {gen.stats['accepted'] / gen.stats['drafted']:.0%}"
    log(msg)
    return 0


if __name__ == "__main__":
    sys.exit(main())

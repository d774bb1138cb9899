"""python -m r1jax.serve --model SRC [--host 127.0.0.1] [--port 8000] [--served-model-name NAME]
[--api-key KEY] [--max-batch-size 64] [--max-queue-delay-ms 10] [--quantize none]

An OpenAI-compatible server (r1jax/serve/app.py) over the continuous-batching engine
(r1jax/serve/engine.py). SRC is as in `python -m r1jax.generate`. It binds loopback unless told
otherwise, compiles the decode buckets and the short prefills before /health answers 200, and
stops cleanly on SIGINT/SIGTERM.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time


def _sizes(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers, e.g. 16,32,64") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers >= 1")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m r1jax.serve", description=__doc__.split("\n\n")[1])
    ap.add_argument("--model", required=True, help="a run directory, orbax:DIR or hf:DIR")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None, help="the model id clients send (default: SRC)")
    ap.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on every API call")
    ap.add_argument("--max-batch-size", type=int, default=64, help="decode slots")
    ap.add_argument("--preferred-batch-sizes", type=_sizes, default=(16, 32, 64),
                    help="compiled decode buckets (comma-separated); powers of two below the smallest are added")
    ap.add_argument("--max-queue-delay-ms", type=float, default=10.0,
                    help="how long an idle engine gathers requests before a prefill (never delays decodes)")
    ap.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond this get 429")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="prompt + completion tokens per request (default: the model's, at most 2048)")
    ap.add_argument("--max-tokens", type=int, default=None, help="the largest max_tokens a request may ask")
    ap.add_argument("--decode-steps", type=int, default=4, help="decode steps per engine call")
    ap.add_argument("--warmup-prompt-len", type=int, default=128,
                    help="compile prefills for prompts up to this many tokens before /health is ready")
    ap.add_argument("--speculative", action="store_true", help="MTP drafts, verified in one pass")
    ap.add_argument("--quantize", choices=["none", "int8", "fp8"], default="none",
                    help="weights: int8 per output channel, fp8 e4m3 in 128x128 blocks (r1jax/infer/quant.py)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides (infer.*, mesh.*)")
    ap.add_argument("--log-level", default="info")
    a = ap.parse_args(argv)

    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    if not 0 < a.port < 65536:
        return fail(f"--port {a.port}: must be in 1..65535")
    from r1jax.config import ConfigError
    from r1jax.infer import source as sourcelib
    from r1jax.serve.engine import Engine, EngineConfig
    try:
        src = sourcelib.resolve(a.model, a.set)
        tokenizer = src.tokenizer()
    except ConfigError as e:
        return fail(str(e))
    m = src.cfg.model
    if a.speculative and (m.num_nextn_predict_layers < 1 or src.mtp_fresh):
        return fail(f"--speculative: {a.model} has no trained MTP module to draft with")
    max_len = a.max_model_len or min(m.max_position_embeddings, 2048)
    try:
        ecfg = EngineConfig(max_batch_size=a.max_batch_size, preferred_batch_sizes=a.preferred_batch_sizes,
                            max_queue_delay_ms=a.max_queue_delay_ms, max_queue=a.max_queue, max_model_len=max_len,
                            decode_steps=a.decode_steps, speculative=a.speculative,
                            warmup_prompt_len=a.warmup_prompt_len)
    except ValueError as e:
        return fail(str(e))
    if a.max_tokens is not None and a.max_tokens < 1:
        return fail(f"--max-tokens {a.max_tokens}: must be >= 1")

    logging.getLogger("r1jax.serve").setLevel(a.log_level.upper())

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
    name = a.served_model_name or a.model
    t0 = time.perf_counter()
    try:
        gen = src.generator(tokenizer, say, quantize=a.quantize)
    except ConfigError as e:
        return fail(str(e))
    from r1jax.data import chat
    from r1jax.serve.app import Server
    from r1jax.serve.metrics import Metrics
    metrics = Metrics(name, gen.mesh.devices.flat[0])
    metrics.config(ecfg)
    engine = Engine(gen, ecfg, metrics)
    template = chat.for_directory(src.tokenizer_path.parent if src.tokenizer_path else None)
    say(f"loaded {a.model} in {time.perf_counter() - t0:.1f}s; {gen.cache_line(engine.n_slots, max_len)}; "
             f"decode buckets {engine.buckets}; chat template {template.name}")
    server = Server(engine, name, tokenizer=tokenizer, template=template, vocab=m.vocab_size, api_key=a.api_key,
                    metrics=metrics, max_tokens=a.max_tokens)
    t0 = time.perf_counter()
    engine.start(warmup=True)

    import uvicorn

    def ready_note():
        engine.ready.wait()
        say(f"compiled in {time.perf_counter() - t0:.1f}s; serving {name!r} on http://{a.host}:{a.port}/v1")
    import threading
    threading.Thread(target=ready_note, daemon=True).start()
    # uvicorn handles SIGINT/SIGTERM: it stops accepting, lets open responses finish, returns
    uvicorn.run(server.app(), host=a.host, port=a.port, log_level=a.log_level.lower(), access_log=False,
                timeout_graceful_shutdown=10)
    engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Data pipeline throughput on the demo config, against what the demo's training step consumes.

    python bench/data_pipeline.py [--config configs/demo.yaml] [--runs 3] [--batches 150]

Builds the demo's data exactly as the trainer does (stdlib corpus, byte-level BPE trained on
data.tokenizer_train_mb, the held-out split, seq_len x batch rows) and times `next()` on the
batch iterator after a warm-up, in-process and with 2 Grain worker processes. Each run starts a
fresh iterator with another seed, so the numbers are not one lucky stretch of the corpus.
Writes bench/results/data_pipeline.json and .md and prints the markdown table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TRAIN_TOKENS_PER_S = 2048 / 1.8   # the demo step on 2 cores: 8 x 256 tokens in ~1.8 s


def measure(make, warmup: int, batches: int, tokens_per_batch: int) -> dict[str, float]:
    t0 = time.perf_counter()
    it = iter(make())
    next(it)
    first = time.perf_counter() - t0
    for _ in range(warmup):
        next(it)
    t1 = time.perf_counter()
    for _ in range(batches):
        next(it)
    dt = time.perf_counter() - t1
    if hasattr(it, "close"):
        it.close()
    return {"first_batch_s": first, "tokens_per_s": batches * tokens_per_batch / dt}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batches", type=int, default=150)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = p.parse_args(argv)

    from r1jax import config as configlib
    from r1jax.data import tokenizer as toklib
    from r1jax.data.sources import describe, open_corpus
    from r1jax.data.pipeline import lm_batches, split_documents

    cfg = configlib.load(args.config)
    d, t = cfg.data, cfg.train
    t0 = time.perf_counter()
    docs = open_corpus(d)
    open_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok = toklib.train_on(docs, cfg.model.vocab_size, d.tokenizer_train_mb)
    tok_s = time.perf_counter() - t0
    eos = toklib.eos_id(tok)
    split = split_documents(len(docs), d.eval_fraction, t.seed)
    tokens_per_batch = t.global_batch_size * d.seq_len
    print(f"corpus: {describe(docs)}; opened in {open_s:.1f}s; tokenizer ({tok.get_vocab_size()}) trained in "
          f"{tok_s:.1f}s", flush=True)

    rows = []
    for workers in args.workers:
        runs = []
        for run in range(args.runs):
            def make(seed=t.seed + run):
                return lm_batches(docs, split.train, tok, eos, seq_len=d.seq_len, batch_size=t.global_batch_size,
                                  seed=seed, block_size=d.block_size, workers=workers)
            runs.append(measure(make, args.warmup, args.batches, tokens_per_batch))
            print(f"workers={workers} run {run}: {runs[-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
        tps = [r["tokens_per_s"] for r in runs]
        rows.append({"workers": workers, "tokens_per_s_min": min(tps), "tokens_per_s_median": statistics.median(tps),
                     "first_batch_s_median": statistics.median(r["first_batch_s"] for r in runs),
                     "x_training_step": min(tps) / TRAIN_TOKENS_PER_S, "runs": runs})

    table = ["| pipeline | tokens/s min | tokens/s median | first batch | min / demo step's 1,138 tokens/s |",
             "|---|---|---|---|---|"]
    for r in rows:
        name = "in-process" if r["workers"] == 0 else f"mp_prefetch, {r['workers']} workers"
        table.append(f"| {name} | {r['tokens_per_s_min']:,.0f} | {r['tokens_per_s_median']:,.0f} | "
                     f"{r['first_batch_s_median']:.2f} s | {r['x_training_step']:.0f}x |")
    command = "python bench/data_pipeline.py " + " ".join(argv if argv is not None else sys.argv[1:])
    machine = (f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
               f"load average {os.getloadavg()[0]:.1f} at the end, Python {platform.python_version()}")
    date = datetime.datetime.now().astimezone().isoformat(timespec="minutes")
    setup = (f"{Path(args.config).name}: {describe(docs)}; BPE vocab {tok.get_vocab_size()}; seq_len {d.seq_len}, "
             f"batch {t.global_batch_size} ({tokens_per_batch} tokens); {args.runs} runs x {args.batches} "
             f"batches after {args.warmup} warm-up batches, a fresh iterator and seed per run")
    print("\n" + "\n".join(table))

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "data_pipeline.json").write_text(json.dumps({
        "command": command.strip(), "date": date, "machine": machine, "setup": setup,
        "corpus_open_s": open_s, "tokenizer_train_s": tok_s, "train_step_tokens_per_s": TRAIN_TOKENS_PER_S,
        "results": rows}, indent=2) + "\n")
    (RESULTS / "data_pipeline.md").write_text(
        f"# Data pipeline throughput\n\n`{command.strip()}` on {date}; {machine}.\n\n{setup}. Before the "
        f"first batch, opening the corpus (one scan) took {open_s:.1f} s and training the tokenizer {tok_s:.1f} s "
        "(once per training run; a resumed run reloads its tokenizer.json).\n\n"
        + "\n".join(table) + "\n\nThe demo's training step consumes about 1,100 tokens/s on the same machine "
        "(2,048 tokens per ~1.8 s step); the target is 20x that. On 2 shared cores, two workers are no reliable "
        "gain over one process: "
        "tokenizing is light next to the IPC, the 2 cores are shared with the consumer, and worker start-up "
        "(spawn + imports) costs seconds. Workers pay off with CPU-heavy per-document work (cleaning, long "
        "documents) and spare cores.\n")
    return 0


if __name__ == "__main__":  # Grain workers re-import __main__ (spawn): run nothing at import
    sys.exit(main())

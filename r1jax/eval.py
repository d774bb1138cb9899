"""python -m r1jax.eval --model SRC [--quantize none|int8|fp8] [--data FILE] [--max-tokens N]
                        [--out OUT.json] [--set KEY=VALUE ...]

What weight quantisation (r1jax/infer/quant.py) costs, measured as llama.cpp's `perplexity
--kl-divergence` does: teacher-forced over held-out text, the quantised model's perplexity next
to the unquantised model's, the mean per-token KL(p_unquantised || p_quantised) and how often the
two models' most likely next tokens agree. Both run the model's forward in the generator's
compute dtype (`infer.dtype`) on the same weights, the quantised one on exactly the QArrays the
generator holds (`quant.quantize_state`), dequantised as the generator's step dequantises them.

SRC as in `python -m r1jax.generate`. Held-out text: `--data FILE` (plain text, cut into rows of
`data.seq_len` tokens), else a run directory's own held-out documents packed as its training
evaluated them (`data.eval_fraction` split, `train.eval_batches` batches of
`train.global_batch_size` rows): the unquantised perplexity then is the run's last eval
perplexity. Prints one line per measure; `--out` also writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _file_batches(path: Path, tok, eos, seq_len: int, rows: int, max_tokens: int):
    """Rows of `seq_len` tokens from a text file (one document: one segment), `rows` a batch;
    the last row padded with segment 0 (no targets)."""
    ids = tok.encode(path.read_text(encoding="utf-8", errors="replace")).ids
    if eos is not None:
        ids.append(eos)
    if max_tokens:
        ids = ids[:max_tokens + 1]
    n = -(-len(ids) // seq_len)
    if len(ids) < 2:
        raise ValueError(f"--data {path}: fewer than 2 tokens")
    n_rows = -(-n // rows) * rows
    arr = np.zeros((n_rows, seq_len), np.int32)
    seg = np.zeros((n_rows, seq_len), np.int32)
    flat = np.asarray(ids, np.int32)
    arr.reshape(-1)[:len(flat)] = flat
    seg.reshape(-1)[:len(flat)] = 1
    pos = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (n_rows, seq_len))
    for i in range(0, n_rows, rows):
        yield {"ids": arr[i:i + rows], "segment_ids": seg[i:i + rows], "positions": np.ascontiguousarray(pos[i:i + rows])}


def _held_out_batches(cfg, tok, max_tokens: int):
    """The run's eval batches, as r1jax/train/trainer.py `_eval_batches` makes them."""
    from r1jax.data.pipeline import lm_batches, split_documents
    from r1jax.data.sources import open_corpus
    from r1jax.data import tokenizer as toklib
    t, d = cfg.train, cfg.data
    docs = open_corpus(d)
    split = split_documents(len(docs), d.eval_fraction, t.seed)
    if not split.eval:
        raise ValueError("the run holds out no documents (data.eval_fraction=0); give --data FILE")
    n, seen = 0, 0
    for b in lm_batches(docs, split.eval, tok, toklib.eos_id(tok), seq_len=d.seq_len, batch_size=t.global_batch_size,
                        seed=t.seed, epochs=1, shuffle_rows=0, block_size=d.block_size):
        if b["ids"].shape[0] != t.global_batch_size:
            return
        yield b
        n += 1
        seen += b["ids"].size
        if (max_tokens and seen >= max_tokens) or (not max_tokens and n >= max(t.eval_batches, 1)):
            return


def _measure(logits_ref, logits_q, ids, seg):
    """Sums over a batch's target positions: NLL (ref, quantised), KL(ref || q), top-1 agreement, count."""
    import jax
    import jax.numpy as jnp
    from r1jax.train.loss import shifted_targets
    targets, valid = shifted_targets(ids, seg, 1)
    w = valid.astype(jnp.float32)
    lr = jax.nn.log_softmax(logits_ref.astype(jnp.float32), axis=-1)
    lq = jax.nn.log_softmax(logits_q.astype(jnp.float32), axis=-1)
    pick = lambda lp: -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]
    kl = jnp.sum(jnp.exp(lr) * (lr - lq), axis=-1)
    agree = (jnp.argmax(lr, -1) == jnp.argmax(lq, -1)).astype(jnp.float32)
    return {"nll_ref": jnp.sum(pick(lr) * w), "nll_q": jnp.sum(pick(lq) * w), "kl": jnp.sum(kl * w),
            "agree": jnp.sum(agree * w), "tokens": jnp.sum(w)}


def evaluate(src, quantize: str, batches, log=lambda s: None) -> dict:
    """The measures of `quantize` against the unquantised model over `batches`."""
    import jax
    from flax import nnx
    from r1jax import model as modellib
    from r1jax.convert import hf
    from r1jax.infer import quant
    from r1jax.infer.generator import _in_compute_dtype
    from r1jax.parallel import mesh as meshlib
    cfg = src.cfg
    mesh = meshlib.make_mesh(meshlib.one_stage(cfg.mesh))
    dtype = modellib.COMPUTE_DTYPES[cfg.infer.dtype]
    ref = src.load(mesh, log)
    fp8_ckpt = quantize == "fp8" and src.init_from.startswith("hf:") and hf.is_fp8(src.init_from[3:])
    qstate = quant.quantize_state(src.load(mesh, log, "fp8") if fp8_ckpt else ref, quantize)
    ref, qstate = _in_compute_dtype(ref, dtype), _in_compute_dtype(qstate, dtype)
    graphdef = modellib.abstract(cfg.model, cfg.kernels, dtype)[0]

    @jax.jit
    def logits(state, b):
        return nnx.merge(graphdef, state)(b["ids"], b["positions"], b["segment_ids"]).logits

    measure = jax.jit(_measure)
    put = lambda b: jax.device_put({k: np.asarray(v) for k, v in b.items() if k in ("ids", "positions", "segment_ids")},
                                   meshlib.batch_sharding(mesh))
    tot: dict[str, float] = {}
    t0 = time.perf_counter()
    with meshlib.activate(mesh):
        for b in batches:
            b = put(b)
            lr = logits(ref, b)
            lq = lr if quantize == "none" else logits(qstate, b)
            for k, v in jax.device_get(measure(lr, lq, b["ids"], b["segment_ids"])).items():
                tot[k] = tot.get(k, 0.0) + float(v)
    n = tot.get("tokens", 0.0)
    if not n:
        raise ValueError("no held-out tokens to evaluate")
    ppl_ref, ppl_q = float(np.exp(tot["nll_ref"] / n)), float(np.exp(tot["nll_q"] / n))
    wb_ref, wb_q = quant.weight_bytes(ref), quant.weight_bytes(qstate)
    return {"quantize": quantize, "dtype": cfg.infer.dtype.value, "tokens": int(n), "perplexity": ppl_q,
            "perplexity_unquantized": ppl_ref, "perplexity_change": ppl_q / ppl_ref - 1,
            "kl": tot["kl"] / n, "top1_agreement": tot["agree"] / n,
            "weight_bytes": wb_q["total"], "weight_bytes_quantized_part": wb_q["quantized"],
            "weight_bytes_unquantized": wb_ref["total"], "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m r1jax.eval",
                                 description="held-out perplexity, KL and top-1 agreement of quantised weights")
    ap.add_argument("--model", required=True, help="a run directory, orbax:DIR or hf:DIR")
    ap.add_argument("--quantize", default="none", help="none, int8 or fp8 (r1jax/infer/quant.py)")
    ap.add_argument("--data", default=None, help="held-out plain text (default: the run's own held-out split)")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="evaluate about this many tokens (default: the run's train.eval_batches, or all of --data)")
    ap.add_argument("--out", default=None, help="also write the measures as JSON")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. infer.dtype=bf16 data.seq_len=512")
    a = ap.parse_args(argv)

    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    from r1jax.config import ConfigError
    from r1jax.infer import quant
    from r1jax.infer import source as sourcelib
    if a.quantize not in quant.KINDS:
        return fail(f"--quantize {a.quantize}: allowed {', '.join(quant.KINDS)}")
    if a.max_tokens < 0:
        return fail(f"--max-tokens {a.max_tokens}: must be >= 0")
    if a.data is not None and not Path(a.data).is_file():
        return fail(f"--data {a.data}: no such file")
    try:
        src = sourcelib.resolve(a.model, a.set)
        tok = src.tokenizer()
    except ConfigError as e:
        return fail(str(e))
    if tok is None:
        return fail(f"--model {a.model}: no tokenizer.json to read held-out text with")
    if a.data is None and src.run_dir is None:
        return fail(f"--model {a.model}: not a run directory, so no held-out split of its own; give --data FILE")
    from r1jax.data import tokenizer as toklib
    cfg = src.cfg
    log = lambda s: print(s, file=sys.stderr, flush=True)
    try:
        if a.data is not None:
            batches = _file_batches(Path(a.data), tok, toklib.eos_id(tok), cfg.data.seq_len, cfg.train.global_batch_size,
                                    a.max_tokens)
        else:
            batches = _held_out_batches(cfg, tok, a.max_tokens)
        r = evaluate(src, a.quantize, batches, log)
    except (ConfigError, ValueError) as e:
        return fail(str(e))
    what = f"KL(unquantised || {a.quantize})"
    print(f"perplexity: {r['perplexity']:.4f} ({a.quantize}; unquantised {r['perplexity_unquantized']:.4f}, "
          f"{100 * r['perplexity_change']:+.3f}%; {r['tokens']} tokens, compute {r['dtype']})")
    print(f"kl: {r['kl']:.6f} nats/token ({what})")
    print(f"top1_agreement: {r['top1_agreement']:.4f}")
    print(f"weight_bytes: {r['weight_bytes']:,} ({a.quantize}; unquantised {r['weight_bytes_unquantized']:,} "
          f"in {r['dtype']}, {r['weight_bytes_unquantized'] / r['weight_bytes']:.2f}x)")
    if a.out:
        r.update(model=a.model, data=a.data or "held-out split")
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

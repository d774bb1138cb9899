"""python -m r1jax.export --model SRC --out DIR [--format stablehlo|onnx] [flags]

Greedy generation's two functions, with fixed shapes, in a directory that runs without r1jax:
- prefill(params..., ids [B,T], lengths [B], max_new [B], stop_ids [B,8]) -> (state..., first
  tokens [B], done [B]): right-padded prompts of at most T tokens into an empty cache of S
  positions per row;
- decode(params..., state...) -> (state..., tokens [B,N], count [B], done [B]): up to N steps
  (--decode-steps), stopping early once every row is done; row b emitted tokens[b, :count[b]].

Both are the Generator's own prefill and decode (`Generator._prefill_fn`, `_decode_fn`: one
implementation of the model) at temperature 0, wrapped to take and return flat arrays only, so
reloading them needs no r1jax pytree (nnx.State, Rows, KV). `state` is the rows' tok, pos, n,
done, stopped, max_new and stop_ids, then the latent cache, one array per layer. A row stops
at one of its stop_ids (-1 pads; EOS is the manifest's `eos_id`), after max_new tokens, or at
the cache's end. Greedy only: no sampling, logprobs or MTP speculation.

DIR holds params/ (safetensors, in the functions' input order), manifest.json (shapes, dtypes,
orders, vocab, EOS, B/T/S/N, versions), runner.py (a copy of r1jax/export_runner.py: jax and
numpy, or onnxruntime and numpy), tokenizer.json when the source has one, and per format:
- stablehlo: prefill.jax_exported and decode.jax_exported, `jax.export` serialisations lowered
  for --platforms (default cpu and cuda); `jax.export.deserialize(blob).call(...)` runs them.
- onnx: prefill.onnx and decode.onnx (jax2onnx; onnxruntime runs them; r1jax/export_onnx.py
  says what it takes). StableHLO is the supported path; ONNX is for runtimes without XLA.

SRC: a run directory, orbax:DIR or hf:DIR (as python -m r1jax.generate). The export runs on one
device: the config's mesh section is not used.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

FORMAT_VERSION = 1
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")       # what jax.export lowers for
ROWS = ("tok", "pos", "n", "done", "stopped", "max_new", "stop_ids")   # Rows fields in the state
FILES = {"stablehlo": ("prefill.jax_exported", "decode.jax_exported"), "onnx": ("prefill.onnx", "decode.onnx")}


class ExportError(ValueError):
    """A model or shape that cannot be exported as asked; the message is one line."""


class Greedy:
    """The Generator's prefill and decode at temperature 0 over flat arrays: B rows, prompts of
    at most T tokens, S cache positions, up to `steps` tokens a decode call."""

    def __init__(self, gen, B: int, T: int, S: int, steps: int):
        import jax
        from r1jax.infer import cache as cachelib
        from r1jax.infer.generator import MAX_STOP_IDS
        self.gen, self.B, self.T, self.S, self.steps = gen, B, T, S, steps
        self.K = MAX_STOP_IDS
        flat, self.ptree = jax.tree_util.tree_flatten_with_path(gen.params)
        self.param_names = [_name(p) for p, _ in flat]
        self.params = [x for _, x in flat]
        if len(set(self.param_names)) != len(self.param_names):
            raise ExportError("two parameters share a path name")
        kv = dataclasses.replace(cachelib.shapes(gen.m, B, S, gen.cache_dtype, mtp=False, unrolled=True),
                                 absorbed=True)
        flat_kv, self.kv_tree = jax.tree_util.tree_flatten_with_path(kv)
        self.kv_specs = [x for _, x in flat_kv]
        i32 = jax.numpy.int32
        sds = jax.ShapeDtypeStruct
        self.row_specs = [sds((B,), i32), sds((B,), i32), sds((B,), i32), sds((B,), bool), sds((B,), bool),
                          sds((B,), i32), sds((B, self.K), i32)]
        self.state_names = [f"rows.{k}" for k in ROWS] + [f"kv.{_name(p)}" for p, _ in flat_kv]
        self.state_specs = self.row_specs + self.kv_specs
        self.param_specs = [sds(x.shape, x.dtype) for x in self.params]
        self.prefill_extra = [("ids", sds((B, T), i32)), ("lengths", sds((B,), i32)), ("max_new", sds((B,), i32)),
                              ("stop_ids", sds((B, self.K), i32))]
        self.prefill_out = [("token", sds((B,), i32)), ("done", sds((B,), bool))]
        self.decode_out = [("tokens", sds((B, steps), i32)), ("count", sds((B,), i32)), ("done", sds((B,), bool))]
        self._prefill = gen._prefill_fn(False, None)
        self._decode = gen._decode_fn(B, steps, False, None)

    # ------------------------------------------------------------------ pytrees <-> flat arrays
    def _rows(self, tok, pos, n, done, stopped, max_new, stop_ids):
        """Rows at temperature 0 (greedy: the sampler's random branch is never taken)."""
        import jax.numpy as jnp
        from r1jax.infer.generator import Rows
        from r1jax.infer.sampling import Sampling
        B = self.B
        greedy = Sampling(jnp.zeros((B,), jnp.float32), jnp.zeros((B,), jnp.int32), jnp.ones((B,), jnp.float32),
                          jnp.zeros((B,), jnp.float32), jnp.zeros((B,), jnp.uint32))
        return Rows(tok=tok, pos=pos, n=n, done=done, stopped=stopped, max_new=max_new, stop_ids=stop_ids,
                    sampling=greedy, draft=jnp.zeros((B,), jnp.int32),
                    h_prev=jnp.zeros((B, self.gen.m.hidden_size), self.gen.dtype))

    def _state(self, rows, kv) -> list:
        import jax
        kv = dataclasses.replace(kv, slots=None, positions=None)
        leaves, tree = jax.tree.flatten(kv)
        if tree != self.kv_tree:
            raise ExportError(f"the cache came back as {tree}, not {self.kv_tree}")
        return [getattr(rows, k) for k in ROWS] + leaves

    def _from_state(self, state):
        import jax
        return self._rows(*state[:len(ROWS)]), jax.tree.unflatten(self.kv_tree, state[len(ROWS):])

    # ------------------------------------------------------------------ the exported functions
    def prefill(self, *a):
        import jax
        import jax.numpy as jnp
        P = len(self.params)
        params = jax.tree.unflatten(self.ptree, a[:P])
        ids, lengths, max_new, stop_ids = a[P:]
        B = self.B
        zero, no = jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool)
        new = self._rows(zero, zero, zero, no, no, max_new, stop_ids)
        empty = self._rows(zero, zero, zero, ~no, no, max_new, stop_ids)      # every slot free (done)
        kv = jax.tree.unflatten(self.kv_tree, [jnp.zeros(s.shape, s.dtype) for s in self.kv_specs])
        rows, kv, (tok, *_) = self._prefill(params, ids, lengths, new, jnp.arange(B, dtype=jnp.int32), empty, kv)
        return (*self._state(rows, kv), tok, rows.done)

    def decode(self, *a):
        import jax
        P = len(self.params)
        params = jax.tree.unflatten(self.ptree, a[:P])
        rows, kv = self._from_state(a[P:])
        rows, kv, out = self._decode(params, rows, kv)
        return (*self._state(rows, kv), out.tokens, out.count, rows.done)

    def specs(self):
        """(prefill's, decode's) input ShapeDtypeStructs, in order."""
        return self.param_specs + [s for _, s in self.prefill_extra], self.param_specs + self.state_specs

    def input_names(self):
        """(prefill's, decode's) input names, in order."""
        p = [f"param.{n}" for n in self.param_names]
        return p + [n for n, _ in self.prefill_extra], p + [f"state.{n}" for n in self.state_names]


def one_device_generator(src, tokenizer=None, log=lambda s: None):
    """`src.generator(tokenizer)` on the first device alone: the exported functions are
    single-device programs, whatever mesh the source's config asks for (`Source.generator`
    builds that mesh over every device)."""
    from r1jax.data import tokenizer as toklib
    from r1jax.infer.generator import Generator
    from r1jax.parallel import mesh as meshlib
    mesh = meshlib.single_device_mesh()
    cfg = src.cfg
    eos = toklib.eos_id(tokenizer) if tokenizer is not None else None
    eos = cfg.model.eos_token_id if eos is None else eos
    return Generator(cfg.model, src.load(mesh, log), cfg.infer, mesh=mesh, kernels=cfg.kernels, eos_id=eos,
                     tokenizer=tokenizer)


def _name(path) -> str:
    import jax
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _spec(name, s) -> dict:
    import numpy as np
    return {"name": name, "shape": list(s.shape), "dtype": np.dtype(s.dtype).name}


def export(gen, out: Path, *, fmt: str = "stablehlo", batch: int = 1, max_len: int = 1024, prompt_len: int = 64,
           steps: int = 1, platforms: tuple[str, ...] = ("cpu", "cuda"), tokenizer_path: Path | None = None,
           source: str = "", log=lambda s: None) -> dict:
    """Write the export directory `out` (which must not exist, or be empty) from `gen` (a
    Generator on one device); the manifest. Everything is written to a sibling temporary
    directory first, so a failure leaves `out` as it was."""
    import jax
    import numpy as np
    from r1jax.convert import safetensors_io
    if gen.mesh.devices.size != 1:
        raise ExportError(f"the generator spans {gen.mesh.devices.size} devices; export runs on one")
    if prompt_len >= max_len:
        raise ExportError(f"--prompt-len {prompt_len} must be below --max-len {max_len} (room for a new token)")
    g = Greedy(gen, batch, prompt_len, max_len, steps)
    pin, din = g.input_names()
    pspecs, dspecs = g.specs()
    files = FILES[fmt]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)                 # mkdtemp's 0700 is not what the user's umask asks
    try:
        t0 = time.perf_counter()
        if fmt == "stablehlo":
            for f, fn, specs, want in zip(files, (g.prefill, g.decode), (pspecs, dspecs), (g.prefill_out, g.decode_out)):
                try:
                    exp = jax.export.export(jax.jit(fn), platforms=platforms)(*specs)
                except (ValueError, NotImplementedError) as e:     # e.g. a custom call without a stability guarantee
                    msg = " ".join(str(e).split())
                    raise ExportError(f"jax.export of {f.split('.')[0]} for {','.join(platforms)}: {msg[:300]}") from None
                got = [(a.shape, a.dtype) for a in exp.out_avals[len(g.state_specs):]]
                assert got == [(s.shape, s.dtype) for _, s in want], (got, want)
                (tmp / f).write_bytes(exp.serialize())
        else:
            from r1jax import export_onnx
            for f, fn, specs, ins in zip(files, (g.prefill, g.decode), (pspecs, dspecs), (pin, din)):
                try:
                    model = export_onnx.convert(fn, specs, f.split(".")[0], ins)
                except export_onnx.OnnxError as e:
                    raise ExportError(f"--format onnx: {e}") from None
                (tmp / f).write_bytes(model.SerializeToString())
        log(f"lowered prefill and decode ({fmt}) in {time.perf_counter() - t0:.1f}s")

        names = pin[:len(g.params)]
        arrays = dict(zip(names, g.params))
        safetensors_io.write(tmp / "params", [(n, tuple(a.shape), np.dtype(a.dtype)) for n, a in arrays.items()],
                             lambda n: np.asarray(jax.device_get(arrays[n])))
        shutil.copyfile(Path(__file__).with_name("export_runner.py"), tmp / "runner.py")
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
        m = gen.m
        manifest = {
            "format": "r1jax-export", "format_version": FORMAT_VERSION, "kind": fmt, "source": source,
            "jax_version": jax.__version__, "platforms": list(platforms) if fmt == "stablehlo" else [],
            "vocab_size": m.vocab_size, "eos_id": gen.eos_id, "batch_size": batch, "prompt_len": prompt_len,
            "max_len": max_len, "decode_steps": steps, "max_stop_ids": g.K,
            "dtype": np.dtype(gen.dtype).name, "cache_dtype": np.dtype(gen.cache_dtype).name,
            "params": {"dir": "params", "order": [_spec(n, s) for n, s in zip(names, g.param_specs)]},
            "state": [_spec(n, s) for n, s in zip(g.state_names, g.state_specs)],
            "prefill": {"file": files[0], "inputs": [_spec(n, s) for n, s in g.prefill_extra],
                        "outputs": [_spec(n, s) for n, s in g.prefill_out]},
            "decode": {"file": files[1], "outputs": [_spec(n, s) for n, s in g.decode_out]},
            "calling": "prefill(*params, *prefill.inputs) -> (*state, *prefill.outputs); "
                       "decode(*params, *state) -> (*state, *decode.outputs)",
            "model": {k: v for k, v in dataclasses.asdict(m).items() if isinstance(v, (int, float, str, bool))},
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if out.exists():
            out.rmdir()                   # empty (checked by the caller); os.replace needs it gone or empty
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m r1jax.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a run directory, orbax:DIR or hf:DIR")
    ap.add_argument("--out", required=True, help="the export directory (new, or empty)")
    ap.add_argument("--format", default="stablehlo", help="stablehlo (jax.export; the supported path) or onnx")
    ap.add_argument("--batch-size", type=int, default=1, help="rows prefilled and decoded together (B)")
    ap.add_argument("--max-len", type=int, default=None,
                    help="cache positions per row (S; default min(max_position_embeddings, 1024))")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt positions of prefill (T)")
    ap.add_argument("--platforms", default=None, help="comma-separated jax.export platforms (default cpu,cuda)")
    ap.add_argument("--decode-steps", type=int, default=1, help="tokens per decode call, at most (N)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. infer.cache_dtype=fp32 infer.dtype=bf16")
    a = ap.parse_args(argv)

    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    if a.format not in FILES:
        return fail(f"--format {a.format}: must be stablehlo or onnx")
    for flag, v in (("--batch-size", a.batch_size), ("--prompt-len", a.prompt_len), ("--decode-steps", a.decode_steps)):
        if v < 1:
            return fail(f"{flag} {v}: must be an integer >= 1")
    if a.max_len is not None and a.max_len < 2:
        return fail(f"--max-len {a.max_len}: must be an integer >= 2")
    if a.platforms is not None and a.format != "stablehlo":
        return fail("--platforms: only --format stablehlo is lowered per platform")
    platforms = tuple(p.strip() for p in (a.platforms or "cpu,cuda").split(","))
    bad = [p for p in platforms if p not in PLATFORMS]
    if bad or not platforms or len(set(platforms)) != len(platforms):
        return fail(f"--platforms {a.platforms}: a comma-separated list of distinct {', '.join(PLATFORMS)}")
    out = Path(a.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        return fail(f"--out {out}: exists and is not an empty directory; give a new one")
    if a.format == "stablehlo":
        try:
            import flatbuffers  # noqa: F401  (jax.export serialises with it)
        except ImportError:
            return fail("--format stablehlo needs the flatbuffers package (pip install flatbuffers)")
    else:
        from r1jax import export_onnx
        missing = export_onnx.missing()
        if missing:
            return fail(f"--format onnx needs {missing}")

    from r1jax.config import ConfigError
    from r1jax.infer import source as sourcelib
    try:
        src = sourcelib.resolve(a.model, a.set)
        tokenizer = src.tokenizer()
    except ConfigError as e:
        return fail(str(e))
    if a.format == "onnx" and src.cfg.infer.dtype.value != "fp32":
        return fail(f"--format onnx: infer.dtype={src.cfg.infer.dtype.value}: onnxruntime's CPU kernels "
                    "(Einsum, MatMul) take no bf16/fp16; export with infer.dtype=fp32 (the cache may stay bf16)")
    m = src.cfg.model
    S = a.max_len if a.max_len is not None else min(m.max_position_embeddings, 1024)
    if a.prompt_len >= S:
        return fail(f"--prompt-len {a.prompt_len}: must be below the cache's {S} positions (--max-len)")

    log = lambda s: print(s, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    gen = one_device_generator(src, tokenizer, log)
    log(f"loaded {a.model} in {time.perf_counter() - t0:.1f}s; {gen.cache_line(a.batch_size, S)}")
    try:
        export(gen, out, fmt=a.format, batch=a.batch_size, max_len=S, prompt_len=a.prompt_len, steps=a.decode_steps,
               platforms=platforms, tokenizer_path=src.tokenizer_path, source=a.model, log=log)
    except ExportError as e:
        return fail(str(e))
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log(f"wrote {out} ({total / 2**20:.1f} MiB): " + ", ".join(
        f"{p.relative_to(out)} {p.stat().st_size:,} B" for p in sorted(out.rglob("*")) if p.is_file()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

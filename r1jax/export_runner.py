"""Greedy generation from a `python -m r1jax.export` directory, without r1jax's model or flax.

    python DIR/runner.py DIR --prompt-ids 5,9,17 [--prompt-ids 7 ...] [--max-new-tokens 16] [--ignore-eos]

prints one JSON line per prompt ({"completion_ids": [...]}). This file is self-contained (the
export copies it into DIR as runner.py): a StableHLO export needs jax and numpy (and ml_dtypes,
which jax brings), an ONNX export onnxruntime and numpy. `generate(DIR, prompts, ...)` is the
same from Python.

Prompts go B at a time (the manifest's batch_size; missing rows are padding that stops at
once): one prefill, then decode calls until every row is done (a stop id, max_new_tokens, or
the cache's max_len positions).
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
             "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
             "BOOL": "bool"}


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:                       # bfloat16, float8_*: numpy's extension types
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))


def read_safetensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors files in `directory` (one file or shards)."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        raw = np.memmap(path, np.uint8, mode="r")
        (n,) = struct.unpack("<Q", raw[:8].tobytes())
        header = json.loads(raw[8:8 + n].tobytes())
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            out[name] = raw[8 + n + a:8 + n + b].view(_dtype(ST_DTYPES[info["dtype"]])).reshape(info["shape"])
    return out


class Exported:
    """An export directory loaded for its format: `prefill(ids, lengths, max_new, stop_ids)` and
    `decode(state)` over numpy arrays."""

    def __init__(self, directory: str | Path):
        d = self.dir = Path(directory)
        self.manifest = m = json.loads((d / "manifest.json").read_text())
        if m.get("format") != "r1jax-export" or m.get("format_version") != 1:
            raise ValueError(f"{d}: not an r1jax export (format version 1)")
        tensors = read_safetensors(d / m["params"]["dir"])
        params = [tensors[p["name"]] for p in m["params"]["order"]]
        self.nstate = len(m["state"])
        self.kind = m["kind"]
        if self.kind == "stablehlo":
            import jax
            self.params = [jax.device_put(p) for p in params]
            fns = [jax.export.deserialize(bytearray((d / m[k]["file"]).read_bytes())) for k in ("prefill", "decode")]
            P = len(params)
            self._prefill = jax.jit(fns[0].call)
            # the state (the cache) is consumed: its buffers are reused for the next one
            self._decode = jax.jit(fns[1].call, donate_argnums=tuple(range(P, P + self.nstate)))
        else:
            import onnxruntime as ort
            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            self.params = [_ort_value(p) for p in params]        # views: each OrtValue holds its array
            sessions = [ort.InferenceSession(str(d / m[k]["file"]), opts, providers=["CPUExecutionProvider"])
                        for k in ("prefill", "decode")]
            self._prefill = self._onnx(sessions[0])
            self._decode = self._onnx(sessions[1])

    @staticmethod
    def _onnx(session):
        """The session over OrtValues (onnxruntime's numpy conversion has no bfloat16: a bf16
        cache stays an OrtValue from one call to the next)."""
        ins, outs = [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()]
        return lambda *a: session.run_with_ort_values(outs, dict(zip(ins, [_ort_value(x) for x in a])))

    def prefill(self, ids, lengths, max_new, stop_ids):
        """(state, first tokens [B], done [B])."""
        out = self._prefill(*self.params, ids, lengths, max_new, stop_ids)
        return list(out[:self.nstate]), *map(_numpy, out[-2:])

    def decode(self, state):
        """(state, tokens [B, N], count [B], done [B])."""
        out = self._decode(*self.params, *state)
        return list(out[:self.nstate]), *map(_numpy, out[-3:])


def _numpy(x) -> np.ndarray:
    return x.numpy() if hasattr(x, "numpy") and not hasattr(x, "__array__") else np.asarray(x)


def _ort_value(x):
    import onnxruntime as ort
    if isinstance(x, ort.OrtValue):
        return x
    x = np.ascontiguousarray(x)
    if x.dtype.name == "bfloat16":          # onnx TensorProto.BFLOAT16
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(x.view(np.uint16), 16)
    return ort.OrtValue.ortvalue_from_numpy(x)


def generate(exported: Exported | str | Path, prompts: list[list[int]], max_new_tokens: int = 16,
             ignore_eos: bool = False, stop_ids: tuple[int, ...] = ()) -> list[list[int]]:
    """Greedy completions (token ids) of `prompts`, in order."""
    ex = exported if isinstance(exported, Exported) else Exported(exported)
    m = ex.manifest
    B, T, S, K = m["batch_size"], m["prompt_len"], m["max_len"], m["max_stop_ids"]
    stops = list(stop_ids) + ([] if ignore_eos or m["eos_id"] is None else [m["eos_id"]])
    if len(stops) > K:
        raise ValueError(f"at most {K} stop ids (EOS included)")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    for p in prompts:
        if not 1 <= len(p) <= min(T, S - 1):
            raise ValueError(f"a prompt of {len(p)} tokens: this export takes 1 to {min(T, S - 1)}")
        if not all(0 <= t < m["vocab_size"] for t in p):
            raise ValueError(f"prompt ids must be in [0, {m['vocab_size']})")
    results = []
    for start in range(0, len(prompts), B):
        group = prompts[start:start + B]
        n = len(group)
        ids = np.zeros((B, T), np.int32)
        lengths = np.ones((B,), np.int32)
        for i, p in enumerate(group):
            ids[i, :len(p)] = p
            lengths[i] = len(p)
        max_new = np.array([max_new_tokens] * n + [1] * (B - n), np.int32)      # padding rows stop at once
        stop = np.full((B, K), -1, np.int32)
        stop[:n, :len(stops)] = stops
        state, tok, done = ex.prefill(ids, lengths, max_new, stop)
        out = [[int(tok[i])] for i in range(n)]
        while not done[:n].all():
            state, toks, count, done = ex.decode(state)
            for i in range(n):
                out[i] += [int(t) for t in toks[i, :count[i]]]
        results += out
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the export directory")
    ap.add_argument("--prompt-ids", action="append", required=True, help="comma-separated token ids; repeatable")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--ignore-eos", action="store_true")
    a = ap.parse_args(argv)
    try:
        prompts = [[int(t) for t in p.split(",")] for p in a.prompt_ids]
        outs = generate(a.dir, prompts, a.max_new_tokens, a.ignore_eos)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for o in outs:
        print(json.dumps({"completion_ids": o}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

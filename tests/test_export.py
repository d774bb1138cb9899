"""`python -m r1jax.export` end to end, in real processes: a tiny model exported as StableHLO
(lowered for cpu and cuda) and as ONNX, each reloaded in a fresh process by the runner the
export writes into its directory, which generates the same greedy tokens as
`Generator.generate` without importing r1jax or flax; and one-line errors with exit 2 that
write nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from r1jax import config as configlib
from r1jax import export as exportlib
from r1jax import weights
from r1jax.convert import hf

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    """The environment of the processes these tests start, read when each starts: it carries
    tests/conftest.py's -O0 settings for this file (set once the module's tests begin)."""
    return {**os.environ, "JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"}

PROMPTS = [[5, 9, 17, 3], [7], list(range(1, 17))]       # 3 prompts over B=2 rows: a padding row too
NEW = 8
SHAPES = ["--batch-size", "2", "--max-len", "64", "--prompt-len", "16", "--decode-steps", "4"]

# run in a fresh process with -I (no cwd or PYTHONPATH on sys.path): only DIR/runner.py
RUN = """
import json, sys
d = sys.argv[1]
sys.path.insert(0, d)
import runner
out = runner.generate(d, json.loads(sys.argv[2]), int(sys.argv[3]), ignore_eos=True)
mods = sorted(m for m in sys.modules if m.split(".")[0] in ("r1jax", "flax"))
print(json.dumps({"out": out, "mods": mods, "jax": "jax" in sys.modules}))
"""


def _export(*args):
    return subprocess.run([sys.executable, "-m", "r1jax.export", *args], capture_output=True, text=True,
                          timeout=600, env=_env(), cwd=ROOT)


def _reload(d: Path):
    p = subprocess.run([sys.executable, "-I", "-c", RUN, str(d), json.dumps(PROMPTS), str(NEW)], capture_output=True,
                       text=True, timeout=600, env=_env(), cwd=d.parent)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("export") / "hf"
    m = configlib.load(ROOT / "configs" / "tiny.yaml", ["mesh.data=1", "model.num_nextn_predict_layers=0"]).model
    hf.save(weights.create(m, seed=1), m, d)
    return d


@pytest.fixture(scope="module")
def expected(model_dir):
    """Generator.generate's greedy tokens with the export's shapes (cache of 64 positions, the
    config's cache dtype, prompts padded to 16, batches of 2)."""
    from r1jax.infer import source as sourcelib
    from r1jax.infer.generator import Request
    src = sourcelib.resolve(f"hf:{model_dir}", ["infer.max_len=64", "infer.batch_size=2"])
    gen = exportlib.one_device_generator(src)
    out = gen.generate([Request(tuple(p), NEW, ignore_eos=True) for p in PROMPTS])
    return [c.completion_ids for c in out]


@pytest.mark.slow      # an export process, a reload process and the in-process reference: ~30 s
def test_stablehlo_reloads_without_r1jax_and_matches_the_generator(model_dir, expected, tmp_path):
    import jax
    d = tmp_path / "out"
    p = _export("--model", f"hf:{model_dir}", "--out", str(d), *SHAPES)
    assert p.returncode == 0, p.stderr
    man = json.loads((d / "manifest.json").read_text())
    assert man["format"] == "r1jax-export" and man["format_version"] == exportlib.FORMAT_VERSION
    assert man["kind"] == "stablehlo" and man["platforms"] == ["cpu", "cuda"] and man["jax_version"] == jax.__version__
    assert (man["batch_size"], man["prompt_len"], man["max_len"], man["decode_steps"]) == (2, 16, 64, 4)
    assert man["vocab_size"] == 512 and man["cache_dtype"] == "bfloat16"
    assert man["decode"]["outputs"][0] == {"name": "tokens", "shape": [2, 4], "dtype": "int32"}
    for f in ("prefill", "decode"):
        exp = jax.export.deserialize(bytearray((d / man[f]["file"]).read_bytes()))
        assert exp.platforms == ("cpu", "cuda") and exp.nr_devices == 1      # cuda lowered on a CPU host
        assert len(exp.in_avals) == len(man["params"]["order"]) + (4 if f == "prefill" else len(man["state"]))

    got = _reload(d)
    assert got["mods"] == [] and got["jax"]                # neither r1jax (r1jax.model) nor flax
    assert got["out"] == expected
    assert all(len(o) == NEW for o in expected)


@pytest.mark.slow      # jax2onnx's conversion alone takes ~15 s
def test_onnx_runs_in_onnxruntime_and_matches_the_generator(model_dir, expected, tmp_path):
    d = tmp_path / "onnx"
    p = _export("--model", f"hf:{model_dir}", "--out", str(d), "--format", "onnx", *SHAPES)
    assert p.returncode == 0, p.stderr
    import onnx

    def ops(g):                    # every node's op, the If/Loop bodies' included
        for n in g.node:
            yield n.op_type
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    yield from ops(sub)

    for f in ("prefill.onnx", "decode.onnx"):
        found = set(ops(onnx.load(str(d / f)).graph))
        assert "Loop" in found and not found & {"RandomUniform", "RandomUniformLike", "RandomNormal", "BitCast"}
    got = _reload(d)
    assert got["mods"] == [] and not got["jax"]           # onnxruntime and numpy alone
    assert got["out"] == expected


def test_one_line_errors_and_nothing_written(model_dir, tmp_path, capsys):
    def err(*args):
        assert exportlib.main(list(args)) == 2
        e = capsys.readouterr().err
        assert len(e.strip().splitlines()) == 1 and e.startswith("error: "), e
        return e

    src = f"hf:{model_dir}"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert "not an empty directory" in err("--model", src, "--out", str(busy))
    assert [f.name for f in busy.iterdir()] == ["keep.txt"]
    out = tmp_path / "out"
    assert "must be stablehlo or onnx" in err("--model", src, "--out", str(out), "--format", "tflite")
    assert "--prompt-len 64: must be below" in err("--model", src, "--out", str(out), "--max-len", "64")
    assert "--platforms cpu,metal" in err("--model", src, "--out", str(out), "--platforms", "cpu,metal")
    assert "--batch-size 0" in err("--model", src, "--out", str(out), "--batch-size", "0")
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["busy"]

    # the real command: an unknown SRC, one line on stderr, exit 2
    p = _export("--model", str(tmp_path / "nowhere"), "--out", str(out))
    assert p.returncode == 2 and "not a run directory" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not out.exists()

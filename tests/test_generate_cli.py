"""`python -m r1jax.generate` end to end, in real processes: JSONL in and out (text and id
prompts, per-line sampling fields, input order kept), `--prompt` streaming to stdout, the
same completions from `hf:DIR` and the `orbax:DIR` converted from it, and one-line errors with
exit 2 (a bad line by its number, before anything compiles; an unknown SRC; no tokenizer)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from r1jax import config as configlib
from r1jax import weights
from r1jax.convert import hf
from r1jax.data import tokenizer as toklib

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=600):
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "r1jax.generate", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """An HF directory with a tokenizer, and the orbax checkpoint converted from it."""
    d = tmp_path_factory.mktemp("gen")
    m = configlib.load(ROOT / "configs" / "tiny.yaml", ["mesh.data=1", "model.num_nextn_predict_layers=0"]).model
    hf.save(weights.create(m, seed=1), m, d / "hf")
    toklib.train(["def f(x):\n    return x + 1\n", "import os\nprint('hello world')\n"] * 200, m.vocab_size).save(
        str(d / "hf" / "tokenizer.json"))
    hf.hf_to_orbax(d / "hf", d / "orbax")
    (d / "orbax" / "tokenizer.json").write_text((d / "hf" / "tokenizer.json").read_text())
    return d


@pytest.mark.slow      # two CLI processes, conversion and generation: `make test`
def test_jsonl_in_and_out_from_hf_and_orbax(model_dirs, tmp_path):
    lines = [{"prompt": "def f(x):"}, {"prompt_ids": [5, 9, 17, 3]},
             {"prompt": "import os", "max_new_tokens": 3, "temperature": 0.8, "seed": 4, "top_k": 50},
             {"prompt_ids": [7], "ignore_eos": True, "logprobs": 2}]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    outs = {}
    for name in ("hf", "orbax"):
        dst = tmp_path / f"{name}.jsonl"
        p = _run("--model", f"{name}:{model_dirs / name}", "--input", str(src), "--output", str(dst),
                 "--max-new-tokens", "6", "--ignore-eos", "--batch-size", "2")
        assert p.returncode == 0, p.stderr
        assert "latent cache" in p.stderr and "per-head K/V" in p.stderr
        outs[name] = [json.loads(x) for x in dst.read_text().splitlines()]
    got = outs["hf"]
    assert got == outs["orbax"]
    assert len(got) == 4
    for rec, line in zip(got, lines):
        assert list(rec)[:5] == ["completion_ids", "completion", "finish_reason", "prompt_tokens", "completion_tokens"]
        assert rec["completion_tokens"] == len(rec["completion_ids"]) == line.get("max_new_tokens", 6)
        assert rec["finish_reason"] == "length"
    assert got[1]["prompt_tokens"] == 4 and got[3]["prompt_tokens"] == 1
    assert len(got[3]["logprobs"]) == 6 and all(len(t) == 2 for t in got[3]["top_logprobs"])

    # --prompt streams the same greedy completion as the JSONL path
    p = _run("--model", f"hf:{model_dirs / 'hf'}", "--prompt", "def f(x):", "--max-new-tokens", "6", "--ignore-eos")
    assert p.returncode == 0, p.stderr
    assert p.stdout == got[0]["completion"] + "\n"


@pytest.mark.parametrize("line,message", [
    ('{"prompt_ids": [1, 2]}\n{"prompt_ids": "nope"}\n', "line 2: \"prompt_ids\" must be a non-empty list"),
    ('{"prompt_ids": [1]}\n{"prompt_ids": [1], "temperature": -1}\n', "line 2: \"temperature\"=-1: must be a number >= 0"),
    ('{"prompt_ids": [1], "colour": "red"}\n', "line 1: unknown field \"colour\""),
    ('{"prompt_ids": [100000]}\n', "line 1: \"prompt_ids\" must be a non-empty list of token ids in [0, 512)"),
    ('not json\n', "line 1: not JSON"),
])
def test_a_bad_line_is_named_and_nothing_compiles(model_dirs, tmp_path, line, message):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(line)
    t0 = time.perf_counter()
    p = _run("--model", f"hf:{model_dirs / 'hf'}", "--input", str(src), "--output", str(dst))
    assert p.returncode == 2
    assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not dst.exists()
    assert time.perf_counter() - t0 < 60      # no weights loaded, nothing compiled


def test_unknown_source_and_missing_tokenizer(model_dirs, tmp_path):
    p = _run("--model", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert p.returncode == 2 and "not a run directory" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in (model_dirs / "hf").iterdir():
        if f.name != "tokenizer.json":
            (bare / f.name).symlink_to(f)
    p = _run("--model", f"hf:{bare}", "--prompt", "hi")
    assert p.returncode == 2 and "no tokenizer.json" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt_ids": [1, 2]}\n{"prompt": "text"}\n')
    p = _run("--model", f"hf:{bare}", "--input", str(src), "--output", str(tmp_path / "o.jsonl"))
    assert p.returncode == 2 and "line 2" in p.stderr and "no tokenizer.json" in p.stderr
    p = _run("--model", f"hf:{model_dirs / 'hf'}", "--prompt", "hi", "--speculative")
    assert p.returncode == 2 and "no MTP module" in p.stderr

"""Sanity of the benchmark scripts' measuring functions and of RESULTS.md assembly (no timings asserted).

The model is tiny.yaml cut to two dense layers without MTP, compiled at XLA backend optimisation
level 0: the functions' plumbing is what is tested, and that keeps four compiles near a minute.
"""
from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow      # whole runs, meshes or processes: `make test`, not `make check`

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    """bench/NAME.py as module bench_NAME (bench/ is not a package)."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


accum, compile_time, results = (_load(n) for n in ("accum", "compile_time", "results"))

TINY = ROOT / "configs" / "tiny.yaml"
FAST = {"xla_backend_optimization_level": 0}


def dense(layers: int) -> list[str]:
    return ["model.num_nextn_predict_layers=0", f"model.num_hidden_layers={layers}",
            f"model.first_k_dense_replace={layers}"]


def test_accum_temp_shrinks_with_microbatch():
    rows = accum.measure(TINY, dense(2), accums=(1, 4), compiler_options=FAST)
    by = {r["grad_accum"]: r for r in rows}
    assert by[1]["temp_bytes"] > 0 and by[4]["temp_bytes"] > 0
    assert by[4]["temp_bytes"] < by[1]["temp_bytes"]
    assert by[4]["argument_bytes"] == by[1]["argument_bytes"]      # the state and batch do not change
    assert by[4]["microbatch_rows"] * 4 == by[1]["microbatch_rows"]


def test_compile_time_measures_a_program_that_does_not_grow_with_depth():
    """What bench/compile_time.py rests on: the layers are scanned, so 4 dense layers lower to the
    program 2 do (StableHLO lines and optimised HLO instructions equal within 2%), while what the
    program keeps for the backward grows with depth; trace, lower and compile are each timed and
    add up to the total."""
    r = {n: compile_time.measure(TINY, dense(n), compiler_options=FAST) for n in (2, 4)}
    for n, m in r.items():
        assert m["layers"] == n and m["dense_layers"] == n
        assert min(m["trace_s"], m["lower_s"], m["compile_s"]) > 0
        assert m["total_s"] == pytest.approx(m["trace_s"] + m["lower_s"] + m["compile_s"])
    assert r[4]["stablehlo_lines"] == pytest.approx(r[2]["stablehlo_lines"], rel=0.02)
    assert r[4]["hlo_instructions"] == pytest.approx(r[2]["hlo_instructions"], rel=0.02)
    assert r[4]["temp_bytes"] > r[2]["temp_bytes"]


def test_results_reassembles_every_table(tmp_path):
    repo_results = (ROOT / "bench" / "RESULTS.md").read_bytes()
    bench = tmp_path / "bench"
    shutil.copytree(ROOT / "bench" / "results", bench / "results")
    # the repository's RESULTS.md is what its tables and notes assemble to: a note written into
    # RESULTS.md alone would be lost by the next `python bench/results.py`
    assert results.assemble(bench).read_bytes() == repo_results
    (bench / "results" / "zz_extra.md").write_text("# An extra table\n\n| a |\n|---|\n| 1 |\n")
    (bench / "results" / "zz_extra.notes.md").write_text("A hand-written note on it.\n")
    (bench / "results" / "bench_moe_small.md").write_text("# r1jax against torch, moe_small\n\ntext\n")
    out = results.assemble(bench)
    assert out == bench / "RESULTS.md"
    text = out.read_text()
    assert text.startswith(results.HEADER)
    assert "| 1 |\n\nA hand-written note on it.\n" in text                # a table's notes follow it
    for md in sorted((bench / "results").glob("*.md")):
        if md.name.endswith(".notes.md"):
            continue
        heading = md.read_text().splitlines()[0]
        assert heading.startswith("# ")
        assert "\n#" + heading in text, md.name                    # demoted to "## ..."
    present = [n for n in results.ORDER if (bench / "results" / f"{n}.md").is_file()]
    positions = [text.index("\n#" + (bench / "results" / f"{n}.md").read_text().splitlines()[0]) for n in present]
    assert positions == sorted(positions)                          # ORDER first, in order
    assert text.index("An extra table") > max(positions)
    assert text.index("r1jax against torch") < positions[present.index("data_pipeline")]   # bench_* go with "bench"
    assert (ROOT / "bench" / "RESULTS.md").read_bytes() == repo_results     # the repository's file is untouched

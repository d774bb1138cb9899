"""bench/serve_load.py without a server: summarize() on hand-made records, the one-line exit-2
argument errors, and (where httpx is installed) the stream parsing against httpx.MockTransport."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    if "bench_serve_load" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_serve_load", ROOT / "bench" / "serve_load.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_serve_load"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_serve_load"]


sl = _load()


def rec(i, ttft=0.1, e2e=1.0, tokens=10, itl=(), ok=True, status=200, error=None, prompt_tokens=5, start=0.0):
    return {"index": i, "ok": ok, "status": status, "error": error, "ttft": ttft if ok else None,
            "itl": list(itl), "e2e": e2e if ok else None, "output_tokens": tokens if ok else 0,
            "prompt_tokens": prompt_tokens, "start": start, "end": start + (e2e or 0.0)}


def test_percentiles_are_numpy_linear_in_ms():
    records = [rec(i, ttft=(i + 1) / 1000, e2e=1.0) for i in range(100)]     # TTFT 1..100 ms
    s = sl.summarize(records, duration_s=10.0)
    assert s["ttft_ms"] == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert s["e2e_ms"] == pytest.approx({"p50": 1000.0, "p90": 1000.0, "p99": 1000.0})
    assert s["completed"] == 100 and s["errors"] == 0 and s["qps"] == pytest.approx(10.0)
    assert s["output_tok_s"] == pytest.approx(100.0) and s["total_tok_s"] == pytest.approx(150.0)


def test_tpot_formula_itl_and_slo_fraction():
    records = [rec(0, ttft=0.1, e2e=1.0, tokens=10, itl=[0.1] * 9),          # (1.0 - 0.1) / 9 = 100 ms
               rec(1, ttft=0.2, e2e=0.4, tokens=3, itl=[0.05, 0.15]),        # (0.4 - 0.2) / 2 = 100 ms
               rec(2, ttft=0.3, e2e=0.3, tokens=1)]                          # one token: no TPOT
    s = sl.summarize(records, duration_s=2.0)
    assert s["tpot_ms"] == pytest.approx({"p50": 100.0, "p99": 100.0})
    gaps = [100.0] * 9 + [50.0, 150.0]
    assert s["itl_ms"] == pytest.approx({"p50": np.percentile(gaps, 50), "p99": np.percentile(gaps, 99)})
    assert s["e2e_le_500ms_frac"] == pytest.approx(2 / 3, abs=1e-4)
    assert s["output_tokens"] == 14 and s["output_tok_s"] == pytest.approx(7.0)


def test_errors_counted_by_status_with_first_five_distinct_messages():
    errors = [rec(10 + i, ok=False, status=500, error=f"HTTP 500: boom {i % 7}") for i in range(12)]
    errors += [rec(30, ok=False, status=None, error="ConnectError: refused"),
               rec(31, ok=False, status=200, error="stream ended without [DONE]")]
    records = [rec(0, e2e=0.2), rec(1, e2e=0.8)] + errors
    s = sl.summarize(records, duration_s=4.0)
    assert (s["sent"], s["completed"], s["errors"]) == (16, 2, 14)
    assert s["error_statuses"] == {"500": 12, "no status": 1, "200": 1}
    assert s["error_messages"] == [f"HTTP 500: boom {i}" for i in range(5)]
    assert s["qps"] == pytest.approx(0.5)                              # completed / duration
    assert s["e2e_le_500ms_frac"] == pytest.approx(1 / 16, abs=1e-4)            # over all requests sent
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)                 # errors leave latencies alone


def test_summarize_empty_and_default_duration():
    empty = sl.summarize([])
    assert empty["completed"] == 0 and empty["qps"] is None and empty["ttft_ms"]["p50"] is None
    s = sl.summarize([rec(0, e2e=1.0, start=0.5), rec(1, e2e=1.0, start=1.5)])   # 0.5 -> 2.5
    assert s["duration_s"] == pytest.approx(2.0) and s["qps"] == pytest.approx(1.0)


def test_prompt_ids_deterministic_per_index():
    cfg = sl.LoadConfig(url="http://127.0.0.1:1", clients=1, requests=2, prompt_ids_len=64)
    a, b = sl.prompt_for(cfg, 0), sl.prompt_for(cfg, 1)
    assert a == sl.prompt_for(cfg, 0) and a != b and len(a) == 64
    assert all(isinstance(t, int) and 3 <= t < 200 for t in a + b)
    assert sl.prompt_for(sl.LoadConfig(url="u", clients=1, requests=1, prompt="hi"), 3) == "hi"


OK = ["--url", "http://127.0.0.1:8000", "--clients", "2", "--requests", "4"]


@pytest.mark.parametrize("argv, flag", [
    (["--clients", "2", "--requests", "4"], "--url"),
    (["--url", "http://127.0.0.1:8000", "--requests", "4"], "--clients"),
    ([*OK[:4], "--requests", "0"], "--requests"),
    ([*OK[:2], "--clients", "x", "--requests", "4"], "--clients"),
    ([*OK, "--arrival", "burst"], "--arrival"),
    ([*OK, "--arrival", "poisson"], "--rate"),
    ([*OK, "--rate", "3"], "--rate"),
    ([*OK, "--prompt", "a", "--prompt-ids-len", "8"], "--prompt"),
    ([*OK, "--max-tokens", "0"], "--max-tokens"),
    ([*OK, "--duration-s", "-1"], "--duration-s"),
    ([*OK, "--compare-batching"], "--compare-batching"),
    ([*OK, "--serve-model", "x"], "--serve-model"),
    (["--url", "127.0.0.1:8000", *OK[2:]], "--url"),
    (["--serve-model", "x", "--serve-args", "--max-batch-size 4", "--compare-batching", *OK[2:]],
     "--compare-batching"),
])
def test_bad_arguments_exit_2_with_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        sl.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err, err


def test_md_header_matches_row_width():
    run = {"label": "x", "config": {"arrival": "poisson", "rate": 2.0, "clients": 1, "max_tokens": 4},
           "summary": sl.summarize([rec(0)], 1.0), "rss_mib": {"before": 1.0, "after": 2.0, "peak": 3.0},
           "cpu_start": {"loadavg_1m": 0.1, "psi_cpu_avg10": 0.0}, "cpu_end": {"loadavg_1m": 0.1, "psi_cpu_avg10": 0.0}}
    assert sl.md_row(run).count("|") == sl.MD_HEADER.splitlines()[0].count("|")


def _mock(delays, mode="ok"):
    """httpx transport that streams len(delays) text chunks, each after its delay (seconds)."""
    httpx = pytest.importorskip("httpx")
    seen = []

    async def chunks():
        for i, d in enumerate(delays):
            await asyncio.sleep(d)
            if mode == "error" and i == 1:
                yield b'data: {"error": {"message": "engine died"}}\n\n'
                return
            finish = "length" if i == len(delays) - 1 else None
            choice = {"index": 0, "text": "x", "logprobs": None, "finish_reason": finish}
            yield f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n\n".encode()
        yield b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}}\n\n'
        if mode != "nodone":
            yield b"data: [DONE]\n\n"

    async def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "stub"}]})
        seen.append(json.loads(request.content))
        if mode == "500":
            return httpx.Response(500, text="boom")
        return httpx.Response(200, content=chunks(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler), seen


def test_stream_timings_usage_and_request_body():
    transport, seen = _mock([0.06, 0.02, 0.02])
    cfg = sl.LoadConfig(url="http://127.0.0.1:9", clients=2, requests=3, max_tokens=3, api_key="k")
    run = asyncio.run(sl.run_load(cfg, transport=transport))
    s = run["summary"]
    assert s["completed"] == 3 and s["errors"] == 0 and run["config"]["api_key"] == "***"
    assert 55 <= s["ttft_ms"]["p50"] < 1000 and s["output_tokens"] == 27 and s["prompt_tokens"] == 21
    r = run["records"][0]
    assert len(r["itl"]) == 2 and r["e2e"] >= r["ttft"] + sum(r["itl"]) - 1e-6
    assert seen[0] == {"model": "stub", "prompt": sl.DEFAULT_PROMPT, "max_tokens": 3, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


@pytest.mark.parametrize("mode, message", [("error", "error chunk: engine died"), ("500", "HTTP 500: boom"),
                                           ("nodone", "stream ended without [DONE]")])
def test_stream_errors(mode, message):
    transport, _ = _mock([0.0, 0.0, 0.0], mode)
    cfg = sl.LoadConfig(url="http://127.0.0.1:9", clients=1, requests=2, model="m", arrival="poisson", rate=1000.0)
    s = asyncio.run(sl.run_load(cfg, transport=transport))["summary"]
    assert (s["completed"], s["errors"], s["error_messages"]) == (0, 2, [message])


def test_rss_growth_is_split_into_halves():
    """A soak's RSS trend: warm-up growth shows in the first half only, a leak in both."""
    warm = [[0.0, 100.0], [10.0, 110.0], [20.0, 110.0], [30.0, 110.0]]
    assert sl.rss_halves(warm, 110.0) == (10.0, 0.0)
    leak = [[0.0, 100.0], [10.0, 105.0], [20.0, 110.0], [30.0, 115.0]]
    assert sl.rss_halves(leak, 120.0) == (10.0, 10.0)
    assert sl.rss_halves([[0.0, 1.0]], None) is None

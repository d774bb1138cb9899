"""`python -m r1jax.serve` in a real process on loopback, called with the official `openai`
client (strict response validation) and raw HTTP: completions and chat, streamed and whole,
greedy text equal to `python -m r1jax.generate`'s, concurrent streams each equal to their solo
result, OpenAI error bodies for bad requests, a disconnect freeing its slot, 1,000 malformed
requests without memory growth, and the load tester against it. Every loop is bounded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from r1jax import config as configlib
from r1jax import weights
from r1jax.convert import hf
from r1jax.data import tokenizer as toklib
from r1jax.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key"
NAME = "tiny"


def _env() -> dict:
    """The environment of the processes these tests start, read when each starts: it carries
    tests/conftest.py's -O0 settings for this file (set once the module's tests begin)."""
    return {**os.environ, "JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"}


def _model_dir(d: Path) -> Path:
    m = configlib.load(ROOT / "configs" / "tiny.yaml", ["mesh.data=1"]).model
    hf.save(weights.create(m, seed=1), m, d)
    toklib.train(["def f(x):\n    return x + 1\n", "import os\nprint('hello world')\n"] * 200, m.vocab_size).save(
        str(d / "tokenizer.json"))
    return d


class Running:
    def __init__(self, model: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(model.parent / f"serve-{self.port}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "r1jax.serve", "--model", f"hf:{model}", "--port", str(self.port),
             "--served-model-name", NAME, *args], stdout=self.log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
        deadline = time.time() + 600
        while time.time() < deadline:
            assert self.proc.poll() is None, self.tail()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        pytest.fail("the server was not ready in 600 s:\n" + self.tail())

    def tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("serve") / "hf")


@pytest.fixture(scope="module")
def server(model):
    s = Running(model, "--api-key", KEY, "--max-batch-size", "8", "--preferred-batch-sizes", "4,8",
                "--max-model-len", "128", "--max-queue-delay-ms", "5", "--warmup-prompt-len", "16")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, _strict_response_validation=True, max_retries=0,
                  timeout=120)


def _post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    return httpx.post(server.url + path, content=body, headers={**headers, "Content-Type": "application/json"},
                      timeout=120, **kw)


@pytest.mark.slow
def test_openai_client_completions_and_chat_match_generate(server, client, model, tmp_path):
    assert [m.id for m in client.models.list().data] == [NAME]
    prompt = "def f(x):"
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 8
    # the same greedy text as python -m r1jax.generate
    out = tmp_path / "out.jsonl"
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": prompt}) + "\n")
    p = subprocess.run([sys.executable, "-m", "r1jax.generate", "--model", f"hf:{model}", "--input",
                        str(tmp_path / "in.jsonl"), "--output", str(out), "--max-new-tokens", "8", "--ignore-eos"],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr
    assert choice.text == json.loads(out.read_text())["completion"]
    assert whole.usage.prompt_tokens == json.loads(out.read_text())["prompt_tokens"]

    # a token-id prompt, n = 2 seeded samples, logprobs with alternatives
    many = client.completions.create(model=NAME, prompt=[5, 9, 17], max_tokens=4, temperature=1.0, seed=3, n=2,
                                     logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1] and many.usage.completion_tokens == 8
    again = client.completions.create(model=NAME, prompt=[5, 9, 17], max_tokens=4, temperature=1.0, seed=3, n=2,
                                      logprobs=2, extra_body={"ignore_eos": True})
    assert [c.text for c in many.choices] == [c.text for c in again.choices]
    lp = many.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    # the legacy format keys alternatives by their text: two tokens that decode alike share a key
    assert all(1 <= len(alts) <= 2 for alts in lp.top_logprobs)

    # chat, whole and streamed: the same greedy text, a role opener, usage last
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    with_lp = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                             top_logprobs=3, extra_body={"ignore_eos": True})
    assert with_lp.choices[0].message.content == chat.choices[0].message.content
    content = with_lp.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == max(a.logprob for a in t.top_logprobs) for t in content)      # greedy: the best
    streamed = [c for c in client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    # the stream's chunks carry each token's log-probs once, as the whole response has them
    assert [t.logprob for c in streamed for t in c.choices[0].logprobs.content] == [t.logprob for t in content]
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

    # a stop string ends the text before it, and the stream says "stop"
    full = choice.text
    if len(full) > 3:
        cut = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, stop=[full[2:4]],
                                        extra_body={"ignore_eos": True})
        assert cut.choices[0].text == full[:full.index(full[2:4])] and cut.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_concurrent_streams_each_equal_their_solo_result(server):
    prompts = [[3 + i, 40 + 2 * i, 7] for i in range(12)]
    lengths = [5 + (i % 4) * 3 for i in range(12)]

    def body(i, stream):
        return {"model": NAME, "prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0, "ignore_eos": True,
                "stream": stream}

    solo = [_post(server, "/v1/completions", body(i, False)).json()["choices"][0]["text"] for i in range(12)]
    iterations_before = server.metric("vllm:iteration_tokens_total_count")
    results: dict[int, str] = {}

    def stream(i):
        text, done = "", False
        with httpx.stream("POST", server.url + "/v1/completions", json=body(i, True), timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    obj = json.loads(line[6:])
                    if obj["choices"]:
                        text += obj["choices"][0]["text"]
        assert done
        results[i] = text

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [results.get(i) for i in range(12)] == solo
    # they shared decode calls: fewer calls than the tokens they generated
    calls = server.metric("vllm:iteration_tokens_total_count") - iterations_before
    assert 0 < calls < sum(lengths) / 2, calls
    assert server.metric("vllm:num_requests_running") == 0


BAD = [
    ("not json", 400, None),
    ([1, 2], 400, None),
    ({"prompt": "x"}, 400, "model"),
    ({"model": NAME}, 400, "prompt"),
    ({"model": NAME, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": NAME, "prompt": "x", "n": 99}, 400, "n"),
    ({"model": NAME, "prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"model": NAME, "prompt": list(range(3, 200))}, 400, "prompt"),           # past max_model_len 128
    ({"model": NAME, "prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "stop": [1]}, 400, "stop"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_a_bad_request_gets_an_openai_error(server, body, status, param):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param


def test_key_routes_and_body_limits(server):
    r = _post(server, "/v1/completions", {"model": NAME, "prompt": "x"}, key=None)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert _post(server, "/v1/completions", {"model": NAME, "prompt": "x"}, key="wrong").status_code == 401
    assert _post(server, "/v1/nothing", {}).status_code == 404
    assert httpx.get(server.url + "/v1/completions", timeout=10).status_code == 405
    big = json.dumps({"model": NAME, "prompt": "x" * (2 << 20)})
    assert _post(server, "/v1/completions", big).status_code == 413
    r = _post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and "messages[0].role" in r.json()["error"]["message"]
    # and the server still answers a good request
    ok = _post(server, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.slow
def test_a_disconnect_frees_the_slot(server):
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": NAME, "prompt": "def", "max_tokens": 120, "ignore_eos": True,
                            "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 2:
                break
    deadline = time.time() + 30
    while time.time() < deadline:
        if (server.metric("vllm:num_requests_running") == 0 and
                server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1):
            break
        time.sleep(0.2)
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1


@pytest.mark.slow
def test_a_thousand_malformed_requests_leave_memory_flat(server):
    import random
    rng = random.Random(0)
    bodies = ["{", "null", "[]", '{"model": 1}', json.dumps({"model": NAME, "prompt": {"a": 1}}),
              json.dumps({"model": NAME, "prompt": "x", "top_p": 7}), "\xff\xfe", json.dumps({"model": NAME}),
              json.dumps({"model": NAME, "messages": "hi"}), json.dumps({"model": "other", "prompt": "x"})]

    def burst(n):
        with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as c:
            for _ in range(n):
                path = rng.choice(["/v1/completions", "/v1/chat/completions"])
                body = rng.choice(bodies)
                if rng.random() < 0.3:                 # truncated or mangled bytes
                    body = body[:rng.randrange(len(body) + 1)] + chr(rng.randrange(32, 0x2FF))
                r = c.post(server.url + path, content=body.encode("utf-8", "surrogateescape"))
                assert 400 <= r.status_code < 500 and "error" in r.json(), (body, r.status_code, r.text)

    burst(200)                                           # allocator warm-up
    before = server.rss()
    burst(1000)
    after = server.rss()
    assert after - before < 8 * 2**20, (before, after)   # flat: under 8 MiB over 1,000 requests
    assert _post(server, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.slow
def test_the_load_tester_against_the_server(server):
    sys.path.insert(0, str(ROOT / "bench"))
    import asyncio

    import serve_load
    cfg = serve_load.LoadConfig(url=server.url, model=NAME, api_key=KEY, clients=6, requests=18, duration_s=120,
                                arrival="closed", prompt_ids_len=12, max_tokens=8, server_pid=server.proc.pid)
    out = asyncio.run(serve_load.run_load(cfg))
    s = out["summary"]
    assert s["completed"] == 18 and s["errors"] == 0, s
    assert s["qps"] > 0 and s["ttft_ms"]["p50"] > 0 and s["e2e_ms"]["p99"] >= s["e2e_ms"]["p50"]


def test_bad_command_lines_exit_2_with_one_line(tmp_path):
    for args, words in [(["--model", str(tmp_path / "none")], "not a run directory"),
                        (["--model", "hf:/nonexistent"], "not an HF model directory"),
                        (["--model", "hf:/nonexistent", "--port", "0"], "--port 0")]:
        p = subprocess.run([sys.executable, "-m", "r1jax.serve", *args], capture_output=True, text=True, env=_env(),
                           cwd=ROOT, timeout=120)
        assert p.returncode == 2 and words in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.slow
def test_a_real_prometheus_scrapes_the_server(server, tmp_path):
    import prom
    prom.ensure_prometheus()
    _post(server, "/v1/completions", {"model": NAME, "prompt": "def", "max_tokens": 3})
    base, proc = prom.start_prometheus([f"127.0.0.1:{server.port}"], tmp_path,
                                       rules=ROOT / "launch" / "monitoring" / "alerts.yml")
    try:
        got = prom.wait_for(base, f'vllm:request_success_total{{model_name="{NAME}"}}',
                            lambda r: r and sum(float(x["value"][1]) for x in r) >= 1, timeout=60)
        assert {x["metric"]["finished_reason"] for x in got} >= {"length"}
        mem = prom.wait_for(base, "r1jax:device_memory_used_bytes / r1jax:device_memory_limit_bytes",
                            lambda r: bool(r), timeout=30)
        assert 0 < prom.value(mem) < 1
        hist = prom.query(base, 'vllm:e2e_request_latency_seconds_bucket{le="0.5"}')
        assert hist and hist[0]["metric"]["engine"] == "0"
    finally:
        prom.stop_prometheus(proc)

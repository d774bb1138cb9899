"""The HTTP side: an ASGI app (Starlette, served by uvicorn) over the engine.

Starlette rather than FastAPI: five routes whose bodies are checked by hand (r1jax/serve/protocol.py)
so that every bad request gets OpenAI's error body with a 400, where FastAPI's pydantic layer
answers 422 in its own shape; streaming is Starlette's StreamingResponse, which also cancels the
response's generator when the client disconnects, and that frees the request's slot.

Every request passes the same gate first: the API key when one is set (401), the body-size
limit (413), JSON (400). Engine events arrive on the engine thread and are moved onto the event
loop with `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from r1jax.serve import protocol
from r1jax.serve.engine import Engine, QueueFull
from r1jax.serve.protocol import APIError

MAX_BODY_BYTES = 1 << 20                   # 1 MiB: far above any prompt max_model_len allows


class Server:
    def __init__(self, engine: Engine, name: str, *, tokenizer, template, vocab: int, api_key: str | None,
                 metrics, max_tokens: int | None = None, max_body: int = MAX_BODY_BYTES):
        self.engine, self.name, self.tokenizer, self.template = engine, name, tokenizer, template
        self.api_key, self.metrics, self.max_body = api_key, metrics, max_body
        L = engine.cfg.max_model_len
        self.limits = protocol.Limits(max_model_len=L, max_tokens=min(max_tokens or L, L))
        self.vocab = vocab
        self.created = int(time.time())

    # ------------------------------------------------------------------ plumbing
    def error(self, e: APIError, headers: dict | None = None) -> JSONResponse:
        if self.metrics:
            self.metrics.reject(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def _auth(self, request: HTTPRequest) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "a valid API key is required: Authorization: Bearer KEY",
                           "authentication_error", code="invalid_api_key")

    async def _json(self, request: HTTPRequest):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body:
            raise APIError(413, f"the request body is over {self.max_body} bytes")
        body = b""
        async for part in request.stream():
            body += part
            if len(body) > self.max_body:
                raise APIError(413, f"the request body is over {self.max_body} bytes")
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None

    # ------------------------------------------------------------------ routes
    async def health(self, request: HTTPRequest) -> Response:
        if self.engine.ready.is_set():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "loading"}, status_code=503)

    async def models(self, request: HTTPRequest) -> Response:
        try:
            self._auth(request)
        except APIError as e:
            return self.error(e)
        return JSONResponse({"object": "list", "data": [{
            "id": self.name, "object": "model", "created": self.created, "owned_by": "r1jax",
            "max_model_len": self.engine.cfg.max_model_len}]})

    async def metrics_route(self, request: HTTPRequest) -> Response:
        self.metrics.sample_memory()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: HTTPRequest) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: HTTPRequest, chat: bool) -> Response:
        try:
            self._auth(request)
            body = await self._json(request)
            parsed = protocol.parse(body, chat=chat, tokenizer=self.tokenizer, template=self.template,
                                    vocab=self.vocab, limits=self.limits)
            if parsed.model != self.name:
                raise APIError(404, f"the model '{parsed.model}' does not exist; this server serves '{self.name}'",
                               param="model", code="model_not_found")
            events, jobs = self._submit(parsed)
        except QueueFull as e:
            return self.error(APIError(429, f"the server is at capacity ({e}); retry later",
                                       "rate_limit_error", code="queue_full"), headers={"Retry-After": "1"})
        except APIError as e:
            return self.error(e)
        rid = protocol.new_id(chat)
        if parsed.stream:
            return StreamingResponse(self._stream(parsed, rid, events, jobs), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, parsed, rid, events, jobs)

    def _submit(self, parsed):
        """Submit every choice; events land on one asyncio queue as (choice, kind, payload)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        jobs = []
        try:
            for i, req in enumerate(parsed.requests):
                def on_event(kind, payload, i=i):
                    loop.call_soon_threadsafe(events.put_nowait, (i, kind, payload))
                jobs.append(self.engine.submit(req, on_event))
        except (QueueFull, ValueError) as e:
            for j in jobs:
                self.engine.cancel(j)
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param="prompt") from None
            raise
        return events, jobs

    async def _whole(self, request, parsed, rid, events, jobs) -> Response:
        done: dict[int, object] = {}
        try:
            while len(done) < len(jobs):
                try:
                    i, kind, payload = await asyncio.wait_for(events.get(), 0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise asyncio.CancelledError
                    continue
                if kind == "done":
                    done[i] = payload
                elif kind == "error":
                    return self.error(APIError(500, payload, "server_error"))
        finally:
            for j in jobs:
                self.engine.cancel(j)          # no-op for finished jobs; frees slots on disconnect
        completions = [done[i] for i in range(len(jobs))]
        return JSONResponse(protocol.response(parsed, rid, self.name, completions, self.tokenizer))

    async def _stream(self, parsed, rid, events, jobs):
        created = int(time.time())

        def sse(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        done: dict[int, object] = {}
        offsets = [0] * len(jobs)              # completions' text_offset runs on across chunks
        try:
            if parsed.chat:
                for i in range(len(jobs)):
                    yield sse(protocol.chunk(parsed, rid, self.name, created, i, role=True))
            while len(done) < len(jobs):
                i, kind, payload = await events.get()
                if kind == "text":
                    lp = protocol.logprobs_block(payload.ids, payload.logprobs, payload.top_logprobs, parsed.chat,
                                                 parsed.logprobs or 0, self.tokenizer, offsets[i])
                    offsets[i] += len(payload.text)
                    yield sse(protocol.chunk(parsed, rid, self.name, created, i, text=payload.text, logprobs=lp))
                elif kind == "done":
                    done[i] = payload
                    yield sse(protocol.chunk(parsed, rid, self.name, created, i, finish=payload.finish_reason))
                else:
                    yield sse(APIError(500, payload, "server_error").body())
                    return
            if parsed.include_usage:
                yield sse(protocol.usage_chunk(parsed, rid, self.name, created, [done[i] for i in range(len(jobs))]))
            yield "data: [DONE]\n\n"
        finally:
            for j in jobs:
                self.engine.cancel(j)

    # ------------------------------------------------------------------ app
    def app(self) -> Starlette:
        async def http_error(request, exc: HTTPException):
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return self.error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       code=code))

        async def any_error(request, exc: Exception):
            return self.error(APIError(500, f"internal error: {type(exc).__name__}", "server_error"))

        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
        ], exception_handlers={HTTPException: http_error, Exception: any_error})

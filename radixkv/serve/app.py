"""The OpenAI-compatible HTTP API over one `LLM`: routes, request checks and response streaming.

A request goes: parse (pydantic) -> prompt token ids (chat template or completion prompt) ->
`SamplingParams` -> capacity check (503 when the waiting queue is full) -> `EngineLoop.submit`
-> updates until the final output -> one JSON body, or server-sent events as tokens arrive.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixkv.engine.llm import LLM, RequestUpdate
from radixkv.engine.sampling_params import SamplingParams
from radixkv.serve.engine_loop import EngineLoop, RequestStream
from radixkv.serve.metrics import CONTENT_TYPE, ServerMetrics
from radixkv.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    bad_request,
    chat_chunk,
    chat_response,
    completion_response,
    usage,
)
from radixkv.serve.stop_strings import StopStringMatcher
from radixkv.serve.worker_api import add_worker_routes

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Server settings. `model_name` is the id clients pass as `model` (and /v1/models lists)."""

    model_name: str
    max_queued_requests: int = 256  # waiting for admission; more are answered 503
    retry_after_s: int = 1  # the Retry-After header of a 503

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        for name in ("max_queued_requests", "retry_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class _Piece:
    """Text for the client; the last piece of a request also has its finish reason and usage."""

    text: str
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


class OpenAIServer:
    """Owns the engine loop and the metrics of one app; the route handlers call into it."""

    def __init__(self, llm: LLM, config: ServeConfig) -> None:
        self.llm = llm
        self.config = config
        self.engine = EngineLoop(llm, on_update=self._observe_update)
        self.metrics = ServerMetrics(lambda: self.engine.snapshot, lambda: self.engine.num_queued)

    # ------------------------------------------------------------------ prompts and params

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not body.messages:
            raise bad_request("messages must not be empty", "messages")
        if not self.llm.has_chat_template:
            raise bad_request(f"model {self.config.model_name!r} has no chat template", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            return self.llm.encode_chat(messages)
        except Exception as exc:  # a template may raise on roles or order it does not accept
            message = f"the chat template rejected the messages: {exc}"
            raise bad_request(message, "messages") from exc

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request("one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt must not be empty", "prompt")
            try:
                return self.llm.encode(prompt)
            except ValueError as exc:
                raise bad_request(str(exc), "prompt") from exc
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return list(prompt)

    def prepare_chat(self, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        """The prompt ids and params a chat request runs with (its render is exactly this)."""
        prompt = self.chat_prompt(body)
        requested = body.max_completion_tokens
        if requested is None:
            requested = body.max_tokens
        return prompt, self.sampling_params(body, len(prompt), requested, prompt_param="messages")

    def prepare_completion(self, body: CompletionRequest) -> tuple[list[int], SamplingParams]:
        """The prompt ids and params a completion request runs with (and renders to)."""
        prompt = self.completion_prompt(body)
        params = self.sampling_params(
            body,
            len(prompt),
            body.max_tokens,
            prompt_param="prompt",
            default=DEFAULT_COMPLETION_MAX_TOKENS,
        )
        return prompt, params

    def sampling_params(
        self,
        body: SamplingFields,
        num_prompt_tokens: int,
        max_tokens: int | None,
        *,
        prompt_param: str,
        default: int | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams; `default` max_tokens, None: as many as the context and
        the KV cache hold. Raises APIError(400) for an unknown model, n != 1, a prompt (the body
        field `prompt_param`) or reply over the context length, or an out-of-range sampling
        value (its field named as the error's param)."""
        if body.model is not None and body.model != self.config.model_name:
            raise APIError(
                400,
                f"the model {body.model!r} does not exist; this server serves "
                f"{self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if body.n != 1:
            raise bad_request(f"only n=1 is supported, got n={body.n}", "n")
        context = self.llm.config.max_model_len
        room = context - num_prompt_tokens
        if room < 1:
            raise bad_request(
                f"the prompt has {num_prompt_tokens} tokens; the model's context length is "
                f"{context}",
                prompt_param,
            )
        if max_tokens is None:
            cache_tokens = self.llm.cache.num_blocks * self.llm.cache.block_size
            max_tokens = max(1, min(room, cache_tokens - num_prompt_tokens, default or room))
        elif max_tokens > room:
            raise bad_request(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceed the "
                f"model's context length ({context})",
                "max_tokens",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                seed=body.seed,
                stop_token_ids=body.stop_ids(),
                ignore_eos=body.ignore_eos,
            )
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), _sampling_param(exc)) from exc

    # ------------------------------------------------------------------ running a request

    async def submit(
        self, prompt_ids: list[int], params: SamplingParams, body: SamplingFields, arrival: _Arrival
    ) -> RequestStream:
        """Hand the request to the engine thread; returns once the engine has queued it.

        Records the body's receive time, the server overhead (request in -> handed to the engine
        thread) and the admission time (request in -> queued in the engine). Raises APIError: 503
        when the waiting queue is full, 400 when the engine rejects the request."""
        self.metrics.receive.observe(arrival.received - arrival.headers)
        self.metrics.overhead.observe(time.perf_counter() - arrival.received)
        queued = self.engine.num_queued
        if queued >= self.config.max_queued_requests:
            raise APIError(
                503,
                f"the server is at capacity ({queued} requests waiting); retry later",
                type="server_overloaded",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )
        try:
            stream = await self.engine.submit(
                prompt_ids, params, cache_salt=body.cache_salt, t_arrival=arrival.headers
            )
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc)) from exc
        self.metrics.admission.observe(time.perf_counter() - arrival.received)
        return stream

    async def pieces(self, stream: RequestStream, stops: Sequence[str]) -> AsyncIterator[_Piece]:
        """The reply of `stream` as text pieces; the last one has finish reason and usage.

        Raises APIError(500) when the engine failed the request. Leaving early (a disconnected
        client) aborts the request in the engine."""
        matcher = StopStringMatcher(stops)
        num_tokens = 0  # tokens up to the stop string, if one cut the reply
        failed = False
        try:
            while True:
                item: RequestUpdate | BaseException = await stream.updates.get()
                if isinstance(item, BaseException) or item.error is not None:
                    error = item if isinstance(item, BaseException) else item.error
                    self.metrics.requests.labels("error").inc()
                    failed = True
                    raise APIError(
                        500, f"the engine failed this request: {error!r}", type="server_error"
                    )
                if not matcher.stopped:
                    num_tokens += len(item.new_token_ids)
                    text = matcher.push(item.new_text)
                    if matcher.stopped:
                        # Keep the stream open: the aborted request's output carries its usage.
                        self.engine.abort(stream.request_id, keep_stream=True)
                    if text:
                        yield _Piece(text)
                if item.output is not None:
                    output = item.output
                    if matcher.stopped:
                        reason, use = "stop", usage(output, num_tokens)
                    else:
                        reason, use = output.finish_reason, usage(output)
                    self.metrics.record_finished(output, reason)
                    yield _Piece(matcher.flush(), reason, use)
                    return
        finally:
            if not (stream.finished or failed):
                self.metrics.requests.labels("abort").inc()
            self.engine.release(stream)

    def _observe_update(self, stream: RequestStream, update: RequestUpdate) -> None:
        n = len(update.new_token_ids)
        if not n:
            return
        now = time.perf_counter()
        if stream.t_first_token is None:
            stream.t_first_token = now
            self.metrics.ttft.observe(now - stream.t_arrival)
        elif stream.t_last_token is not None:
            gap = (now - stream.t_last_token) / n
            for _ in range(n):
                self.metrics.inter_token.observe(gap)
        stream.t_last_token = now


def _sampling_param(exc: Exception) -> str | None:
    """The request field a SamplingParams error is about: its messages start with the name."""
    name = str(exc).split(" ", 1)[0]
    if name.startswith("stop_token_ids"):
        return "stop"
    return name if name in SamplingFields.model_fields else None


async def _join(pieces: AsyncIterator[_Piece]) -> tuple[str, _Piece]:
    parts = []
    last = _Piece("")
    async for piece in pieces:
        parts.append(piece.text)
        last = piece
    return "".join(parts), last


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(pieces: AsyncIterator[_Piece], request: Request) -> tuple[str, _Piece] | None:
    """The whole reply, or None if the client went away first (the request is then aborted)."""
    reply = asyncio.ensure_future(_join(pieces))
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    await asyncio.wait({reply, gone}, return_when=asyncio.FIRST_COMPLETED)
    if reply.done():
        gone.cancel()
        return reply.result()
    reply.cancel()
    await asyncio.gather(reply, return_exceptions=True)
    return None


class _StampArrival:
    """ASGI middleware: notes when a request's headers arrived (before its body is read) and when
    the app received its whole body: the request is in. The gap between the two is the client's
    (a client may send the body in a later write than the headers), not the server's."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope["radixkv.t_arrival"] = time.perf_counter()

        async def receive_stamped() -> Any:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                scope.setdefault("radixkv.t_received", time.perf_counter())
            return message

        await self.app(scope, receive_stamped, send)


@dataclass(frozen=True, slots=True)
class _Arrival:
    """When a request's headers came in, and when its whole body had (perf_counter seconds)."""

    headers: float
    received: float

    @classmethod
    def of(cls, request: Request) -> _Arrival:
        now = time.perf_counter()
        headers = float(request.scope.get("radixkv.t_arrival", now))
        return cls(headers, float(request.scope.get("radixkv.t_received", max(headers, now))))


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def create_app(
    llm: LLM, config: ServeConfig, *, on_shutdown: Sequence[Callable[[], None]] = ()
) -> FastAPI:
    """The FastAPI app serving `llm`. Its lifespan starts and stops the engine thread; then
    each `on_shutdown` callable runs, in order (e.g. closing a KV-event publisher subscribed to
    `llm.cache`, whose callbacks run on the engine thread)."""
    server = OpenAIServer(llm, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            server.engine.stop()
            for close in on_shutdown:
                close()

    app = FastAPI(title="radixkv", lifespan=lifespan)
    app.add_middleware(_StampArrival)
    app.state.server = server
    _add_error_handlers(app, server)
    _add_info_routes(app, server)
    _add_completion_routes(app, server)
    add_worker_routes(app, server)
    return app


def _add_error_handlers(app: FastAPI, server: OpenAIServer) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status_code == 400:
            server.metrics.requests.labels("bad_request").inc()
        elif exc.status_code == 503:
            server.metrics.requests.labels("overloaded").inc()
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        server.metrics.requests.labels("bad_request").inc()
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request body')}"
        return JSONResponse(
            APIError(400, message, param=loc[0] if loc else None).body(), status_code=400
        )


def _add_info_routes(app: FastAPI, server: OpenAIServer) -> None:
    @app.get("/health")
    async def health() -> Response:
        if not server.engine.is_alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": server.config.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "radixkv",
                    "max_model_len": server.llm.config.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)


def _add_completion_routes(app: FastAPI, server: OpenAIServer) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = _Arrival.of(request)
        prompt, params = server.prepare_chat(body)
        return await _respond(server, request, body, prompt, params, arrival, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = _Arrival.of(request)
        prompt, params = server.prepare_completion(body)
        return await _respond(server, request, body, prompt, params, arrival, chat=False)


async def _respond(
    server: OpenAIServer,
    request: Request,
    body: SamplingFields,
    prompt: list[int],
    params: SamplingParams,
    arrival: _Arrival,
    *,
    chat: bool,
) -> Response:
    """Run the request; answer with server-sent events or one JSON body in `chat` or completion
    format. A client that disconnects before the end gets nothing (its request is aborted)."""
    stream = await server.submit(prompt, params, body, arrival)
    pieces = server.pieces(stream, body.stop_strings())
    model = server.config.model_name
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{stream.request_id}"
    if body.stream:
        events = _chat_events if chat else _completion_events
        return _event_stream(events(rid, model, pieces, body.include_usage))
    result = await _collect(pieces, request)
    if result is None:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    text, last = result
    build = chat_response if chat else completion_response
    return JSONResponse(build(rid, model, text, last.finish_reason, last.usage))


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _chat_events(
    rid: str, model: str, pieces: AsyncIterator[_Piece], include_usage: bool
) -> AsyncIterator[str]:
    try:
        yield _sse(chat_chunk(rid, model, {"role": "assistant", "content": ""}))
        async for piece in pieces:
            if piece.text:
                yield _sse(chat_chunk(rid, model, {"content": piece.text}))
            if piece.finish_reason is not None:
                yield _sse(chat_chunk(rid, model, {}, piece.finish_reason))
                if include_usage:
                    yield _sse(chat_chunk(rid, model, None, usage_=piece.usage))
        yield _sse("[DONE]")
    except APIError as exc:
        yield _sse(exc.body())


async def _completion_events(
    rid: str, model: str, pieces: AsyncIterator[_Piece], include_usage: bool
) -> AsyncIterator[str]:
    try:
        async for piece in pieces:
            if piece.text or piece.finish_reason is not None:
                yield _sse(completion_response(rid, model, piece.text, piece.finish_reason, None))
            if piece.finish_reason is not None and include_usage:
                yield _sse(completion_response(rid, model, None, None, piece.usage))
        yield _sse("[DONE]")
    except APIError as exc:
        yield _sse(exc.body())

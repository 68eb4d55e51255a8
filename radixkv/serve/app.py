"""The OpenAI-compatible HTTP API over one engine: routes, request preparation and streaming.

A request goes: the door (`door.py`: its body read under the server's limits) -> the preparation
thread: JSON checked (`bodies.py`), prompt token ids (chat template or completion prompt),
`SamplingParams`, the stop-string matcher -> capacity check (503 when the waiting queue is full)
-> `EngineHandle.submit` (the engine on a thread, or in a process of its own) -> updates until
the final output -> one JSON body, or server-sent events as tokens arrive. The event loop itself
only moves bytes: parsing, templating and tokenizing never stall the other connections.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixkv.engine.outputs import RequestOutput, TokenLogprobs
from radixkv.engine.sampling.grammar import GrammarError
from radixkv.engine.sampling_params import SamplingParams
from radixkv.serve.bodies import (
    BodyLimits,
    SamplingFields,
    over_context,
    parse_json,
    read_chat_body,
    read_completion_body,
)
from radixkv.serve.choices import merged, merged_usage
from radixkv.serve.config import ServeConfig
from radixkv.serve.door import RequestDoor
from radixkv.serve.engine_handle import EngineHandle, RequestStream
from radixkv.serve.engine_loop import EngineLoop
from radixkv.serve.grammar_pool import CompilesBusy, CompileTimeout, GrammarPool
from radixkv.serve.logprobs_format import LogprobsWriter, token_texts
from radixkv.serve.metrics import CONTENT_TYPE, ServerMetrics
from radixkv.serve.protocol import (
    APIError,
    bad_request,
    chat_chunk,
    chat_response,
    completion_response,
    shutting_down,
    usage,
)
from radixkv.serve.served_model import ServedModel
from radixkv.serve.stop_strings import StopStringMatcher
from radixkv.serve.structured import Constraint
from radixkv.serve.tools import (
    ToolCallReader,
    ToolRequest,
    messages_with_tools,
    template_renders_tools,
    tool_constraint,
)
from radixkv.serve.ui_routes import add_ui_routes
from radixkv.serve.vllm_metrics import CacheInfo
from radixkv.serve.worker_api import add_worker_routes

if TYPE_CHECKING:
    from radixkv.engine.llm import LLM
    from radixkv.engine.records import RequestUpdate
    from radixkv.serve.engine_client import EngineClient

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Piece:
    """Text for the client; the last piece of a request also has its finish reason and usage."""

    text: str
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # of the tokens this piece's update brought


@dataclass(slots=True)
class Job:
    """A checked request, ready for the engine."""

    fields: SamplingFields
    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolRequest | None = None
    constraint: Constraint | None = None  # structured output
    grammar: Any | None = None  # its compiled grammar (`compile_grammar`), for the engine

    def stop_matcher(self) -> StopStringMatcher:
        """A fresh matcher of the request's stop strings, for one of its replies."""
        return StopStringMatcher(self.fields.stop_strings, self.params.min_tokens)

    def tool_reader(self) -> ToolCallReader | None:
        """A reader of the reply's tool calls, None when it may make none."""
        if self.tools is None or not self.tools.calls_allowed:
            return None
        return ToolCallReader(self.tools.names)


class OpenAIServer:
    """Owns the engine loop, the preparation thread and the metrics of one app; the route
    handlers call into it.

    `stopping` (a future, created by `start`) is done once the server is shutting down: from
    then on new requests get 503; `end_all` ends the replies still in flight.
    """

    def __init__(self, model: ServedModel, engine: EngineHandle, config: ServeConfig) -> None:
        self.model = model
        self.config = config
        # OpenAI's system_fingerprint, one per server process: behind a router, a reply tells
        # which replica served it (/server_info reports it too). Random, as the request ids.
        self.fingerprint = f"fp_{uuid.uuid4().hex[:12]}"
        self.engine = engine
        engine.on_update = self._observe_update
        settings = model.config
        cache_info = CacheInfo(config.model_name, settings.block_size, settings.enable_prefix_cache)
        self.metrics = ServerMetrics(
            lambda: self.engine.snapshot, lambda: self.engine.num_queued, cache_info, model.kv_pools
        )
        self.limits = BodyLimits(
            vocab_size=model.vocab_size,
            max_stops=config.max_stops,
            max_stop_chars=config.max_stop_chars,
            max_prompt_chars=_max_prompt_chars(model),
            max_messages=settings.max_model_len,
            # `n` choices are queued together: more than the queue holds could never be
            max_n=min(config.max_n, config.max_queued_requests),
        )
        # Grammars compile in worker processes, off the event loop, the preparation thread and
        # the engine thread, each within `grammar_compile_timeout_s` (then killed).
        self.grammars = GrammarPool(
            model.text.tokenizer,
            model.vocab_size,
            num_workers=config.max_grammar_compiles,
            timeout_s=config.grammar_compile_timeout_s,
            cache_bytes=config.grammar_cache_bytes,
            serialized=engine.ships_serialized_grammars,
        )
        # One thread: preparation is GIL-bound Python (JSON, template) or releases the GIL
        # (tokenizing); more threads would not make it faster, only let big requests pile up.
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixkv-prep")
        self.token_text = token_texts(model.text.tokenizer)
        self.stopping: asyncio.Future[None] | None = None
        # Called on the asyncio side with each request's final output (the live page's).
        self.on_finished: list[Callable[[RequestStream, RequestOutput], None]] = []

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.stopping = loop.create_future()
        self.engine.start(loop)

    def begin_shutdown(self) -> None:
        """Refuse new requests (503); the replies in flight go on."""
        if self.stopping is not None and not self.stopping.done():
            self.stopping.set_result(None)

    def end_all(self) -> None:
        """End every reply in flight now: a stream with an error event and [DONE], a whole
        reply with a 503."""
        self.begin_shutdown()
        self.grammars.close()  # a compile still running ends now, its request with a 503
        self.engine.end_all(shutting_down())

    def stop(self) -> None:
        self.engine.stop()
        self._prep.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()

    @property
    def is_stopping(self) -> bool:
        return self.stopping is not None and self.stopping.done()

    # ------------------------------------------------------------------ preparation

    async def prepare(self, raw: bytes, *, chat: bool) -> Job:
        """`raw` checked and turned into a Job, in the preparation thread. Raises APIError."""
        return await self.off_loop(partial(self.prepare_now, raw, chat=chat))

    async def off_loop(self, fn: Callable[[], T]) -> T:
        """`fn()` in the preparation thread: what costs time in proportion to a request's size
        (parsing, templating, tokenizing, encoding a large reply) never runs on the event loop,
        and one request at a time runs there."""
        return await asyncio.get_running_loop().run_in_executor(self._prep, fn)

    def prepare_now(self, raw: bytes, *, chat: bool) -> Job:
        body = parse_json(raw)
        tools = None
        if chat:
            chat_body = read_chat_body(body, self.limits)
            fields, prompt_param, default = chat_body.sampling, "messages", None
            tools = chat_body.tools
            prompt = self.chat_prompt(chat_body.messages, tools)
        else:
            completion = read_completion_body(body, self.limits)
            fields, prompt_param = completion.sampling, "prompt"
            default = DEFAULT_COMPLETION_MAX_TOKENS
            prompt = self.completion_prompt(completion.prompt)
        constraint = fields.constraint or (tools and tool_constraint(tools))
        params = self.sampling_params(fields, len(prompt), prompt_param, default, constraint)
        return Job(fields, prompt, params, tools, constraint)

    async def compile_grammar(self, job: Job) -> None:
        """Compile the job's grammar into `job.grammar` (the request carries it to the engine),
        in the grammar pool's worker processes. APIError: 400 naming the field for a grammar
        that cannot be compiled, is too large or takes too long (its compile is killed); 503
        when too many compiles wait, or the server is shutting down."""
        c, spec = job.constraint, job.params.grammar_spec
        if c is None or spec is None:
            return
        try:
            job.grammar = await self.grammars.compile(spec)
        except CompilesBusy as exc:
            raise APIError(
                503,
                f"the server is at capacity for grammar compiles ({exc}); retry later",
                type="server_overloaded",
                headers={"Retry-After": str(self.config.retry_after_s)},
            ) from None
        except CompileTimeout:
            timeout = self.config.grammar_compile_timeout_s
            message = f"{c.param} did not compile within {timeout:g} s: simplify it"
            raise bad_request(message, c.param) from None
        except GrammarError as exc:
            if self.is_stopping:
                raise shutting_down() from None
            raise bad_request(str(exc), c.param) from None

    def chat_prompt(
        self, messages: Sequence[dict[str, Any]], tools: ToolRequest | None = None
    ) -> list[int]:
        if not self.model.text.has_chat_template:
            raise bad_request(f"model {self.config.model_name!r} has no chat template", "messages")
        shown = None
        if tools is not None and template_renders_tools(self.model.text.tokenizer):
            shown = tools.tools
        elif tools is not None:
            messages = messages_with_tools(messages, tools.tools)
        try:
            if shown is None:
                return self.model.text.encode_chat(messages)
            return self.model.text.encode_chat(messages, shown)
        except (ValueError, TypeError) as exc:  # a template may refuse roles or their order
            message = f"the chat template rejected the messages: {exc}"
            raise bad_request(message, "messages") from exc

    def completion_prompt(self, prompt: str | tuple[int, ...]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        try:
            return self.model.text.encode(prompt)
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), "prompt") from exc

    def sampling_params(
        self,
        fields: SamplingFields,
        num_prompt_tokens: int,
        prompt_param: str,
        default: int | None,
        constraint: Constraint | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams; `default` max_tokens, None: as many as the context and
        the KV cache hold. Raises APIError(400) for an unknown model, a prompt (the body field
        `prompt_param`) or reply over the context length, or an out-of-range sampling value
        (its field named as the error's param)."""
        if fields.model is not None and fields.model != self.config.model_name:
            raise APIError(
                400,
                f"the model {fields.model!r} does not exist; this server serves "
                f"{self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )
        context = self.model.config.max_model_len
        room = context - num_prompt_tokens
        if room < 1:
            raise over_context(num_prompt_tokens, context, prompt_param)
        max_tokens = fields.max_tokens
        cache_tokens = self.model.cache.num_blocks * self.model.cache.block_size
        if max_tokens is None:  # the n replies must fit the cache together
            fits = (cache_tokens - num_prompt_tokens) // fields.n
            max_tokens = max(1, min(room, fits, default or room))
        elif max_tokens > room:
            raise bad_request(
                f"prompt ({num_prompt_tokens} tokens) + {fields.max_tokens_param} ({max_tokens}) "
                f"exceed the model's context length ({context})",
                fields.max_tokens_param,
            )
        if fields.n > 1 and num_prompt_tokens + fields.n * max_tokens > cache_tokens:
            raise bad_request(
                f"n ({fields.n}) x {fields.max_tokens_param} ({max_tokens}) + the prompt "
                f"({num_prompt_tokens} tokens) exceed the KV cache ({cache_tokens} tokens)",
                "n",
            )
        try:
            return SamplingParams(
                n=fields.n,
                max_tokens=max_tokens,
                temperature=1.0 if fields.temperature is None else fields.temperature,
                top_p=1.0 if fields.top_p is None else fields.top_p,
                seed=fields.seed,
                stop_token_ids=fields.stop_token_ids,
                ignore_eos=fields.ignore_eos,
                presence_penalty=fields.presence_penalty or 0.0,
                frequency_penalty=fields.frequency_penalty or 0.0,
                logit_bias=fields.logit_bias,
                logprobs=fields.logprobs,
                top_k=fields.top_k or 0,
                min_p=fields.min_p or 0.0,
                repetition_penalty=(
                    1.0 if fields.repetition_penalty is None else fields.repetition_penalty
                ),
                min_tokens=fields.min_tokens or 0,
                **({} if constraint is None else {constraint.kind: constraint.value}),
            )
        except (ValueError, TypeError) as exc:
            param = _sampling_param(exc, fields)
            if constraint is not None and str(exc).startswith(constraint.kind):
                param = constraint.param
            raise bad_request(str(exc), param) from exc

    # ------------------------------------------------------------------ running a request

    async def submit(
        self, job: Job, arrival: _Arrival, params: SamplingParams | None = None
    ) -> RequestStream:
        """Hand the request to the engine thread; returns once the engine has queued it.

        Records the body's receive time, the server overhead (request in -> handed to the engine
        thread) and the admission time (request in -> queued in the engine). Raises APIError: 503
        when the server is shutting down or the waiting queue is full, 400 when the engine
        rejects the request."""
        if self.is_stopping:
            raise shutting_down()
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
                job.prompt_ids,
                job.params if params is None else params,
                cache_salt=job.fields.cache_salt,
                t_arrival=arrival.headers,
                grammar=job.grammar,
            )
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc)) from exc
        self.metrics.admission.observe(time.perf_counter() - arrival.received)
        return stream

    async def submit_choices(self, job: Job, arrival: _Arrival) -> list[RequestStream]:
        """`submit` for each of the job's `n` choices, together (so that they meet in one step
        and share the prompt's prefill); all or none: a refused one releases the others."""
        results = await asyncio.gather(
            *(self.submit(job, arrival, p) for p in job.params.choices()), return_exceptions=True
        )
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for stream in streams:
                self.engine.release(stream)
            raise errors[0]
        return streams

    async def pieces(
        self, stream: RequestStream, stops: StopStringMatcher
    ) -> AsyncIterator[_Piece]:
        """The reply of `stream` as text pieces; the last one has finish reason and usage.

        Raises APIError: 500 when the engine failed the request, 503 when the server ended it
        (shutting down). Leaving early (a disconnected client) aborts the request in the
        engine."""
        num_tokens = 0  # tokens up to the stop string, if one cut the reply
        failed = False
        try:
            while True:
                item: RequestUpdate | BaseException = await stream.updates.get()
                if isinstance(item, APIError):
                    failed = True
                    raise item
                if isinstance(item, BaseException) or item.error is not None:
                    error = item if isinstance(item, BaseException) else item.error
                    failed = True
                    # NOTE: the type only, never the text: a fault that failed a whole step
                    # reaches every request of it, and its text may be about another's.
                    logger.error("the engine failed %s: %r", stream.request_id, error)
                    raise APIError(
                        500,
                        f"the engine failed this request ({type(error).__name__}); the server's "
                        "log has the details",
                        type="server_error",
                    )
                if not stops.stopped:
                    num_tokens += len(item.new_token_ids)
                    text = stops.push(item.new_text, len(item.new_token_ids))
                    if stops.stopped and len(item.new_token_ids) > 1:
                        # A jump-forward's forced text: bill its tokens up to the stop string,
                        # as one token at a time would have been.
                        spent = self._tokens_spelling(item.new_token_ids, stops.stop_end)
                        num_tokens -= len(item.new_token_ids) - spent
                    if stops.stopped:
                        # Keep the stream open: the aborted request's output carries its usage.
                        self.engine.abort(stream.request_id, keep_stream=True)
                    if text or item.new_logprobs:
                        yield _Piece(text, logprobs=item.new_logprobs)
                if item.output is not None:
                    output = item.output
                    if stops.stopped:
                        reason, use = "stop", usage(output, num_tokens)
                    else:
                        reason, use = output.finish_reason, usage(output)
                    self.metrics.record_finished(output, reason)
                    for hook in self.on_finished:
                        hook(stream, output)
                    yield _Piece(stops.flush(), reason, use)
                    return
        finally:
            if not (stream.finished or failed):
                self.metrics.requests.labels("abort").inc()
            self.engine.release(stream)

    def _tokens_spelling(self, token_ids: Sequence[int], num_chars: int) -> int:
        """How many of `token_ids`, from the first, it takes to spell `num_chars` characters
        of their text (decoded alone: close enough to bill a cut reply by)."""
        if num_chars <= 0:
            return 0
        for count in range(1, len(token_ids)):
            if len(self.model.text.decode(token_ids[:count])) >= num_chars:
                return count
        return len(token_ids)

    def _observe_update(self, stream: RequestStream, update: RequestUpdate) -> None:
        """Per update, as each step's reach the server (asyncio side): the token counts, TTFT
        and inter-token latency."""
        n = len(update.new_token_ids)
        if not n:
            return
        self.metrics.record_generated(n)
        now = time.perf_counter()
        if stream.t_first_token is None:
            stream.t_first_token = now
            self.metrics.ttft.observe(now - stream.t_arrival)
        elif stream.t_last_token is not None:
            gap = (now - stream.t_last_token) / n
            for _ in range(n):
                self.metrics.inter_token.observe(gap)
        stream.t_last_token = now


def _max_prompt_chars(model: ServedModel) -> int | None:
    """The longest text that could fit the context: no token covers more characters than the
    longest entry of the vocabulary (byte-level BPE and SentencePiece spell each byte or
    character of a token in its entry). None without a tokenizer (prompts are then token ids)."""
    tokenizer = model.text.tokenizer
    if tokenizer is None:
        return None
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return model.config.max_model_len * longest


def _sampling_param(exc: Exception, fields: SamplingFields) -> str | None:
    """The request field a SamplingParams error is about: its messages start with the name."""
    name = str(exc).split(" ", 1)[0]
    if name == "max_tokens":
        return fields.max_tokens_param
    if name.startswith("stop_token_ids"):
        return "stop"
    if name.startswith("logit_bias"):
        return "logit_bias"
    return name if name in SamplingFields.__dataclass_fields__ else None


async def _join(pieces: AsyncIterator[_Piece]) -> tuple[str, list[TokenLogprobs], _Piece]:
    parts = []
    logprobs: list[TokenLogprobs] = []
    last = _Piece("")
    async for piece in pieces:
        parts.append(piece.text)
        logprobs += piece.logprobs
        last = piece
    return "".join(parts), logprobs, last


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(
    pieces: Sequence[AsyncIterator[_Piece]], request: Request
) -> list[tuple[str, list[TokenLogprobs], _Piece]] | None:
    """Each whole reply, or None if the client went away first (the requests are then
    aborted)."""
    joins = [asyncio.ensure_future(_join(p)) for p in pieces]
    replies = asyncio.ensure_future(asyncio.gather(*joins))
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    await asyncio.wait({replies, gone}, return_when=asyncio.FIRST_COMPLETED)
    if replies.done():
        gone.cancel()
        if replies.exception() is not None:  # one choice failed: the others are aborted
            for join in joins:
                join.cancel()
        return replies.result()
    replies.cancel()
    await asyncio.gather(replies, return_exceptions=True)
    return None


@dataclass(frozen=True, slots=True)
class _Arrival:
    """When a request's headers came in, and when its whole body had (perf_counter seconds),
    as the door stamped them."""

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
    engine: LLM | EngineClient,
    config: ServeConfig,
    *,
    on_shutdown: Sequence[Callable[[], None]] = (),
) -> FastAPI:
    """The FastAPI app serving an engine: an `LLM` of this process (stepped on a thread of it,
    `EngineLoop`) or an engine process, started and ready (`EngineClient`: what `radixkv serve`
    runs). Its lifespan starts and stops the engine; then each `on_shutdown` callable runs, in
    order (e.g. closing a KV-event publisher subscribed to an `LLM`'s cache, whose callbacks
    run on the engine thread). `radixkv.serve.http_server` runs it with the connection rules
    and the graceful shutdown of `config`."""
    if isinstance(engine, EngineHandle):
        server = OpenAIServer(engine.model, engine, config)
    else:
        server = OpenAIServer(ServedModel.of(engine), EngineLoop(engine), config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            server.stop()
            for close in on_shutdown:
                close()
            logger.info("engine stopped, %d shutdown hook(s) run", len(on_shutdown))

    app = FastAPI(title="radixkv", lifespan=lifespan)
    app.add_middleware(RequestDoor, server=server)
    app.state.server = server
    _add_error_handlers(app, server)
    _add_info_routes(app, server)
    _add_completion_routes(app, server)
    add_worker_routes(app, server)
    if config.ui:
        add_ui_routes(app, server)
    return app


def _add_error_handlers(app: FastAPI, server: OpenAIServer) -> None:
    def answer(exc: APIError) -> JSONResponse:
        server.metrics.record_refusal(exc)
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = f"{exc.detail} ({request.method} {request.url.path})"
        return answer(APIError(exc.status_code, message, headers=dict(exc.headers or {})))


def _add_info_routes(app: FastAPI, server: OpenAIServer) -> None:
    @app.get("/health")
    async def health() -> Response:
        if server.is_stopping:
            return JSONResponse({"status": "shutting down"}, status_code=503)
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
                    "max_model_len": server.model.config.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)


def _add_completion_routes(app: FastAPI, server: OpenAIServer) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _complete(server, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(server, request, chat=False)


async def _complete(server: OpenAIServer, request: Request, *, chat: bool) -> Response:
    """Run the request, its `n` choices side by side; answer with server-sent events or one
    JSON body in `chat` or completion format. A client that disconnects before the end gets
    nothing (its requests are aborted)."""
    arrival = _Arrival.of(request)
    if server.is_stopping:
        raise shutting_down()
    job = await server.prepare(request.scope.get("radixkv.body", b""), chat=chat)
    await server.compile_grammar(job)
    streams = await server.submit_choices(job, arrival)
    pieces = [server.pieces(s, job.stop_matcher()) for s in streams]
    model = server.config.model_name
    # Random, as OpenAI's: an id must not tell how many requests the server has seen.
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    replies = [_Reply(job, server.token_text, chat) for _ in streams]
    if job.fields.stream:
        events = (_chat_events if chat else _completion_events)(
            rid, model, merged(pieces), job.fields.include_usage, replies
        )
        return StreamingResponse(
            _ending_with_error(events, server),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    results = await _collect(pieces, request)
    if results is None:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    bodies = []
    for index, ((text, logprobs, last), reply) in enumerate(zip(results, replies, strict=True)):
        written = None if reply.writer is None else reply.writer(logprobs)
        if not chat:
            reason = last.finish_reason
            bodies.append(completion_response(rid, model, text, reason, None, written, index))
            continue
        text, calls, reason = reply.tool_text(text, last.finish_reason, end=True)
        bodies.append(chat_response(rid, model, text, reason, None, written, calls, index))
    usage_ = merged_usage([last.usage for _, _, last in results])
    choices = [b["choices"][0] for b in bodies]
    fingerprint = server.fingerprint
    return JSONResponse(
        {**bodies[0], "choices": choices, "usage": usage_, "system_fingerprint": fingerprint}
    )


class _Reply:
    """The per-choice state of a reply being written: its logprobs writer and tool reader."""

    __slots__ = ("tools", "writer")

    def __init__(self, job: Job, token_text: Any, chat: bool) -> None:
        self.writer: LogprobsWriter | None = None
        if job.fields.logprobs is not None:
            self.writer = LogprobsWriter(token_text, chat=chat)
        self.tools: ToolCallReader | None = job.tool_reader() if chat else None

    def tool_text(
        self, text: str, finish_reason: str | None, *, end: bool
    ) -> tuple[str, list[dict[str, Any]], str | None]:
        """`text` less the calls it completes (held back while it may begin one, all of it
        at the `end`), the calls, and the finish reason: "tool_calls" after a call."""
        if self.tools is None:
            return text, [], finish_reason
        text, calls = self.tools.push(text)
        text += self.tools.finish() if end else ""
        if self.tools.num_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return text, calls, finish_reason


async def _ending_with_error(
    events: AsyncIterator[str], server: OpenAIServer
) -> AsyncIterator[str]:
    """`events`, then [DONE]; a reply that fails after its response started ends with an error
    event, then [DONE] (as vLLM ends it), so that a client never sees a stream simply cut."""
    try:
        async for event in events:
            yield event
    except APIError as exc:
        server.metrics.record_refusal(exc)
        yield _sse(exc.body())
    yield _sse("[DONE]")


async def _chat_events(
    rid: str,
    model: str,
    pieces: AsyncIterator[tuple[int, _Piece]],
    include_usage: bool,
    replies: Sequence[_Reply],
) -> AsyncIterator[str]:
    """Chat chunks, each with its choice's index; with tools, text that may begin a call is
    held back until it is one, and each call comes whole in one `tool_calls` delta with its
    index. The usage chunk comes once every choice has finished."""
    for index in range(len(replies)):
        yield _sse(chat_chunk(rid, model, {"role": "assistant", "content": ""}, index=index))
    usages = []
    async for index, piece in pieces:
        reply = replies[index]
        end = piece.finish_reason is not None
        text, calls, reason = reply.tool_text(piece.text, piece.finish_reason, end=end)
        if text or (reply.writer and piece.logprobs):
            logprobs = None if reply.writer is None else reply.writer(piece.logprobs)
            delta = {"content": text}
            yield _sse(chat_chunk(rid, model, delta, logprobs=logprobs, index=index))
        if calls:
            yield _sse(chat_chunk(rid, model, {"tool_calls": calls}, index=index))
        if end:
            yield _sse(chat_chunk(rid, model, {}, reason, index=index))
            usages.append(piece.usage)
    if include_usage:
        yield _sse(chat_chunk(rid, model, None, usage_=merged_usage(usages)))


async def _completion_events(
    rid: str,
    model: str,
    pieces: AsyncIterator[tuple[int, _Piece]],
    include_usage: bool,
    replies: Sequence[_Reply],
) -> AsyncIterator[str]:
    usages = []
    async for index, piece in pieces:
        writer = replies[index].writer
        if piece.text or piece.finish_reason is not None or (writer and piece.logprobs):
            logprobs = None if writer is None else writer(piece.logprobs)
            reason = piece.finish_reason
            yield _sse(completion_response(rid, model, piece.text, reason, None, logprobs, index))
        if piece.finish_reason is not None:
            usages.append(piece.usage)
    if include_usage:
        yield _sse(completion_response(rid, model, None, None, merged_usage(usages)))

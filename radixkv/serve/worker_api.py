"""The worker endpoints that routers call on each replica, in the schemas the routers read.

A replica behind a router is asked more than the OpenAI routes. What each router calls, read from
their sources and seen on the wire:

    sglang-router (sgl-model-gateway)
        GET  /server_info, then /get_server_info   when a worker registers: model_path,
             served_model_name (its labels), dp_size, max_total_tokens, version ...
        GET  /model_info, then /get_model_info     model_path, tokenizer_path, is_generation,
             model_type, architectures
        GET  /get_load                             [{dp_rank, num_reqs, num_waiting_reqs,
             num_tokens}] per data-parallel rank; the router sums num_tokens (power_of_two)
        POST /flush_cache                          fanned out by the router's own /flush_cache
    vllm-router (cache_aware, kv_aware)
        POST /v1/chat/completions/render, /v1/completions/render   on every worker for every
             request: vLLM's GenerateRequest, whose token_ids the router scores against its index
        POST /tokenize                             the fallback when render is missing
        GET  /get_server_info, /get_model_info, /health_generate   passed through to workers
             (/health_generate: `health.py`)

Render and tokenize go through `OpenAIServer.prepare` / `chat_prompt` / `completion_prompt`, the
very code the completion routes run, so the ids a router scores are the ids the engine runs. As
every POST route, they read the body the door took in (`scope["radixkv.body"]`), with its limits.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixkv.serve.bodies import (
    BodyLimits,
    TokenizeBody,
    over_context,
    parse_json,
    read_bool,
    read_detokenize_body,
    read_tokenize_body,
)
from radixkv.serve.health import GenerateProbe
from radixkv.serve.protocol import APIError, bad_request

if TYPE_CHECKING:
    from radixkv.engine.llm import LLM
    from radixkv.serve.engine_handle import EngineHandle
    from radixkv.serve.served_model import ServedModel

logger = logging.getLogger(__name__)

T = TypeVar("T")


class OpenAIServer(Protocol):
    """What these routes use of `radixkv.serve.app.OpenAIServer` (which registers them)."""

    model: ServedModel
    config: Any  # ServeConfig: model_name, max_queued_requests, admin_key
    engine: EngineHandle
    limits: BodyLimits
    is_stopping: bool

    def chat_prompt(self, messages: Any) -> list[int]: ...
    def completion_prompt(self, prompt: str | tuple[int, ...]) -> list[int]: ...
    # app.Job (prompt_ids, params, fields); named by app.py, which imports this module
    async def prepare(self, raw: bytes, *, chat: bool) -> Any: ...
    async def off_loop(self, fn: Callable[[], T]) -> T: ...


def add_worker_routes(app: FastAPI, server: OpenAIServer) -> None:
    """Register the router-facing endpoints on `app` (see the module docstring)."""
    _add_sglang_routes(app, server)
    _add_vllm_routes(app, server)


# ---------------------------------------------------------------------------------- SGLang
def _add_sglang_routes(app: FastAPI, server: OpenAIServer) -> None:
    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return _server_info(server)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return _model_info(server)

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        snap = server.engine.snapshot
        waiting = server.engine.num_queued
        return [
            {
                "dp_rank": 0,
                "num_reqs": snap.num_running + waiting,
                "num_waiting_reqs": waiting,
                # KV held by requests (cached-but-evictable blocks are capacity, not load)
                "num_tokens": snap.num_in_use_blocks * server.model.cache.block_size,
            }
        ]

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        _check_admin(server, request)
        keep_disk = await server.off_loop(partial(_read_flush_body, _raw(request)))
        flush = partial(_flush, keep_disk=keep_disk)
        refused, tiers = await asyncio.wrap_future(server.engine.call(flush))
        if refused is None:
            return Response(f"Cache flushed: {tiers}.\n", status_code=200, media_type="text/plain")
        # SGLang answers 400 when requests are running or waiting.
        message = f"Cache not flushed: {refused}.\n"
        return Response(message, status_code=400, media_type="text/plain")


def _check_admin(server: OpenAIServer, request: Request) -> None:
    """The admin routes (they act on every tenant's cache) answer only a client that sends the
    server's admin key as `Authorization: Bearer KEY`; a server started without one has them
    off. A GET (which a page's `<img src>` can send) never reaches them: they are POST only."""
    key = server.config.admin_key
    if key is None:
        raise APIError(
            403,
            f"{request.url.path} is off: start the server with --admin-key (or the "
            "RADIXKV_ADMIN_KEY environment variable) and send 'Authorization: Bearer KEY'",
            type="permission_error",
        )
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise APIError(
            401,
            f"{request.url.path} needs the server's admin key as 'Authorization: Bearer KEY'",
            type="authentication_error",
            code="invalid_api_key",
        )


def _read_flush_body(raw: bytes) -> bool:
    """Whether the flush keeps the disk tier: `{"keep_disk": true}`; no body clears it too."""
    if not raw.strip():
        return False
    return bool(read_bool(parse_json(raw), "keep_disk"))


def _flush(llm: LLM, *, keep_disk: bool) -> tuple[str | None, str]:
    """Reset the prefix cache when the engine is idle (engine thread), and clear the disk tier
    unless `keep_disk`. Returns (why not, or None; what was cleared and what was kept)."""
    if llm.has_unfinished_requests():
        running, waiting = llm.scheduler.num_running, llm.num_waiting_requests
        return f"{running} requests running and {waiting} waiting", ""
    if not llm.cache.reset():  # every KV cache group's
        return "a request still holds cached blocks", ""
    disks = [t.disk for t in llm.tier_ios if t is not None and t.disk is not None]
    if not disks:
        return None, "every tier cleared (there is no disk tier)"
    if keep_disk:
        kept = f"the disk tier kept ({sum(d.num_files for d in disks)} files indexed)"
        return None, f"the device and host tiers cleared, {kept}"
    for disk in disks:
        disk.clear()
    return None, "every tier cleared, the disk tier's files included"


def _server_info(server: OpenAIServer) -> dict[str, Any]:
    """SGLang's /server_info: its server arguments and scheduler info, the fields routers read."""
    model, config = server.model, server.config
    settings = model.config
    max_total_tokens = model.cache.num_blocks * model.cache.block_size
    return {
        "model_path": model.text.model_name,
        "tokenizer_path": model.tokenizer_path,
        "served_model_name": config.model_name,
        "dp_size": 1,
        "tp_size": 1,
        "page_size": model.cache.block_size,
        "context_length": settings.max_model_len,
        "max_total_tokens": max_total_tokens,
        "max_prefill_tokens": settings.max_num_batched_tokens,
        "chunked_prefill_size": settings.chunked_prefill_size,
        "max_running_requests": settings.max_num_seqs,
        "max_req_input_len": settings.max_model_len - 1,
        "schedule_policy": settings.policy,
        "disable_radix_cache": not settings.enable_prefix_cache,
        "max_queued_requests": config.max_queued_requests,
        "internal_states": [],
        "version": _version(),
        "system_fingerprint": server.fingerprint,  # what this server's replies carry
    }


def _model_info(server: OpenAIServer) -> dict[str, Any]:
    """SGLang's /model_info."""
    model = server.model
    return {
        "model_path": model.text.model_name,
        "tokenizer_path": model.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": model.model_type,
        "architectures": list(model.architectures),
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"radixkv-{version('radixkv')}"
    except PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "radixkv"


# ------------------------------------------------------------------------------------ vLLM
def _add_vllm_routes(app: FastAPI, server: OpenAIServer) -> None:
    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> dict[str, Any]:
        server.metrics.renders.inc()
        job = await server.prepare(_raw(request), chat=True)
        return _generate_request("chatcmpl", job)

    @app.post("/v1/completions/render")
    async def render_completion(request: Request) -> list[dict[str, Any]]:
        server.metrics.renders.inc()
        job = await server.prepare(_raw(request), chat=False)
        return [_generate_request("cmpl", job)]

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await server.off_loop(partial(_tokenize_reply, server, _raw(request)))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await server.off_loop(partial(_detokenize_reply, server, _raw(request)))

    probe = GenerateProbe(
        server.engine,
        max_queued=server.config.max_queued_requests,
        timeout_s=server.config.health_check_timeout_s,
    )
    app.state.health_probe = probe

    @app.get("/health_generate")
    async def health_generate() -> Response:
        # A replica on its way out takes no probe (a router should stop sending it requests).
        failure = "shutting down" if server.is_stopping else await probe.check()
        if failure is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": failure}, status_code=503)

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> dict[str, Any]:
        _check_model(server, model_id)
        return {
            "id": server.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "radixkv",
            "max_model_len": server.model.config.max_model_len,
        }


def _raw(request: Request) -> bytes:
    return bytes(request.scope.get("radixkv.body", b""))


def _generate_request(kind: str, job: Any) -> dict[str, Any]:
    """vLLM's GenerateRequest (`vllm/entrypoints/serve/disagg/protocol.py`): what the request
    would run, as the engine takes it."""
    params, fields = job.params, job.fields
    sampling = asdict(params)
    sampling["stop_token_ids"] = list(params.stop_token_ids)
    sampling["logit_bias"] = {str(t): b for t, b in params.logit_bias}
    return {
        "request_id": f"{kind}-{uuid.uuid4().hex}",
        "token_ids": job.prompt_ids,
        "features": None,
        "sampling_params": sampling,
        "model": fields.model,
        "stream": fields.stream,
        "stream_options": {"include_usage": fields.include_usage} if fields.stream else None,
        "cache_salt": fields.cache_salt,
        "priority": 0,
        "token_offsets": None,
    }


def _tokenize_reply(server: OpenAIServer, raw: bytes) -> Response:
    """vLLM's /tokenize answer to the body `raw` (preparation thread). The ids are capped at
    the context length, as a completion's prompt is, so the reply stays small."""
    body = read_tokenize_body(parse_json(raw), server.limits)
    _check_model(server, body.model)
    tokens = _tokenize(server, body)
    context = server.model.config.max_model_len
    if len(tokens) > context:
        raise over_context(len(tokens), context, "prompt" if body.messages is None else "messages")
    tokenizer = server.model.text.tokenizer
    strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    reply = {"count": len(tokens), "max_model_len": context, "tokens": tokens, "token_strs": strs}
    return JSONResponse(reply)  # encoded here, in the preparation thread, as it is built


def _tokenize(server: OpenAIServer, body: TokenizeBody) -> list[int]:
    """A chat through the chat template (with the assistant's turn opened, exactly as generation
    renders it) or a prompt through the tokenizer."""
    if body.messages is not None:
        if not body.add_generation_prompt or body.continue_final_message:
            raise bad_request(
                "only add_generation_prompt=true without continue_final_message is supported: "
                "the chat prompt as generation renders it",
                "add_generation_prompt",
            )
        if body.add_special_tokens:
            raise bad_request("the chat template adds the special tokens", "add_special_tokens")
        return server.chat_prompt(body.messages)
    assert body.prompt is not None, "read_tokenize_body gives one of prompt and messages"
    if body.add_special_tokens is False:
        tokenizer = server.model.text.tokenizer
        if tokenizer is None:
            raise bad_request("the model has no tokenizer", "prompt")
        return list(tokenizer.encode(body.prompt, add_special_tokens=False))
    return server.completion_prompt(body.prompt)


def _detokenize_reply(server: OpenAIServer, raw: bytes) -> Response:
    """vLLM's /detokenize answer to the body `raw` (preparation thread); as many ids as the
    context holds."""
    body = read_detokenize_body(parse_json(raw), server.limits)
    _check_model(server, body.model)
    context = server.model.config.max_model_len
    if len(body.tokens) > context:
        raise bad_request(
            f"{len(body.tokens)} token ids: more than the model's context length ({context})",
            "tokens",
        )
    return JSONResponse({"prompt": server.model.text.decode(body.tokens)})


def _check_model(server: OpenAIServer, model: str | None) -> None:
    """404 for a model this server does not serve, as vLLM's `_check_model` answers."""
    if model is not None and model != server.config.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {server.config.model_name!r}",
            param="model",
            code="model_not_found",
        )

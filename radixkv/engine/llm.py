"""The engine: `LLM` ties model runner, scheduler, prefix cache and sampler together.

One step loop, three front doors:

    add_request / step / abort_request   (the server: one thread drives step())
    generate(prompts)                    steps until its requests finish
    stream(prompt)                       steps whenever its consumer wants more
        │
        ▼
    step: schedule() ─► ModelRunner.execute() ─► sample() ─► update_from_output() ─► detokenize

Requests of every door advance together in each step. A fault anywhere in a step fails the
requests of that step (finish reason "error"), returns their blocks and locks, and the engine
keeps serving. `LLM` is not thread-safe: one thread calls it.
"""

from __future__ import annotations

import logging
import numbers
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixkv.cache import PackedTokens, PrefixCache, check_size
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.kv_events import KVEventsTarget, check_kv_events, publish_kv_events
from radixkv.engine.model_loader import Progress, load_model
from radixkv.engine.model_runner import KVCacheSpec, ModelRunner, plan_num_blocks
from radixkv.engine.outputs import RequestOutput, RequestStats, StreamDelta
from radixkv.engine.sampler import make_generator, sample
from radixkv.scheduler import Request, Scheduler, SchedulerConfig
from radixkv.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptInput = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What one engine step did to one request."""

    request_id: str
    new_token_ids: tuple[int, ...]  # tokens sampled for it in this step (may be empty)
    new_text: str  # newly completed detokenised text (may be "")
    output: RequestOutput | None = None  # set once, when it finished (stop/length/abort/error)
    error: BaseException | None = None  # set when it failed in this step


@dataclass(slots=True)
class _Tracked:
    """Engine-side record of one request, kept until its front door has taken the output."""

    request: Request
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    t_submit: float
    external: bool  # added by add_request: its updates are handed out by step()
    t_first_token: float | None = None
    t_last_token: float | None = None
    output: RequestOutput | None = None
    error: BaseException | None = None


class LLM:
    """A prefix-caching inference engine over a Hugging Face Llama-family causal LM.

    `model`: None (the embedded SmolLM2-135M-Instruct, converted once into the user cache dir),
    a local folder, a Hugging Face id, or a loaded `PreTrainedModel` (its attention implementation
    is switched to the paged one). `block_size` tokens per KV block; the KV pool holds `num_blocks`
    blocks, or what `kv_cache_bytes` holds, or (CPU) 512 MiB / (CUDA) 80 % of free device memory.
    `num_threads` (CPU only): torch threads; None = half the cores (1 on a 2-core machine), because
    OpenMP spin-waiting collapses when a co-tenant keeps the other cores busy.
    `enforce_eager`: no CUDA graphs for decode steps (the CPU always runs eager).
    `kv_events`: None, or where the prefix cache's KV events go (`radixkv.engine.kv_events`): a
    ZeroMQ address such as "tcp://*:5557" (vLLM's wire format, for cache-aware routers) or a
    callable taking each event; `self.kv_events.close()` stops them.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | Any | None = None,
        *,
        tokenizer: Any | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        enable_prefix_cache: bool = True,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 1024,
        chunked_prefill_size: int = 512,
        policy: str = "lpm",
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 0,
        num_threads: int | None = None,
        progress: Progress | None = None,
        enforce_eager: bool = False,
        kv_events: KVEventsTarget | None = None,
    ) -> None:
        check_size(block_size, "block_size", low=1)
        check_kv_events(kv_events)
        check_size(seed, "seed", low=0)
        if num_threads is not None:
            check_size(num_threads, "num_threads", low=1)
        loaded = load_model(
            model, tokenizer=tokenizer, device=device, dtype=dtype, progress=progress
        )
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.max_model_len = _max_model_len(self.model.config.get_text_config())
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            chunked_prefill_size=chunked_prefill_size,
            policy=policy,
            enable_prefix_cache=enable_prefix_cache,
            max_model_len=self.max_model_len,
        )
        param = next(self.model.parameters())
        if param.device.type == "cpu":
            _set_cpu_threads(num_threads)
        spec = KVCacheSpec.from_model(self.model, block_size, param.dtype)
        n_blocks = plan_num_blocks(
            spec, param.device, num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes
        )
        self.runner = ModelRunner(
            self.model,
            block_size=block_size,
            num_blocks=n_blocks,
            enforce_eager=enforce_eager,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
        )
        self.cache = PrefixCache(n_blocks, block_size)
        self.scheduler = Scheduler(self.cache, self.scheduler_config)
        self.kv_events = None if kv_events is None else publish_kv_events(self.cache, kv_events)
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self.seed = seed
        self._num_submitted = 0
        self._tracked: dict[str, _Tracked] = {}
        self._outbox: list[RequestUpdate] = []  # updates of add_request's requests, not yet taken
        self._stepping = False
        self._orphans: list[str] = []  # streams dropped during a step, released after it

    # ------------------------------------------------------------------ step API

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> str:
        """Validate (ValueError / TypeError, nothing queued) and queue one request; returns its id.
        Its progress comes back from `step()` as RequestUpdates. No model work. Requests share
        cached KV only with requests of the same `cache_salt` (None: the shared namespace)."""
        prompts, plist = self._one_prompt(prompt), _normalize_params(params, 1)
        (rid,) = self._submit(prompts, plist, True, cache_salt)
        return rid

    def step(self) -> list[RequestUpdate]:
        """Run one scheduler step if any request is pending; returns the updates of the requests
        queued by `add_request` ([] when idle).

        Never raises because of a fault inside the step: the requests of a failed step come back
        with `error` set (finish reason "error"), their blocks and locks returned. On a
        KeyboardInterrupt / SystemExit the step's requests are failed the same way, then it is
        re-raised (their updates come with the next call)."""
        self._run_step()
        updates, self._outbox = self._outbox, []
        return updates

    def abort_request(self, request_id: str) -> bool:
        """Abort a queued or running request (its blocks come back; its final update, finish
        reason "abort", comes with the next `step()`). False if unknown or finished."""
        t = self._tracked.get(request_id)
        if t is None or t.output is not None:
            return False
        self.scheduler.abort(request_id)
        self._finish(t, "abort")
        self._emit(t, (), "")
        return True

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running, or an update waits for `step()`."""
        return self.scheduler.has_unfinished() or bool(self._outbox)

    @property
    def num_waiting_requests(self) -> int:
        return self.scheduler.num_waiting

    # ------------------------------------------------------------------ generate / stream

    def generate(
        self,
        prompts: PromptInput,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one or many prompts (strings or token-id lists), in input order.

        Raises ValueError / TypeError, with nothing admitted, for an empty prompt, token ids outside
        the vocabulary, a prompt that can never fit, or params of the wrong type or count. Raises
        the exception of a step that failed one of its requests (the others are aborted).
        """
        prompt_ids = self._normalize_prompts(prompts)
        ids = self._submit(prompt_ids, _normalize_params(params, len(prompt_ids)), False)
        try:
            while True:
                records = [self._tracked[rid] for rid in ids]
                error = next((t.error for t in records if t.error is not None), None)
                if error is not None:
                    raise error
                if all(t.output is not None for t in records):
                    return [t.output for t in records if t.output is not None]
                self._run_step()
        finally:
            for rid in ids:
                self._discard(rid)

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> Iterator[StreamDelta]:
        """Generate for one prompt, yielding text deltas as tokens arrive; the last delta carries
        the finished RequestOutput (`delta.output`). Closing or dropping the iterator, started or
        not, aborts the request. Iterating raises the exception of a step that failed it.

        Validation errors are raised by this call, before iteration starts."""
        (rid,) = self._submit(self._one_prompt(prompt), _normalize_params(params, 1), False)
        return _Stream(self._deltas(rid), lambda: self._release(rid))

    def encode(self, text: str) -> list[int]:
        """Tokenize like generate() does for a string prompt."""
        if self.tokenizer is None:
            raise ValueError(
                f"model {self.model_name!r} has no tokenizer: pass prompts as token-id lists"
            )
        return list(self.tokenizer.encode(text))

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    # ------------------------------------------------------------------ the step loop

    def _submit(
        self,
        prompts: list[PackedTokens],
        params: list[SamplingParams],
        external: bool,
        cache_salt: str | None = None,
    ) -> list[str]:
        """Add every request or none (a rejected one rolls back those added before it)."""
        added: list[str] = []
        now = time.perf_counter()
        try:
            for tokens, p in zip(prompts, params, strict=True):
                # Ids are never reused, not even those of a rolled-back call.
                rid = f"req-{self._num_submitted}"
                seed = (
                    p.seed if p.seed is not None else _derive_seed(self.seed, self._num_submitted)
                )
                self._num_submitted += 1
                eos = () if p.ignore_eos else self.eos_token_ids
                request = Request(rid, tokens, p, eos_token_ids=eos, cache_salt=cache_salt)
                self.scheduler.add_request(request)
                added.append(rid)
                gen = None if p.greedy else make_generator(seed, self.runner.device)
                detok = IncrementalDetokenizer(self.tokenizer)
                self._tracked[rid] = _Tracked(request, gen, detok, now, external)
        except BaseException:
            for rid in added:
                self._discard(rid)
            raise
        return added

    def _run_step(self) -> None:
        """One step, if anything is pending. A fault fails the step's requests (see `step`)."""
        if not self.scheduler.has_unfinished():
            return
        step_ids: list[str] = []
        self._stepping = True
        try:
            self._step(step_ids)
        except BaseException as exc:
            logger.error("step failed, failing its requests: %r", exc)
            self._fail(step_ids, exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._stepping = False
            while self._orphans:
                self._discard(self._orphans.pop())

    def _step(self, step_ids: list[str]) -> None:
        """schedule -> forward -> sample -> update -> detokenize; `step_ids` gets the ids of the
        step's rows as soon as they are known."""
        out = self.scheduler.schedule()
        step_ids.extend(row.request_id for row in out.rows)
        if out.is_empty:
            raise RuntimeError(
                f"scheduler scheduled nothing with {self.scheduler.num_waiting} requests waiting"
            )
        logits = self.runner.execute(out)
        sample_ids = [row.request_id for row in out.rows if row.sample]
        records = [self._tracked[rid] for rid in sample_ids]
        tokens = sample(logits, [t.request.params for t in records], [t.generator for t in records])
        self.scheduler.update_from_output(out, dict(zip(sample_ids, tokens, strict=True)))
        now = time.perf_counter()
        for t, token in zip(records, tokens, strict=True):
            t.t_first_token = t.t_first_token or now
            t.t_last_token = now
            text = t.detok.push((token,))
            if t.request.is_finished:
                text += t.detok.finish()
                self._finish(t, str(t.request.finish_reason))
            self._emit(t, (token,), text)

    def _fail(self, step_ids: list[str], exc: BaseException) -> None:
        """Fail the requests of a faulty step: every live one when it failed before its rows were
        known, since then nothing tells which requests it touched."""
        self.scheduler.fail_step()
        for rid in step_ids or list(self._tracked):
            t = self._tracked.get(rid)
            if t is not None and t.output is None:
                self.scheduler.abort(rid)  # False where fail_step() failed it already
                t.error = exc
                self._finish(t, "error")
                self._emit(t, (), "")

    def _finish(self, t: _Tracked, finish_reason: str) -> None:
        req = t.request
        out_ids = tuple(req.output_token_ids)
        now = time.perf_counter()
        t_first = t.t_first_token or now
        decode_s = (t.t_last_token or now) - t_first
        stats = RequestStats(
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=len(out_ids),
            ttft_s=t_first - t.t_submit,
            decode_tokens_per_s=(len(out_ids) - 1) / decode_s if decode_s > 0 else 0.0,
            total_s=now - t.t_submit,
        )
        t.output = RequestOutput(
            req.request_id,
            tuple(req.prompt_token_ids),
            out_ids,
            t.detok.emitted,
            finish_reason,
            stats,
        )

    def _emit(self, t: _Tracked, new_token_ids: tuple[int, ...], new_text: str) -> None:
        """Hand an update of a step-API request to the next `step()`; drop its record once final."""
        if t.external:
            rid = t.request.request_id
            self._outbox.append(RequestUpdate(rid, new_token_ids, new_text, t.output, t.error))
            if t.output is not None:
                del self._tracked[rid]

    def _discard(self, rid: str) -> None:
        """Drop a request's record, aborting it if it has not finished."""
        t = self._tracked.pop(rid, None)
        if t is not None and t.output is None:
            self.scheduler.abort(rid)

    def _release(self, rid: str) -> None:
        """A stream was closed or dropped; a drop may come from the garbage collector in the
        middle of a step, so the abort then waits for the step's end."""
        if self._stepping:
            self._orphans.append(rid)
        else:
            self._discard(rid)

    def _deltas(self, rid: str) -> Iterator[StreamDelta]:
        num_tokens = num_chars = 0
        while True:
            t = self._tracked[rid]
            if t.error is not None:
                raise t.error
            token_ids = t.request.output_token_ids
            if t.output is None and len(token_ids) == num_tokens:
                self._run_step()
                continue
            new = tuple(token_ids[num_tokens:])
            text = t.detok.emitted[num_chars:]
            num_tokens += len(new)
            num_chars += len(text)
            if t.output is not None:
                yield StreamDelta(text, new, t.output)
                return
            if new or text:
                yield StreamDelta(text, new)

    # ------------------------------------------------------------------ validation

    def _one_prompt(self, prompt: str | Sequence[int]) -> list[PackedTokens]:
        prompts = self._normalize_prompts(prompt)
        if len(prompts) != 1:
            raise ValueError("one prompt expected; use generate() for several")
        return prompts

    def _normalize_prompts(self, prompts: PromptInput) -> list[PackedTokens]:
        """Each prompt as PackedTokens (validated once here, at the engine's door)."""
        if isinstance(prompts, str):
            items: list[Any] = [prompts]
        elif isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
            if len(prompts) == 0:
                raise ValueError("prompts must not be empty")
            # A flat list of ints is one prompt given as token ids.
            items = [prompts] if _is_int(prompts[0]) else list(prompts)
        else:
            raise TypeError(
                "prompts must be a string, a list of strings, a list of token ids or a list of "
                f"token-id lists, got {type(prompts).__name__}"
            )
        return [self._tokens(i, item) for i, item in enumerate(items)]

    def _tokens(self, i: int, item: Any) -> PackedTokens:
        if isinstance(item, str):
            if not item:
                raise ValueError(f"prompt {i} is an empty string")
            item = self.encode(item)
        elif not isinstance(item, Sequence) or isinstance(item, (bytes, bytearray)):
            raise TypeError(
                f"prompt {i} must be a string or a list of token ids, got {type(item).__name__}"
            )
        elif bool in map(type, item):
            raise TypeError(f"prompt {i}: token ids must be ints, not bools")
        vocab = f"the vocabulary [0, {self.vocab_size})"
        try:
            tokens = PackedTokens(item)
        except TypeError as e:
            raise TypeError(f"prompt {i}: token ids must be ints: {e}") from None
        except ValueError as e:
            raise ValueError(f"prompt {i}: token ids outside {vocab}: {e}") from None
        if not tokens:
            raise ValueError(f"prompt {i} is empty (no tokens)")
        if max(tokens) >= self.vocab_size:
            bad = [t for t in tokens if t >= self.vocab_size][:5]
            raise ValueError(f"prompt {i}: token ids {bad} are outside {vocab}")
        if len(tokens) >= self.max_model_len:
            raise ValueError(
                f"prompt {i} has {len(tokens)} tokens; the model's context is {self.max_model_len}"
            )
        return tokens


class _Stream(Iterator[StreamDelta]):
    """What `LLM.stream` returns. Closing it, or dropping it, started or not, runs `on_close`
    (abort the request, drop its record): a bare generator's `finally` never runs unless it
    was started."""

    def __init__(self, deltas: Iterator[StreamDelta], on_close: Callable[[], None]) -> None:
        self._deltas = deltas
        self._on_close: Callable[[], None] | None = on_close

    def __next__(self) -> StreamDelta:
        try:
            return next(self._deltas)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def __del__(self) -> None:
        self.close()


def _normalize_params(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}] must be SamplingParams, got {type(p).__name__}")
        return list(params)
    raise TypeError(f"params must be SamplingParams or a list of them, got {type(params).__name__}")


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _derive_seed(engine_seed: int, index: int) -> int:
    """Seed of an unseeded sampled request: a fixed mix of the engine seed and submit order."""
    return (engine_seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (2**63)


def _eos_token_ids(model: Any, tokenizer: Any | None) -> tuple[int, ...]:
    ids: list[int] = []
    gen_cfg = getattr(model, "generation_config", None)
    for source in (
        getattr(gen_cfg, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if source is None:
            continue
        for t in [source] if _is_int(source) else list(source):
            if int(t) not in ids:
                ids.append(int(t))
    return tuple(ids)


def _max_model_len(cfg: Any) -> int:
    n = int(getattr(cfg, "max_position_embeddings", None) or 8192)
    window = getattr(cfg, "sliding_window", None)
    if (
        window
        and getattr(cfg, "use_sliding_window", True)
        and not getattr(cfg, "layer_types", None)
    ):
        # The paged attention is full causal attention: it equals a sliding-window model's
        # attention only while the whole context fits in the window (Mistral-style configs).
        n = min(n, int(window))
    return n


def _set_cpu_threads(num_threads: int | None) -> None:
    if num_threads is None:
        num_threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) // 2))
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)

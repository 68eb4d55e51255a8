"""The engine: `LLM` ties model runner, scheduler, prefix cache and sampler together.

One step loop, three front doors:

    add_request / step / abort_request   (the server: one thread drives step())
    generate(prompts)                    steps until its requests finish
    stream(prompt)                       steps whenever its consumer wants more
        │
        ▼
    step: schedule() ─► tier moves ─► launch (forward, draw) ─► finish (read tokens) ─► fill
          ─► detokenize (`radixkv.engine.step`; with `async_scheduling`, the next step is
          launched before this one is finished)

Requests of every door advance together in each step. A fault that belongs to one row of a
step (its sampling, its detokenizing) fails that request alone and the step's other rows go on;
a fault in the work the rows share (scheduling, the forward, the cache update) fails the
requests of that step. Either way they finish with reason "error", their blocks and locks come
back, and the engine keeps serving. `LLM` is not thread-safe: one thread calls it.

The doors validate what users pass (prompts, sampling params, salts, settings) once; everything
below them (scheduler, cache, runner) trusts it.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from radixkv.cache import PackedTokens, PrefixCache
from radixkv.cache.hybrid import HybridCache
from radixkv.cache.keys import BlockHasher, make_block_hasher
from radixkv.cache.moves import Move, Poisoned
from radixkv.cache.window import WindowStats
from radixkv.engine.chat_template import encode_chat
from radixkv.engine.config import EngineConfig
from radixkv.engine.detokenizer import IncrementalDetokenizer, decode
from radixkv.engine.grammar import GrammarCompiler, RequestGrammar
from radixkv.engine.interrupts import sigint_deferred
from radixkv.engine.jump_forward import plan_jump
from radixkv.engine.model_loader import Progress, load_model
from radixkv.engine.model_runner import ModelRunner
from radixkv.engine.outputs import (
    DeltaStream,
    RequestOutput,
    RequestStats,
    StreamDelta,
    TokenLogprobs,
)
from radixkv.engine.penalties import prompt_token_mask
from radixkv.engine.prompts import (
    PromptInput,
    check_chat_messages,
    expand_choices,
    pack_prompts,
    params_list,
)
from radixkv.engine.sampler import make_generator
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.step import Launched, SampledRow, Steps, sources
from radixkv.engine.tier_io import TierIO, make_group_tier_ios, make_tier_io
from radixkv.kv_events import KVEventFeed
from radixkv.scheduler import HybridScheduler, Request, Scheduler
from radixkv.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What one engine step did to one request."""

    request_id: str
    new_token_ids: tuple[int, ...]  # tokens sampled for it in this step (may be empty)
    new_text: str  # newly completed detokenised text (may be "")
    output: RequestOutput | None = None  # set once, when it finished (stop/length/abort/error)
    error: BaseException | None = None  # set when it failed in this step
    new_logprobs: tuple[TokenLogprobs, ...] = ()  # of new_token_ids, if the request asked


@dataclass(slots=True)
class _Tracked:
    """Engine-side record of one request, kept until its front door has taken the output."""

    request: Request
    params: SamplingParams
    generator: random.Random | None
    detok: IncrementalDetokenizer
    t_submit: float
    sink: Callable[[RequestUpdate], None] | None  # where its updates go (generate needs none)
    t_first_token: float | None = None
    t_last_token: float | None = None
    output: RequestOutput | None = None
    error: BaseException | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # if its params ask for them
    failed_load: bool = False  # a copy of cached KV for it failed once: the next failure fails it
    grammar: RequestGrammar | None = None  # its structured-output matcher, if it asked for one
    jumps: bool = False  # jump-forward over the text its grammar forces
    # [vocab] bool on the device, its prompt's tokens: made at submit with a repetition penalty
    prompt_mask: torch.Tensor | None = None


class LLM:
    """A prefix-caching inference engine over a Hugging Face Llama-family causal LM.

    `model`: None (the embedded SmolLM2-135M-Instruct, converted once into the user cache dir),
    a local folder, a Hugging Face id, or a loaded `PreTrainedModel` (its attention implementation
    is switched to the paged one). `tokenizer`: one to use instead of the model's. `progress`:
    called with a line per stage of the default model's one-time conversion. `settings`: the
    fields of `EngineConfig` (block size and cache size, scheduler bounds, device, dtype, seed, KV
    events, ...), checked before the model loads; `llm.config` is the config it runs with.

    Raises ModelLoadError (a ValueError; its subclass ModelNotFoundError when nothing is found)
    for any model that cannot be loaded: a missing folder or id, corrupt or truncated weights,
    shapes that do not match the config, missing weights. A folder without a tokenizer loads
    (prompts must then be token ids); a chat over it raises ModelLoadError.

    Invariants (between calls): the unfinished records are exactly the scheduler's live
    requests; a finished record waits only for its front door (the update in `step()`'s outbox,
    the stream's queue, generate's return); no dropped stream waits for release.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | Any | None = None,
        *,
        tokenizer: Any | None = None,
        progress: Progress | None = None,
        **settings: Any,
    ) -> None:
        config = EngineConfig(**settings)  # TypeError naming an unknown setting
        loaded = load_model(
            model, tokenizer=tokenizer, device=config.device, dtype=config.dtype, progress=progress
        )
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.tokenizer_path = loaded.tokenizer_path or loaded.name  # a local folder where known
        model_len = _max_model_len(self.model.config.get_text_config())
        max_len = min(config.max_model_len or model_len, model_len)
        device_type = next(self.model.parameters()).device.type
        self.config = replace(config, max_model_len=max_len)
        if device_type == "cpu":
            _set_cpu_threads(config.num_threads)
        self.runner = ModelRunner(self.model, self.config)
        self.runner.warm_up()
        self.tier_io, self.window_tier_io = self._tier_ios()
        events = config.kv_events
        hasher = events is not None and make_block_hasher(config.block_hash, config.block_hash_seed)
        self.cache = PrefixCache(
            self.runner.num_blocks,
            config.block_size,
            kv_events=hasher,
            host_blocks=0 if self.tier_io is None else self.tier_io.host.num_blocks,
            disk=None if self.tier_io is None else self.tier_io.disk,
            write_through=config.host_cache_write_through,
        )
        self.scheduler = self._scheduler(hasher)
        self.kv_events = None if events is None else _event_feed(config)
        overlap = config.async_scheduling
        self._overlap = self.runner.device.type == "cuda" if overlap is None else overlap
        self._steps = Steps(self.runner)
        self._in_flight: Launched | None = None  # overlapped: the step launched, not finished
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self._num_submitted = 0
        self._tracked: dict[str, _Tracked] = {}
        self._outbox: list[RequestUpdate] = []  # updates of add_request's requests, not yet taken
        self._stepping = False
        self._orphans: list[str] = []  # streams dropped during a step, released after it
        self._grammars: GrammarCompiler | None = None  # made on the first structured request

    def _tier_ios(self) -> tuple[TierIO | None, TierIO | None]:
        """The tier movers of the full layers' pool and of the window layers' (None: no host
        tier, or no window layers)."""
        runner = self.runner
        full = (runner.k_cache, runner.v_cache)
        if runner.window_k_cache is None:
            return make_tier_io(self.model, *full, self.config), None
        window = (runner.window_k_cache, runner.window_v_cache)
        return make_group_tier_ios(self.model, full, window, self.config)

    def _scheduler(self, hasher: BlockHasher | bool) -> Scheduler:
        """The plain scheduler over `cache`, or for a model with window layers the hybrid one
        over `cache` (then its full group, whose queue the window group's events join) and the
        window group (`radixkv.cache.hybrid`)."""
        runner = self.runner
        if runner.window is None:
            return Scheduler(self.cache, self.config)
        full, window = self.tier_io, self.window_tier_io
        hybrid = HybridCache(
            runner.num_blocks,
            runner.num_window_blocks,
            self.config.block_size,
            runner.window,
            kv_events=hasher,
            host_blocks=0 if full is None else full.host.num_blocks,
            disk=None if full is None else full.disk,
            write_through=self.config.host_cache_write_through,
            window_host_blocks=0 if window is None else window.host.num_blocks,
            window_disk=None if window is None else window.disk,
        )
        self.cache = hybrid.full
        return HybridScheduler(hybrid, self.config)

    # ------------------------------------------------------------------ step API

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        grammar: Any | None = None,
    ) -> str:
        """Validate (ValueError / TypeError, nothing queued) and queue one request; returns its id.
        Its progress comes back from `step()` as RequestUpdates. No model work. Requests share
        cached KV only with requests of the same `cache_salt` (None: the shared namespace).
        `grammar`: the compiled form of `params.grammar_spec` (an xgrammar CompiledGrammar of
        this vocabulary), compiled elsewhere; None: compiled here, in the caller's thread."""
        prompts, plist = self._pack_one(prompt), params_list(params, 1)
        (rid,) = self._submit(prompts, plist, self._outbox.append, cache_salt, grammar)
        return rid

    def step(self) -> list[RequestUpdate]:
        """Run one scheduler step if any request is pending; returns the updates of the requests
        queued by `add_request` ([] when idle).

        Never raises because of a fault inside the step: the requests it failed (the faulty row's
        alone, or the whole step's: see the module docstring) come back with `error` set (finish
        reason "error"), their blocks and locks returned. On a
        KeyboardInterrupt / SystemExit raised inside the step the step's requests are failed the
        same way, then it is re-raised (their updates come with the next call). A Ctrl-C on the
        main thread waits for the end of the step (`radixkv.engine.interrupts`): the step
        completes, and the KeyboardInterrupt is raised after it with its updates kept for the
        next call."""
        self._run_step()
        updates = list(self._outbox)
        self._outbox.clear()  # in place: the requests' sinks append to this very list
        for u in updates:
            if u.output is not None:
                del self._tracked[u.request_id]
        return updates

    @sigint_deferred()
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

    def window_stats(self) -> WindowStats | None:
        """The window layers' group's figures (None: a model without window layers); the full
        layers' are `cache.stats()`."""
        cache = self.scheduler.cache
        return cache.window_stats() if isinstance(cache, HybridCache) else None

    def check_integrity(self) -> None:
        """Recompute the invariants (see the class docstring), then the scheduler's and cache's."""
        self.scheduler.check_integrity()
        assert not self._stepping and not self._orphans, self._orphans
        unfinished = {rid for rid, t in self._tracked.items() if t.output is None}
        live = self.scheduler.running_requests + self.scheduler.waiting_requests
        assert unfinished == {r.request_id for r in live}, (unfinished, live)
        # The requests with placeholders are the step in flight's sampled ones, one each.
        pending = {r.request_id: r.num_pending for r in live if r.num_pending}
        waiting = sources(self._in_flight)
        assert pending == {r.request_id: 1 for r in live if r.request_id in waiting}, pending
        for u in self._outbox:
            assert u.output is None or u.request_id in self._tracked, u
        for t in self._tracked.values():
            if t.grammar is not None:
                t.grammar.check_integrity(t.request.output_token_ids)
            penalised = t.params.repetition_penalty != 1.0
            assert (t.prompt_mask is not None) == penalised, (t.request, "a prompt mask iff needed")
            if t.prompt_mask is not None:
                prompt = set(t.request.prompt_token_ids)
                assert set(t.prompt_mask.nonzero()[:, 0].tolist()) == prompt, t.request
        if self._grammars is not None:
            self._grammars.check_integrity()

    # ------------------------------------------------------------------ generate / stream

    def generate(
        self,
        prompts: PromptInput,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for one or many prompts (strings or token-id lists), in input order, sharing
        cached KV only with requests of the same `cache_salt` (as `add_request`).

        A prompt whose params have `n` > 1 gives its n outputs one after another (choice i
        seeded with seed + i when the params have a seed): the choices share the prompt's
        cached KV, one prefill for all.

        Raises ValueError / TypeError, with nothing admitted, for an empty prompt, token ids outside
        the vocabulary, a prompt that can never fit, or params of the wrong type or count. Raises
        the exception of a step that failed one of its requests (the others are aborted).
        """
        packed = pack_prompts(prompts, self.encode, self.vocab_size, self.config.max_model_len)
        packed, plist = expand_choices(packed, params_list(params, len(packed)))
        ids = self._submit(packed, plist, None, cache_salt)
        try:
            records = [self._tracked[rid] for rid in ids]
            while any(t.output is None for t in records):
                self._run_step()
                for t in records:
                    if t.error is not None:
                        raise t.error
            return [t.output for t in records if t.output is not None]
        finally:
            self._discard(*ids)

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Iterator[StreamDelta]:
        """Generate for one prompt, yielding text deltas as tokens arrive; the last delta carries
        the finished RequestOutput (`delta.output`). Closing or dropping the iterator, started or
        not, aborts the request. Iterating raises the exception of a step that failed it.
        `cache_salt` as in `add_request`.

        Validation errors are raised by this call, before iteration starts."""
        pending: deque[RequestUpdate] = deque()
        (rid,) = self._submit(
            self._pack_one(prompt), params_list(params, 1), pending.append, cache_salt
        )
        return DeltaStream(self._deltas(pending), lambda: self._release(rid))

    def encode(self, text: str) -> list[int]:
        """Tokenize like generate() does for a string prompt."""
        if self.tokenizer is None:
            raise ValueError(
                f"model {self.model_name!r} has no tokenizer: pass prompts as token-id lists"
            )
        return list(self.tokenizer.encode(text))

    @property
    def has_chat_template(self) -> bool:
        """Whether the model has a tokenizer with a chat template (what `encode_chat` needs)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt of a chat: `messages` (and `tools`, OpenAI's tool definitions, for a
        template that renders them) through the tokenizer's chat template, with the
        assistant's turn opened; special-token text in their content is plain text unless the
        config's `parse_special_tokens_in_content` (see `chat_template.py`). Raises ValueError
        for a model without a tokenizer or chat template, a message without a string role and
        content (TypeError: not a dict, or a role or content of another type), or messages the
        template refuses."""
        if not self.has_chat_template:
            raise ValueError(f"model {self.model_name!r} has no chat template")
        checked = check_chat_messages(messages)
        parse = self.config.parse_special_tokens_in_content
        return encode_chat(self.tokenizer, checked, parse_special_tokens=parse, tools=tools)

    def decode(self, token_ids: Sequence[int]) -> str:
        return decode(self.tokenizer, token_ids)

    # ------------------------------------------------------------------ the step loop

    def _submit(
        self,
        prompts: list[PackedTokens],
        params: list[SamplingParams],
        sink: Callable[[RequestUpdate], None] | None,
        cache_salt: str | None,
        compiled: Any | None = None,
    ) -> list[str]:
        """Queue every request or none: one the scheduler refuses (it can never fit the cache)
        rolls back those before it. The prompts and params come checked from the door."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        for p in params:
            if p.n != 1:
                raise ValueError("n > 1 is generate()'s: add one request per choice (`choices()`)")
            if p.logit_bias and p.logit_bias[-1][0] >= self.vocab_size:  # sorted by token id
                raise ValueError(
                    f"logit_bias's token id {p.logit_bias[-1][0]} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        # compile errors before any state
        grammars = [self._grammar_of(p, compiled) for p in params]
        added: list[str] = []
        try:
            for tokens, p, grammar in zip(prompts, params, grammars, strict=True):
                index = self._num_submitted
                self._num_submitted += 1
                rid = f"req-{index}"  # never reused, not even after a rollback
                seed = _derive_seed(self.config.seed, index) if p.seed is None else p.seed
                stop = p.stop_tokens(self.eos_token_ids)
                request = Request(rid, tokens, p.max_tokens, stop, cache_salt=cache_salt)
                self.scheduler.add_request(request)
                added.append(rid)
                gen = None if p.greedy else make_generator(seed)
                detok = IncrementalDetokenizer(self.tokenizer)
                t = _Tracked(request, p, gen, detok, time.perf_counter(), sink)
                t.grammar = None if grammar is None else RequestGrammar(grammar, stop)
                t.jumps = grammar is not None and self._jumps(p)
                if p.repetition_penalty != 1.0:
                    t.prompt_mask = prompt_token_mask(tokens, self.vocab_size, self.runner.device)
                if t.jumps and t.grammar.jump_string(()):  # see `_jump_forward`
                    self.scheduler.hold(rid)
                self._tracked[rid] = t
        except BaseException:
            self._discard(*added)
            raise
        return added

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler (made on first use). ValueError without a tokenizer."""
        if self._grammars is None:
            if self.tokenizer is None:
                name = self.model_name
                raise ValueError(f"model {name!r} has no tokenizer: no structured output")
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammars

    def _jumps(self, params: SamplingParams) -> bool:
        """Whether a request with a grammar jumps forward: its own switch, else the engine's;
        never with logprobs (jumped tokens are not sampled: `SamplingParams.jump_forward`)."""
        on = self.config.jump_forward if params.jump_forward is None else params.jump_forward
        return on and params.logprobs is None

    def _grammar_of(self, params: SamplingParams, compiled: Any | None = None) -> Any:
        """The compiled grammar of a request's params (None without one): `compiled` when the
        caller compiled it, else compiled now. ValueError for one that cannot be compiled, is
        of another vocabulary, or could never end (no stop token)."""
        spec = params.grammar_spec
        if spec is None:
            if compiled is not None:
                raise ValueError("grammar given for a request whose params have no grammar")
            return None
        if not params.stop_tokens(self.eos_token_ids):
            raise ValueError(f"{spec[0]} needs a stop token: ignore_eos with no stop_token_ids")
        if compiled is None:
            return self.grammars.compile(spec)
        size = getattr(getattr(compiled, "tokenizer_info", None), "vocab_size", None)
        if size != self.vocab_size:
            raise ValueError(
                f"grammar is compiled for a vocabulary of {size}, not {self.vocab_size}"
            )
        return compiled

    @sigint_deferred()
    def _run_step(self) -> None:
        """One step, if anything is pending. A fault fails the step's requests (see `step`)."""
        if not self.scheduler.has_unfinished():
            return
        step_ids: list[str] = []
        self._stepping = True
        try:
            self._step(step_ids)
        except BaseException as exc:
            interrupted = not isinstance(exc, Exception)  # the caller's to report: INFO only
            level = logging.INFO if interrupted else logging.ERROR
            logger.log(level, "step failed, failing its requests: %r", exc)
            self._in_flight = None  # its requests are among the step's, failed here
            self._fail(step_ids, exc)
            if interrupted:
                raise
        finally:
            self._stepping = False
            while self._orphans:
                self._discard(self._orphans.pop())
            if self.kv_events is not None:
                self.kv_events.publish(self.cache.take_events())

    def _step(self, step_ids: list[str]) -> None:
        """Schedule and launch a step; finish it at once, or, overlapped, finish the one launched
        before it. `step_ids` gets the ids of the requests a fault would concern as soon as they
        are known."""
        out = self.scheduler.schedule()
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            previous.poll()  # a device done by now: its tokens' time is before this launch
            step_ids.extend(row.request_id for row in previous.output.rows)
        step_ids.extend(row.request_id for row in out.rows)
        if out.is_empty and previous is None:
            raise RuntimeError(
                f"scheduler scheduled nothing with {self.scheduler.num_waiting} requests waiting"
            )
        # Even with no rows: the moves the cache planned since the last step must run.
        requeued = self._run_step_moves(out) if out.moves or out.window_moves else set()
        launched = None
        if not out.is_empty:
            launched = self._steps.launch(out, self._sampled_rows(out), previous, requeued)
            self.scheduler.record_launched(out)
        if self._overlap:
            self._in_flight, launched = launched, previous
        if launched is not None:
            self._finish_step(launched)

    def _sampled_rows(self, out: SchedulerOutput) -> list[SampledRow]:
        records = (self._tracked[row.request_id] for row in out.rows if row.sample)
        return [
            SampledRow(t.request, t.params, t.generator, t.grammar, t.prompt_mask) for t in records
        ]

    def _finish_step(self, launched: Launched) -> None:
        """Read a launched step's tokens: a row that failed fails its request alone (before the
        scheduler takes the others'); each other request takes its token."""
        sampled: dict[str, int] = {}
        logprobs_of: dict[str, TokenLogprobs | None] = {}
        for row in self._steps.finish(launched):
            t = self._tracked.get(row.request_id)
            if isinstance(row.token, Exception):
                if t is not None and t.output is None:
                    self._fail_one(t, row.token)
            else:
                sampled[row.request_id] = row.token
                logprobs_of[row.request_id] = row.logprobs
        took = self.scheduler.fill(launched.output, sampled, launched.requeued)
        assert launched.sampled_at is not None  # finish() stamps it
        for req in took:
            t, rid = self._tracked[req.request_id], req.request_id
            try:
                self._take_token(t, sampled[rid], launched.sampled_at, logprobs_of[rid])
            except Exception as exc:  # e.g. its detokenizer: the fault is this row's alone
                self._fail_one(t, exc)

    def _take_token(
        self, t: _Tracked, token: int, now: float, logprobs: TokenLogprobs | None
    ) -> None:
        """Detokenize a request's new token and hand its update to its front door."""
        t.t_first_token = t.t_first_token or now
        t.t_last_token = now
        if logprobs is not None:
            t.logprobs.append(logprobs)
        new = (token,)
        if t.jumps and not t.request.is_finished:
            new = self._jump_forward(t) or new
        text = t.detok.push(new)
        if t.request.is_finished:
            text += t.detok.finish()
            self._finish(t, str(t.request.finish_reason))
        self._emit(t, new, text, () if logprobs is None else (logprobs,))

    def _jump_forward(self, t: _Tracked) -> tuple[int, ...] | None:
        """Jump-forward (`radixkv.engine.jump_forward`) after a request's sampled token, if the
        text before that token was forced: the rest of the forced text is appended,
        re-tokenized with that token, and its next row computes it as one extend. Returns its
        new tokens from the sampled one's place on (that token, or what replaced it, first),
        None without a jump.

        NOTE: both step modes jump at the same tokens, so that their outputs agree. Overlapped,
        a request's next step is launched before its token is read, so whenever text is forced
        after its known tokens it is held (`Scheduler.hold`): its next token is then read
        before anything later is computed, and the jump after it can be taken."""
        req, grammar = t.request, t.grammar
        assert grammar is not None
        out = req.output_token_ids
        new = None
        if not req.num_pending and grammar.jump_string(out[:-1]):
            new = self._jump(t)
        known = len(out) - req.num_pending
        if not req.is_finished and grammar.jump_string(out[:known]):
            self.scheduler.hold(req.request_id)
        return new

    def _jump(self, t: _Tracked) -> tuple[int, ...] | None:
        """Splice the jump after a request's last token (all its tokens known) into the
        request and its matcher; its new tokens from that token's place on, or None."""
        req, grammar = t.request, t.grammar
        assert grammar is not None
        jump = plan_jump(self.tokenizer, grammar, req.output_token_ids, req.stop_token_ids)
        if jump is None:
            return None
        sampled_at = len(req.output_token_ids) - 1
        self.scheduler.jump(req.request_id, jump.num_kept, jump.token_ids)
        grammar.rewind(jump.num_kept)
        grammar.catch_up(req.output_token_ids)  # the forced text's tokens: allowed
        return tuple(req.output_token_ids[sampled_at:])

    def _fail_one(self, t: _Tracked, exc: Exception) -> None:
        """Fail one request of a step whose other rows go on: its blocks and lock come back."""
        logger.error("request %s failed in a step: %r", t.request.request_id, exc)
        self._fail_requests([t.request.request_id], exc)

    @sigint_deferred()
    def save_kv_cache(self) -> None:
        """Write every cached full block to the disk tier, so that an engine started later over
        the same `kv_cache_dir` finds it (the host and device tiers end with the process). Nothing
        to do without a disk tier. Not during a step."""
        assert not self._stepping, "save_kv_cache() inside a step"
        hybrid = self.scheduler.cache if isinstance(self.scheduler, HybridScheduler) else None
        (hybrid or self.cache).persist()
        moves = self.cache.take_moves()
        if moves:
            self._run_moves(moves)
        window_moves = [] if hybrid is None else hybrid.take_window_moves()
        if window_moves:
            self._run_moves(window_moves, window=True)
        for tier_io in (self.tier_io, self.window_tier_io):
            if tier_io is not None:
                tier_io.log_saved()

    def _run_moves(self, moves: Sequence[Move], *, window: bool = False) -> Poisoned:
        """Run tier moves in order (`window`: the window layers' group's); the cache forgets the
        host copies a failed move left holding garbage, whatever happens. Returns the blocks
        that failed."""
        tier_io = self.window_tier_io if window else self.tier_io
        assert tier_io is not None, "the cache plans moves only with a host tier"
        try:
            poisoned = tier_io.run(moves)
        finally:
            garbage = sorted(tier_io.poisoned_so_far.host)
            if window:
                self.scheduler.cache.forget_window_host_blocks(garbage)  # type: ignore[attr-defined]
            else:
                self.cache.forget_host_blocks(garbage)
        tier_io.order_before_compute()
        return poisoned

    def _run_step_moves(self, out: SchedulerOutput) -> set[str]:
        """The step's tier moves, before its copies and forward. A move that fails leaves blocks
        holding garbage: the cache forgets the host copies among them, and a request whose row
        reads one of the device blocks goes back to the waiting queue, to be admitted from what
        the cache holds then (a block file that could not be read is a miss, not an error: the
        disk tier does not offer it again); a second failed copy fails it. Their rows still run,
        and are ignored. Returns their ids."""
        poisoned = self._run_moves(out.moves) if out.moves else Poisoned()
        window = self._run_moves(out.window_moves, window=True) if out.window_moves else Poisoned()
        if poisoned.device or window.device:

            def reading(bad: set[int], wbad: set[int]) -> list[str]:
                return [
                    r.request_id
                    for r in out.rows
                    if bad.intersection(r.block_table) or wbad.intersection(r.window_block_table)
                ]

            hit = reading(poisoned.device, window.device)
            struck = reading(poisoned.faulty, window.faulty)
            failed = [rid for rid in struck if self._tracked[rid].failed_load]
            for rid in struck:
                self._tracked[rid].failed_load = True
            for rid in hit:
                if rid not in failed:
                    self.scheduler.requeue(rid)
            logger.warning("loading cached KV failed: requeued %s, failing %s", hit, failed)
            self._fail_requests(failed, RuntimeError("loading cached KV into the device failed"))
            return set(hit)
        return set()

    def _fail(self, step_ids: list[str], exc: BaseException) -> None:
        """Fail the requests of a faulty step: every live one when it failed before its rows were
        known, since then nothing tells which requests it touched."""
        self.scheduler.fail_step()
        self._fail_requests(step_ids or list(self._tracked), exc)

    def _fail_requests(self, request_ids: Sequence[str], exc: BaseException) -> None:
        for rid in request_ids:
            t = self._tracked.get(rid)
            if t is not None and t.output is None:
                self.scheduler.abort(rid)  # False where it finished or fail_step() failed it
                t.error = exc
                self._finish(t, "error")
                self._emit(t, (), "")

    def _finish(self, t: _Tracked, finish_reason: str) -> None:
        """Record a request's output; its final update is emitted by the caller."""
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
            num_matched_tokens=max(req.num_matched_tokens, req.num_cached_tokens),
        )
        rid, prompt_ids = req.request_id, tuple(req.prompt_token_ids)
        logprobs = None if t.params.logprobs is None else tuple(t.logprobs)
        t.output = RequestOutput(
            rid, prompt_ids, out_ids, t.detok.emitted, finish_reason, stats, logprobs
        )

    def _emit(
        self,
        t: _Tracked,
        new_token_ids: tuple[int, ...],
        new_text: str,
        new_logprobs: tuple[TokenLogprobs, ...] = (),
    ) -> None:
        if t.sink is not None:
            rid = t.request.request_id
            t.sink(RequestUpdate(rid, new_token_ids, new_text, t.output, t.error, new_logprobs))

    @sigint_deferred()
    def _discard(self, *request_ids: str) -> None:
        """Drop the requests' records, aborting those that have not finished (all of them: a
        Ctrl-C waits for the last)."""
        for rid in request_ids:
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

    def _deltas(self, pending: deque[RequestUpdate]) -> Iterator[StreamDelta]:
        """A stream's deltas: its request's updates, stepping the engine while none is pending."""
        while True:
            while not pending:
                assert self.scheduler.has_unfinished(), "a stream's request left unannounced"
                self._run_step()
            update = pending.popleft()
            if update.error is not None:
                raise update.error
            yield StreamDelta(
                update.new_text, update.new_token_ids, update.output, update.new_logprobs
            )
            if update.output is not None:
                return

    def _pack_one(self, prompt: str | Sequence[int]) -> list[PackedTokens]:
        packed = pack_prompts(prompt, self.encode, self.vocab_size, self.config.max_model_len)
        if len(packed) != 1:
            raise ValueError("one prompt expected; use generate() for several")
        return packed


def _event_feed(config: EngineConfig) -> KVEventFeed:
    """Where the cache's drained events go: a callable, or a publisher on an address."""
    assert config.kv_events is not None
    if not isinstance(config.kv_events, str):
        return KVEventFeed(config.kv_events)
    return KVEventFeed(
        config.kv_events,
        event_layout=config.kv_events_layout,
        topic=config.kv_events_topic,
        replay_endpoint=config.kv_events_replay,
        connect=config.kv_events_connect,
    )


def _derive_seed(engine_seed: int, index: int) -> int:
    """Seed of an unseeded sampled request: a fixed mix of the engine seed and submit order."""
    return (engine_seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (2**63)


def _eos_token_ids(model: Any, tokenizer: Any | None) -> tuple[int, ...]:
    """The EOS ids of the model's generation config, then the tokenizer's, without repeats."""
    ids: list[int] = []
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for eos in (config_eos, getattr(tokenizer, "eos_token_id", None)):
        if eos is not None:
            ids += list(eos) if isinstance(eos, Sequence) else [eos]
    return tuple(dict.fromkeys(int(t) for t in ids))


def _max_model_len(cfg: Any) -> int:
    # The positions the model was trained for; a sliding window limits what a layer sees, not
    # the context (GPT-2's n_positions answers to this name too).
    return int(getattr(cfg, "max_position_embeddings", None) or 8192)


def _set_cpu_threads(num_threads: int | None) -> None:
    if num_threads is None:
        num_threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) // 2))
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)

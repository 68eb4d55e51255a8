"""The engine's door: `LLM` checks what users pass, keeps a record of each request (`records`)
and runs the one step loop over the parts `assembly` builds from the model (model runner, tier
movers, grouped KV cache, scheduler, KV event feed).

One step loop, three front doors:

    add_request / step / abort_request   (the server: one thread drives step())
    generate(prompts)                    steps until its requests finish
    stream(prompt)                       steps whenever its consumer wants more
        │
        ▼
    step: schedule() ─► tier moves ─► launch (forward, draw) ─► finish (read tokens) ─► fill
          ─► detokenize (`radixkv.engine.step.launch`; with `async_scheduling`, the next step is
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
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from radixkv.cache import PackedTokens
from radixkv.engine.assembly import assemble
from radixkv.engine.config import EngineConfig
from radixkv.engine.interrupts import sigint_deferred
from radixkv.engine.model.model_loader import Progress, eos_token_ids, load_model, model_max_len
from radixkv.engine.model.prompts import (
    PromptInput,
    expand_choices,
    pack_prompts,
    params_list,
)
from radixkv.engine.model.text import ModelText
from radixkv.engine.outputs import DeltaStream, RequestOutput, StreamDelta, TokenLogprobs
from radixkv.engine.records import Record, RequestUpdate, derive_seed
from radixkv.engine.sampling.grammar import GrammarCompiler, RequestGrammar
from radixkv.engine.sampling.jump_forward import jump_after_token
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.step.launch import Launched, SampledRow, Steps, sources
from radixkv.engine.tiers.tier_moves import MoveFailure, run_planned_moves, run_step_moves
from radixkv.scheduler import Request
from radixkv.scheduler.output import SchedulerOutput

__all__ = ["LLM", "RequestUpdate"]  # RequestUpdate: where the server has always imported it

logger = logging.getLogger(__name__)


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
        model_len = model_max_len(self.model)
        max_len = min(config.max_model_len or model_len, model_len)
        device_type = next(self.model.parameters()).device.type
        self.config = replace(config, max_model_len=max_len)
        parse = config.parse_special_tokens_in_content
        self.text = ModelText(self.tokenizer, self.model_name, parse)
        if device_type == "cpu":
            _set_cpu_threads(config.num_threads)
        parts = assemble(self.model, self.config)
        self.runner, self.tier_ios, self.cache = parts.runner, parts.tier_ios, parts.cache
        self.scheduler, self.kv_events = parts.scheduler, parts.kv_events
        overlap = config.async_scheduling
        self._overlap = self.runner.device.type == "cuda" if overlap is None else overlap
        self._steps = Steps(self.runner)
        self._in_flight: Launched | None = None  # overlapped: the step launched, not finished
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)
        self._num_submitted = 0
        self._tracked: dict[str, Record] = {}
        self._outbox: list[RequestUpdate] = []  # updates of add_request's requests, not yet taken
        self._stepping = False
        self._orphans: list[str] = []  # streams dropped during a step, released after it
        self._grammars: GrammarCompiler | None = None  # made on the first structured request

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
        t.finish("abort")
        t.emit((), "")
        return True

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running, or an update waits for `step()`."""
        return self.scheduler.has_unfinished() or bool(self._outbox)

    @property
    def num_waiting_requests(self) -> int:
        return self.scheduler.num_waiting

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
        """Tokenize like generate() does for a string prompt (`ModelText.encode`)."""
        return self.text.encode(text)

    @property
    def has_chat_template(self) -> bool:
        """Whether the model has a tokenizer with a chat template (what `encode_chat` needs)."""
        return self.text.has_chat_template

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt of a chat through the tokenizer's chat template (`ModelText.encode_chat`,
        which says what it raises)."""
        return self.text.encode_chat(messages, tools)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.text.decode(token_ids)

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
                seed = derive_seed(self.config.seed, index) if p.seed is None else p.seed
                stop = p.stop_tokens(self.eos_token_ids)
                request = Request(rid, tokens, p.max_tokens, stop, cache_salt=cache_salt)
                self.scheduler.add_request(request)
                added.append(rid)
                matcher = None if grammar is None else RequestGrammar(grammar, stop)
                t = Record.open(
                    request,
                    p,
                    seed=seed,
                    tokenizer=self.tokenizer if self.config.detokenize else None,
                    sink=sink,
                    grammar=matcher,
                    jumps=self._jumps(p),
                    vocab_size=self.vocab_size,
                    device=self.runner.device,
                )
                if t.jumps and matcher.jump_string(()):  # see `jump_after_token`
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
        moved = run_step_moves(out, self.tier_ios, self.cache) if out.has_moves else None
        requeued = self._recover(moved)
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
        self, t: Record, token: int, now: float, logprobs: TokenLogprobs | None
    ) -> None:
        """Detokenize a request's new token (and those jump-forward appends after it) and hand
        its update to its front door."""
        t.took(now, logprobs)
        new = (token,)
        if t.jumps and not t.request.is_finished:
            assert t.grammar is not None
            new = jump_after_token(t.request, t.grammar, self.tokenizer, self.scheduler) or new
        text = t.detok.push(new)
        if t.request.is_finished:
            text += t.detok.finish()
            t.finish(str(t.request.finish_reason))
        t.emit(new, text, () if logprobs is None else (logprobs,))

    def _fail_one(self, t: Record, exc: Exception) -> None:
        """Fail one request of a step whose other rows go on: its blocks and lock come back."""
        logger.error("request %s failed in a step: %r", t.request.request_id, exc)
        self._fail_requests([t.request.request_id], exc)

    @sigint_deferred()
    def save_kv_cache(self) -> None:
        """Write every cached full block (and a hybrid model's recurrent-state snapshots) to the
        disk tier, so that an engine started later over the same `kv_cache_dir` finds it (the
        host and device tiers end with the process). Nothing to do without a disk tier. Not
        during a step."""
        assert not self._stepping, "save_kv_cache() inside a step"
        if self._in_flight is None:
            # The snapshot copies planned since the last step (a leaving request's, with compact
            # snapshots) run first, so the snapshots they fill are written down too; the second
            # call says they ran. (An overlapped step in flight may still fail: its copies'
            # snapshots stay unsettled, and persist passes over them.)
            self.runner.run_copies_now(self.cache.take_copies())
            self.cache.take_copies()
        self.cache.persist()
        run_planned_moves(self.tier_ios, self.cache)
        for tier_io in self.tier_ios:
            if tier_io is not None:
                tier_io.log_saved()

    def _recover(self, failure: MoveFailure | None) -> set[str]:
        """After a step's moves: the requests whose rows read garbage go back to the waiting
        queue (`radixkv.engine.tiers.tier_moves`), one struck by a fault a second time fails.
        Returns the requests sent back or failed, whose rows are ignored."""
        if failure is None:
            return set()
        failed = [rid for rid in failure.struck if self._tracked[rid].failed_load]
        for rid in failure.struck:
            self._tracked[rid].failed_load = True
        for rid in failure.reading:
            if rid not in failed:
                self.scheduler.requeue(rid)
        logger.warning("loading cached KV failed: requeued %s, failing %s", failure.reading, failed)
        self._fail_requests(failed, RuntimeError("loading cached KV into the device failed"))
        return set(failure.reading)

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
                t.finish("error")
                t.emit((), "")

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


def _set_cpu_threads(num_threads: int | None) -> None:
    if num_threads is None:
        num_threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) // 2))
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)

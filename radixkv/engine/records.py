"""The engine's record of each request, from submit until its front door took the output.

A `Record` holds what the scheduler's `Request` does not: the sampling params and random stream,
the detokenizer, the grammar and its jump-forward switch, the prompt mask of a repetition
penalty, the timestamps the stats come from, and where its updates go (`sink`: the server's
outbox or a stream's queue; `generate` reads the record itself). `finish` makes its
`RequestOutput`, `emit` hands a `RequestUpdate` to its sink.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from radixkv.engine.model.detokenizer import IncrementalDetokenizer
from radixkv.engine.outputs import RequestOutput, RequestStats, TokenLogprobs
from radixkv.engine.sampling.grammar import RequestGrammar
from radixkv.engine.sampling.penalties import prompt_token_mask
from radixkv.engine.sampling.sampler import make_generator
from radixkv.engine.sampling_params import SamplingParams
from radixkv.scheduler import Request


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
class Record:
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

    @classmethod
    def open(
        cls,
        request: Request,
        params: SamplingParams,
        *,
        seed: int,
        tokenizer: Any,
        sink: Callable[[RequestUpdate], None] | None,
        grammar: RequestGrammar | None,
        jumps: bool,
        vocab_size: int,
        device: torch.device,
    ) -> Record:
        """The record of a request just queued: `grammar` its matcher (None: no grammar),
        `jumps` whether it jumps forward over the text the grammar forces."""
        generator = None if params.greedy else make_generator(seed)
        detok = IncrementalDetokenizer(tokenizer)
        record = cls(request, params, generator, detok, time.perf_counter(), sink)
        record.grammar, record.jumps = grammar, grammar is not None and jumps
        if params.repetition_penalty != 1.0:
            record.prompt_mask = prompt_token_mask(request.packed_tokens, vocab_size, device)
        return record

    def took(self, now: float, logprobs: TokenLogprobs | None) -> None:
        """A token was sampled for it at `now` (perf_counter), with its logprobs if asked."""
        self.t_first_token = self.t_first_token or now
        self.t_last_token = now
        if logprobs is not None:
            self.logprobs.append(logprobs)

    def finish(self, finish_reason: str) -> None:
        """Make its output; its final update is emitted by the caller."""
        req = self.request
        out_ids = tuple(req.output_token_ids)
        now = time.perf_counter()
        t_first = self.t_first_token or now
        decode_s = (self.t_last_token or now) - t_first
        stats = RequestStats(
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=len(out_ids),
            ttft_s=t_first - self.t_submit,
            decode_tokens_per_s=(len(out_ids) - 1) / decode_s if decode_s > 0 else 0.0,
            total_s=now - self.t_submit,
            num_matched_tokens=max(req.num_matched_tokens, req.num_cached_tokens),
        )
        rid, prompt_ids = req.request_id, tuple(req.prompt_token_ids)
        logprobs = None if self.params.logprobs is None else tuple(self.logprobs)
        self.output = RequestOutput(
            rid, prompt_ids, out_ids, self.detok.emitted, finish_reason, stats, logprobs
        )

    def emit(
        self,
        new_token_ids: tuple[int, ...],
        new_text: str,
        new_logprobs: tuple[TokenLogprobs, ...] = (),
    ) -> None:
        """Hand its sink an update (nothing without one)."""
        if self.sink is not None:
            rid = self.request.request_id
            output, error = self.output, self.error
            self.sink(RequestUpdate(rid, new_token_ids, new_text, output, error, new_logprobs))


def derive_seed(engine_seed: int, index: int) -> int:
    """Seed of an unseeded sampled request: a fixed mix of the engine seed and submit order."""
    return (engine_seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (2**63)

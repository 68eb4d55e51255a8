"""One engine step, in two halves: `launch` puts a scheduled batch on the device, `finish` reads
what it sampled.

    launch: token feed ─► forward ─► grammar masks ─► min_tokens, bias, penalties ─► draw and
            logprobs
            ─► copies to the host
            (all queued on the device; nothing waits for it, but a grammar row's mask, which
            needs its request's last token: see `_masked`)
    finish: wait for the copies ─► per sampled row: its token, or the fault that is its own

A synchronous step is `finish(launch(...))`. Overlapped steps (`async_scheduling`, as vLLM's async
scheduling) keep one launched step in flight and finish it after launching the next, so that the
host schedules and packs step n+1 while the device runs step n:

* The scheduler records a launched step's rows as written and appends a placeholder per sampled
  row (`Scheduler.record_launched`), so the next `schedule()` computes it like any last sampled
  token; `Scheduler.fill` brings the real tokens when the step is finished. A synchronous step
  goes through the same two calls, back to back.
* The next step's decode rows take the previous step's tokens on the device (`TokenFeed`: the
  runner writes them over the placeholders in its `input_ids`; the indices travel through pinned
  memory), and penalties (and min_tokens) count a request's last token there too.
* A row whose draw fails (probabilities that are not finite, a fault in the sampler's shared work
  that only its params trigger) fails its request alone. Overlapped, that is known one step
  late: the request's placeholder, already computed by the next step, is dropped as after a stop.
* A request sent back to the queue because a tier load it reads failed (`requeued`) takes no
  token from the step it was in: its token is neither fed to the next step nor filled in.

Each request's tokens, and each seeded request's random numbers, are the same in both modes:
only when the engine learns them moves. On a CPU the forward runs on the calling thread, so
nothing overlaps; there the overlap only costs its bookkeeping.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixkv.engine.outputs import TokenLogprobs
from radixkv.engine.sampling.grammar import RequestGrammar, mask_rows
from radixkv.engine.sampling.logprobs import StepLogprobs, logprobs_on_device
from radixkv.engine.sampling.penalties import RowTokens, adjust_logits
from radixkv.engine.sampling.sampler import Draw, draw, host_values_on
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.step.cuda_graphs import TokenFeed
from radixkv.engine.step.model_runner import ModelRunner
from radixkv.engine.step.step_inputs import InputStager
from radixkv.scheduler import Request
from radixkv.scheduler.output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class SampledRow:
    """What the step needs of a row whose token it samples: its request (the tokens generated
    so far, for penalties), its sampling params and its random stream (None when greedy)."""

    request: Request
    params: SamplingParams
    generator: random.Random | None
    grammar: RequestGrammar | None = None  # its structured-output matcher, if any
    # [vocab] bool, its prompt's tokens (`prompt_token_mask`): with a repetition penalty only
    prompt_mask: torch.Tensor | None = None


@dataclass(slots=True)
class Launched:
    """A launched step whose tokens are not read yet."""

    output: SchedulerOutput
    sample_ids: list[str]  # request ids of its sampled rows, in row order
    params: list[SamplingParams]  # theirs, in the same order
    draw: Draw  # tokens and usable flags on the device, and the rows whose draw raised
    host: torch.Tensor  # tokens then usable flags, on the host (pinned on CUDA) once `ready`
    logprobs: StepLogprobs | None  # of the rows that asked, on the host once `ready` fired
    ready: torch.cuda.Event | None  # None on the CPU: everything is computed already
    requeued: set[str]  # requests whose rows are ignored: a load they read failed
    # When the host first saw the tokens sampled (perf_counter): their requests' token time.
    sampled_at: float | None = None

    def poll(self) -> None:
        """Stamp `sampled_at` if the device is done with this step (never waits)."""
        if self.sampled_at is None and (self.ready is None or self.ready.query()):
            self.sampled_at = time.perf_counter()

    def read(self) -> list[int]:
        """The sampled tokens (a failed row's is a placeholder), then the rows' usable flags,
        waiting for the device."""
        if self.ready is not None:
            self.ready.synchronize()
        self.poll()
        return self.host.tolist()


@dataclass(frozen=True, slots=True)
class RowOutcome:
    """One sampled row of a finished step: its token, or the exception that failed the row."""

    request_id: str
    token: int | Exception
    logprobs: TokenLogprobs | None


class Steps:
    """Launches and finishes the engine's steps over one model runner (see the module
    docstring). Stateless between calls: the engine keeps the step in flight, if any."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._stager = InputStager(runner.device, capacity=1 << 10)  # the feed's indices

    def launch(
        self,
        out: SchedulerOutput,
        rows: Sequence[SampledRow],
        previous: Launched | None = None,
        requeued: set[str] | None = None,
    ) -> Launched:
        """Queue `out`'s forward and its sampled `rows`' draw on the device. `previous`: the step
        still in flight, whose tokens this step's placeholders take on the device."""
        logits = self.runner.execute(out, self._feed(out, previous))
        params = [r.params for r in rows]
        masked, grammar_faults = _masked(logits, rows, previous)
        adjusted = _adjusted(masked, rows, previous)
        drawn = draw(adjusted, params, [r.generator for r in rows])
        drawn.faults.update(grammar_faults)  # a row its grammar failed fails its request alone
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs = None
        if asked:
            chosen = drawn.tokens[host_values_on(drawn.tokens.device, asked, torch.int64)]
            logprobs = logprobs_on_device(logits, params, asked, chosen).to_host()
        packed = drawn.packed()
        sample_ids = [r.request.request_id for r in rows]
        launched = Launched(
            out, sample_ids, params, drawn, packed, logprobs, None, requeued or set()
        )
        if packed.device.type == "cuda":
            launched.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            launched.host.copy_(packed, non_blocking=True)
            launched.ready = torch.cuda.Event()
            launched.ready.record()
        else:
            launched.poll()  # computed already: sampled now
        return launched

    def finish(self, launched: Launched) -> list[RowOutcome]:
        """Wait for a launched step's tokens; per sampled row, its token or its fault, and its
        logprobs (None where not asked for)."""
        read = launched.read()
        tokens = launched.draw.results(read)
        logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
        if launched.logprobs is not None:
            logprobs = launched.logprobs.read(launched.params, read[: len(tokens)])
        return [
            RowOutcome(rid, token, lp)
            for rid, token, lp in zip(launched.sample_ids, tokens, logprobs, strict=True)
        ]

    def _feed(self, out: SchedulerOutput, previous: Launched | None) -> TokenFeed | None:
        """Where this step's placeholders are: the last token of each sampled row of a request
        that the previous step sampled (a request with a placeholder is scheduled only to
        compute it). None when there is none."""
        source = sources(previous)
        if not source:
            return None
        assert previous is not None
        dst: list[int] = []
        src: list[int] = []
        end = 0  # tokens packed so far
        for row in out.rows:
            end += len(row.token_ids)
            i = source.get(row.request_id)
            if i is not None and row.sample:
                dst.append(end - 1)
                src.append(i)
        if not dst:
            return None
        return token_feed(self._stager, dst, src, previous.draw.tokens)


def sources(launched: Launched | None) -> dict[str, int]:
    """Request id -> index of its token among a launched step's sampled tokens, for the
    requests that wait for that token (not those sent back to the queue)."""
    if launched is None:
        return {}
    ids = launched.sample_ids
    return {rid: i for i, rid in enumerate(ids) if rid not in launched.requeued}


def _known_output(req: Request, source: dict[str, int]) -> tuple[list[int], int | None]:
    """A row's request's generated tokens known on the host, and, when its last one is still a
    placeholder, that token's index among the step in flight's (`source`: `sources(previous)`)."""
    assert req.num_pending <= 1, req
    known = req.output_token_ids[: len(req.output_token_ids) - req.num_pending]
    i = source.get(req.request_id) if req.num_pending else None
    assert (i is None) == (not req.num_pending), (req, "a placeholder of no step in flight")
    return known, i


def _masked(
    logits: torch.Tensor, rows: Sequence[SampledRow], previous: Launched | None
) -> tuple[torch.Tensor, dict[int, Exception]]:
    """The logits with the grammar rows' masks applied, and the rows their grammar failed.
    NOTE: a mask needs the request's last token, which may be the step in flight's: a step
    holding such a row waits for that step's tokens (the simplest correct choice; this step's
    forward is queued already, only its draw waits)."""
    if not any(r.grammar is not None for r in rows):
        return logits, {}
    source = sources(previous)
    waiting = [r for r in rows if r.grammar is not None and r.request.num_pending]
    in_flight = previous.read() if previous is not None and waiting else []
    outputs: list[list[int] | None] = []
    for r in rows:
        known, i = _known_output(r.request, source)
        last = [] if i is None else [in_flight[i]]
        outputs.append(None if r.grammar is None else [*known, *last])
    return mask_rows(logits, [r.grammar for r in rows], outputs)


def _adjusted(
    logits: torch.Tensor, rows: Sequence[SampledRow], previous: Launched | None
) -> torch.Tensor:
    """The logits with the rows' bias, penalties and min_tokens applied: a request's last token
    may still be the previous step's, on the device (its placeholder is not filled yet)."""
    params = [r.params for r in rows]
    # len(output_token_ids) counts a placeholder: the tokens generated, read or not.
    if not any(r.params.adjusts_logits_at(len(r.request.output_token_ids)) for r in rows):
        return logits
    source = sources(previous)
    tokens: list[RowTokens] = []
    for r in rows:
        known, i = _known_output(r.request, source)
        in_flight = None if i is None else previous.draw.tokens[i : i + 1]  # type: ignore[union-attr]
        stops = r.request.stop_token_ids
        tokens.append(RowTokens(known, in_flight, r.prompt_mask, stops))
    return adjust_logits(logits, params, tokens)


def token_feed(
    stager: InputStager, dst: Sequence[int], src: Sequence[int], tokens: torch.Tensor
) -> TokenFeed:
    """`input_ids[dst[i]] = tokens[src[i]]` on the device, with no synchronization."""
    n = len(dst)
    host = stager.host(2 * n)
    host.numpy()[:n] = dst
    host.numpy()[n:] = src
    index = stager.to_device(host).long()

    def feed(input_ids: torch.Tensor) -> None:
        input_ids[index[:n]] = tokens[index[n:]].to(input_ids.dtype)

    return feed

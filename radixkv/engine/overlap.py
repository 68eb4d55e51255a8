"""Overlapped steps: the host schedules and packs step n+1 while the device runs step n.

In a plain step the host waits for the sampled tokens (`.tolist()`), then updates the scheduler,
schedules and packs the next step, and only then launches it: the device idles for all of that.
Here, as in vLLM's async scheduling, one step stays in flight and its tokens are read one step
late:

    schedule(n+1) ─► launch(n+1) ─► advance(n+1) ─► read tokens of n ─► fill(n) ─► deliver n
                     (queued behind n on the device; its decode rows take n's tokens there)

* `Scheduler.advance` records a launched step's rows as written and appends a placeholder per
  sampled row, so the next `schedule()` computes it like any last sampled token.
* The runner's `TokenFeed` writes the previous step's sampled tokens, still on the device, over
  those placeholders in the step's `input_ids` (the indices travel through pinned memory).
* A step's tier moves run before it is launched, step n still in flight (on CUDA the copies
  wait for the work queued before them, the forward for the copies). A request sent back to the
  queue because a load it reads failed takes no token from the step it was in: that token is
  neither fed to its next step nor filled in.
* Penalties count a request's last token while it is still on the device; logprobs are copied
  to the host behind the tokens and read with them.
* A grammar row's mask needs its request's last token: a step holding one reads the tokens of
  the step in flight after queuing its own forward and before masking (`_masked`), so only its
  sampling waits for the step before. A row the grammar fails is reported in `take_faults()`.
* `Scheduler.fill` brings the real tokens. A request that stopped (EOS, a stop token) had one
  more row computed in the step already launched: that row's token is dropped and its KV is not
  inserted. A request whose placeholder is its `max_tokens`-th token is not scheduled again.

Each request's tokens, and each seeded request's random numbers, are the same as without the
overlap: only when the engine learns them moves. On a CPU the forward runs on the calling thread,
so nothing overlaps; there the overlap only costs its bookkeeping (see `EngineConfig`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from radixkv.engine.cuda_graphs import TokenFeed
from radixkv.engine.grammar import RequestGrammar, mask_rows
from radixkv.engine.logprobs import StepLogprobs, logprobs_on_device
from radixkv.engine.model_runner import ModelRunner
from radixkv.engine.outputs import TokenLogprobs
from radixkv.engine.penalties import adjust_logits
from radixkv.engine.sampler import host_values_on, sample_on_device
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.step_inputs import InputStager
from radixkv.scheduler import Request, Scheduler
from radixkv.scheduler.output import SchedulerOutput

# request id -> (its sampling params, its random stream, its grammar); the engine's records.
SamplingOf = Callable[[str], tuple[SamplingParams, random.Random | None, RequestGrammar | None]]
# Runs a step's tier moves before its forward; returns the requests sent back to the waiting
# queue because a load into their blocks failed (their rows run, and are ignored).
RunMoves = Callable[[SchedulerOutput], set[str]]


@dataclass(slots=True)
class _InFlight:
    """A launched step whose tokens are not read yet."""

    output: SchedulerOutput
    sample_ids: list[str]  # request ids of its sampled rows, in row order
    params: list[SamplingParams]  # theirs, in the same order
    tokens: torch.Tensor  # [len(sample_ids)] int64 on the device
    host: torch.Tensor  # their copy on the host (pinned on CUDA), valid once `ready` fired
    logprobs: StepLogprobs | None  # of the rows that asked, on the host once `ready` fired
    ready: torch.cuda.Event | None  # None on the CPU: everything is computed already
    requeued: set[str]  # requests whose rows are ignored: a load they read failed
    # When the host first saw the tokens sampled (perf_counter): their first tokens' time.
    sampled_at: float | None = None

    def poll(self) -> None:
        """Stamp `sampled_at` if the device is done with this step (never waits)."""
        if self.sampled_at is None and (self.ready is None or self.ready.query()):
            self.sampled_at = time.perf_counter()

    def tokens_now(self) -> list[int]:
        """The sampled tokens, waiting for the device if need be."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

    def read(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The sampled tokens and each row's logprobs (None where not asked for)."""
        if self.ready is not None:
            self.ready.synchronize()
        self.poll()
        tokens = self.host.tolist()
        if self.logprobs is None:
            return tokens, [None] * len(tokens)
        return tokens, self.logprobs.read(self.params, tokens)


class OverlappedSteps:
    """Runs the engine's steps with one step in flight (see the module docstring).

    Invariants between steps: at most one step is in flight; its sampled rows' requests, where
    still live, each hold exactly one placeholder for it (their last output token).
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self._stager = InputStager(runner.device, capacity=1 << 10)  # the feed's indices
        self._in_flight: _InFlight | None = None
        self._faults: list[tuple[str, Exception]] = []  # rows a grammar failed, not yet taken

    def step(
        self, step_ids: list[str], sampling_of: SamplingOf, run_moves: RunMoves
    ) -> tuple[float, list[tuple[Request, int, TokenLogprobs | None]]]:
        """Launch the next step (if any), then read the previous one's tokens into the scheduler.
        Returns when those tokens were sampled (as near as the host can tell: before this step's
        launch if the device was done by then), the requests that took a token, their tokens and
        logprobs. `step_ids` gets the
        ids of every request a fault now would concern: the previous step's and this one's. On a
        fault the step in flight is dropped (the engine fails its requests)."""
        try:
            return self._step(step_ids, sampling_of, run_moves)
        except BaseException:
            self._in_flight = None
            self._faults.clear()
            raise

    def take_faults(self) -> list[tuple[str, Exception]]:
        """The requests whose rows in the launched step failed their grammar (the engine fails
        them; their tokens are garbage), since the last call."""
        faults, self._faults = self._faults, []
        return faults

    def check_integrity(self) -> None:
        """The live requests with placeholders are exactly the in-flight step's sampled ones
        (less those it requeued), one placeholder each."""
        live = self.scheduler.running_requests + self.scheduler.waiting_requests
        pending = {r.request_id: r.num_pending for r in live if r.num_pending}
        sampled = set(_sources(self._in_flight))
        assert pending == {r.request_id: 1 for r in live if r.request_id in sampled}, pending

    def _step(
        self, step_ids: list[str], sampling_of: SamplingOf, run_moves: RunMoves
    ) -> tuple[float, list[tuple[Request, int, TokenLogprobs | None]]]:
        out = self.scheduler.schedule()
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            previous.poll()  # on the CPU, or a device already done: sampled before this launch
        if previous is not None:
            step_ids.extend(row.request_id for row in previous.output.rows)
        step_ids.extend(row.request_id for row in out.rows)
        if out.is_empty and previous is None:
            raise RuntimeError(
                f"scheduler scheduled nothing with {self.scheduler.num_waiting} requests waiting"
            )
        # Even with no rows: the moves the cache planned since the last step must run.
        requeued = run_moves(out) if out.transfers else set()
        if not out.is_empty:
            self._in_flight = self._launch(out, previous, sampling_of, requeued)
        if previous is None:
            return time.perf_counter(), []
        tokens, logprobs = previous.read()
        by_id = dict(zip(previous.sample_ids, tokens, strict=True))
        logprobs_of = dict(zip(previous.sample_ids, logprobs, strict=True))
        took = self.scheduler.fill(previous.output, by_id, previous.requeued)
        assert previous.sampled_at is not None  # read() stamps it
        tokens_of = [(req, by_id[req.request_id], logprobs_of[req.request_id]) for req in took]
        return previous.sampled_at, tokens_of

    def _launch(
        self,
        out: SchedulerOutput,
        previous: _InFlight | None,
        sampling_of: SamplingOf,
        requeued: set[str],
    ) -> _InFlight:
        logits = self.runner.execute(out, self._feed(out, previous))
        sample_ids = [row.request_id for row in out.rows if row.sample]
        sampling = [sampling_of(rid) for rid in sample_ids]
        params = [p for p, _, _ in sampling]
        masked = self._masked(logits, sample_ids, [g for _, _, g in sampling], previous)
        adjusted = self._adjusted(masked, sample_ids, params, previous)
        tokens = sample_on_device(adjusted, params, [gen for _, gen, _ in sampling])
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs = None
        if rows:
            chosen = tokens[host_values_on(tokens.device, rows, torch.int64)]
            logprobs = logprobs_on_device(logits, params, rows, chosen).to_host()
        self.scheduler.advance(out)
        if tokens.device.type != "cuda":  # computed already: sampled now
            now = time.perf_counter()
            return _InFlight(out, sample_ids, params, tokens, tokens, logprobs, None, requeued, now)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _InFlight(out, sample_ids, params, tokens, host, logprobs, ready, requeued)

    def _masked(
        self,
        logits: torch.Tensor,
        sample_ids: list[str],
        grammars: list[RequestGrammar | None],
        previous: _InFlight | None,
    ) -> torch.Tensor:
        """The logits with the grammar rows' masks applied. NOTE: a mask needs the request's
        last token, which may be the step in flight's: this waits for that step's tokens (the
        simplest correct choice; this step's forward is queued already)."""
        if not any(grammars):
            return logits
        source = _sources(previous)
        in_flight: list[int] = []
        if previous is not None and any(rid in source for rid in sample_ids):
            in_flight = previous.tokens_now()
        outputs: list[list[int] | None] = []
        for rid, grammar in zip(sample_ids, grammars, strict=True):
            req = self.scheduler.get_request(rid)
            assert req is not None, rid
            known = req.output_token_ids[: len(req.output_token_ids) - req.num_pending]
            i = source.get(rid) if req.num_pending else None
            last = [] if i is None else [in_flight[i]]
            outputs.append(None if grammar is None else [*known, *last])
        masked, faults = mask_rows(logits, grammars, outputs)
        self._faults += [(sample_ids[i], exc) for i, exc in faults.items()]
        return masked

    def _adjusted(
        self,
        logits: torch.Tensor,
        sample_ids: list[str],
        params: list[SamplingParams],
        previous: _InFlight | None,
    ) -> torch.Tensor:
        """The logits with the rows' bias and penalties applied: a request's last token may
        still be the previous step's, on the device (its placeholder is not filled yet)."""
        if not any(p.adjusts_logits for p in params):
            return logits
        source = _sources(previous)
        outputs: list[list[int]] = []
        in_flight: list[torch.Tensor | None] = []
        for rid in sample_ids:
            req = self.scheduler.get_request(rid)
            assert req is not None and req.num_pending <= 1, (rid, req)
            known = len(req.output_token_ids) - req.num_pending
            outputs.append(req.output_token_ids[:known])
            i = source.get(rid) if req.num_pending else None
            assert (i is None) == (not req.num_pending), (rid, "a placeholder of no step in flight")
            in_flight.append(None if i is None else previous.tokens[i : i + 1])  # type: ignore[union-attr]
        return adjust_logits(logits, params, outputs, in_flight)

    def _feed(self, out: SchedulerOutput, previous: _InFlight | None) -> TokenFeed | None:
        """Where this step's placeholders are: the last token of each sampled row of a request
        that the previous step sampled (a request with a placeholder is scheduled only to
        compute it). None when there is none."""
        if previous is None:
            return None
        source = _sources(previous)
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
        return token_feed(self._stager, dst, src, previous.tokens)


def _sources(previous: _InFlight | None) -> dict[str, int]:
    """Request id -> index of its token among the in-flight step's sampled tokens, for the
    requests that wait for that token (not those sent back to the queue)."""
    if previous is None:
        return {}
    ids = previous.sample_ids
    return {rid: i for i, rid in enumerate(ids) if rid not in previous.requeued}


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

"""Faults never wedge the engine: an exception anywhere in a step fails that step's requests, hands
the exception to their callers, returns every block and lock, and the next call works.

Each run injects one exception (KeyboardInterrupt and SystemExit included) at the n-th pass
through one point of the step: scheduling (before, inside, or after the scheduler's work), the
model forward (between two layers), the KV store, sampling, the scheduler's update (its cache
commit), detokenizing; while requests of all three front doors (step API, stream, generate) are in
flight on one long-lived engine. Afterwards the engine, scheduler and cache are consistent, nothing
is in use, and the engine's outputs equal a fresh engine's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from tiny_llama import random_prompts

import radixkv.engine.step.launch as step_module
from radixkv import LLM, RequestUpdate, SamplingParams, kernels
from radixkv.engine.model.detokenizer import IncrementalDetokenizer
from radixkv.engine.step.attention import PagedKVCache

ENGINE_ARGS = dict(block_size=4, num_blocks=96, max_num_seqs=3, chunked_prefill_size=8)
POINTS = (
    "schedule",
    "_allocate",  # the cache's allocation inside admit and grow, after admit locked its hit
    "scheduled",
    "forward",
    "kv-store",
    "sample",
    "commit",
    "detokenize",
)
PROMPTS = random_prompts(51, 6, shared_prefix=10, max_len=24)
PARAMS = [
    SamplingParams(max_tokens=6, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=5),
    SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=6, ignore_eos=True),
    SamplingParams(max_tokens=4, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=1.2, seed=7),
]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("gqa"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def expected(model_dir):
    outs = LLM(model_dir, **ENGINE_ARGS).generate(PROMPTS, PARAMS)
    return [o.token_ids for o in outs]


@contextmanager
def fault(llm: LLM, point: str, at: int, exc: BaseException) -> Iterator[list[bool]]:
    """Raise `exc` at the `at`-th pass through `point`; yields [fired]."""
    fired = [False]
    passes = iter(range(1, 10**9))

    def trip() -> None:
        if next(passes) == at:
            fired[0] = True
            raise exc

    def around(real: Callable, before: bool) -> Callable:
        def wrapper(*args, **kwargs):
            if before:
                trip()
            result = real(*args, **kwargs)
            if not before:
                trip()
            return result

        return wrapper

    with pytest.MonkeyPatch.context() as mp:
        hook = None
        if point in ("schedule", "scheduled"):
            mp.setattr(
                llm.scheduler, "schedule", around(llm.scheduler.schedule, point == "schedule")
            )
        elif point in ("_allocate", "commit"):  # the cache's, in schedule / record / fill
            mp.setattr(llm.cache.tree, point, around(getattr(llm.cache.tree, point), True))
        elif point == "forward":
            hook = llm.model.model.layers[1].register_forward_pre_hook(lambda *_: trip())
        elif point == "kv-store":  # the fused Llama layers' store, or the generic hook's
            mp.setattr(kernels, "rope_store_kv_step", around(kernels.rope_store_kv_step, True))
            mp.setattr(PagedKVCache, "update", around(PagedKVCache.update, True))
        elif point == "sample":  # the one draw of both step modes
            mp.setattr(step_module, "draw", around(step_module.draw, True))
        else:
            mp.setattr(IncrementalDetokenizer, "push", around(IncrementalDetokenizer.push, True))
        try:
            yield fired
        finally:
            if hook is not None:
                hook.remove()


def attempt(action: Callable[[], object], caught: list[BaseException]) -> object:
    try:
        return action()
    except (Exception, KeyboardInterrupt, SystemExit) as e:
        caught.append(e)
        return None


def drain(stream: Iterator, caught: list[BaseException]) -> list:
    deltas = []
    while (delta := attempt(lambda: next(stream, None), caught)) is not None:
        deltas.append(delta)
    return deltas


@pytest.fixture(scope="module")
def overlapped_llm(model_dir):
    return LLM(model_dir, async_scheduling=True, **ENGINE_ARGS)


@pytest.mark.parametrize("run", range(64))
def test_a_fault_anywhere_fails_only_its_step(llm, expected, run):
    fault_run(llm, expected, run)


@pytest.mark.parametrize("run", range(32))
def test_a_fault_fails_only_the_steps_in_flight_when_overlapped(overlapped_llm, expected, run):
    """With a step in flight, a fault fails the requests of both steps it concerns."""
    fault_run(overlapped_llm, expected, run)


def fault_run(llm: LLM, expected: list, run: int) -> None:
    rng = random.Random(run)
    point = POINTS[run % len(POINTS)]
    exc = rng.choice([RuntimeError(f"injected {run}"), KeyboardInterrupt(), SystemExit(3)])
    caught: list[BaseException] = []
    updates: list[RequestUpdate] = []
    with fault(llm, point, rng.randint(1, 4), exc) as fired:
        rid = llm.add_request(PROMPTS[0], PARAMS[0])
        stream = llm.stream(PROMPTS[1], PARAMS[1])
        first = attempt(lambda: next(stream), caught)
        updates += attempt(llm.step, caught) or []
        outs = attempt(lambda: llm.generate(PROMPTS[2:4], PARAMS[2:4]), caught)
        deltas = [first, *drain(stream, caught)] if first is not None else []
        while llm.has_unfinished_requests():
            updates += attempt(llm.step, caught) or []
            llm.check_integrity()
    assert fired[0], f"the fault at {point} never fired"
    assert all(e is exc for e in caught)

    # Each front door saw its request end exactly once, failed with this very exception or done.
    (final,) = [u for u in updates if u.output is not None]
    assert final.request_id == rid and updates[-1] is final
    assert (final.error is exc) == (final.output.finish_reason == "error")
    num_failed_doors = len(caught) + (final.error is exc)
    assert num_failed_doors >= 1
    if point == "detokenize" and isinstance(exc, Exception):
        assert num_failed_doors == 1  # one row's fault: its request alone failed
    if final.error is None:
        assert final.output.token_ids == expected[0]
    if deltas and deltas[-1].output is not None:
        assert deltas[-1].output.token_ids == expected[1]
    if outs is not None:
        assert [o.token_ids for o in outs] == expected[2:4]

    llm.check_integrity()
    assert llm.cache.stats().num_in_use_blocks == 0
    assert not llm.has_unfinished_requests() and not llm._tracked
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    llm.check_integrity()

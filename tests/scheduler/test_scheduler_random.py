"""Random request mixes through a small cache: every invariant after every step, outputs equal to
the request run alone, nothing leaked at the end."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.scheduler.request import Request

MakeHarness = Callable[..., Any]  # the `harness` fixture of conftest.py

tokens = st.lists(st.integers(1, 6), max_size=24)


@st.composite
def scenarios(draw: st.DrawFn, *, bursts: bool = False) -> dict[str, Any]:
    """A random mix. `bursts`: requests arrive within 3 steps, share prefixes of >= 4 tokens, the
    cache is on and deferral too, so in-batch deferral (`defer_shared_prefix_tokens`) happens
    often; in the general mix it seldom gets a second candidate in one step."""
    prefix_tokens = st.lists(st.integers(1, 6), min_size=4, max_size=24) if bursts else tokens
    prefixes = draw(st.lists(prefix_tokens, min_size=1, max_size=3))
    requests = draw(
        st.lists(
            st.fixed_dictionaries(
                {
                    "prefix": st.integers(0, len(prefixes) - 1),
                    "suffix": st.lists(st.integers(1, 6), min_size=1, max_size=12),
                    "max_tokens": st.integers(1, 24),
                    "arrival": st.integers(0, 2 if bursts else 8),
                    "abort": st.none() | st.integers(0, 30),
                    "abort_in_flight": st.booleans(),  # between schedule() and update
                    "stop": st.none() | st.integers(1, 999),
                }
            ),
            min_size=3 if bursts else 1,
            max_size=10,
        )
    )
    return {
        "cache": {
            "num_blocks": draw(st.integers(8 if bursts else 3, 40 if bursts else 24)),
            "block_size": draw(st.sampled_from([1, 2, 4, 16])),
        },
        "config": {
            "max_num_seqs": draw(st.integers(2 if bursts else 1, 5)),
            "max_num_batched_tokens": draw(st.integers(8, 64) if bursts else st.integers(1, 40)),
            "chunked_prefill_size": draw(st.integers(1, 24)),
            "policy": draw(st.sampled_from(["fcfs", "lpm"])),
            "enable_prefix_cache": True if bursts else draw(st.booleans()),
            "max_model_len": draw(st.integers(40 if bursts else 4, 64)),
            # Prompts here are at most 36 tokens: small thresholds, or deferral would never run.
            "defer_shared_prefix_tokens": draw(st.sampled_from([1, 2, 4, 8] if bursts else [0, 3])),
            "prefill_first": draw(st.booleans()),
        },
        "prefixes": prefixes,
        "requests": requests,
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_random_request_mixes(harness: MakeHarness, scenario: dict[str, Any]) -> None:
    run_scenario(harness, scenario)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(bursts=True))
def test_random_shared_prefix_bursts(harness: MakeHarness, scenario: dict[str, Any]) -> None:
    run_scenario(harness, scenario)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_random_request_mixes_overlapped(harness: MakeHarness, scenario: dict[str, Any]) -> None:
    """Tokens read one step late (placeholders, advance / fill): the same outputs, no leak."""
    run_scenario(harness, scenario, overlapped=True)


def run_scenario(harness: MakeHarness, scenario: dict[str, Any], overlapped: bool = False) -> None:
    h = harness(**scenario["cache"], **scenario["config"])
    step_fn = h.step_overlapped if overlapped else h.step
    sched, cache = h.scheduler, h.cache
    arrivals: dict[int, list[Request]] = {}
    aborts: dict[int, list[tuple[str, bool]]] = {}
    for i, spec in enumerate(scenario["requests"]):
        stop = () if spec["stop"] is None else (spec["stop"],)
        prompt = scenario["prefixes"][spec["prefix"]] + spec["suffix"]
        if len(prompt) >= h.max_model_len:
            continue  # the engine's door refuses it: no room for a generated token
        request = Request(f"r{i}", prompt, spec["max_tokens"], stop)
        arrivals.setdefault(spec["arrival"], []).append(request)
        if spec["abort"] is not None:
            aborts.setdefault(spec["abort"], []).append((f"r{i}", spec["abort_in_flight"]))

    added: list[Request] = []
    aborted: set[str] = set()
    step = 0
    while arrivals or sched.has_unfinished():
        assert step < 5_000, "no progress"
        for req in arrivals.pop(step, ()):
            max_kv = req.max_num_tokens(h.max_model_len) - 1
            too_big = -(-max_kv // cache.block_size) > cache.num_blocks
            try:
                sched.add_request(req)
            except ValueError:
                assert too_big, req
                continue
            assert not too_big, req
            added.append(req)
        now = aborts.pop(step, [])

        def abort(in_flight: bool, now: list[tuple[str, bool]] = now) -> None:
            for rid, when in now:
                if when == in_flight and sched.abort(rid):
                    aborted.add(rid)

        abort(in_flight=False)
        if sched.has_unfinished():
            step_fn(in_flight=lambda: abort(in_flight=True))
        else:
            abort(in_flight=True)
        step += 1

    for req in added:
        assert req.is_finished
        if req.request_id in aborted:
            assert req.finish_reason == "abort"
        else:
            assert h.finished[req.request_id] is req
            assert req.output_token_ids == h.reference(req), req
    h.assert_no_leak()

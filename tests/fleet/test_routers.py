"""Two replicas behind real routers: every request completes, the replicas' /metrics add up to
what the clients were told, and cache-aware routing beats round robin on the same workload."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import fleet
import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from benchmarks.fleet_bench import Result, Workload, run_policy

# An odd number of conversations: with an even one, round robin in lockstep would send each
# conversation to the same replica on every turn by accident. Replies of 24 tokens keep the
# requests in flight long enough for chat's closed loop (a client waits for its reply) to
# show in the routers' load signal, as with a real model; 4-token replies finish before the
# next request arrives, and cache_aware then routed no better than round robin.
WORKLOAD = Workload(conversations=5, turns=4, max_tokens=24, system=True, tiny=True)


def needs(package: str) -> None:
    if fleet.router_python(package) is None:
        pytest.skip(f"{package} is not installed: run scripts/setup_routers.sh")


@pytest.fixture(scope="module")
def run(tiny_model_dir: Callable[[str], Path]) -> Callable[[str], Result]:
    results: dict[str, Result] = {}

    def run_once(policy: str) -> Result:
        if policy not in results:
            serve_args = ["--model", str(tiny_model_dir("gqa")), "--num-blocks", "256"]
            results[policy] = run_policy(policy, WORKLOAD, 2, serve_args, "tiny")
        return results[policy]

    return run_once


def assert_complete_and_counted(result: Result) -> None:
    total = WORKLOAD.conversations * WORKLOAD.turns
    assert result.num_requests == total
    assert sum(result.per_replica) == total  # the replicas served exactly the clients' requests
    assert result.replica_prompt_tokens == result.prompt_tokens
    assert result.replica_cached_tokens == result.cached_tokens
    assert result.output_tokens == total * WORKLOAD.max_tokens


@pytest.mark.parametrize("policy", ["sglang-cache-aware", "vllm-cache-aware"])
def test_cache_aware_router_completes_and_beats_round_robin(
    run: Callable[[str], Result], policy: str
) -> None:
    needs("vllm-router")
    needs("sglang-router" if policy.startswith("sglang") else "vllm-router")
    result, baseline = run(policy), run("round-robin")
    assert_complete_and_counted(result)
    assert_complete_and_counted(baseline)
    assert all(n > 0 for n in baseline.per_replica)
    assert min(result.per_replica) > 0, "cache-aware routing used one replica only"
    assert result.cached_fraction > baseline.cached_fraction

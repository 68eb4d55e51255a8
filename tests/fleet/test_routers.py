"""Two replicas behind real routers (sglang-router cache_aware; vllm-router kv_aware, fed by the
replicas' KV events): every request completes, the replicas' /metrics add up to what the clients
were told (and count none of the routers' probes as refused requests), kv_aware routes on
the prefixes the events report, and with the replicas idle both send a prompt to the replica
whose cache holds its prefix. On user-like traffic, the session recipes (kv_aware
with session affinity, sticky_least_loaded) keep every later turn on its conversation's home
replica, and sticky_least_loaded splits the conversations evenly; router-cost mode counts the
render calls vllm-router makes on every worker."""

from __future__ import annotations

import contextlib
import os
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import fleet
import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from benchmarks.fleet_bench import (
    Result,
    Users,
    Workload,
    measure_router_cost,
    router_cost_report,
    run_policy,
)

# An odd number of conversations: with an even one, round robin in lockstep would send each
# conversation to the same replica on every turn by accident. Replies of 24 tokens keep the
# requests in flight long enough for chat's closed loop (a client waits for its reply) to
# show in the routers' load signal, as with a real model; 4-token replies finish before the
# next request arrives, and cache_aware then routed no better than round robin.
WORKLOAD = Workload(conversations=5, turns=4, max_tokens=24, system=True, tiny=True)


def needs(package: str) -> None:
    if fleet.router_python(package) is None:
        pytest.skip(f"{package} is not installed: run scripts/setup_routers.sh")


ADMIN_KEY = "fleet-tests"
# A replica publishes a step's KV events as the step ends, over ZeroMQ: what a router reads
# them by within milliseconds, given far more here for a machine under load.
EVENTS_SETTLE_S = 1.0


@pytest.fixture(scope="module")
def serve_args(tiny_model_dir: Callable[[str], Path]) -> list[str]:
    return ["--model", str(tiny_model_dir("gqa")), "--num-blocks", "256", "--admin-key", ADMIN_KEY]


@pytest.fixture(scope="module")
def fresh_replicas(
    serve_args: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[], list[fleet.Replica]]]:
    """Two replicas (KV events on) that every router of the module takes its turn in front of,
    started at the first call (a test that skips for want of its router starts none), their
    caches flushed before each turn: a replica's start is most of a fleet test's time, and a
    flushed replica serves as a new one does (the runs count only what they add)."""
    with contextlib.ExitStack() as stack:
        replicas: list[fleet.Replica] = []

        def fresh() -> list[fleet.Replica]:
            if not replicas:
                log_dir = tmp_path_factory.mktemp("fleet-replicas")
                start = fleet.start_replicas(2, serve_args, model="tiny", log_dir=log_dir)
                replicas.extend(stack.enter_context(start))
            for r in replicas:
                flush = urllib.request.Request(
                    f"{r.url}/flush_cache",
                    method="POST",
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                )
                with urllib.request.urlopen(flush, timeout=30) as response:
                    assert response.status == 200
            return replicas

        yield fresh


@pytest.fixture(scope="module")
def run(
    serve_args: list[str],
    fresh_replicas: Callable[[], list[fleet.Replica]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], tuple[Result, Path]]:
    """policy -> its result and its logs' folder (each policy runs once per module)."""
    results: dict[str, tuple[Result, Path]] = {}

    def run_once(policy: str) -> tuple[Result, Path]:
        if policy not in results:
            log_dir = tmp_path_factory.mktemp(f"fleet-{policy}")
            # vllm-router logs its decisions (kv_aware: the prefix credited) at debug
            with mock.patch.dict(os.environ, {"RADIXKV_ROUTER_LOG_LEVEL": "debug"}):
                running = fresh_replicas()
                result = run_policy(policy, WORKLOAD, 2, serve_args, "tiny", log_dir, running)
            results[policy] = result, log_dir
        return results[policy]

    return run_once


def credited_prefixes(router_log: Path) -> list[int]:
    """The prefix tokens vllm-router credited to the chosen worker, per kv_aware decision
    (logged at debug: RADIXKV_ROUTER_LOG_LEVEL)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", router_log.read_text(errors="replace"))
    return [int(n) for n in re.findall(r"KV prefix decision .*?credited_prefix_tokens=(\d+)", text)]


def assert_complete_and_counted(result: Result) -> None:
    total = WORKLOAD.conversations * WORKLOAD.turns
    assert result.num_requests == total
    assert sum(result.per_replica) == total  # the replicas served exactly the clients' requests
    assert result.replica_prompt_tokens == result.prompt_tokens
    assert result.replica_cached_tokens == result.cached_tokens
    assert result.output_tokens == total * WORKLOAD.max_tokens
    # the routers' HTTP/2 probes (sglang-router's at start) are no refused requests
    assert result.replica_refusals == 0


# The two the issue names; vllm-router's cache_aware (sglang's algorithm again) runs in the
# benchmark only, to keep CI short. Whether they beat round robin is the benchmark's to measure
# (benchmarks/fleet_bench.py, RESULTS.md): on 20 requests in a closed loop both route by load
# whenever loads differ, and their cached fraction against round robin's turned on the suite's
# CPU contention (0.66-0.68 against 0.70-0.71, twice in fresh runs). The next test checks the
# prefix routing itself, with the load out of the way.
@pytest.mark.parametrize("policy", ["sglang-cache-aware", "vllm-kv-aware"])
def test_cache_aware_router_completes_and_spreads_the_load(
    run: Callable[[str], Result], policy: str
) -> None:
    needs("sglang-router" if policy.startswith("sglang") else "vllm-router")
    result, logs = run(policy)
    assert_complete_and_counted(result)
    assert min(result.per_replica) > 0, "cache-aware routing used one replica only"
    assert result.cached_tokens > 0
    if policy == "vllm-kv-aware":  # it routed on the replicas' events, read as they are
        credited = credited_prefixes(logs / "router.log")
        assert credited, "vllm-router logged no kv_aware decision"
        assert max(credited) > 0, "the router's index held none of the replicas' blocks"


@pytest.mark.parametrize("policy", ["sglang-cache-aware", "vllm-kv-aware", "round-robin"])
def test_a_prompt_goes_where_its_prefix_is_cached_with_the_replicas_idle(
    fresh_replicas: Callable[[], list[fleet.Replica]], tmp_path: Path, policy: str
) -> None:
    """One request at a time, so the loads are equal and only the prefix decides: a prompt
    that extends an earlier one goes to the replica that served the earlier one (sglang: by the
    text it routed; kv_aware: by the replica's KV events, given a moment to arrive), whose
    cache serves all of it. Round robin, the control, sends each extension to the other one."""
    needs("sglang-router" if policy.startswith("sglang") else "vllm-router")
    import openai

    start = fleet.start_fleet(policy, 2, model="tiny", log_dir=tmp_path, replicas=fresh_replicas())
    with start as f:
        client = openai.OpenAI(base_url=f"{f.url}/v1", api_key="none", max_retries=0)
        served_from_cache = []
        for i in range(3):
            words = " ".join(f"w{10 + (i * 53 + j * 7) % 240}" for j in range(60))
            first = client.completions.create(model="tiny", prompt=words, max_tokens=1)
            time.sleep(EVENTS_SETTLE_S)
            longer = client.completions.create(model="tiny", prompt=f"{words} w11", max_tokens=1)
            cached = longer.usage.prompt_tokens_details.cached_tokens
            served_from_cache.append(cached >= first.usage.prompt_tokens - 1)
    assert served_from_cache == [policy != "round-robin"] * 3


# More conversations than replicas, shuffled arrivals, think time, replies of drawn lengths.
USERS = Workload(
    conversations=3,
    turns=3,
    max_tokens=8,
    system=True,
    tiny=True,
    users=Users(think_s=0.5, in_flight=2, seed=1),
)


@pytest.mark.parametrize("policy", ["vllm-kv-aware-session", "session-least-loaded"])
def test_session_recipes_keep_later_turns_home_on_user_traffic(
    serve_args: list[str],
    fresh_replicas: Callable[[], list[fleet.Replica]],
    tmp_path: Path,
    policy: str,
) -> None:
    needs("vllm-router")
    result = run_policy(policy, USERS, 2, serve_args, "tiny", tmp_path, fresh_replicas())
    total = USERS.conversations * USERS.turns
    assert result.num_requests == total and sum(result.per_replica) == total
    assert result.replica_prompt_tokens == result.prompt_tokens
    assert result.replica_refusals == 0
    assert result.later_turns == USERS.conversations * (USERS.turns - 1)
    assert result.later_turns_home == result.later_turns  # x-session-id pinned each one
    if policy == "session-least-loaded":
        # each new conversation went to the replica with fewer: 2 and 1 of the 3
        assert sorted(result.per_replica) == [USERS.turns, 2 * USERS.turns]
        log = (tmp_path / "router.log").read_text(errors="replace")
        assert log.count("SLL: new session") == USERS.conversations


def test_router_cost_counts_the_renders_vllm_router_asks_of_every_worker(
    serve_args: list[str], fresh_replicas: Callable[[], list[fleet.Replica]], tmp_path: Path
) -> None:
    needs("vllm-router")
    running = fresh_replicas()
    cost = measure_router_cost(
        "vllm-kv-aware", 3, serve_args, "tiny", tiny=True, log_dir=tmp_path, running=running
    )
    assert len(cost.direct_ttft_s) == len(cost.routed_ttft_s) == 3
    assert cost.renders_per_request == 2.0  # each routed request rendered on both replicas
    assert router_cost_report([cost]).splitlines()[-1].startswith("| vllm-kv-aware | ")

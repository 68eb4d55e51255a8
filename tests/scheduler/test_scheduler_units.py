"""Request stop rules, waiting-queue policies (no scheduling)."""

from __future__ import annotations

import pytest

from radixkv.cache.prefix_cache import PrefixCache
from radixkv.engine.sampling_params import SamplingParams
from radixkv.scheduler.policy import POLICIES, FcfsPolicy, LongestPrefixMatchPolicy
from radixkv.scheduler.request import Request, RequestStatus


def running(req: Request) -> Request:
    req.status = RequestStatus.RUNNING
    return req


STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize(
    ("params", "eos", "tokens", "status", "num_out"),
    [
        (SamplingParams(max_tokens=3), (), [5, 6, 7, 8], LENGTH, 3),
        (SamplingParams(max_tokens=9), (6,), [5, 6, 7], STOPPED, 2),
        (SamplingParams(max_tokens=9, stop_token_ids=(7,)), (), [5, 7], STOPPED, 2),
        (SamplingParams(max_tokens=3, ignore_eos=True), (6,), [6, 6, 6], LENGTH, 3),
        # ignore_eos does not ignore explicit stop tokens
        (SamplingParams(max_tokens=9, ignore_eos=True, stop_token_ids=(6,)), (6,), [6], STOPPED, 1),
    ],
)
def test_request_stop_rules(
    params: SamplingParams,
    eos: tuple[int, ...],
    tokens: list[int],
    status: RequestStatus,
    num_out: int,
) -> None:
    # The stop tokens as the engine hands them to the request.
    req = running(Request("r", [1, 2, 3], params.max_tokens, params.stop_tokens(eos)))
    for t in tokens:
        req.append_output_token(t, max_model_len=100)
        if req.is_finished:
            break
    assert req.status is status
    assert req.finish_reason == ("stop" if status is STOPPED else "length")
    assert len(req.output_token_ids) == num_out
    assert req.all_token_ids.tolist() == [1, 2, 3, *req.output_token_ids]


def test_request_stops_at_max_model_len() -> None:
    req = running(Request("r", [1, 2, 3], 50))
    assert req.max_num_tokens(max_model_len=5) == 5
    req.append_output_token(9, max_model_len=5)
    assert not req.is_finished
    req.append_output_token(9, max_model_len=5)
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_tokens == 5
    # The longest prompt the engine admits leaves room for one token (longer ones: its door).
    assert Request("f", [1] * 4, 50).max_num_tokens(max_model_len=5) == 5


def test_appending_tokens_does_not_copy_the_sequence() -> None:
    req = running(Request("r", list(range(1, 1001)), 10_000))
    assert req.packed_tokens is req.prompt_token_ids  # nothing appended: the prompt as it is
    tokens = req.all_token_ids
    for t in range(500):
        req.append_output_token(t, max_model_len=10_000)
    assert req.all_token_ids is tokens  # one growing array, appended to in amortized O(1)
    assert req.all_token_ids.tolist() == [*range(1, 1001), *range(500)]
    packed = req.packed_tokens  # what the cache reads: packed once, until the next append
    assert packed.tolist() == req.all_token_ids.tolist() and req.packed_tokens is packed


def test_a_request_packs_a_token_list_it_is_given() -> None:
    # The engine hands PackedTokens (checked at its door); a list, as tests pass, is packed.
    with pytest.raises(ValueError):
        Request("r", [1, -2], 4)


def test_status_is_finished() -> None:
    assert not RequestStatus.WAITING.is_finished and not RequestStatus.RUNNING.is_finished
    assert RequestStatus.FINISHED_ABORTED.is_finished


def test_fcfs_keeps_queue_order() -> None:
    reqs = [Request(str(i), [i + 1], 1) for i in range(4)]
    assert list(FcfsPolicy().order(reqs, None)) == reqs
    assert POLICIES["fcfs"] is FcfsPolicy  # an unknown name: EngineConfig refuses it


def test_lpm_without_cache_is_fcfs() -> None:
    reqs = [Request(str(i), [i + 1], 1) for i in range(4)]
    assert list(LongestPrefixMatchPolicy().order(reqs, None)) == reqs


def test_lpm_orders_by_cached_prefix_read_only() -> None:
    cache = PrefixCache(num_blocks=32, block_size=4)
    cached = list(range(1, 21))
    table = cache.admit(cached, max_hit=0)
    cache.commit(table, cached)
    cache.close(table)
    reqs = [
        Request("cold", [50] * 12, 1),
        Request("short", [*cached[:6], 60], 1),
        Request("long", [*cached[:17], 61], 1),
        Request("cold2", [70] * 3, 1),
        Request("all", cached, 1),  # capped at len - 1 = 19 cached tokens
    ]
    stats, nodes = cache.stats(), list(cache.nodes())
    order = list(LongestPrefixMatchPolicy().order(reqs, cache))
    assert [r.request_id for r in order] == ["all", "long", "short", "cold", "cold2"]
    assert cache.stats() == stats and list(cache.nodes()) == nodes, "scoring changed the cache"
    cache.check_integrity()


def test_a_jump_replaces_tokens_without_kv_and_stops_at_the_length_limit() -> None:
    req = running(Request("r", [1, 2, 3], 6, stop_token_ids=(99,)))
    req.append_output_token(7, max_model_len=100)
    req.num_computed_tokens = 3  # the sampled 7 has no KV yet
    packed = req.packed_tokens
    assert req.jump(0, [8, 9], max_model_len=100) == 2  # 7 replaced by a merge, then 9
    assert req.output_token_ids == [8, 9] and req.all_token_ids.tolist() == [1, 2, 3, 8, 9]
    assert req.packed_tokens is not packed and req.packed_tokens.tolist() == [1, 2, 3, 8, 9]
    assert not req.is_finished
    assert req.jump(2, [10, 11, 12, 13, 14], max_model_len=100) == 4  # cut at max_tokens = 6
    assert req.status is RequestStatus.FINISHED_LENGTH and len(req.output_token_ids) == 6

"""SchedulerConfig validation, Request stop rules, waiting-queue policies (no scheduling)."""

from __future__ import annotations

import pytest

from radixkv.cache.prefix_cache import PrefixCache
from radixkv.scheduler.config import SchedulerConfig
from radixkv.scheduler.policy import FcfsPolicy, LongestPrefixMatchPolicy, make_policy
from radixkv.scheduler.request import Request, RequestStatus
from radixkv.scheduler.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("max_num_seqs", 0, ValueError),
        ("max_num_batched_tokens", -1, ValueError),
        ("chunked_prefill_size", 0, ValueError),
        ("max_model_len", 0, ValueError),
        ("max_num_seqs", 2.0, TypeError),
        ("max_num_seqs", True, TypeError),
        ("policy", "lifo", ValueError),
        ("policy", ["lpm"], ValueError),  # unhashable: still named, not a bare TypeError
        ("enable_prefix_cache", 1, TypeError),
        ("defer_shared_prefix_tokens", -1, ValueError),
        ("defer_shared_prefix_tokens", 1.5, TypeError),
        ("defer_shared_prefix_tokens", True, TypeError),
    ],
)
def test_config_rejects_bad_values(field: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=field if field != "policy" else "policy"):
        SchedulerConfig(**{field: value})  # type: ignore[arg-type]


def test_config_is_frozen() -> None:
    cfg = SchedulerConfig()
    with pytest.raises(AttributeError):
        cfg.max_num_seqs = 3  # type: ignore[misc]


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
    req = running(Request("r", [1, 2, 3], params, eos))
    for t in tokens:
        req.append_output_token(t, max_model_len=100)
        if req.is_finished:
            break
    assert req.status is status
    assert req.finish_reason == ("stop" if status is STOPPED else "length")
    assert len(req.output_token_ids) == num_out
    assert req.all_token_ids.tolist() == [1, 2, 3, *req.output_token_ids]


def test_request_stops_at_max_model_len() -> None:
    req = running(Request("r", [1, 2, 3], SamplingParams(max_tokens=50)))
    assert req.max_num_tokens(max_model_len=5) == 5
    req.append_output_token(9, max_model_len=5)
    assert not req.is_finished
    req.append_output_token(9, max_model_len=5)
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_tokens == 5
    # A prompt that fills the context still gets one token (computed at the last position).
    assert Request("f", [1] * 5).max_num_tokens(max_model_len=5) == 6


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("", [1]), ValueError),
        (("r", [1, -2]), ValueError),
        (("r", [1], "greedy"), TypeError),
        (("r", [1], None, [True]), ValueError),
    ],
)
def test_request_validates(args: tuple, error: type[Exception]) -> None:
    with pytest.raises(error):
        Request(*args)


def test_status_is_finished() -> None:
    assert not RequestStatus.WAITING.is_finished and not RequestStatus.RUNNING.is_finished
    assert RequestStatus.FINISHED_ABORTED.is_finished


def test_fcfs_keeps_queue_order() -> None:
    reqs = [Request(str(i), [i + 1]) for i in range(4)]
    assert list(FcfsPolicy().order(reqs, None)) == reqs
    assert isinstance(make_policy("fcfs"), FcfsPolicy)
    with pytest.raises(ValueError):
        make_policy("random")


def test_lpm_without_cache_is_fcfs() -> None:
    reqs = [Request(str(i), [i + 1]) for i in range(4)]
    assert list(LongestPrefixMatchPolicy().order(reqs, None)) == reqs


def test_lpm_orders_by_cached_prefix_read_only() -> None:
    cache = PrefixCache(num_blocks=32, block_size=4)
    cached = list(range(1, 21))
    table = cache.admit(cached, max_hit=0)
    cache.commit(table, cached)
    cache.close(table)
    reqs = [
        Request("cold", [50] * 12),
        Request("short", [*cached[:6], 60]),
        Request("long", [*cached[:17], 61]),
        Request("cold2", [70] * 3),
        Request("all", cached),  # capped at len - 1 = 19 cached tokens
    ]
    stats, nodes = cache.stats(), list(cache.nodes())
    order = list(LongestPrefixMatchPolicy().order(reqs, cache))
    assert [r.request_id for r in order] == ["all", "long", "short", "cold", "cold2"]
    assert cache.stats() == stats and list(cache.nodes()) == nodes, "scoring changed the cache"
    cache.check_integrity()

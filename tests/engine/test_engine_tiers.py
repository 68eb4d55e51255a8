"""The engine with tiers: a move that fails touches only the requests that read what it left
holding garbage (admitted again, failed on a second failure), nothing leaks, the engine keeps
serving correct output; a restarted engine over the same
KV directory picks up the prefixes cached before; bad tier settings are refused at the door.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from block_files import damage_every_other_file
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams

# 6 prompts of 33-52 tokens (9-13 blocks of 4) and a device pool of 24: each round evicts the
# prefixes of the one before into the host tier and loads them back.
PROMPTS = random_prompts(71, 6, shared_prefix=30, max_len=22)
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)
TIERS = dict(block_size=4, num_blocks=24, max_num_seqs=2, host_cache_bytes=2**20)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("gqa"))


@pytest.fixture(scope="module")
def expected(reference_generate):
    return reference_generate("gqa", PROMPTS, [5] * len(PROMPTS))


def run(llm: LLM) -> list[Any]:
    """Every prompt through the step API; each request's last update, in prompt order."""
    ids = [llm.add_request(p, PARAMS) for p in PROMPTS]
    last = {}
    while llm.has_unfinished_requests():
        for update in llm.step():
            last[update.request_id] = update
        llm.check_integrity()
    return [last[rid] for rid in ids]


def failing(real: Any, calls: list[int], times: int) -> Any:
    """`real`, raising on its first `times` calls (counted in calls[0])."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] <= times:
            raise OSError("injected fault")
        return real(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("point", ["load", "offload", "disk-read"])
def test_a_failed_move_fails_only_the_requests_that_read_it(
    point, overlap, model_dir, expected, tmp_path, monkeypatch
):
    """Two faults in a row: a request whose load failed goes back to the queue; if its second
    load fails too, it fails; every other request is served correctly. With overlapped steps
    the requeued request's row is in the step in flight: its token is dropped, not fed on."""
    disk = dict(host_cache_bytes=6 * 3072, kv_cache_dir=tmp_path) if point == "disk-read" else {}
    llm = LLM(model_dir, **{**TIERS, **disk}, async_scheduling=overlap)
    assert [list(u.output.token_ids) for u in run(llm)] == expected
    tiers = llm.tier_ios[0]
    target, name = {
        "load": (tiers.copier, "load"),
        "offload": (tiers.copier, "offload"),
        "disk-read": (tiers.disk, "get"),
    }[point]
    calls = [0]
    monkeypatch.setattr(target, name, failing(getattr(target, name), calls, times=2))
    second = run(llm)
    assert calls[0] > 2, "the fault was injected"
    failed = [u for u in second if u.error is not None]
    for u, tokens in zip(second, expected, strict=True):
        assert u.error is not None or list(u.output.token_ids) == tokens
        assert (u.error is not None) == (u.output.finish_reason == "error")
    # An offload that failed costs only the copy (recomputed later); a request whose load failed
    # is admitted again, and fails only if that load fails too.
    assert failed == [] if point == "offload" else len(failed) <= 1
    assert tiers.totals[point.replace("-", "_")].num_failed_blocks > 0
    stats = llm.cache.stats()
    assert stats.num_in_use_blocks == stats.num_private_blocks == 0
    llm.check_integrity()
    # The host copies the faults left holding garbage were forgotten: served again, all correct.
    monkeypatch.undo()
    assert [list(u.output.token_ids) for u in run(llm)] == expected
    llm.check_integrity()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_a_block_file_gone_between_probe_and_read_is_a_miss(overlap, model_dir, expected, tmp_path):
    """Another process evicts the files this one probed: the request is admitted again and
    recomputes; nothing fails."""
    settings = {**TIERS, "host_cache_bytes": 6 * 3072, "kv_cache_dir": tmp_path}
    llm = LLM(model_dir, **settings, async_scheduling=overlap)
    run(llm)
    disk = llm.tier_ios[0].disk
    real_get = disk.get

    def get_after_another_process_evicted(key, out):
        disk._path(key.block_hash).unlink(missing_ok=True)
        return real_get(key, out)

    disk.get = get_after_another_process_evicted
    outs = run(llm)
    assert [list(u.output.token_ids) for u in outs] == expected
    assert llm.tier_ios[0].totals["disk_read"].num_failed_blocks > 0  # the misses
    llm.check_integrity()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_a_restarted_engine_picks_up_prefixes_from_the_disk_tier(
    overlap, model_dir, expected, tmp_path
):
    settings = {**TIERS, "host_cache_bytes": 8 * 3072, "kv_cache_dir": tmp_path}
    settings["async_scheduling"] = overlap
    first = LLM(model_dir, **settings)
    assert [list(u.output.token_ids) for u in run(first)] == expected
    first.save_kv_cache()  # what the chat and the server do when they stop
    del first
    restarted = LLM(model_dir, **settings)
    outs = run(restarted)
    assert [list(u.output.token_ids) for u in outs] == expected
    assert restarted.cache.stats().num_disk_hit_tokens >= 30 // 4 * 4
    restarted.check_integrity()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_damaged_block_files_are_misses_and_the_output_is_unchanged(
    overlap, model_dir, expected, tmp_path
):
    """An engine restarted over a folder whose files were damaged after it indexed them: every
    damaged file is a miss, then a recompute; no request fails and greedy output equals a
    tier-less engine's, twice over (the second time the damaged files are not probed)."""
    settings = {**TIERS, "host_cache_bytes": 8 * 3072, "kv_cache_dir": tmp_path}
    first = LLM(model_dir, **settings)
    run(first)
    first.save_kv_cache()
    del first
    restarted = LLM(model_dir, **settings, async_scheduling=overlap)
    assert damage_every_other_file(tmp_path) >= 6
    for _ in range(2):
        outs = run(restarted)
        assert [u.error for u in outs] == [None] * len(PROMPTS)
        assert [list(u.output.token_ids) for u in outs] == expected
    reads = restarted.tier_ios[0].totals["disk_read"]  # missed and loaded blocks
    assert reads.num_failed_blocks > 0 and reads.num_blocks > 0
    assert restarted.tier_ios[0].disk.stats().num_unusable > 0
    stats = restarted.cache.stats()
    assert stats.num_in_use_blocks == stats.num_private_blocks == 0
    restarted.check_integrity()


def test_a_keyed_disk_tier_is_read_back_with_its_secret_alone_and_says_what_it_holds(
    model_dir, expected, tmp_path, caplog
):
    """The log says how many block files the disk tier found at start and wrote by the stop;
    an engine with another secret (or none) never takes the files for its own."""
    settings = {**TIERS, "host_cache_bytes": 8 * 3072, "kv_cache_dir": tmp_path}

    def start(secret: str | None) -> LLM:
        with caplog.at_level(logging.INFO, logger="radixkv.engine.tiers.tier_io"):
            return LLM(model_dir, **settings, kv_cache_secret=secret)

    first = start("one")
    assert "0 block files found at start" in caplog.text
    run(first)
    with caplog.at_level(logging.INFO, logger="radixkv.engine.tiers.tier_io"):
        first.save_kv_cache()
    num_files = len(list(tmp_path.rglob("*.kv")))
    assert num_files > 0 and f": {num_files} block files written" in caplog.text
    caplog.clear()
    again = start("one")
    assert f"{num_files} block files found at start" in caplog.text
    assert [list(u.output.token_ids) for u in run(again)] == expected
    assert again.cache.stats().num_disk_hit_tokens > 0
    for secret in ("two", None):
        other = start(secret)
        assert [list(u.output.token_ids) for u in run(other)] == expected
        assert other.cache.stats().num_disk_hit_tokens == 0
        assert other.tier_ios[0].disk.stats().num_damaged == 0


@pytest.mark.parametrize(
    "settings, error",
    [
        (dict(kv_cache_dir="x"), "host_cache_bytes"),
        (dict(host_cache_bytes=-1), "host_cache_bytes"),
        (dict(host_cache_bytes=10), "holds no KV block"),
        (dict(host_cache_bytes=2**20, kv_cache_dir="x", disk_cache_bytes=100), "holds no KV block"),
    ],
)
def test_tier_settings_are_checked_at_the_door(model_dir, settings, error):
    with pytest.raises(ValueError, match=error):
        LLM(model_dir, block_size=4, num_blocks=24, **settings)

"""A model with sliding-window layers over the host and disk tiers: the window KV a hit resumes
from follows its prefix down (`radixkv.cache.hybrid`), and greedy output with the tiers equals
transformers' token for token, with hits really served from the host tier, from the disk tier,
after a restart over the same folder, and from a folder whose files were damaged since (each
damaged file a miss). Tiny random Gemma 2 / Gemma 3 / Mistral-with-window models (`tiny_archs`).
"""

from __future__ import annotations

import pytest
from block_files import damage_every_other_file
from tiny_archs import WINDOW_TIER_DEVICE, WINDOW_TIER_PROMPTS, build_arch, greedy_tokens

from radixkv import LLM, SamplingParams
from radixkv.cache.events import BlockStored
from radixkv.chat.cli import tier_lines
from radixkv.engine.tiers.disk_store import block_file_nbytes
from radixkv.serve.engine_worker import tier_moves

# every round evicts the prefixes and tails of the one before into the lower tiers
PROMPTS, DEVICE = WINDOW_TIER_PROMPTS, WINDOW_TIER_DEVICE
MAX_NEW = [5 + i % 3 for i in range(len(PROMPTS))]
ARCHS = ("gemma2", "gemma3", "mistral-window")


@pytest.fixture(scope="module")
def arch_model(tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            path = build_arch(arch, tmp_path_factory.mktemp(arch))
            made[arch] = (str(path), greedy_tokens(path, PROMPTS, MAX_NEW))
        return made[arch]

    return get


def run(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n) for n in MAX_NEW]
    outs = llm.generate(PROMPTS, params)
    llm.check_integrity()
    return [list(o.token_ids) for o in outs]


def window_moved(llm: LLM, kind: str) -> int:
    assert llm.tier_ios[1] is not None
    return llm.tier_ios[1].totals[kind].num_blocks


@pytest.mark.parametrize(
    ("arch", "overlap"), [*((arch, False) for arch in ARCHS), ("gemma3", True)]
)
def test_host_tier_hits_match_transformers(arch, overlap, arch_model):
    path, expected = arch_model(arch)
    llm = LLM(path, **DEVICE, host_cache_bytes=2**20, async_scheduling=overlap)
    for _ in range(2):
        assert run(llm) == expected
    stats = llm.cache.stats()
    assert stats.num_host_hit_tokens > 0
    assert window_moved(llm, "offload") > 0 and window_moved(llm, "load") > 0
    # /metrics counts both groups' moves
    moved = tier_moves(llm.tier_ios[0], llm.tier_ios[1])["load"][0]
    assert moved == llm.tier_ios[0].totals["load"].nbytes + llm.tier_ios[1].totals["load"].nbytes
    assert moved > llm.tier_ios[0].totals["load"].nbytes
    assert llm.cache.groups[1].num_evicted_tails > 0


def test_write_through_copies_window_tails_when_kept_and_matches_tiers_off(arch_model):
    """host_cache_write_through: a window tail's full blocks reach the window group's host
    tier when the tail is kept, before any eviction; greedy output equals the engine's without
    tiers, with hits served from the host after the device's tails were evicted."""
    path, expected = arch_model("gemma3")
    tiers_off = run(LLM(path, **DEVICE))
    assert tiers_off == expected
    llm = LLM(path, **DEVICE, host_cache_bytes=2**20, host_cache_write_through=True)
    window = llm.cache.groups[1]
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1))
    assert window.num_tails > 0 and window.num_evicted_tails == 0
    held = {key.block_hash for tail in window._tails.values() for key in tail.keys}
    assert held and held <= set(window.tiers.entries)
    for _ in range(2):
        assert run(llm) == tiers_off
    assert window.num_evicted_tails > 0 and window_moved(llm, "load") > 0
    assert llm.cache.stats().num_host_hit_tokens > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_disk_tier_hits_and_a_restart_match_transformers(arch, arch_model, tmp_path):
    path, expected = arch_model(arch)
    # room for 8 blocks of each group on the host: the rest spills to disk
    settings = dict(DEVICE, host_cache_bytes=8 * _bytes_per_block_pair(path), kv_cache_dir=tmp_path)
    first = LLM(path, **settings)
    for _ in range(2):
        assert run(first) == expected
    assert first.cache.stats().num_disk_hit_tokens > 0
    assert window_moved(first, "disk_write") > 0 and window_moved(first, "disk_read") > 0
    window = first.tier_ios[1]
    held = len(first.cache.groups[1].tiers.entries)
    _, _, host_line, disk_line = tier_lines(first)  # the chat's /stats: both groups' tiers
    assert host_line.startswith(f"window host tier {held} of {window.host.num_blocks} blocks used;")
    assert disk_line.startswith(f"window disk tier {window.disk.stats().num_files} files")
    first.save_kv_cache()
    del first
    restarted = LLM(path, **settings)
    assert run(restarted) == expected
    assert restarted.cache.stats().num_disk_hit_tokens > 0
    assert window_moved(restarted, "disk_read") > 0


@pytest.mark.parametrize("harm", ["damaged", "gone"])
def test_damaged_or_missing_window_files_are_misses(harm, arch_model, tmp_path):
    """Files spoiled (every other one, of both groups) or the window group's files deleted
    after the restarted engine indexed them: misses and recomputes, the output unchanged."""
    path, expected = arch_model("gemma3")
    settings = dict(DEVICE, host_cache_bytes=8 * _bytes_per_block_pair(path), kv_cache_dir=tmp_path)
    first = LLM(path, **settings)
    run(first)
    first.save_kv_cache()
    del first
    restarted = LLM(path, **settings)
    window_disk = restarted.tier_ios[1].disk
    if harm == "damaged":
        assert damage_every_other_file(tmp_path) >= 6
    else:
        files = list(window_disk.directory.rglob("*.kv"))
        assert len(files) >= 6 and window_disk.num_files == len(files)
        for file in files:
            file.unlink()
    for _ in range(2):
        assert run(restarted) == expected
    missed = sum(t.totals["disk_read"].num_failed_blocks for t in _tier_ios(restarted))
    assert missed > 0
    if harm == "damaged":
        assert window_disk.stats().num_unusable > 0
    else:
        assert restarted.tier_ios[1].totals["disk_read"].num_failed_blocks > 0
    stats = restarted.cache.stats()
    assert stats.num_in_use_blocks == stats.num_private_blocks == 0


def _tier_ios(llm: LLM):
    return [llm.tier_ios[0], llm.tier_ios[1]]


def _bytes_per_block_pair(path: str) -> int:
    """Host bytes of one block of each group (the two pools hold as many blocks each)."""
    runner = LLM(path, **DEVICE).runner
    return 2 * (runner.kv[0].k_cache[:, 0].nbytes + runner.kv[1].k_cache[:, 0].nbytes)


def test_a_disk_budget_short_of_one_file_per_group_is_refused_naming_both(arch_model, tmp_path):
    """The disk budget is split between the groups' block files: one byte short of a file of
    each is refused with what that pair needs; a pair's worth is taken."""
    path, _ = arch_model("gemma3")
    runner = LLM(path, **DEVICE).runner
    full, window = (
        block_file_nbytes(DEVICE["block_size"], 2 * k[:, 0].nbytes)
        for k in (runner.kv[0].k_cache, runner.kv[1].k_cache)
    )
    settings = dict(DEVICE, host_cache_bytes=2**20, kv_cache_dir=tmp_path)
    with pytest.raises(ValueError) as refused:
        LLM(path, **settings, disk_cache_bytes=full + window - 1)
    message = str(refused.value)
    assert message.startswith(f"disk_cache_bytes={full + window - 1} holds no pair of KV block")
    needs = f"({full} bytes for the full layers + {window} for the window layers = {full + window})"
    assert message.endswith(needs)
    llm = LLM(path, **settings, disk_cache_bytes=full + window)
    assert llm.tier_ios[0].disk.budget_bytes == full and llm.tier_ios[1].disk.budget_bytes == window


def test_a_host_budget_short_of_one_block_per_group_is_refused_naming_both(arch_model):
    path, _ = arch_model("gemma3")
    runner = LLM(path, **DEVICE).runner
    full, window = (2 * k[:, 0].nbytes for k in (runner.kv[0].k_cache, runner.kv[1].k_cache))
    with pytest.raises(ValueError) as refused:
        LLM(path, **DEVICE, host_cache_bytes=full + window - 1)
    assert str(refused.value) == (
        f"host_cache_bytes={full + window - 1} holds no pair of KV blocks, one per KV cache group "
        f"({full} bytes for the full layers + {window} for the window layers = {full + window})"
    )
    llm = LLM(path, **DEVICE, host_cache_bytes=full + window)
    assert [io.host.num_blocks for io in (llm.tier_ios[0], llm.tier_ios[1])] == [1, 1]


def test_kv_events_name_the_tier_and_group_with_tiers_on(arch_model):
    path, expected = arch_model("gemma3")
    events: list = []
    llm = LLM(path, **DEVICE, host_cache_bytes=2**20, kv_events=events.append)
    for _ in range(2):
        assert run(llm) == expected
    stored = {(e.medium, e.group_idx) for e in events if isinstance(e, BlockStored)}
    assert stored == {(None, 0), (None, 1), ("CPU", 0), ("CPU", 1)}
    tiers = llm.cache.groups[1].tiers
    held: set[int] = set()
    for e in events:
        if getattr(e, "medium", None) == "CPU" and e.group_idx == 1:
            (held.update if isinstance(e, BlockStored) else held.difference_update)(e.block_hashes)
    assert held == set(tiers.entries)


@pytest.mark.parametrize("point", ["load", "offload"])
def test_a_failed_window_move_fails_only_the_requests_that_read_it(point, arch_model, monkeypatch):
    """Two window copies fail: a request whose window load failed is admitted again (and fails
    only if that fails too); an offload that failed costs only that copy; every other request's
    output is transformers'; the garbage host copies are forgotten, so a third round is exact."""
    path, expected = arch_model("gemma3")
    llm = LLM(path, **DEVICE, host_cache_bytes=2**20)
    assert run(llm) == expected
    copier = llm.tier_ios[1].copier
    real, calls = getattr(copier, point), [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] <= 2:
            raise OSError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(copier, point, failing)
    ids = [
        llm.add_request(p, SamplingParams(max_tokens=n))
        for p, n in zip(PROMPTS, MAX_NEW, strict=True)
    ]
    last = {}
    while llm.has_unfinished_requests():
        for update in llm.step():
            last[update.request_id] = update
        llm.check_integrity()
    assert calls[0] > 2, "the fault was injected"
    outs = [last[rid] for rid in ids]
    failed = [u for u in outs if u.error is not None]
    for u, tokens in zip(outs, expected, strict=True):
        assert u.error is not None or list(u.output.token_ids) == tokens
    assert failed == [] if point == "offload" else len(failed) <= 1
    assert llm.tier_ios[1].totals[point].num_failed_blocks > 0
    monkeypatch.undo()
    assert run(llm) == expected

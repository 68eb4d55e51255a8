"""Hybrid models over the host and disk tiers: recurrent-state snapshots follow their prefixes down
(`radixkv.cache.state_tiers`), and greedy output with the tiers on equals transformers' token for
token, with hits really resumed from a snapshot the host tier brought back, from one on disk after
a restart over the same folder, from a folder whose snapshot files were damaged since (misses),
and with faults in the snapshot copies failing only the request that read them.

The workload is a chat's: three conversations' first turns, one at a time, then their next turns
(prompt + reply + a new message), each resuming at its conversation's written end (the last
sampled token has no state yet). One running request and one snapshot slot beside it: the third
first turn evicts the first one's snapshot to the host tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from block_files import damage_every_other_file
from tiny_archs import build_arch, greedy_tokens
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams
from radixkv.cache.events import BlockRemoved, BlockStored
from radixkv.cache.state_tiers import SNAPSHOT_KIND
from radixkv.chat.cli import stats_text
from radixkv.chat.tree_view import render_tree

MAX_NEW = [6, 7, 5]
HOST = dict(
    block_size=4,
    num_blocks=256,
    max_num_seqs=1,
    num_snapshots=1,
    snapshot_min_gap_tokens=4,
    host_cache_bytes=2**20,
)
# One token a block: every snapshot's end is a block boundary, so the KV the tree wrote to disk
# reaches every snapshot (a partial block never goes down a tier).
DISK = dict(block_size=1, num_blocks=512, snapshot_min_gap_tokens=4, host_cache_bytes=2**20)
FAMILIES = ("qwen3_5", "bamba", "lfm2")  # Gated DeltaNet, Mamba-2, short convolutions


class Chat:
    """The first turns, the next turns and transformers' greedy replies to both."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.first = random_prompts(31, 3, min_len=10, max_len=16)
        self.first_replies = greedy_tokens(path, self.first, MAX_NEW)
        news = random_prompts(33, 3, min_len=4, max_len=7)
        self.turns = [
            p + r + n for p, r, n in zip(self.first, self.first_replies, news, strict=True)
        ]
        self.turn_replies = greedy_tokens(path, self.turns, MAX_NEW)

    def ends(self) -> list[int]:
        """Where each next turn resumes: its conversation's written end."""
        return [len(p) + len(r) - 1 for p, r in zip(self.first, self.first_replies, strict=True)]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    made: dict[str, Chat] = {}

    def get(family: str) -> Chat:
        if family not in made:
            made[family] = Chat(build_arch(family, tmp_path_factory.mktemp(family)))
        return made[family]

    return get


def one_by_one(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each prompt alone, in turn: the replies and the tokens each resumed past."""
    tokens, hits = [], []
    for prompt, n in zip(prompts, MAX_NEW, strict=True):
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=n))
        llm.check_integrity()
        tokens.append(list(out.token_ids))
        hits.append(out.stats.num_cached_tokens)
    return tokens, hits


def stepped(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    """Every prompt at once, stepped by hand: each request's last update (its error, if any)."""
    params = [SamplingParams(max_tokens=n) for n in MAX_NEW]
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    last = {}
    while llm.has_unfinished_requests():
        for update in llm.step():
            last[update.request_id] = update
        llm.check_integrity()
    return [last[rid] for rid in ids]


def state_moved(llm: LLM, kind: str) -> int:
    tier_io = llm.tier_ios[-1]
    assert tier_io is not None
    return tier_io.totals[kind].num_blocks


@pytest.mark.parametrize(
    ("family", "overlap"), [*((f, False) for f in FAMILIES), ("qwen3_5", True)]
)
def test_a_snapshot_evicted_to_the_host_comes_back_and_matches_transformers(family, overlap, chat):
    c = chat(family)
    llm = LLM(c.path, **HOST, async_scheduling=overlap)
    assert one_by_one(llm, c.first)[0] == c.first_replies
    state = llm.cache.group_stats()[-1]
    assert state.num_evicted >= 1 and state.num_host_cached_blocks >= 1
    tokens, hits = one_by_one(llm, c.turns)
    assert tokens == c.turn_replies
    assert hits[0] == c.ends()[0], "the first conversation resumes from the host's snapshot"
    state = llm.cache.group_stats()[-1]
    assert state.num_lower_hits >= 1 and state.num_disk_reads == 0
    assert state_moved(llm, "offload") >= 1 and state_moved(llm, "load") == state.num_lower_hits
    if not overlap:  # (an overlapped step may run a reply past its stop: no end to keep)
        assert hits == c.ends() and state.num_hit_tokens == sum(c.ends())
    assert llm.cache.group_stats()[-1].num_running_slots == 0


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_a_restarted_hybrid_engine_resumes_from_the_snapshots_on_disk(family, chat, tmp_path):
    c = chat(family)
    settings = dict(DISK, kv_cache_dir=tmp_path)
    first = LLM(c.path, **settings)
    assert one_by_one(first, c.first)[0] == c.first_replies
    first.save_kv_cache()  # what the chat and the server do when they stop
    first.check_integrity()
    del first
    restarted = LLM(c.path, **settings)
    tokens, hits = one_by_one(restarted, c.turns)
    assert tokens == c.turn_replies
    assert hits == c.ends()
    state = restarted.cache.group_stats()[-1]
    assert state.num_lower_hits == 3 and state.num_hit_tokens == sum(c.ends())
    assert state.num_disk_reads == 3 and state_moved(restarted, "disk_read") == 3
    assert restarted.cache.stats().num_disk_hit_tokens > 0


def test_damaged_snapshot_files_are_misses_and_the_output_is_unchanged(chat, tmp_path):
    c = chat("qwen3_5")
    settings = dict(DISK, kv_cache_dir=tmp_path)
    first = LLM(c.path, **settings)
    one_by_one(first, c.first)
    first.save_kv_cache()
    state_dir = Path(first.tier_ios[-1].disk.directory)
    del first
    assert damage_every_other_file(state_dir) == 2  # of the three snapshots' files
    restarted = LLM(c.path, **settings)
    tokens, hits = one_by_one(restarted, c.turns)
    assert tokens == c.turn_replies
    # one file removed at the start (truncated), one found corrupt when read (its request
    # admitted again, from what is left): one conversation alone resumes at its end
    assert restarted.tier_ios[-1].disk.stats().num_damaged == 2
    assert sum(hit == end for hit, end in zip(hits, c.ends(), strict=True)) == 1
    restarted.check_integrity()


@pytest.mark.parametrize(
    ("point", "overlap"),
    [("load", False), ("load", True), ("offload", False), ("disk-read", False)],
)
def test_a_failed_snapshot_move_fails_only_the_request_that_read_it(
    point, overlap, chat, tmp_path, monkeypatch
):
    """Two snapshot copies fail: a request whose load failed is admitted again (and fails only
    if that fails too); an offload that failed costs only that copy; every other request's
    output is transformers'; no slot is left in use, the garbage host copies are forgotten, and
    the next round is exact."""
    c = chat("qwen3_5")
    if point == "disk-read":
        settings = dict(DISK, kv_cache_dir=tmp_path)
        first = LLM(c.path, **settings)
        one_by_one(first, c.first)
        first.save_kv_cache()
        del first
        llm = LLM(c.path, **settings, async_scheduling=overlap)
        target, name = llm.tier_ios[-1].disk, "get"
    else:
        llm = LLM(c.path, **HOST, async_scheduling=overlap)
        one_by_one(llm, c.first)
        target, name = llm.tier_ios[-1].copier, point
    real, calls = getattr(target, name), [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] <= 2:
            raise OSError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, failing)
    outs = stepped(llm, c.turns)
    assert calls[0] >= 2, "the fault was injected"
    failed = [u for u in outs if u.error is not None]
    for u, tokens in zip(outs, c.turn_replies, strict=True):
        assert u.error is not None or list(u.output.token_ids) == tokens
    assert failed == [] if point == "offload" else len(failed) <= 1
    assert llm.tier_ios[-1].totals[point.replace("-", "_")].num_failed_blocks > 0
    assert llm.cache.group_stats()[-1].num_running_slots == 0
    monkeypatch.undo()
    assert one_by_one(llm, c.turns)[0] == c.turn_replies


def test_snapshot_events_name_the_state_group_on_every_tier(chat, tmp_path):
    """Stored and removed snapshots are announced as the state group's (vLLM's kind "mamba"),
    on the device, the host and the disk; what the host's events leave held is what it holds."""
    c = chat("qwen3_5")
    events: list = []
    llm = LLM(c.path, **HOST, kv_cache_dir=tmp_path, kv_events=events.append)
    one_by_one(llm, c.first)
    one_by_one(llm, c.turns)
    g = len(llm.cache.groups) - 1
    mine = [e for e in events if getattr(e, "group_idx", 0) == g]
    stored = {(e.medium, e.kind) for e in mine if isinstance(e, BlockStored)}
    assert stored >= {(None, SNAPSHOT_KIND), ("CPU", SNAPSHOT_KIND)}
    assert {e.medium for e in mine if isinstance(e, BlockRemoved)} >= {None}
    assert all(e.kind is None for e in events if isinstance(e, BlockStored) and e.group_idx == 0)
    held: set[int] = set()
    for e in mine:
        if getattr(e, "medium", None) == "CPU":
            (held.update if isinstance(e, BlockStored) else held.difference_update)(e.block_hashes)
    assert held == set(llm.cache.groups[g].tiers.entries)


def test_a_host_budget_whose_snapshot_share_holds_no_snapshot_is_refused_in_one_line(chat):
    c = chat("qwen3_5")
    with pytest.raises(ValueError, match="holds no snapshot") as caught:
        LLM(c.path, **{**HOST, "host_cache_bytes": 2**14, "snapshot_share": 0.01})
    assert "\n" not in str(caught.value) and "host_cache_bytes=16384" in str(caught.value)


def test_the_chats_stats_and_tree_show_snapshots_and_their_tiers(chat, tmp_path):
    """/stats: the state slots' line counts the hits from the lower tiers, and the snapshots'
    host and disk tiers have lines of their own; /tree marks each node a snapshot ends in."""
    c = chat("qwen3_5")
    llm = LLM(c.path, **HOST, kv_cache_dir=tmp_path)
    one_by_one(llm, c.first)
    one_by_one(llm, c.turns)
    state = llm.cache.group_stats()[-1]
    lines = stats_text(llm).splitlines()
    slots = next(line for line in lines if line.startswith("state slots"))
    assert f"{state.num_hits} hits resumed {state.num_hit_tokens} tokens from one" in slots
    assert f"({state.num_lower_hits} from the host or disk tier)" in slots
    host = next(line for line in lines if line.startswith("state host tier"))
    assert f" {state.num_host_cached_blocks} of {state.num_host_blocks} snapshots used" in host
    assert any(line.startswith("state disk tier") for line in lines)
    marks = llm.cache.snapshot_nodes()
    assert sum(marks.values()) == state.num_snapshots  # each device snapshot ends in one node
    picture = render_tree(llm.cache.nodes(), snapshots=marks)
    marked = [line for line in picture.splitlines() if "snapshot" in line]
    assert len(marked) == len(marks)
    for node_id, n in marks.items():
        (line,) = [m for m in marked if f"#{node_id} [" in m]
        assert line.endswith(f"[{n} snapshot{'s' if n > 1 else ''}]")
    assert "snapshot" not in render_tree(llm.cache.nodes())


# Compact snapshots (`snapshot_dtype` bf16 / int8) go down the tiers as the device stores them:
# a resume from the host or the disk reads the very bytes a resume from the device would, so the
# output equals the same format's run in which every snapshot stays on the device (it may differ
# from transformers': a compact snapshot is rounded once, when taken).
# Two running slots: a compact leaving request's slot is read by its snapshot's copy in the next
# step, so a hit from the host loads into the other one (with one, it would wait for the copy).
COMPACT = [("qwen3_5", "bf16"), ("qwen3_5", "int8"), ("bamba", "int8"), ("kimi_linear", "bf16")]
HOST_COMPACT = dict(HOST, max_num_seqs=2)


def on_device_only(c: Chat, snapshot_dtype: str, **settings: Any) -> tuple[list, list[int]]:
    """The next turns' replies and hits in `snapshot_dtype` without lower tiers, with room for
    every snapshot taken: each turn resumes from its own conversation's, on the device."""
    settings = {**settings, "num_snapshots": 16}
    settings.pop("host_cache_bytes", None)
    llm = LLM(c.path, **settings, snapshot_dtype=snapshot_dtype)
    one_by_one(llm, c.first)
    tokens, hits = one_by_one(llm, c.turns)
    assert hits == c.ends() and llm.cache.group_stats()[-1].num_evicted == 0
    return tokens, hits


def _host_holds_compact_snapshots(llm: LLM) -> None:
    """The host tier's unit is a compact snapshot, and its budget is counted in those."""
    states, tier_io = llm.runner.states, llm.tier_ios[-1]
    assert states is not None and tier_io is not None
    size = tier_io.copier.host.bytes_per_block
    assert size == states.snapshot_nbytes() < states.slot_nbytes()
    share = int(llm.config.snapshot_share * llm.config.host_cache_bytes)
    assert llm.cache.group_stats()[-1].num_host_blocks == share // size
    assert tier_io.totals["offload"].nbytes == size * tier_io.totals["offload"].num_blocks


@pytest.mark.parametrize(("family", "snapshot_dtype"), COMPACT)
def test_a_compact_snapshot_evicted_to_the_host_comes_back_as_the_device_held_it(
    family, snapshot_dtype, chat
):
    c = chat(family)
    expected, _ = on_device_only(c, snapshot_dtype, **HOST_COMPACT)
    llm = LLM(c.path, **HOST_COMPACT, snapshot_dtype=snapshot_dtype)
    assert one_by_one(llm, c.first)[0] == c.first_replies  # nothing resumed yet
    state = llm.cache.group_stats()[-1]
    assert state.num_evicted >= 1 and state.num_host_cached_blocks >= 1
    tokens, hits = one_by_one(llm, c.turns)
    assert tokens == expected and hits == c.ends()
    state = llm.cache.group_stats()[-1]
    assert state.num_lower_hits >= 1 and state.snapshot_bytes < state.slot_bytes
    assert state_moved(llm, "load") == state.num_lower_hits
    _host_holds_compact_snapshots(llm)
    assert state.num_running_slots == 0


@pytest.mark.parametrize("snapshot_dtype", ["bf16", "int8"])
def test_a_restart_resumes_from_compact_snapshots_on_disk_but_not_another_formats(
    snapshot_dtype, chat, tmp_path
):
    """A restart in the same format resumes every turn from disk, as the device would have; one
    in another format finds no snapshot file of its own (the fingerprint names the format) and
    computes the turns cold, equal to transformers."""
    c = chat("qwen3_5")
    expected, _ = on_device_only(c, snapshot_dtype, **DISK)
    settings = dict(DISK, kv_cache_dir=tmp_path)
    first = LLM(c.path, **settings, snapshot_dtype=snapshot_dtype)
    assert one_by_one(first, c.first)[0] == c.first_replies
    first.save_kv_cache()
    first.check_integrity()
    del first
    restarted = LLM(c.path, **settings, snapshot_dtype=snapshot_dtype)
    tokens, hits = one_by_one(restarted, c.turns)
    assert tokens == expected and hits == c.ends()
    state = restarted.cache.group_stats()[-1]
    assert state.num_lower_hits == 3 and state.num_disk_reads == 3
    del restarted
    other = "int8" if snapshot_dtype == "bf16" else "exact"
    elsewhere = LLM(c.path, **settings, snapshot_dtype=other)
    tokens, _ = one_by_one(elsewhere, c.turns)
    state = elsewhere.cache.group_stats()[-1]
    assert state.num_lower_hits == 0 and state.num_disk_reads == 0
    if other == "exact":
        assert tokens == c.turn_replies

"""The window group's lower tiers: an evicted tail's full window blocks follow their prefix to
the host and disk tiers, and a hit past the device's tails resumes at the deepest block boundary
where both groups' blocks are found in some tier.

`Sim` plays the engine as `test_tiers.Sim` does, for both groups: every slot of every block holds
a stand-in for the KV of one position (a hash of the tokens up to it), the planned moves of each
group run in order on its own arrays and a real `DiskStore` each, and every position a request's
first query reads (all earlier ones in the full layers, the last W in the window layers) is
checked before it writes its own.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from kv_sim import run_move, sim_disk_store
from lifecycle import HashCount
from window_cache import window_cache

from radixkv.cache.events import BlockRemoved, BlockStored
from radixkv.cache.keys import BlockKey, token_bytes_le
from radixkv.cache.tiers import LowerHit
from radixkv.cache.tokens import PackedTokens
from radixkv.cache.window import first_live_index
from radixkv.engine.tiers.disk_store import DiskStore


def kv(tokens: list[int], pos: int) -> int:
    return xxhash.xxh64_intdigest(repr(tokens[: pos + 1]).encode()) or 1


def _disk(root: Path | None, name: str, block_size: int, files: int) -> DiskStore | None:
    if root is None:
        return None
    return sim_disk_store(root, {"sim": block_size, "group": name}, block_size, files)


class _Group:
    """One group's device and host arrays and its disk store; runs its moves."""

    def __init__(self, num_blocks: int, host_blocks: int, B: int, disk: DiskStore | None) -> None:
        self.device = np.zeros((num_blocks, B), np.uint64)
        self.host = np.zeros((host_blocks, B), np.uint64)
        self.disk = disk
        self.kinds: list[str] = []

    def run(self, moves: list[Any]) -> None:
        for move in moves:
            self.kinds.append(type(move).__name__)
            run_move(move, self.device, self.host, self.disk)


class Sim:
    def __init__(
        self,
        *,
        B: int = 4,
        window: int = 6,
        num_blocks: int = 24,
        num_window_blocks: int = 12,
        host_blocks: int = 64,
        root: Path | None = None,
        disk_files: int = 256,
        kv_events: bool = False,
        write_through: bool = False,
    ) -> None:
        full_disk = _disk(root, "full", B, disk_files)
        window_disk = _disk(root, "window", B, disk_files)
        self.cache = window_cache(
            num_blocks,
            num_window_blocks,
            B,
            window,
            host_blocks=host_blocks,
            disk=full_disk,
            window_host_blocks=host_blocks,
            window_disk=window_disk,
            kv_events=kv_events,
            write_through=write_through,
        )
        self.B, self.W = B, window
        self.full = _Group(num_blocks, host_blocks, B, full_disk)
        self.window = _Group(num_window_blocks, host_blocks, B, window_disk)

    def run_moves(self) -> None:
        full, window = self.cache.take_moves()
        self.full.run(full)
        self.window.run(window)
        self.cache.check_integrity()

    def serve(self, prompt: list[int], reply: list[int], namespace: str | None = None) -> int:
        """One request: admitted (its loads run), its reads checked, its KV written, committed
        with a tail one token short of the prompt; returns its hit."""
        cache, B, W = self.cache, self.B, self.W
        written = prompt + reply
        table = cache.admit(written, max_hit=len(prompt) - 1, namespace=namespace)
        assert table is not None
        self.run_moves()
        for group, copy in ((self.full, table.tables[0].copy), (self.window, table.tables[1].copy)):
            if copy is not None:
                src, dst, slots = copy
                group.device[dst, :slots] = group.device[src, :slots]
        hit = table.num_cached_tokens
        for pos in range(hit):
            block = table.tables[0].blocks[pos // B]
            assert self.full.device[block, pos % B] == kv(written, pos), ("full", pos)
        for pos in range(max(0, hit - W + 1), hit):
            block = table.tables[1].blocks[pos // B]
            assert block is not None, ("window released", pos)
            assert self.window.device[block, pos % B] == kv(written, pos), ("window", pos)
        for pos in range(hit, len(written)):
            self.full.device[table.tables[0].blocks[pos // B], pos % B] = kv(written, pos)
            self.window.device[table.tables[1].blocks[pos // B], pos % B] = kv(written, pos)
        cache.commit(table, written)
        qb = PackedTokens(prompt).tobytes()
        cache.groups[1].keep_tail(table.tables[1], qb, len(prompt) - 1)  # where a repeat resumes
        cache.slide(table, len(written))
        cache.close(table)
        self.run_moves()
        return hit


def _docs(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(1, 200) for _ in range(length)] for _ in range(n)]


def test_an_evicted_tail_is_demoted_and_a_repeat_resumes_from_the_host() -> None:
    sim = Sim()
    rng = random.Random(0)
    docs = _docs(rng, 6, 22)
    for doc in docs:  # the device holds about two of them
        assert sim.serve(doc, [7, 8]) == 0
    assert "Offload" in sim.window.kinds
    hits = [sim.serve(doc, [9]) for doc in docs[:3]]
    # a lower-tier hit resumes at the last block boundary before the prompt's last token
    assert hits == [20, 20, 20]
    assert "Load" in sim.window.kinds and "Load" in sim.full.kinds
    assert sim.cache.groups[1].tiers.counts["num_loaded_blocks"] > 0
    assert sim.cache.tree.stats().num_host_hit_tokens > 0


def test_a_tail_spills_to_disk_and_a_fresh_cache_resumes_from_it(tmp_path: Path) -> None:
    sim = Sim(host_blocks=8, root=tmp_path)
    rng = random.Random(1)
    docs = _docs(rng, 8, 22)
    for doc in docs:
        sim.serve(doc, [7, 8])
    assert "DiskWrite" in sim.window.kinds
    assert sim.serve(docs[0], [9]) == 20  # from disk: the host holds the later ones
    assert "DiskRead" in sim.window.kinds
    assert sim.cache.tree.stats().num_disk_hit_tokens > 0
    sim.cache.persist()
    sim.run_moves()
    fresh = Sim(host_blocks=8, root=tmp_path)  # a restart over the same folders
    assert fresh.cache.match(docs[-1], max_tokens=21).num_cached_tokens == 20
    assert fresh.serve(docs[-1], [9]) == 20
    assert "DiskRead" in fresh.window.kinds


def _tail_keys(sim: Sim) -> list[BlockKey]:
    return [key for tail in sim.cache.groups[1]._tails.values() for key in tail.keys]


@pytest.mark.parametrize("write_through", [False, True])
def test_write_through_copies_a_tail_to_the_host_when_it_is_kept(write_through: bool) -> None:
    """Written through, every tail's full blocks are on the host as soon as it is kept (written
    back, none before an eviction); the tails' eviction then copies nothing more, and a repeat
    resumes from the host (its reads checked by `serve`)."""
    sim = Sim(write_through=write_through)
    doc = _docs(random.Random(6), 1, 22)[0]
    sim.serve(doc, [7, 8])
    tiers = sim.cache.groups[1].tiers
    assert tiers is not None and sim.cache.groups[1].num_evicted_tails == 0
    keys = _tail_keys(sim)
    assert len(keys) >= 2 and sim.cache.groups[1].num_tails == 2
    assert [tiers.holds(key) for key in keys] == [write_through] * len(keys)
    assert ("Offload" in sim.window.kinds) == write_through
    offloaded = tiers.counts["num_offloaded_blocks"]
    sim.cache.groups[1].evict(sim.cache.groups[1].pool.num_blocks)
    assert sim.cache.groups[1].num_tails == 0 and all(map(tiers.holds, keys))
    assert (tiers.counts["num_offloaded_blocks"] == offloaded) == write_through
    sim.run_moves()
    loads = tiers.counts["num_loaded_blocks"]
    assert sim.serve(doc, [9]) == 20 and tiers.counts["num_loaded_blocks"] > loads


def test_no_window_blocks_below_no_hit() -> None:
    """A prefix whose full blocks are in the tiers but whose window blocks are not is no hit."""
    sim = Sim()
    doc = _docs(random.Random(2), 1, 22)[0]
    sim.serve(doc, [7, 8])
    tiers = sim.cache.groups[1].tiers
    assert tiers is not None
    tiers.clear()  # the window group's lower tiers forget everything; the device keeps its tail
    sim.cache.groups[1].evict(sim.cache.groups[1].pool.num_blocks)  # demotes the tail again
    sim.run_moves()
    tiers.clear()
    sim.run_moves()
    assert sim.cache.groups[1].num_tails == 0
    assert sim.cache.tree.match(doc, max_tokens=21).num_cached_tokens == 21
    assert sim.cache.match(doc, max_tokens=21).num_cached_tokens == 0
    assert sim.serve(doc, [9]) == 0


@pytest.mark.parametrize("write_through", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_through_every_tier_reads_only_what_it_claims(
    seed: int, write_through: bool, tmp_path: Path
) -> None:
    rng = random.Random(seed)
    sim = _random_sim(rng, tmp_path, write_through=write_through)
    stems = _docs(rng, 4, 12)
    hits = 0
    for _ in range(40):
        prompt = _random_prompt(rng, stems)
        hits += sim.serve(prompt, [rng.randrange(1, 200) for _ in range(rng.randrange(1, 4))])
    assert hits > 0
    counts = sim.cache.groups[1].tiers.counts
    assert counts["num_loaded_blocks"] > 0 and counts["num_offloaded_blocks"] > 0


def _random_sim(
    rng: random.Random, root: Path | None, *, kv_events: bool = False, write_through: bool = False
) -> Sim:
    B = rng.choice([1, 4])
    return Sim(
        B=B,
        window=rng.choice([3, 6]),
        num_blocks=96 // B,
        num_window_blocks=48 // B,
        host_blocks=64 // B,
        root=root,
        kv_events=kv_events,
        write_through=write_through,
    )


def _random_prompt(rng: random.Random, stems: list[list[int]]) -> list[int]:
    """A stem and a few tokens more; 3 in 10 become stems too."""
    prompt = rng.choice(stems) + [rng.randrange(1, 200) for _ in range(rng.randrange(1, 12))]
    if rng.random() < 0.3:
        stems.append(prompt)
    return prompt


def _lower_hit_from_scratch(
    sim: Sim, chain: list[BlockKey], num_matched: int, above: int
) -> LowerHit | None:
    """`WindowGroup.lower_hit` over the prompt's chain hashed from block 0, every boundary
    tried from the deepest down (no skipping)."""
    tiers, B = sim.cache.groups[1].tiers, sim.B
    assert tiers is not None
    if not tiers.entries and tiers.disk is None:
        return None
    for k in range(num_matched // B, above // B, -1):
        first = first_live_index(k * B, sim.W, B)
        found = tiers.lookup(first, chain[first:k])
        if len(found.keys) == k - first:
            return LowerHit(tiers, first, tuple(chain[first:k]), found.h)
    return None


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_keys_handed_to_the_window_group_equal_the_chain_hashed_from_scratch(
    seed: int, tmp_path: Path
) -> None:
    """At every admission of a random workload (two namespaces, hits in every tier), the full
    group's keys of the prompt, which the window group's lookup reads instead of hashing the
    prompt again, equal its chain hashed from block 0 over any span, and the window group's
    lower hit equals one found with that chain."""
    rng = random.Random(seed)
    sim = _random_sim(rng, tmp_path if seed % 2 else None, kv_events=bool(seed // 2))
    cache, B = sim.cache, sim.B
    stems = _docs(rng, 4, 12)
    lower_hits = 0
    for _ in range(40):
        prompt = _random_prompt(rng, stems)
        namespace = rng.choice([None, "tenant"])
        found, keys = cache.tree.lookup(prompt, max_tokens=len(prompt) - 1, namespace=namespace)
        assert keys is not None
        qb = PackedTokens(prompt).tobytes()
        num_full = len(prompt) // B
        chain = cache.tree.key_chain.chain(namespace, token_bytes_le(qb[: 4 * B * num_full]))
        for _ in range(4):
            lo = rng.randrange(num_full + 1)
            hi = rng.randrange(lo, num_full + 1)
            assert keys.span(lo, hi) == chain[lo:hi]
        assert keys.span(0, num_full) == chain
        m = found.num_cached_tokens
        above = cache.groups[1].hit(qb, m, namespace)
        lower = cache.groups[1].lower_hit(keys, m, above)
        assert lower == _lower_hit_from_scratch(sim, chain, m, above)
        lower_hits += lower is not None
        cache.check_integrity()
        sim.serve(prompt, [rng.randrange(1, 200) for _ in range(rng.randrange(1, 4))], namespace)
    assert lower_hits > 0


def test_an_admission_hashes_each_block_of_its_prompt_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt whose hit runs through the tree, the full group's host tier and the
    window group's: its admission hashes each block at most once (the window group reads the
    full group's keys, and the full group's admission those of its own lookup)."""
    B = 4
    sim = Sim(B=B, num_blocks=32, num_window_blocks=22)
    rng = random.Random(5)
    long, other = _docs(rng, 1, 80)[0], _docs(rng, 1, 76)[0]
    sim.serve(long, [7, 8])
    sim.serve(other, [7, 8])  # evicts the long prompt's last blocks and its window tails
    assert sim.cache.groups[1].num_tails == 2
    count = HashCount(monkeypatch)
    table = sim.cache.admit(long, max_hit=len(long) - 1)
    assert table is not None
    assert count.num_blocks > 0 and max(count.per_block.values()) == 1
    sim.run_moves()  # (its integrity check hashes every path again)
    # the hit: 12 blocks in the tree, 7 more on the full group's host, their window there too
    assert table.num_cached_tokens == 76 and sim.cache.tree.stats().num_host_hit_tokens == 28
    assert "Load" in sim.window.kinds
    sim.cache.close(table)
    sim.cache.check_integrity()


def test_each_tier_announces_the_window_blocks_it_holds_as_group_1(tmp_path: Path) -> None:
    """Per (tier, group), a strict index fed the one queue holds exactly what that tier holds:
    the host and disk events of the window group's tiers say group 1 and their medium."""
    sim = Sim(host_blocks=8, root=tmp_path, kv_events=True)
    index: dict[tuple[str | None, int], set[int]] = {}
    rng = random.Random(3)
    for doc in _docs(rng, 8, 22) * 2:
        sim.serve(doc, [7, 8])
        for event in sim.cache.tree.take_events():
            held = index.setdefault((event.medium, event.group_idx), set())
            hashes = set(event.block_hashes)
            if isinstance(event, BlockStored):
                assert not hashes & held, "stored twice in one tier and group"
                assert (event.sliding_window is not None) == (event.group_idx == 1)
                held |= hashes
            else:
                assert isinstance(event, BlockRemoved) and hashes <= held, "unknown removal"
                held -= hashes
    tiers = sim.cache.groups[1].tiers
    assert tiers is not None and tiers.disk is not None
    assert index[("CPU", 1)] == set(tiers.entries) and index[("CPU", 1)]
    on_disk = index[("DISK", 1)]
    assert on_disk and len(on_disk) == tiers.disk.num_files
    assert all(tiers.disk.contains(h) for h in on_disk)


def test_a_reset_clears_both_groups_in_every_tier(tmp_path: Path) -> None:
    sim = Sim(host_blocks=8, root=tmp_path, kv_events=True)
    docs = _docs(random.Random(4), 6, 22)
    for doc in docs:
        sim.serve(doc, [7, 8])
    sim.cache.tree.take_events()
    assert sim.cache.reset()
    events = sim.cache.tree.take_events()
    assert type(events[0]).__name__ == "AllBlocksCleared"
    assert {(e.medium, e.group_idx) for e in events[1:]} <= {("CPU", 0), ("CPU", 1)}
    tiers = sim.cache.groups[1].tiers
    assert tiers is not None and not tiers.entries and sim.cache.groups[1].num_tails == 0
    assert sim.cache.groups[1].pool.num_free == sim.cache.groups[1].pool.num_blocks
    sim.cache.check_integrity()
    for doc in docs:  # served again from what is left (the disk keeps its files), reads checked
        sim.serve(doc, [9])

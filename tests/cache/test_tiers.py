"""The lower tiers under the tree: demotion on device eviction, hits in every tier, loads planned
into the table, tenants apart, KV events naming the tier.

`Sim` plays the engine: every slot of every device and host block holds a stand-in for the KV of
one position (a hash of the namespace and the tokens up to it), the planned moves run in order on
those arrays and a real `DiskStore`, a request's prefill writes its slots; so a test checks that
every block a table reads holds exactly the prefix it claims, in every tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_sim import run_move, sim_disk_store
from lifecycle import CheckedCache

from radixkv import PrefixCache
from radixkv.cache.events import BlockRemoved, BlockStored
from radixkv.cache.keys import KeyChain
from radixkv.cache.moves import DiskRead, DiskWrite, Load, Offload
from radixkv.cache.tokens import pack_tokens

EMPTY = 0  # a slot nothing was written to


def kv(namespace: str | None, tokens: Sequence[int], pos: int) -> int:
    """The stand-in for the KV of position `pos` of `tokens` (it depends on the whole prefix)."""
    return xxhash.xxh64_intdigest(repr((namespace, list(tokens[: pos + 1]))).encode()) or 1


class Sim:
    """A cache and the engine's side of it, with KV stand-ins (see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        host_blocks: int,
        disk_dir: Path | None = None,
        disk_files: int = 0,
        **options: Any,
    ) -> None:
        B = block_size
        self.disk = (
            None if disk_dir is None else sim_disk_store(disk_dir, {"sim": B}, B, disk_files)
        )
        self.cache = CheckedCache(
            PrefixCache(num_blocks, B, host_blocks=host_blocks, disk=self.disk, **options)
        )
        self.B = B
        self.device = np.zeros((num_blocks, B), np.uint64)
        self.host = np.zeros((max(host_blocks, 1), B), np.uint64)
        self.moves: list[Any] = []

    def run_moves(self) -> None:
        for move in self.cache.take_moves():
            self.moves.append(move)
            run_move(move, self.device, self.host, self.disk)

    def serve(self, prompt: list[int], reply: list[int], namespace: str | None = None) -> int:
        """One request's life, KV checked on admission and written as computed; its hit."""
        table = self.admit(prompt, namespace)
        self.run_moves()
        return self.compute(table, prompt, reply, namespace)

    def admit(self, prompt: list[int], namespace: str | None) -> Any:
        table = self.cache.admit(prompt, max_hit=len(prompt) - 1, namespace=namespace)
        if table is None:  # its lock pins too much: the scheduler's fallback
            table = self.cache.admit(prompt, max_hit=0, namespace=namespace)
        assert table is not None
        return table

    def compute(self, table: Any, prompt: list[int], reply: list[int], ns: str | None) -> int:
        """The rest of a request's life once its loads ran: the KV it reads is checked, the KV
        it computes written, committed and closed; its hit."""
        cache, B = self.cache, self.B
        written = prompt + reply
        if table.copy is not None:
            src, dst, slots = table.copy
            self.device[dst, :slots] = self.device[src, :slots]
        hit = table.num_cached_tokens
        for pos in range(hit):
            b = table.blocks[pos // B]
            assert self.device[b, pos % B] == kv(ns, prompt, pos), (pos, b, table)
        assert cache.grow(table, -(-len(written) // B) - len(table.blocks))
        self.run_moves()
        for pos in range(hit, len(written)):
            self.device[table.blocks[pos // B], pos % B] = kv(ns, written, pos)
        cache.commit(table, written)
        cache.close(table)
        self.run_moves()
        return hit


def test_an_evicted_block_is_demoted_and_loaded_back() -> None:
    sim = Sim(num_blocks=4, block_size=4, host_blocks=8)
    a, b = list(range(100, 116)), list(range(200, 216))
    assert sim.serve(a, []) == 0
    assert sim.serve(b, []) == 0  # a's 4 blocks leave the device for b's
    assert sim.moves == [Offload((0, 1, 2, 3), (0, 1, 2, 3))]  # the leaf goes whole
    match = sim.cache.match(a, max_tokens=15)
    assert (match.num_cached_tokens, match.block_ids, match.num_host_blocks) == (15, (), 4)
    sim.moves.clear()
    assert sim.serve(a, []) == 15  # KV checked slot by slot
    offload, load = sim.moves[:2]
    assert offload == Offload((0, 1, 2, 3), (4, 5, 6, 7))  # b leaves the device for a
    assert load == Load((0, 1, 2, 3), (0, 1, 2, 3))  # into the blocks b just left
    stats = sim.cache.stats()
    assert (stats.num_host_hit_tokens, stats.num_hit_tokens, stats.num_loaded_blocks) == (15, 15, 4)


def test_a_hit_goes_on_from_the_tree_into_the_host_tier() -> None:
    sim = Sim(num_blocks=8, block_size=4, host_blocks=16)
    a = list(range(24))
    sim.serve(a, [])
    sim.serve(list(range(100, 124)), [])  # 4 of a's 6 blocks go to the host, tail first
    match = sim.cache.match(a, max_tokens=23)
    assert (match.num_cached_tokens, len(match.block_ids), match.num_host_blocks) == (23, 2, 4)
    assert sim.serve(a + [7, 8], [9]) == 24


def test_a_partial_tree_block_is_replaced_by_the_full_one_below() -> None:
    sim = Sim(num_blocks=5, block_size=4, host_blocks=8)
    a = list(range(16))
    sim.serve(a, [])
    sim.serve(list(range(100, 120)), [])
    sim.serve(a[:6], [])  # the tree holds a[:6] again: block 1 partial (2 slots)
    assert sim.cache.match(a, max_tokens=15).num_cached_tokens == 15
    assert sim.serve(a, []) == 15


def test_tenants_never_share_a_block_in_the_host_tier() -> None:
    sim = Sim(num_blocks=4, block_size=4, host_blocks=8)
    a = list(range(16))
    sim.serve(a, [], namespace="t1")
    sim.serve(list(range(100, 116)), [], namespace="t2")
    assert sim.cache.stats().num_host_cached_blocks == 4
    for ns in (None, "t2", ""):
        assert sim.cache.match(a, max_tokens=15, namespace=ns).num_cached_tokens == 0
    assert sim.cache.match(a, max_tokens=15, namespace="t1").num_cached_tokens == 15


def test_a_full_host_tier_spills_to_disk_and_a_fresh_process_reads_it(tmp_path: Path) -> None:
    sim = Sim(num_blocks=4, block_size=4, host_blocks=4, disk_dir=tmp_path, disk_files=64)
    a, b, c = list(range(16)), list(range(100, 116)), list(range(200, 216))
    for seq in (a, b, c):
        sim.serve(seq, [])
    assert any(isinstance(m, DiskWrite) for m in sim.moves)  # a went host -> disk
    match = sim.cache.match(a, max_tokens=15)
    assert (match.num_host_blocks, match.num_disk_blocks) == (0, 4)
    assert sim.serve(a, []) == 15
    assert sim.cache.stats().num_disk_hit_tokens == 15
    # A restart: a new cache over the same directory finds b (written when it left the host).
    fresh = Sim(num_blocks=4, block_size=4, host_blocks=4, disk_dir=tmp_path, disk_files=64)
    assert fresh.cache.match(b, max_tokens=15).num_disk_blocks == 4
    assert fresh.serve(b, []) == 15
    assert fresh.cache.match(b, max_tokens=15, namespace="other").num_cached_tokens == 0


def test_write_through_copies_at_commit_and_eviction_copies_nothing() -> None:
    sim = Sim(num_blocks=4, block_size=4, host_blocks=8, write_through=True)
    a = list(range(14))
    sim.serve(a, [])
    assert sim.moves == [Offload((0, 1, 2), (0, 1, 2))]  # the full blocks, at commit
    sim.moves.clear()
    sim.serve(list(range(100, 116)), [])
    assert sim.moves == [Offload((0, 1, 2, 3), (3, 4, 5, 6))]  # b's own, none for a's eviction
    assert sim.serve(a, []) == 12  # the lower tiers hold full blocks: the partial tail is gone


def test_kv_events_name_the_tier() -> None:
    sim = Sim(num_blocks=4, block_size=4, host_blocks=8, kv_events=True)
    sim.serve(list(range(16)), [])
    sim.cache.take_events()
    sim.serve(list(range(100, 116)), [])
    events = sim.cache.take_events()
    host_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    device_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium is None]
    assert len(host_stored) == 4 and sum(len(e.block_hashes) for e in device_removed) == 4
    assert {h for e in host_stored for h in e.block_hashes} == {
        h for e in device_removed for h in e.block_hashes
    }
    assert host_stored[0].token_ids == (0, 1, 2, 3) and host_stored[0].parent_block_hash is None
    # Loading back keeps the host copy: nothing leaves the host tier (b enters it).
    sim.serve(list(range(16)), [])
    events = sim.cache.take_events()
    assert not [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]


def keys_of(tokens: Sequence[int], block_size: int = 4) -> list[Any]:
    num_full = len(tokens) // block_size
    return KeyChain(block_size).prompt_keys(pack_tokens(tokens), num_full, 0, None, None)


def test_the_disk_run_stops_before_a_block_the_host_holds(tmp_path: Path) -> None:
    """The host holds a prompt's blocks 2-3, the disk all four: the disk run stages 0-1 only
    (staging 2-3 again would leave the host two entries of one block), and the next admission
    goes on from the host."""
    sim = Sim(num_blocks=8, block_size=4, host_blocks=8, disk_dir=tmp_path, disk_files=64)
    a, b = list(range(16)), list(range(100, 116))
    sim.serve(a, [])
    sim.serve(b, [])
    sim.cache.persist()
    sim.cache.evict(8)  # nothing on the device; every block on the host and on disk
    sim.run_moves()
    tiers = sim.cache.inner._tiers
    lost = keys_of(a)[:2] + keys_of(b)[:2]  # a failed move: their host copies are garbage
    sim.cache.forget([tiers.entries[k.block_hash].block for k in lost])
    assert [tiers.holds(k) for k in keys_of(a)] == [False, False, True, True]
    assert sim.disk is not None and sim.disk.probe(keys_of(a)) == 4
    match = sim.cache.match(a, max_tokens=15)
    assert (match.num_cached_tokens, match.num_host_blocks, match.num_disk_blocks) == (8, 0, 2)
    assert sim.serve(a, []) == 8  # integrity checked after every call
    sim.cache.evict(8)
    sim.run_moves()
    assert sim.cache.match(a, max_tokens=15).num_host_blocks == 4
    assert sim.serve(a, []) == 15


def test_a_disk_load_replaces_a_host_entry_of_the_same_block(tmp_path: Path) -> None:
    """A block that entered the host between the lookup and the load (a demotion on the way):
    the staged copy replaces the entry instead of leaving two of one hash."""
    sim = Sim(num_blocks=8, block_size=4, host_blocks=8, disk_dir=tmp_path, disk_files=64)
    a = list(range(16))
    keys = keys_of(a)
    for i, key in enumerate(keys):
        assert sim.disk is not None and sim.disk.put(key, sim.host[0] + i)
    tiers = sim.cache.inner._tiers
    tiers.pin(keys, 0, 4)
    tiers.demote(keys[2:], [6, 7])  # as the device's eviction for this admission would
    tiers.load(keys, 0, 4, [0, 1, 2, 3])
    tiers.check_integrity()
    assert len(tiers.entries) == 4 and tiers.pool.num_free == 4
    read = [m for m in tiers.take_moves() if isinstance(m, DiskRead)]
    assert [k.block_hash for k in read[0].keys] == [k.block_hash for k in keys]


def test_a_fault_while_planning_a_load_leaks_no_block_lock_or_pin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = Sim(num_blocks=8, block_size=4, host_blocks=8, disk_dir=tmp_path, disk_files=64)
    a = list(range(16))
    sim.serve(a, [])
    sim.cache.persist()
    sim.cache.evict(8)
    sim.run_moves()
    tiers = sim.cache.inner._tiers

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tiers, "load", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sim.cache.admit(a + [99], max_hit=16)  # the wrapper checks integrity on the way out
    stats = sim.cache.stats()
    assert stats.num_free_blocks == 8 and stats.num_locked_tables == 0
    assert len(tiers.entries.order) == len(tiers.entries)  # nothing left pinned
    monkeypatch.undo()
    assert sim.serve(a + [99], []) == 16


# ------------------------------------------------------------------------------------ random
BASES = [list(np.random.default_rng(seed).integers(0, 3, 40)) for seed in range(3)]
request = st.tuples(
    st.sampled_from([None, "t"]),  # namespace
    st.integers(0, 2),  # which conversation
    st.integers(2, 26),  # prompt length
    st.integers(0, 3),  # reply length
)


@pytest.mark.parametrize("block_size", [1, 4])
@settings(max_examples=25, deadline=None)
@given(requests=st.lists(request, min_size=1, max_size=25))
def test_random_workload_with_a_host_tier_large_enough_loses_no_full_block(
    block_size: int, requests: list
) -> None:
    """Soundness (every slot read holds its prefix's KV, checked in `serve`) and completeness:
    with a host tier that never evicts, every full block once written is a hit."""
    B = block_size
    sim = Sim(num_blocks=2 * -(-29 // B) + 1, block_size=B, host_blocks=800 // B)
    written: list[tuple[str | None, list[int]]] = []
    for ns, base, n, r in requests:
        prompt, reply = [int(t) for t in BASES[base][:n]], [int(t) for t in BASES[base][n : n + r]]
        best = max(
            (_lcp(prompt, w) for wns, w in written if wns == ns),
            default=0,
        )
        hit = sim.serve(prompt, reply, ns)
        assert hit >= min(len(prompt) - 1, best // B * B), (hit, best)
        written.append((ns, prompt + reply))


@pytest.mark.parametrize("block_size", [1, 4])
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=st.lists(request, min_size=1, max_size=25))
def test_random_workload_through_all_three_tiers_under_pressure(
    tmp_path_factory: pytest.TempPathFactory, block_size: int, requests: list
) -> None:
    """Small device, host and disk budgets: demotions, spills to disk, disk reads and evictions
    everywhere; every slot read holds its prefix's KV, the disk stays inside its budget, and the
    host tier's KV events tell a router exactly what it holds."""
    B = block_size
    root = tmp_path_factory.mktemp("kv")
    device = 2 * -(-29 // B) + 1
    sim = Sim(
        device, B, host_blocks=12 // B + 2, disk_dir=root, disk_files=24 // B + 3, kv_events=True
    )
    # the lower tiers' blocks as a router learns them from the events
    seen: dict[str, set[int]] = {"CPU": set(), "DISK": set()}
    for ns, base, n, r in requests:
        prompt, reply = [int(t) for t in BASES[base][:n]], [int(t) for t in BASES[base][n : n + r]]
        sim.serve(prompt, reply, ns)
        assert sim.disk is not None and sim.disk.num_bytes <= sim.disk.budget_bytes
        for event in sim.cache.take_events():
            held = seen.get(getattr(event, "medium", None) or "")
            if held is not None and isinstance(event, BlockStored):
                assert not held.intersection(event.block_hashes), "stored twice"
                held.update(event.block_hashes)
            elif held is not None and isinstance(event, BlockRemoved):
                assert held.issuperset(event.block_hashes), "removed, never stored"
                held.difference_update(event.block_hashes)
        assert seen["CPU"] == set(sim.cache.inner._tiers.entries)
        assert seen["DISK"] == set(sim.disk._entries)
    assert sum(1 for _ in root.rglob("*.kv")) == sim.disk.num_files


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n

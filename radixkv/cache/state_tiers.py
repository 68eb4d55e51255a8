"""The state group's lower tiers: snapshots in the host and disk tiers, under the KV's chained keys.

A snapshot is one fixed-size unit (every recurrent layer's state after exactly `end` tokens of a
prefix), so a lower tier holds it as one host block or one block file, named by a `BlockKey` of
the same chain as the KV blocks of its prefix (`radixkv.cache.keys`): the link of its *tail*,
the tokens after the last full block strictly before `end`, chained from that block's key:

    positions   0 ......... 16 ......... 32 ... 37         (B = 16)
    blocks      [ block 0  ][ block 1  ][tail )
    key(37)     = the chain's link over tokens [32, 37), after the key of block 1

so a snapshot at a block boundary (a tail of B tokens) has exactly the key of the KV block ending
there, and every key covers the namespace and the whole prefix (its hash and its prefix digest),
as a KV block's does: a snapshot is never loaded for another prefix or tenant.

A lookup needs the ends at which the lower tiers hold snapshots (they are token-granular, and a
prompt's keys name only its full blocks): `SnapshotTiers` indexes them by the hash of the parent
block (tail lengths per snapshot hash), from the host tier's entries, the disk tier's files
(their headers, read once when the store opens, then what it indexes and forgets), so `find`
walks a prompt's block keys once, deepest first, and hashes a tail only where a snapshot of its
length hangs under that block.

Everything else is `LowerTiers`' (the moves it plans, the pins of a planned load, the LRU order,
the events): the state group demotes a snapshot it evicts for room (`demote`, one unit), loads a
hit straight into the running slot of the request that resumes there (`LowerHit.load`), and
writes every snapshot down on `persist`.
"""

from __future__ import annotations

from radixkv.cache.events import EventRecorder
from radixkv.cache.keys import BlockKey, KeyChain, PromptKeys, chain_keys, token_bytes_le
from radixkv.cache.tiers import DiskIndex, HostEntry, LowerHit, LowerTiers
from radixkv.cache.tokens import TOKEN_BYTES

SNAPSHOT_KIND = "mamba"  # vLLM's kv_cache_spec_kind of a recurrent state's group


def tail_start(end: int, block_size: int) -> int:
    """Where the tail of the snapshot at `end` (>= 1) starts: the last block boundary before it."""
    return (end - 1) // block_size * block_size


def snapshot_key(
    chain: KeyChain, namespace: str | None, qb: bytes, end: int, parent: BlockKey | None
) -> BlockKey:
    """The key of the snapshot after `end` tokens of the packed tokens `qb`, whose tail is chained
    from `parent` (the key of block tail_start(end) // B - 1; None when the tail starts at 0)."""
    lo = tail_start(end, chain.block_size)
    tail = token_bytes_le(qb[TOKEN_BYTES * lo : TOKEN_BYTES * end])
    return chain_keys(namespace, tail, end - lo, after=parent, hasher=chain.hasher)[0]


def prefix_snapshot_key(chain: KeyChain, namespace: str | None, qb: bytes, end: int) -> BlockKey:
    """`snapshot_key` with its parent hashed from the prefix itself: O(end)."""
    num_full = tail_start(end, chain.block_size) // chain.block_size
    full = token_bytes_le(qb[: TOKEN_BYTES * chain.block_size * num_full])
    parent = chain.chain(namespace, full)[-1] if num_full else None
    return snapshot_key(chain, namespace, qb, end, parent)


class SnapshotTiers(LowerTiers):
    """The host tier (`num_host_slots` snapshots) and the disk store of the state group, named by
    `chain`'s keys (see the module docstring); its events name group `group` of kind
    SNAPSHOT_KIND.

    Invariants (`check_integrity`, besides `LowerTiers`'): every host entry is indexed under its
    parent with its tail's length; the index by parent and by hash agree."""

    def __init__(
        self,
        num_host_slots: int,
        chain: KeyChain,
        disk: DiskIndex | None,
        events: EventRecorder | None,
        *,
        group: int,
    ) -> None:
        super().__init__(
            num_host_slots, chain.block_size, disk, events, group=group, kind=SNAPSHOT_KIND
        )
        self.chain = chain
        self._tails: dict[int | None, dict[int, int]] = {}  # parent hash -> {hash: tail tokens}
        self._parent: dict[int, int | None] = {}  # hash -> parent hash
        if disk is not None:
            for block_hash, parent, tokens in disk.heads():
                self._note(block_hash, parent, len(tokens) // TOKEN_BYTES)
            stored, removed = disk.on_stored, disk.on_removed

            def on_stored(key: BlockKey) -> None:
                self._note(key.block_hash, key.parent_hash, len(key.tokens) // TOKEN_BYTES)
                if stored is not None:
                    stored(key)

            def on_removed(block_hash: int) -> None:
                if block_hash not in self.entries:
                    self._unnote(block_hash)
                if removed is not None:
                    removed(block_hash)

            disk.on_stored, disk.on_removed = on_stored, on_removed

    @property
    def num_indexed(self) -> int:
        """Snapshots the host or disk tier may hold (a file another process removed included)."""
        return len(self._parent)

    def find(
        self, keys: PromptKeys, qb: bytes, namespace: str | None, above: int, upto: int
    ) -> tuple[int, LowerHit] | None:
        """The deepest end e, `above` < e <= `upto`, of the packed prompt `qb` (whose full blocks'
        keys `keys` names) at which the host or disk tier holds a snapshot, and the `LowerHit`
        that loads it; None when there is none. Mutates nothing (the disk is probed, not read).
        O(blocks up to `upto`) lookups, a tail hashed only where a snapshot of its length is."""
        B = self.block_size
        if not self._parent or upto <= above:
            return None
        top = tail_start(upto, B) // B  # the deepest tail hangs under block top - 1
        full = keys.span(0, top)
        for j in range(top, above // B - 1, -1):
            parent = full[j - 1] if j else None
            tails = self._tails.get(None if parent is None else parent.block_hash)
            if not tails:
                continue
            for r in sorted(set(tails.values()), reverse=True):
                end = j * B + r
                if not above < end <= upto:
                    continue
                key = snapshot_key(self.chain, namespace, qb, end, parent)
                if tails.get(key.block_hash) != r:
                    continue
                hit = self.lookup(0, [key])
                if hit.keys:
                    return end, hit
        return None

    def check_integrity(self) -> None:
        super().check_integrity()
        for entry in self.entries.values():
            key = entry.key
            r = self._tails.get(key.parent_hash, {}).get(key.block_hash)
            if r != len(key.tokens) // TOKEN_BYTES:
                raise AssertionError(f"host snapshot {key.block_hash:016x} is not indexed")
        by_parent = {h: p for p, tails in self._tails.items() for h in tails}
        if by_parent != self._parent or any(not tails for tails in self._tails.values()):
            raise AssertionError("the snapshot index by parent and by hash disagree")

    # ---------------------------------------------------------------- internals
    def _add(self, key: BlockKey, block: int) -> None:
        super()._add(key, block)
        self._note(key.block_hash, key.parent_hash, len(key.tokens) // TOKEN_BYTES)

    def _remove(self, entry: HostEntry) -> None:
        super()._remove(entry)
        h = entry.key.block_hash
        if self.disk is None or not self.disk.contains(h):
            self._unnote(h)

    def _note(self, block_hash: int, parent: int | None, num_tail: int) -> None:
        old = self._parent.get(block_hash, parent)
        if old != parent:  # another prefix's snapshot under this hash: the newer one is indexed
            self._unnote(block_hash)
        self._tails.setdefault(parent, {})[block_hash] = num_tail
        self._parent[block_hash] = parent

    def _unnote(self, block_hash: int) -> None:
        if block_hash not in self._parent:
            return
        parent = self._parent.pop(block_hash)
        tails = self._tails[parent]
        del tails[block_hash]
        if not tails:
            del self._tails[parent]

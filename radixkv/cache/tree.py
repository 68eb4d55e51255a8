"""The radix tree: compressed, token-granular, block-owning nodes (internals of `PrefixCache`).

Token map of a path (B = 4), nodes a -> b -> c, and the block indices each node owns:

    positions   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13
    node a      [0 ............ 6)                        owns indices 0, 1       blocks [10, 11]
    node b                   [6 ......... 10)              owns indices 1, 2       blocks [11, 12]
    node c                             [10 .......... 14)  owns indices 2, 3       blocks [12, 13]

A node owns the block ids of every block index its segment touches, so a block that holds a node
boundary (index 1: a's tail and b's head; index 2) is owned by both nodes and its ref count counts
both. The tree never looks at KV contents; the rule that makes a match correct is:

    a node's block at index i holds valid KV for positions [i*B, min((i+1)*B, node.end)) of its
    path.

So for each block index a match uses the block of the *deepest* path node that touches the index
within the matched range (a diverging branch's own copy of a split block wins over the parent's).

Tokens are stored packed (`bytes`, native uint32): 4 bytes a token, compared with memcmp
(`bytes.startswith`) a whole node at a time; only the node where a walk diverges looks for the first
mismatch (bisection by memcmp, then one big-integer XOR). No per-token Python loop touches a
prompt, and a node costs 4 bytes a token (numpy int32 arrays would cost the same plus ~100 bytes of
header each, and a call per comparison).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from radixkv.cache.eviction import EvictionIndex, EvictionKey, lru_key
from radixkv.cache.pool import BlockPool

TOKEN_BYTES = 4
MAX_TOKEN_ID = 2**32 - 1
_TOKEN_DTYPE = np.dtype("=u4")
_INT32_DTYPE = np.dtype("=i4")
_SIGN_BYTE = TOKEN_BYTES - 1 if sys.byteorder == "little" else 0  # byte holding bit 31 of a token
assert array("I").itemsize == TOKEN_BYTES, "radixkv needs a 4-byte C unsigned int"
_unpack_token = struct.Struct("=I").unpack_from
_new_object = object.__new__


def pack_tokens(tokens: Sequence[int], name: str = "tokens") -> bytes:
    """Validate and pack token ids into native uint32 bytes (one C pass over the sequence).

    Accepts any sequence of ints (bool counts as an int; numpy integer arrays take a vectorised
    path; a `PackedTokens` is packed and valid already). Raises TypeError for a non-sequence or a
    non-int element and ValueError for an id outside [0, 2**32 - 1], naming the first offending
    position. Mutates nothing.
    """
    if type(tokens) is PackedTokens:
        return tokens._packed
    if isinstance(tokens, np.ndarray):
        return _pack_ndarray(tokens, name)
    return _as_uint32_array(tokens, name, "a token id").tobytes()


class PackedTokens(Sequence[int]):
    """Token ids validated once and packed the way the cache stores them (native uint32).

    Immutable. Every `PrefixCache` call that takes tokens reads one as is: no validation, no copy.
    A list of n ids costs ~n x 8 ns to validate on each call that takes it; a caller that hands
    the same tokens to several calls (`match` the prompt, then `insert` prompt + reply; a chat,
    turn after turn) pays that once per token with a PackedTokens. `+` appends (validating the
    other operand only), a slice with step 1 is a PackedTokens, `tobytes()` gives the packed
    bytes. Raises like `match` for ids that are not ints in [0, 2**32).
    """

    __slots__ = ("_packed",)

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self._packed: bytes = pack_tokens(tokens)

    @staticmethod
    def _of(packed: bytes) -> PackedTokens:
        """Wrap bytes known to be packed token ids (from other PackedTokens): no validation."""
        obj = _new_object(PackedTokens)
        obj._packed = packed
        return obj

    def __len__(self) -> int:
        return len(self._packed) // TOKEN_BYTES

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> PackedTokens: ...
    def __getitem__(self, index: int | slice) -> int | PackedTokens:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return PackedTokens._of(self._packed[4 * start : 4 * max(start, stop)])
            return PackedTokens(self.tolist()[index])
        try:
            return memoryview(self._packed).cast("I")[index]
        except IndexError:
            raise IndexError("PackedTokens index out of range") from None

    def __iter__(self) -> Iterator[int]:
        return iter(memoryview(self._packed).cast("I"))

    def __add__(self, other: Sequence[int]) -> PackedTokens:
        return PackedTokens._of(self._packed + pack_tokens(other, "other"))

    def __radd__(self, other: Sequence[int]) -> PackedTokens:
        return PackedTokens._of(pack_tokens(other, "other") + self._packed)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedTokens):
            return self._packed == other._packed
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._packed)

    def __repr__(self) -> str:
        n = len(self)
        head = ", ".join(map(str, self[:8]))
        return f"PackedTokens([{head}{', ...' if n > 8 else ''}], len={n})"

    def tobytes(self) -> bytes:
        return self._packed

    def tolist(self) -> list[int]:
        return memoryview(self._packed).cast("I").tolist()


def _pack_ndarray(tokens: np.ndarray, name: str) -> bytes:
    if tokens.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tokens.shape}")
    dtype = tokens.dtype
    if dtype == _TOKEN_DTYPE:
        return tokens.tobytes()  # every uint32 is a token id
    if dtype == _INT32_DTYPE:
        # The common array (tokenizers hand out int32): a non-negative int32 has the bytes of the
        # same uint32, so the sign bits are the only check. They are read from the packed bytes
        # (the top byte of every token must be < 0x80): a strided copy and a scan, both C loops
        # over bytes already in cache, cheaper than numpy's reduction machinery (a few µs a call).
        packed = tokens.tobytes()
        if not packed[_SIGN_BYTE::TOKEN_BYTES].isascii():
            _raise_bad_token_array(tokens, name)
        return packed
    if dtype.kind not in "iu":
        raise TypeError(f"{name} must hold ints, got dtype {dtype}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > MAX_TOKEN_ID):
        _raise_bad_token_array(tokens, name)
    return tokens.astype(_TOKEN_DTYPE, copy=False).tobytes()


def _raise_bad_token_array(tokens: np.ndarray, name: str) -> None:
    bad = int(np.flatnonzero((tokens < 0) | (tokens > MAX_TOKEN_ID))[0])
    raise ValueError(f"{name}[{bad}] = {int(tokens[bad])} is not a token id in [0, {MAX_TOKEN_ID}]")


def _as_uint32_array(values: Sequence[int], name: str, what: str) -> array:
    """`values` as array('I'): C unsigned ints accept exactly the ints in [0, 2**32), so type, sign
    and range are checked in one C pass that reads the list in place (struct.pack(*values) was
    slower: it builds an argument tuple, touching every int object twice more)."""
    if type(values) is not list and (
        isinstance(values, (str, bytes, bytearray, memoryview)) or not hasattr(values, "__len__")
    ):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    try:
        return array("I", values)
    except (TypeError, OverflowError):
        pass
    for i, v in enumerate(values):  # slow path, only to name the culprit
        if not hasattr(v, "__index__"):
            raise TypeError(f"{name}[{i}] = {v!r} is not an int ({type(v).__name__})") from None
        if not 0 <= int(v) <= MAX_TOKEN_ID:
            raise ValueError(f"{name}[{i}] = {int(v)} is not {what} in [0, {MAX_TOKEN_ID}]")
    raise TypeError(f"{name} could not be read as ints")  # pragma: no cover


def block_id_array(block_ids: Sequence[int], name: str = "block_ids") -> array:
    """Block ids validated as array('I') (values in [0, 2**32)), without making an int object per
    id; TypeError or ValueError naming the culprit. The caller checks the upper bound."""
    return _as_uint32_array(block_ids, name, "a block id")


def block_id_list(block_ids: Sequence[int], name: str = "block_ids") -> list[int]:
    """Block ids as plain ints in [0, 2**32) (numpy scalars in, Python ints out); TypeError or
    ValueError naming the culprit. The caller checks the upper bound that applies."""
    return block_id_array(block_ids, name).tolist()


def unpack_tokens(packed: bytes) -> tuple[int, ...]:
    return tuple(memoryview(packed).cast("I")) if packed else ()


def _common_prefix_len(qb: bytes, pos: int, seg: bytes, k: int) -> int:
    """Leading tokens that agree in qb[pos:pos+k] and seg[:k] (token units). The caller knows a
    mismatch exists within the k tokens.

    Bisects with memcmp (`bytes.startswith`) down to <= 64 tokens, then finds the first differing
    byte in one step: the lowest set bit of the XOR of the two runs read as little-endian integers
    (byte j of a run is bits 8j..8j+7, so bit // 32 is the token). O(k) C work, O(log k) Python
    steps; numpy's per-call overhead was larger for the run lengths a walk meets.
    """
    q = TOKEN_BYTES * pos
    lo, hi = 0, k  # tokens [0, lo) agree; the first mismatch lies in [lo, hi)
    while hi - lo > 64:
        mid = (lo + hi) >> 1
        if qb.startswith(seg[4 * lo : 4 * mid], q + 4 * lo):
            lo = mid
        else:
            hi = mid
    x = int.from_bytes(qb[q + 4 * lo : q + 4 * hi], "little") ^ int.from_bytes(
        seg[4 * lo : 4 * hi], "little"
    )
    return lo + (((x & -x).bit_length() - 1) >> 5)


@dataclass(slots=True, eq=False)
class TreeNode:
    """One compressed node: tokens at absolute positions [start, end) and their block ids.

    `blocks[j]` is the block of index `start // B + j`; there are `(end-1)//B - start//B + 1`.
    `head_shared` is True when `blocks[0]` is also owned by an ancestor (at the same index): a split
    inside a block, or a request writing on into the partial tail block of its earlier insert.
    Every other block of a node is owned by no ancestor, so a node is the *shallowest* owner of
    `len(blocks) - head_shared` blocks (its "own" blocks).
    """

    node_id: int
    parent: TreeNode | None
    start: int
    end: int
    tokens: bytes  # packed uint32, (end - start) tokens
    blocks: list[int]
    head_shared: bool = False
    children: dict[int, TreeNode] = field(default_factory=dict)  # keyed by first token
    lock_ref: int = 0  # live lock handles on this node or a descendant
    tick: int = 0  # last acquire/insert that ended here, or at a descendant since evicted
    evict_key: Any = None  # key in the eviction index while an unlocked leaf, else None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_own_blocks(self) -> int:
        return len(self.blocks) - self.head_shared

    @property
    def first_token(self) -> int:
        return int(_unpack_token(self.tokens)[0])

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.node_id}, [{self.start},{self.end}), blocks={self.blocks},"
            f" lock_ref={self.lock_ref}, tick={self.tick})"
        )


class RadixTree:
    """Structure, ownership and eviction order of the cached token paths.

    Invariants (recomputed by `check_integrity`):
    * the root holds no tokens and no blocks; every other node has >= 1 token, `start` equal to its
      parent's `end`, is keyed in its parent's `children` by its first token, and holds exactly the
      block ids of the indices its segment touches;
    * `lock_ref` of a node = live handles on it or on a descendant (so locks cover whole paths);
    * ticks are lazy: an acquire/insert stamps only the node it ends at; a node dropped by eviction
      hands its tick to its parent (max). So when a node becomes a leaf its tick is the last use of
      anything in its subtree, exactly as if every use had stamped the whole path, at O(1) a use;
    * all owners of a block own it at the same block index and lie under its shallowest owner;
      `head_shared` says whether a node's first block has an owner above it;
    * the eviction index holds exactly the unlocked non-root leaves;
    * `num_evictable_blocks` = blocks whose shallowest owner is unlocked (those `evict` can free);
    * `num_nodes` (root excluded) and `num_cached_tokens` match the tree.

    `version` changes on every structural mutation (split, new leaf, eviction, trim): a match taken
    at an older version may point at nodes that moved.
    """

    def __init__(self, pool: BlockPool, eviction_key: EvictionKey = lru_key) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._next_node_id = 1
        self.root = TreeNode(node_id=0, parent=None, start=0, end=0, tokens=b"", blocks=[])
        self.index = EvictionIndex(eviction_key)
        self.version = 0
        self.num_nodes = 0
        self.num_cached_tokens = 0
        self.num_evictable_blocks = 0

    # ------------------------------------------------------------------ reading
    def walk(self, qb: bytes, limit: int) -> tuple[int, TreeNode, list[int]]:
        """Longest cached prefix of the packed tokens `qb`, at most `limit` tokens. Mutates nothing.

        Returns `(m, node, blocks)`: m matched tokens; `node` the deepest node touched (the root
        when m == 0; it may be matched only partly, up to m); `blocks` the block ids of indices
        0 .. ceil(m/B)-1, each from the deepest path node touching that index within [0, m).
        """
        return self.walk_from(self.root, 0, [], qb, limit)

    def walk_from(
        self, node: TreeNode, pos: int, blocks: list[int], qb: bytes, limit: int
    ) -> tuple[int, TreeNode, list[int]]:
        """`walk(qb, limit)` for a caller that already knows tokens [0, pos) of `qb` lie on the
        path to `node` (node.start < pos <= node.end, or the root and pos == 0) and holds their
        `blocks` (indices 0 .. ceil(pos/B)-1, extended in place): same result, without reading
        the known prefix again. Mutates nothing in the tree."""
        B = self.block_size
        startswith = qb.startswith
        if pos < node.end and pos < limit:
            # Resume inside `node` (never the root: it ends at 0). Its blocks up to index
            # (pos-1)//B are collected already.
            start = node.start
            k = min(node.end, limit) - pos
            seg = node.tokens[4 * (pos - start) : 4 * (pos - start + k)]
            matched = k if startswith(seg, 4 * pos) else _common_prefix_len(qb, pos, seg, k)
            first = start // B
            blocks += node.blocks[(pos - 1) // B + 1 - first : (pos + matched - 1) // B + 1 - first]
            pos += matched
            if pos < node.end:  # diverged inside the node, or reached the limit there
                return pos, node, blocks
        if pos >= limit or not node.children:
            return pos, node, blocks
        qv = memoryview(qb).cast("I")
        while True:
            child = node.children.get(qv[pos])  # child.start == pos
            if child is None:
                break
            end = child.end
            if end <= limit and startswith(child.tokens, 4 * pos):
                # The whole node matches: the common step, kept to a few operations (a prompt's
                # path is one step per turn of a conversation).
                if pos % B:
                    blocks[-1:] = child.blocks  # the deeper node's copy of the shared index wins
                else:
                    blocks += child.blocks
                pos = end
                node = child
                if pos == limit:
                    break
                continue
            # Diverges inside the node or reaches the limit there: the last step.
            k = min(end, limit) - pos
            seg = child.tokens
            if k < end - pos and startswith(seg[: 4 * k], 4 * pos):
                matched = k  # the limit falls inside the node, and all before it matches
            else:
                matched = _common_prefix_len(qb, pos, seg, k)  # a mismatch lies within k
            cb = child.blocks[: (pos + matched - 1) // B - pos // B + 1]
            if pos % B:
                blocks[-1:] = cb
            else:
                blocks += cb
            pos += matched
            node = child
            break
        return pos, node, blocks

    def path_block_at(self, node: TreeNode, index: int, end: int, block_id: int) -> bool:
        """Whether a node on the path from the root to `node` (path cut at position `end`) owns
        `block_id` at block `index`. O(depth); used only off the hot path."""
        B = self.block_size
        lo = index * B
        while node is not self.root:
            assert node is not None
            if node.end <= lo:
                break  # this node and every ancestor end before the index
            first = node.start // B
            if node.start < end and first <= index and node.blocks[index - first] == block_id:
                return True
            node = node.parent  # type: ignore[assignment]
        return False

    # ---------------------------------------------------------------- structure
    def split(self, node: TreeNode, p: int) -> TreeNode:
        """Split `node` [s, e) at absolute position s < p < e; returns the NEW prefix node [s, p).

        `node` itself becomes the suffix [p, e), so handles and references to it stay valid; the
        prefix copies its lock_ref and tick. When p % B != 0 the block holding p is owned by both
        halves (ref count +1). Ownership counts are unchanged otherwise; bumps `version`.
        """
        assert node.parent is not None and node.start < p < node.end, (node, p)
        B = self.block_size
        s = node.start
        cut = TOKEN_BYTES * (p - s)
        first = s // B
        prefix = TreeNode(
            node_id=self._new_node_id(),
            parent=node.parent,
            start=s,
            end=p,
            tokens=node.tokens[:cut],
            blocks=node.blocks[: (p - 1) // B - first + 1],
            head_shared=node.head_shared,
            lock_ref=node.lock_ref,
            tick=node.tick,
        )
        node.parent.children[node.first_token] = prefix
        node.tokens = node.tokens[cut:]
        node.start = p
        node.blocks = node.blocks[p // B - first :]
        node.parent = prefix
        prefix.children[node.first_token] = node
        if p % B:
            self.pool.incref(node.blocks[0])
            node.head_shared = True
        else:
            node.head_shared = False
        self.num_nodes += 1
        self.version += 1
        return prefix

    def supersede_tail(self, node: TreeNode, block: int) -> int | None:
        """Before a leaf whose first block is `block` (the caller's copy-on-write of `node`'s
        partial tail) is attached at `node.end`: let `node` own `block` in place of its tail block
        and free that block, when nothing else can read it. Returns the freed block id, or None
        (nothing changed).

        A node's partial tail that a child has superseded is dead weight: every later match through
        the node's end continues into the child and uses the child's copy for that index, and an
        internal node's block is never evicted. The copy's leading slots were copied from the
        old block's valid slots, so the swap changes no KV that any path reads. Done only when:
        * `node.end` is mid-block (the leaf's first index is `node`'s last index);
        * `node` has no child (no other branch co-owns or reads the old block);
        * `node.lock_ref == 1`: the only lock in its subtree is the one the caller has already moved
          or taken onto `node` for the new leaf (no other live handle, hence no request that may
          still read or write the old block, records it);
        * the old block's ref count is 1 (`node` alone owns it: not an ancestor's block too).
        `node` stays locked, so the evictable count does not change; the caller attaches the leaf
        with `head_shared=True` (`node` now owns `block` at that index) and has not yet taken
        ownership of `block` for it (this adds `node`'s reference).
        """
        if node.end % self.block_size == 0 or node.children or node.lock_ref != 1:
            return None
        blocks = node.blocks
        old = blocks[-1]
        refs = self.pool._refs
        if refs[old] != 1 or old == block:
            return None
        self.pool.incref(block)
        blocks[-1] = block
        self.pool.decref(old)
        return old

    def attach_leaf(
        self,
        parent: TreeNode,
        tokens: bytes,
        blocks: list[int],
        *,
        head_shared: bool,
        lock_ref: int,
        tick: int,
    ) -> TreeNode:
        """Add a leaf under `parent` (which must end where the leaf starts and have no child with
        the same first token). The caller has already taken ownership of `blocks` for the leaf
        (transferred or increfed). A locked leaf (lock_ref > 0) needs its path locked by the caller.
        Bumps `version`."""
        start = parent.end
        end = start + len(tokens) // TOKEN_BYTES
        # Fields positionally (node_id, parent, start, end, tokens, blocks, head_shared, children,
        # lock_ref, tick): keywords make the dataclass constructor over twice as slow, once per
        # insert.
        leaf = TreeNode(
            self._new_node_id(), parent, start, end, tokens, blocks, head_shared, {}, lock_ref, tick
        )
        first = _unpack_token(tokens)[0]
        assert first not in parent.children, f"parent {parent.node_id} already has child {first}"
        assert parent.lock_ref >= lock_ref, "lock the parent path before attaching a locked leaf"
        parent.children[first] = leaf
        self.index.discard(parent)  # no longer a leaf
        if lock_ref == 0:
            self.num_evictable_blocks += leaf.num_own_blocks
            self.index.add(leaf)
        self.num_nodes += 1
        self.num_cached_tokens += end - start
        self.version += 1
        return leaf

    # ------------------------------------------------------------------ locking
    def lock_path(self, node: TreeNode, tick: int) -> None:
        """Stamp `node` with `tick`; lock_ref += 1 on it and every ancestor (root included)."""
        node.tick = tick
        index = self.index
        while node is not None:
            if node.lock_ref == 0:
                if node.evict_key is not None:
                    index.discard(node)
                self.num_evictable_blocks -= len(node.blocks) - node.head_shared
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def num_blocks_pinned_by_lock(self, node: TreeNode) -> int:
        """Evictable blocks `lock_path(node)` would take out of `num_evictable_blocks`: the own
        blocks of the path's unlocked nodes. Read-only. The walk stops at the first locked node:
        every ancestor of a locked node is locked (locks cover whole paths)."""
        pinned = 0
        while node is not None and node.lock_ref == 0:
            pinned += len(node.blocks) - node.head_shared
            node = node.parent  # type: ignore[assignment]
        return pinned

    def move_lock(self, old: TreeNode, new: TreeNode, tick: int) -> None:
        """Move one lock from the path of `old` to the path of `new` and stamp `new`.

        Same result as `lock_path(new)` then `unlock_path(old)`, but only the nodes below the two
        paths' lowest common ancestor change: a request whose lock moves down its own path as it
        inserts pays for the new nodes, not for the whole depth. Ancestors have strictly smaller
        `start` than their descendants (the root aside), which finds the common ancestor without
        knowing depths.
        """
        new.tick = tick
        if old is new:  # a request re-inserting what it holds, or writing on past its node's end
            return
        root = self.root
        gain: list[TreeNode] = []
        lose: list[TreeNode] = []
        a, b = new, old
        while a is not b:
            if b is root or (a is not root and a.start > b.start):
                gain.append(a)
                a = a.parent  # type: ignore[assignment]
            elif a is root or b.start > a.start:
                lose.append(b)
                b = b.parent  # type: ignore[assignment]
            else:  # equal starts: two different nodes hanging below the same position
                gain.append(a)
                lose.append(b)
                a = a.parent  # type: ignore[assignment]
                b = b.parent  # type: ignore[assignment]
        index = self.index
        for node in gain:
            if node.lock_ref == 0:
                if node.evict_key is not None:
                    index.discard(node)
                self.num_evictable_blocks -= len(node.blocks) - node.head_shared
            node.lock_ref += 1
        for node in lose:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, f"node {node.node_id} unlocked more often than locked"
            if node.lock_ref == 0:
                self.num_evictable_blocks += len(node.blocks) - node.head_shared
                if not node.children:
                    index.add(node)

    def unlock_path(self, node: TreeNode) -> None:
        """lock_ref -= 1 on `node` and every ancestor; unlocked leaves join the eviction index with
        the tick they already have."""
        root = self.root
        while node is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, f"node {node.node_id} unlocked more often than locked"
            if node.lock_ref == 0:
                self.num_evictable_blocks += len(node.blocks) - node.head_shared
                if not node.children and node is not root:
                    self.index.add(node)
            node = node.parent  # type: ignore[assignment]

    # ----------------------------------------------------------------- eviction
    def evict(self, num_blocks: int) -> tuple[list[int], int]:
        """Free up to `num_blocks` blocks from unlocked leaves in eviction-key order.

        A leaf whose own blocks are more than still needed is trimmed from its tail (its head
        tokens stay cached; its end moves back to a block boundary); otherwise it is removed whole
        and its parent, if now an unlocked leaf, joins the index with its tick (the last use of its
        subtree). O(log n) per leaf.
        Returns (freed block ids in the order freed, tail first; tokens removed from the tree).
        """
        B = self.block_size
        pool = self.pool
        index = self.index
        freed: list[int] = []
        num_tokens = 0
        while len(freed) < num_blocks and index:
            leaf = index.first()
            need = num_blocks - len(freed)
            own = len(leaf.blocks) - leaf.head_shared
            if own > need:
                # Trim: drop the last `need` blocks; they are owned by this leaf alone.
                new_end = (leaf.start // B + len(leaf.blocks) - need) * B
                assert leaf.start < new_end < leaf.end
                num_tokens += leaf.end - new_end
                leaf.tokens = leaf.tokens[: TOKEN_BYTES * (new_end - leaf.start)]
                leaf.end = new_end
                tail = leaf.blocks[-need:]
                del leaf.blocks[-need:]
                tail.reverse()
                released = pool.drop_refs(tail)
                assert len(released) == need, f"trimmed blocks {tail} had other owners"
                freed += released
                self.num_evictable_blocks -= need
            else:
                index.pop_first()  # the leaf
                parent = leaf.parent
                assert parent is not None
                del parent.children[_unpack_token(leaf.tokens)[0]]
                leaf.parent = None
                freed += pool.drop_refs(leaf.blocks[::-1])
                self.num_evictable_blocks -= own
                self.num_nodes -= 1
                num_tokens += leaf.end - leaf.start
                if leaf.tick > parent.tick:
                    parent.tick = leaf.tick  # lazy recency: the subtree's last use
                if parent.lock_ref == 0 and not parent.children and parent is not self.root:
                    index.add(parent)
            self.version += 1
        self.num_cached_tokens -= num_tokens
        return freed, num_tokens

    # ------------------------------------------------------------------ display
    def iter_nodes(self) -> Iterator[tuple[TreeNode, int]]:
        """(node, depth) depth-first from the root, children in increasing first-token order."""
        stack = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            yield node, depth
            for key in sorted(node.children, reverse=True):
                stack.append((node.children[key], depth + 1))

    def last_uses(self) -> dict[int, int]:
        """node id -> last use of the node or anything below it (the eager tick). O(nodes)."""
        order = [node for node, _ in self.iter_nodes()]
        last: dict[int, int] = {}
        for node in reversed(order):  # children before parents
            t = node.tick
            for child in node.children.values():
                t = max(t, last[child.node_id])
            last[node.node_id] = t
        return last

    # ------------------------------------------------------------------ checks
    def check_integrity(self, handles_on: Mapping[int, int], clock: int) -> dict[int, int]:
        """Recompute the invariants in the class docstring; raise AssertionError on a violation.

        `handles_on` maps node id -> live handles on that node; `clock` is the last tick handed out.
        Returns block id -> number of owning nodes, for the caller's ref-count check.
        """
        B = self.block_size
        root = self.root

        def fail(msg: str) -> None:
            raise AssertionError(f"radix tree integrity: {msg}")

        if root.parent is not None or root.tokens or root.blocks or root.start or root.end:
            fail("root must hold nothing")
        if root.evict_key is not None:
            fail("root is in the eviction index")
        order: list[TreeNode] = []
        depth_of: dict[int, int] = {0: 0}
        stack = [root]
        while stack:
            node = stack.pop()
            order.append(node)
            for key, child in node.children.items():
                nid = child.node_id
                if nid in depth_of:
                    fail(f"node id {nid} appears twice")
                depth_of[nid] = depth_of[node.node_id] + 1
                if child.parent is not node:
                    fail(f"node {nid} has a wrong parent pointer")
                if child.start != node.end or child.end <= child.start:
                    fail(f"node {nid} covers [{child.start},{child.end}) under end {node.end}")
                if len(child.tokens) != TOKEN_BYTES * (child.end - child.start):
                    fail(f"node {nid} token segment length does not match [start, end)")
                if key != child.first_token:
                    fail(f"node {nid} keyed by {key} but starts with {child.first_token}")
                expect = (child.end - 1) // B - child.start // B + 1
                if len(child.blocks) != expect:
                    fail(f"node {nid} holds {len(child.blocks)} block ids, needs {expect}")
                for b in child.blocks:
                    if not 0 <= b < self.pool.num_blocks:
                        fail(f"node {nid} holds out-of-range block id {b}")
                stack.append(child)
        if len(order) - 1 != self.num_nodes:
            fail(f"num_nodes is {self.num_nodes}, tree has {len(order) - 1}")
        tokens = sum(n.end - n.start for n in order)
        if tokens != self.num_cached_tokens:
            fail(f"num_cached_tokens is {self.num_cached_tokens}, tree holds {tokens}")

        # Locks: bottom-up sums of handles (reverse pre-order visits children before parents).
        subtree: dict[int, int] = {}
        for node in reversed(order):
            total = handles_on.get(node.node_id, 0) + sum(
                subtree[c.node_id] for c in node.children.values()
            )
            subtree[node.node_id] = total
            if node.lock_ref != total:
                fail(f"node {node.node_id} lock_ref {node.lock_ref} != {total} handles in subtree")
            if node.tick > clock:
                fail(f"node {node.node_id} tick {node.tick} is ahead of the clock {clock}")
        unknown = set(handles_on) - set(subtree)
        if unknown:
            fail(f"live handles point at detached nodes {sorted(unknown)}")

        # Ownership. A node owns a block either as its top (shallowest) owner or, for its head block
        # only, below an ancestor owning it at the same index (head_shared, recomputed here). Such
        # chains must end at exactly one top owner per block, so all owners lie under it.
        owners: dict[int, int] = {}
        index_of: dict[int, int] = {}
        top_owner: dict[int, TreeNode] = {}
        for node in order[1:]:
            first = node.start // B
            head = self._ancestor_owns(node, first, node.blocks[0])
            if head != node.head_shared:
                fail(f"node {node.node_id} head_shared={node.head_shared}, recomputed {head}")
            for j, b in enumerate(node.blocks):
                owners[b] = owners.get(b, 0) + 1
                if index_of.setdefault(b, first + j) != first + j:
                    fail(f"block {b} is owned at block indices {index_of[b]} and {first + j}")
                if j == 0 and head:
                    continue
                top = top_owner.setdefault(b, node)
                if top is not node:
                    fail(f"block {b} has two unrelated owners, {top.node_id} and {node.node_id}")
        evictable = sum(1 for top in top_owner.values() if top.lock_ref == 0)
        if evictable != self.num_evictable_blocks:
            fail(f"num_evictable_blocks is {self.num_evictable_blocks}, recomputed {evictable}")
        by_own = sum(n.num_own_blocks for n in order[1:] if n.lock_ref == 0)
        if by_own != evictable:
            fail(f"own-block sum {by_own} over unlocked nodes != evictable blocks {evictable}")

        # Eviction index == unlocked non-root leaves, each under its current key.
        expected = {n.node_id for n in order[1:] if n.lock_ref == 0 and not n.children}
        members = self.index.items()
        got = {n.node_id for _, n in members}
        if len(got) != len(members) or got != expected:
            fail(f"eviction index {sorted(got)} != unlocked leaves {sorted(expected)}")
        for key, n in members:
            if n.evict_key != key or key != self.index.key(n):
                fail(f"node {n.node_id} is indexed under a stale key {key}")
        for n in order:
            if n.evict_key is not None and n.node_id not in expected:
                fail(f"node {n.node_id} carries an eviction key but is not a member")
        return owners

    # ---------------------------------------------------------------- internals
    def _ancestor_owns(self, node: TreeNode, index: int, block_id: int) -> bool:
        parent = node.parent
        return parent is not None and self.path_block_at(parent, index, node.start, block_id)

    def _new_node_id(self) -> int:
        nid = self._next_node_id
        self._next_node_id = nid + 1
        return nid

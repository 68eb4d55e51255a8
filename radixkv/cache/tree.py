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

Namespaces: the tree has one root per namespace (None = the shared one). A path never crosses
roots, so tokens cached under one namespace never match under another. All namespaces share the
pool and one eviction order; a namespace root with no children and no lock is dropped.

Tokens are stored packed (`bytes`, native uint32) and compared with memcmp (`bytes.startswith`) a
whole node at a time; only the node where a walk diverges looks for the first mismatch.

The tree's one caller is `PrefixCache`, which checks what users hand it: here, preconditions are
asserts and `check_integrity()` recomputes every invariant.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from radixkv.cache.eviction import EvictionIndex, EvictionKey, gdsf_priority
from radixkv.cache.keys import KeyChain, split_keys, trim_keys
from radixkv.cache.node import TreeNode
from radixkv.cache.pool import BlockPool
from radixkv.cache.tokens import TOKEN_BYTES, common_prefix_len

# A walk's result: m matched tokens, the deepest node touched, the blocks of indices < ceil(m/B)
Walk = tuple[int, TreeNode, list[int]]


@dataclass(slots=True)
class InsertPlan:
    """What `RadixTree.commit_insert` does, worked out by `plan_insert` before anything changes."""

    node: TreeNode  # deepest node of the cached prefix [0, p); split at p if p < node.end
    num_cached: int  # p: tokens of the insert already on the tree
    table: list[int]  # canonical block table of [0, n) once committed
    new_ids: list[int]  # blocks the new leaf adopts (indices p // B ..)
    duplicates: list[int]  # private blocks holding what the tree has: freed at commit
    co_owned: int | None = None  # a path block the new leaf co-owns as its head (mid-block start)


class RadixTree:
    """Structure, ownership and eviction order of the cached token paths.

    Invariants (recomputed by `check_integrity`):
    * a root holds no tokens and no blocks; every other node has >= 1 token, `start` equal to its
      parent's `end`, is keyed in its parent's `children` by its first token, and holds exactly the
      block ids of the indices its segment touches;
    * every root but the shared one (namespace None) has a child or a lock;
    * `lock_ref` of a node = locks on it or on a descendant (so locks cover whole paths);
    * ticks are lazy: an admit/commit stamps only the node it ends at; a node dropped by eviction
      hands its tick to its parent (max). So when a node becomes a leaf its tick is the last use of
      anything in its subtree, exactly as if every use had stamped the whole path, at O(1) a use;
    * all owners of a block own it at the same block index and lie under its shallowest owner;
      `head_shared` says whether a node's first block has an owner above it;
    * the eviction index holds exactly the unlocked non-root leaves, each under its current key;
      `gdsf_base` is lazy like ticks (a node's is the largest of its subtree's last uses);
    * `num_evictable_blocks` = blocks whose shallowest owner is unlocked (those `evict` can free);
    * `num_nodes` (roots excluded) and `num_cached_tokens` match the tree;
    * a node's kept `block_keys` are the keys of the full blocks ending in it, as the key chain
      gives them over its path (`radixkv.cache.keys`); without a chain no node keeps keys.
    """

    def __init__(self, pool: BlockPool, eviction_key: EvictionKey, keys: KeyChain | None) -> None:
        """`eviction_key`: the eviction order (`radixkv.cache.eviction`); `keys`: the chain the
        nodes' block keys are checked against (None: nothing is hashed)."""
        self.pool = pool
        self.block_size = pool.block_size
        self._node_ids = itertools.count(1)  # 0 is the shared root's
        self.roots: dict[str | None, TreeNode] = {None: TreeNode(0)}
        self.index = EvictionIndex(eviction_key)
        self.inflation = 0  # GDSF's L: the largest priority evicted so far
        self.keys = keys
        # Called as (node, keep) before an eviction cuts the node's blocks from the `keep`-th
        # on (0: the node goes): the cache demotes them to a lower tier and announces them.
        self.on_cut: Callable[[TreeNode, int], None] | None = None
        self.num_nodes = self.num_cached_tokens = self.num_evictable_blocks = 0

    @property
    def root(self) -> TreeNode:
        """The root of the shared namespace."""
        return self.roots[None]

    def open_root(self, namespace: str | None) -> TreeNode:
        """The root of `namespace`, made if it has none."""
        if namespace not in self.roots:
            self.roots[namespace] = TreeNode(next(self._node_ids), namespace=namespace)
        return self.roots[namespace]

    # ------------------------------------------------------------------ reading
    def walk(
        self, qb: bytes, limit: int, namespace: str | None = None
    ) -> tuple[int, TreeNode | None, list[int]]:
        """Longest cached prefix of the packed tokens `qb` in `namespace`, at most `limit` tokens.
        Mutates nothing.

        Returns `(m, node, blocks)`: m matched tokens; `node` the deepest node touched (the root
        when m == 0, None if the namespace has no root; it may be matched only partly, up to m);
        `blocks` the block ids of indices 0 .. ceil(m/B)-1, each from the deepest path node
        touching that index within [0, m).
        """
        node = self.roots.get(namespace)
        if node is None:
            return 0, None, []
        B = self.block_size
        pos, blocks = 0, []
        qv = memoryview(qb).cast("I")
        while pos < limit:
            child = node.children.get(qv[pos])  # child.start == pos
            if child is None:
                break
            end = child.end
            if end <= limit and qb.startswith(child.tokens, TOKEN_BYTES * pos):
                child_blocks = child.blocks  # the common step: the whole node agrees, one memcmp
            else:
                end = pos + self._match_in(child, qb, limit)
                child_blocks = child.blocks[: (end - 1) // B - pos // B + 1]
            if pos % B:
                blocks[-1:] = child_blocks  # the deeper node's copy of the shared index wins
            else:
                blocks += child_blocks
            pos = end
            node = child
            if pos < child.end:
                break
        return pos, node, blocks

    @staticmethod
    def _match_in(node: TreeNode, qb: bytes, limit: int) -> int:
        """How many tokens of `node` agree with `qb` from the node's start on, up to `limit`."""
        pos, k = node.start, min(node.end, limit) - node.start
        seg = node.tokens[: TOKEN_BYTES * k]
        if qb.startswith(seg, TOKEN_BYTES * pos):
            return k  # the whole (limited) segment agrees, one memcmp
        qv = memoryview(qb).cast("I")[pos : pos + k]
        return common_prefix_len(qv, memoryview(seg).cast("I"))

    def path_block_at(self, node: TreeNode, index: int, end: int, block_id: int) -> bool:
        """Whether a node on the path from the root to `node` (path cut at position `end`) owns
        `block_id` at block `index`. O(depth); used only off the hot path."""
        lo = index * self.block_size
        while node.parent is not None and node.end > lo:
            first = node.start // self.block_size
            if node.start < end and first <= index and node.blocks[index - first] == block_id:
                return True
            node = node.parent
        return False

    # ---------------------------------------------------------------- insertion
    def plan_insert(
        self, walked: Walk, num_tokens: int, ids: tuple[int, ...], private: set[int]
    ) -> InsertPlan:
        """Plan an insert of `num_tokens` tokens whose KV lies in the blocks `ids` (one per block
        index), given the walk of its tokens (`walked`: cached prefix p, its deepest node, the
        tree's blocks). Mutates nothing.

        Per block index i: covered by the tree (positions all < p), the caller's block is the
        tree's, a private duplicate (freed at commit) or a shallower path node's block at that
        index (the caller's own earlier tail); the partial last block when nothing is new stays
        the caller's, whichever it is (it writes on there). New indices hold private blocks,
        except the first when p is mid-block, which may be a path node's block there (the
        caller's own earlier tail): co-owned.
        """
        p, node, canonical = walked
        covered = len(ids) if p == num_tokens else p // self.block_size
        del canonical[covered:]
        plan = InsertPlan(node, p, canonical, list(ids[covered:]), [])
        if ids[:covered] != tuple(canonical):
            self._plan_covered(plan, ids, covered, num_tokens, private)
        new = plan.new_ids
        if new and new[0] not in private:
            assert p % self.block_size and self.path_block_at(node, covered, p, new[0]), new
            plan.co_owned = new[0]
        assert private.issuperset(new[plan.co_owned is not None :]), f"not private: {new}"
        return plan

    def _plan_covered(
        self, plan: InsertPlan, ids: tuple[int, ...], covered: int, n: int, private: set[int]
    ) -> None:
        """The covered indices of a table that differs from the tree's (see `plan_insert`)."""
        canonical = plan.table
        partial_tail = len(ids) - 1 if plan.num_cached == n and n % self.block_size else -1
        for i in range(covered):
            b = ids[i]
            if b == canonical[i]:
                continue
            assert b in private or self.path_block_at(plan.node, i, plan.num_cached, b), (i, b)
            if i == partial_tail:
                canonical[i] = b
            elif b in private:
                plan.duplicates.append(b)

    def commit_insert(
        self, plan: InsertPlan, qb: bytes, old_node: TreeNode, tick: int
    ) -> tuple[TreeNode, bool]:
        """Apply a plan: split at p, move the lock of `old_node` onto the path, add the new leaf
        owning `plan.new_ids`. The caller frees `plan.duplicates` and gives up its private claim
        on `plan.new_ids`. Returns (the locked node, whether the leaf's parent dropped its partial
        tail for the leaf's copy)."""
        node, p, B = plan.node, plan.num_cached, self.block_size
        n = len(qb) // TOKEN_BYTES
        if p < node.end and p < n:
            node = self.split(node, p)
        self.move_lock(old_node, node, tick)
        if n == p:
            return node, False
        superseded = False
        if plan.co_owned is not None:
            self.pool.add_owner(plan.co_owned)
            head_shared = True
        elif p % B and not node.children:
            # The leaf's first block is the caller's copy of node's partial tail: node may take
            # the copy over and free its own tail, which nothing could use any more.
            superseded = head_shared = self.supersede_tail(node, plan.new_ids[0]) is not None
        else:
            head_shared = False
        leaf = self.attach_leaf(
            node, qb[TOKEN_BYTES * p :], plan.new_ids, head_shared=head_shared, tick=tick
        )
        plan.table += plan.new_ids
        return leaf, superseded

    # ---------------------------------------------------------------- structure
    def split(self, node: TreeNode, p: int) -> TreeNode:
        """Split `node` [s, e) at absolute position s < p < e; returns the NEW prefix node [s, p).

        `node` itself becomes the suffix [p, e), so locks and references to it stay valid; the
        prefix copies its lock_ref and tick. When p % B != 0 the block holding p is owned by both
        halves (ref count +1). Ownership counts are unchanged otherwise.
        """
        parent, s, B = node.parent, node.start, self.block_size
        assert parent is not None and s < p < node.end, (node, p)
        cut, first = TOKEN_BYTES * (p - s), s // B
        blocks = node.blocks[: (p - 1) // B - first + 1]
        prefix = TreeNode(
            next(self._node_ids), parent, s, p, node.tokens[:cut], blocks, node.head_shared
        )
        prefix.lock_ref, prefix.tick, prefix.gdsf_base = node.lock_ref, node.tick, node.gdsf_base
        split_keys(prefix, node, p, B)
        member = node.evict_key is not None
        self.index.discard(node)  # the suffix's key reads its start: re-keyed below
        parent.children[node.first_token] = prefix
        node.tokens = node.tokens[cut:]
        node.start = p
        node.blocks = node.blocks[p // B - first :]
        node.parent = prefix
        prefix.children[node.first_token] = node
        node.head_shared = p % B != 0
        if node.head_shared:
            self.pool.add_owner(node.blocks[0])
        if member:
            self.index.add(node)
        self.num_nodes += 1
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
          onto `node` for the new leaf (no other lock, hence no request that may still read or
          write the old block, holds it);
        * the old block's ref count is 1 (`node` alone owns it: not an ancestor's block too).
        `node` stays locked, so the evictable count does not change; the caller attaches the leaf
        with `head_shared=True` (`node` now owns `block` at that index) and has not yet taken
        ownership of `block` for it (this adds `node`'s reference).
        """
        if node.end % self.block_size == 0 or node.children or node.lock_ref != 1:
            return None
        old = node.blocks[-1]
        if old == block or self.pool.ref_count(old) != 1:
            return None
        self.pool.add_owner(block)
        node.blocks[-1] = block
        self.pool.release([old])
        return old

    def attach_leaf(
        self, parent: TreeNode, tokens: bytes, blocks: list[int], *, head_shared: bool, tick: int
    ) -> TreeNode:
        """Add a locked leaf under `parent`, whose path the caller has locked; the parent ends
        where the leaf starts and has no child with its first token. The caller has taken
        ownership of `blocks` for the leaf (transferred or co-owned)."""
        start = parent.end
        end = start + len(tokens) // TOKEN_BYTES
        leaf = TreeNode(next(self._node_ids), parent, start, end, tokens, blocks, head_shared)
        leaf.lock_ref, leaf.tick, leaf.gdsf_base = 1, tick, self.inflation
        first = leaf.first_token
        assert first not in parent.children, f"parent {parent.node_id} already has child {first}"
        assert parent.lock_ref >= 1, "lock the parent path before attaching a locked leaf"
        parent.children[first] = leaf
        self.num_nodes += 1
        self.num_cached_tokens += leaf.end - leaf.start
        return leaf

    # ------------------------------------------------------------------ locking
    def lock_path(self, node: TreeNode, tick: int, stop: TreeNode | None = None) -> None:
        """Stamp `node` with `tick`; lock_ref += 1 on it and every ancestor below `stop` (None: its
        root included). A node that was unlocked leaves the eviction index and its own blocks stop
        being evictable."""
        node.tick = tick
        node.gdsf_base = self.inflation
        while node is not stop:
            if node.lock_ref == 0:
                if node.evict_key is not None:  # an unlocked leaf: a member of the index
                    self.index.discard(node)
                self.num_evictable_blocks -= len(node.blocks) - node.head_shared
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def num_blocks_pinned_by_lock(self, node: TreeNode | None) -> int:
        """Evictable blocks `lock_path(node)` would take out of `num_evictable_blocks`: the own
        blocks of the path's unlocked nodes. Read-only. The walk stops at the first locked node:
        every ancestor of a locked node is locked (locks cover whole paths)."""
        pinned = 0
        while node is not None and node.lock_ref == 0:
            pinned += len(node.blocks) - node.head_shared
            node = node.parent
        return pinned

    def move_lock(self, old: TreeNode, new: TreeNode, tick: int) -> None:
        """Move one lock from the path of `old` to the path of `new` (same root) and stamp `new`.

        Same result as `lock_path(new)` then `unlock_path(old)`, but only the nodes below the two
        paths' lowest common ancestor change: a request whose lock moves down its own path as it
        inserts pays for the new nodes, not for the whole depth. Ancestors have strictly smaller
        `start` than their descendants (the root aside), which finds the common ancestor without
        knowing depths.
        """
        a, b = new, old
        while a is not b:  # up to the lowest common ancestor
            if b.parent is None or (a.parent is not None and a.start > b.start):
                a = a.parent  # type: ignore[assignment]
            elif a.parent is None or b.start > a.start:
                b = b.parent  # type: ignore[assignment]
            else:  # equal starts: two different nodes hanging below the same position
                a = a.parent  # type: ignore[assignment]
                b = b.parent  # type: ignore[assignment]
        self.lock_path(new, tick, a)
        self.unlock_path(old, a)

    def unlock_path(self, node: TreeNode, stop: TreeNode | None = None) -> None:
        """lock_ref -= 1 on `node` and every ancestor below `stop` (None: its root included); a
        node left unlocked has its own blocks evictable and, a leaf, joins the eviction index with
        the tick it already has; a namespace root left empty is dropped."""
        while node is not stop:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, f"node {node.node_id} unlocked more often than locked"
            parent = node.parent
            if node.lock_ref == 0:
                self.num_evictable_blocks += len(node.blocks) - node.head_shared
                if parent is not None and not node.children:
                    self.index.add(node)
                elif parent is None and node.namespace is not None:
                    self._drop_if_empty(node)
            node = parent  # type: ignore[assignment]

    def _drop_if_empty(self, root: TreeNode) -> None:
        """Forget a namespace root with nothing cached and no lock (the shared root stays)."""
        if root.namespace is not None and not root.children and root.lock_ref == 0:
            del self.roots[root.namespace]

    # ----------------------------------------------------------------- eviction
    def evict(self, num_blocks: int) -> tuple[list[int], int]:
        """Free up to `num_blocks` blocks from unlocked leaves in eviction-key order.

        A leaf whose own blocks are more than still needed is trimmed from its tail (its head
        tokens stay cached; its end moves back to a block boundary); otherwise it is removed whole
        and its parent, if now an unlocked leaf, joins the index with its tick (the last use of its
        subtree). O(log n) per leaf.
        Returns (freed block ids in the order freed, tail first; tokens removed from the tree).
        """
        freed: list[int] = []
        num_tokens = 0
        while len(freed) < num_blocks and self.index:
            leaf = self.index.first()
            self.inflation = max(self.inflation, gdsf_priority(leaf, self.block_size))
            need = num_blocks - len(freed)
            if leaf.num_own_blocks > need:
                num_tokens += self._trim(leaf, need, freed)
            else:
                num_tokens += self._remove_leaf(leaf, freed)
        self.num_cached_tokens -= num_tokens
        return freed, num_tokens

    def _trim(self, leaf: TreeNode, num_blocks: int, freed: list[int]) -> int:
        """Drop the last `num_blocks` blocks of an evictable leaf (owned by it alone) and re-key it
        (its key reads its end); returns the tokens removed."""
        B = self.block_size
        new_end = (leaf.start // B + len(leaf.blocks) - num_blocks) * B
        assert leaf.start < new_end < leaf.end
        keep = new_end // B - leaf.start // B
        if self.on_cut is not None:
            self.on_cut(leaf, keep)
        trim_keys(leaf, keep)
        self.index.discard(leaf)
        removed = leaf.end - new_end
        leaf.tokens = leaf.tokens[: TOKEN_BYTES * (new_end - leaf.start)]
        leaf.end = new_end
        tail = leaf.blocks[-num_blocks:]
        del leaf.blocks[-num_blocks:]
        released = self.pool.release(tail)
        assert len(released) == num_blocks, f"trimmed blocks {tail} had other owners"
        freed += released
        self.num_evictable_blocks -= num_blocks
        self.index.add(leaf)
        return removed

    def _remove_leaf(self, leaf: TreeNode, freed: list[int]) -> int:
        """Remove an evictable leaf whole; its parent may become an evictable leaf (or, a root,
        be dropped). Returns the tokens removed."""
        self.index.discard(leaf)
        if self.on_cut is not None:
            self.on_cut(leaf, 0)
        parent = leaf.parent
        assert parent is not None
        del parent.children[leaf.first_token]
        leaf.parent = None
        freed += self.pool.release(leaf.blocks)
        self.num_evictable_blocks -= leaf.num_own_blocks
        self.num_nodes -= 1
        parent.tick = max(parent.tick, leaf.tick)  # lazy recency: the subtree's last use
        parent.gdsf_base = max(parent.gdsf_base, leaf.gdsf_base)
        if parent.parent is None:
            self._drop_if_empty(parent)
        elif parent.lock_ref == 0 and not parent.children:
            self.index.add(parent)
        return leaf.end - leaf.start

    def clear(self) -> None:
        """Drop every cached path (no node may be locked): all blocks go back to the pool, the
        inflation restarts."""
        assert all(root.lock_ref == 0 for root in self.roots.values()), "clear with live locks"
        for node in self.iter_attached():
            self.pool.release(node.blocks)
            node.evict_key = None
        self.roots = {None: self.root}
        self.root.children = {}
        self.root.gdsf_base = 0
        self.index = EvictionIndex(self.index.key)
        self.inflation = 0
        self.num_nodes = self.num_cached_tokens = self.num_evictable_blocks = 0

    def iter_attached(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        return (node for node, _ in self.iter_nodes() if node.parent is not None)

    # ------------------------------------------------------------------ display
    def iter_nodes(self) -> Iterator[tuple[TreeNode, int]]:
        """(node, depth) depth-first from each root (the shared one first, then namespaces by
        name), children in increasing first-token order."""
        names = sorted(ns for ns in self.roots if ns is not None)
        stack = [(self.roots[ns], 0) for ns in reversed([None, *names])]
        while stack:
            node, depth = stack.pop()
            yield node, depth
            for key in sorted(node.children, reverse=True):
                stack.append((node.children[key], depth + 1))

    def last_uses(self) -> dict[int, int]:
        """node id -> last use of the node or anything below it (the eager tick). O(nodes)."""
        last: dict[int, int] = {}
        for node, _ in reversed(list(self.iter_nodes())):  # children before parents
            last[node.node_id] = max(
                [node.tick, *(last[c.node_id] for c in node.children.values())]
            )
        return last

    # ------------------------------------------------------------------ checks
    def check_integrity(self, locks_on: Mapping[int, int], clock: int) -> dict[int, int]:
        """Recompute the invariants in the class docstring; raise AssertionError on a violation.

        `locks_on` maps node id -> locks on that node; `clock` is the last tick handed out.
        Returns block id -> number of owning nodes, for the caller's ref-count check.
        """
        order = self._check_structure()
        self._check_locks_and_index(order, locks_on, clock)
        owners = self._check_ownership(order)
        attached = [n for n in order if n.parent is not None]
        if self.keys is not None:
            self.keys.check(attached)
        elif any(n.block_keys is not None for n in attached):
            _fail("a node keeps block keys, yet nothing is hashed")
        return owners

    def _check_structure(self) -> list[TreeNode]:
        """Shape, segments and counters; returns every node, roots included, parents first."""
        B = self.block_size
        order: list[TreeNode] = []
        seen: set[int] = set()
        for ns, root in self.roots.items():
            holds = root.parent or root.tokens or root.blocks or root.start or root.end
            if holds or root.namespace != ns:
                _fail(f"root of namespace {ns!r} must hold nothing and carry its namespace")
            if ns is not None and not root.children and root.lock_ref == 0:
                _fail(f"namespace {ns!r} is empty and unlocked, yet kept")
        for node, _ in self.iter_nodes():
            if node.node_id in seen:
                _fail(f"node id {node.node_id} appears twice")
            seen.add(node.node_id)
            order.append(node)
            for key, child in node.children.items():
                well_formed = (
                    child.parent is node
                    and child.namespace is None
                    and child.start == node.end < child.end
                    and len(child.tokens) == TOKEN_BYTES * (child.end - child.start)
                    and key == child.first_token
                    and len(child.blocks) == (child.end - 1) // B - child.start // B + 1
                    and all(0 <= b < self.pool.num_blocks for b in child.blocks)
                )
                if not well_formed:  # parent, segment, tokens, key, block count, block range
                    _fail(f"{child!r} under node {node.node_id} (key {key}) is malformed")
        if len(order) - len(self.roots) != self.num_nodes:
            _fail(f"num_nodes is {self.num_nodes}, tree has {len(order) - len(self.roots)}")
        tokens = sum(n.end - n.start for n in order)
        if tokens != self.num_cached_tokens:
            _fail(f"num_cached_tokens is {self.num_cached_tokens}, tree holds {tokens}")
        return order

    def _check_locks_and_index(
        self, order: list[TreeNode], locks_on: Mapping[int, int], clock: int
    ) -> None:
        """lock_ref = locks in the subtree (reverse pre-order visits children first); ticks and
        GDSF bases not ahead; the eviction index holds the unlocked non-root leaves, each under
        its current key, and no other node carries a key."""
        subtree: dict[int, int] = {}
        leaves: set[int] = set()
        for node in reversed(order):
            nid = node.node_id
            subtree[nid] = locks_on.get(nid, 0) + sum(
                subtree[c.node_id] for c in node.children.values()
            )
            if node.lock_ref != subtree[nid]:
                _fail(f"node {nid} lock_ref {node.lock_ref} != {subtree[nid]} locks in subtree")
            if node.tick > clock or node.gdsf_base > self.inflation:
                _fail(f"node {nid} tick or GDSF base ahead of {clock}, {self.inflation}: {node!r}")
            if node.lock_ref == 0 and not node.children and node.parent is not None:
                leaves.add(nid)
            elif node.evict_key is not None:
                _fail(f"node {nid} carries an eviction key but is not an unlocked leaf")
        unknown = set(locks_on) - set(subtree)
        if unknown:
            _fail(f"locks point at detached nodes {sorted(unknown)}")
        members = self.index.items()
        got = {n.node_id for _, n in members}
        if len(got) != len(members) or got != leaves:
            _fail(f"eviction index {sorted(got)} != unlocked leaves {sorted(leaves)}")
        for key, n in members:
            if n.evict_key != key or key != self.index.key(n):
                _fail(f"node {n.node_id} is indexed under a stale key {key}")

    def _check_ownership(self, order: list[TreeNode]) -> dict[int, int]:
        """A node owns a block either as its top (shallowest) owner or, for its head block only,
        below an ancestor owning it at the same index (head_shared, recomputed here). Such chains
        must end at exactly one top owner per block, so all owners lie under it."""
        B = self.block_size
        owners: dict[int, int] = {}
        index_of: dict[int, int] = {}
        top_owner: dict[int, TreeNode] = {}
        for node in order:
            if node.parent is None:
                continue
            first = node.start // B
            head = self.path_block_at(node.parent, first, node.start, node.blocks[0])
            if head != node.head_shared:
                _fail(f"node {node.node_id} head_shared={node.head_shared}, recomputed {head}")
            for j, b in enumerate(node.blocks):
                owners[b] = owners.get(b, 0) + 1
                if index_of.setdefault(b, first + j) != first + j:
                    _fail(f"block {b} is owned at block indices {index_of[b]} and {first + j}")
                if j == 0 and head:
                    continue
                top = top_owner.setdefault(b, node)
                if top is not node:
                    _fail(f"block {b} has two unrelated owners, {top.node_id} and {node.node_id}")
        evictable = sum(1 for top in top_owner.values() if top.lock_ref == 0)
        if evictable != self.num_evictable_blocks:
            _fail(f"num_evictable_blocks is {self.num_evictable_blocks}, recomputed {evictable}")
        by_own = sum(n.num_own_blocks for n in order if n.lock_ref == 0 and n.parent is not None)
        if by_own != evictable:
            _fail(f"own-block sum {by_own} over unlocked nodes != evictable blocks {evictable}")
        return owners


def _fail(msg: str) -> None:
    raise AssertionError(f"radix tree integrity: {msg}")

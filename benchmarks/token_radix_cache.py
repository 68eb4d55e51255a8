"""PageRadixCache: a comparator of the cache benchmark with SGLang RadixCache semantics.

A compressed radix tree over token ids whose storage unit is a *page* of `page_size` token slots:

* `page_size=1` is token-granular storage (SGLang's default): every cached token holds one slot,
  a hit is any token count, nothing is lost to alignment and eviction frees exactly the tokens
  of the leaves it drops. The upper reference for what block-granular storage loses.
* `page_size=B` is SGLang with page size B, a block-granular radix tree: only whole pages are
  matched and cached (a hit is rounded down to a page boundary; a request's partial last page is
  freed when it finishes), so node boundaries always fall on page boundaries.

What is kept from SGLang's design (written anew for this benchmark, not copied):
* a node holds a token segment (a whole number of pages); children are keyed by their first page;
* a node's `lock_ref` counts requests using it or a descendant; only unlocked leaves are evictable;
* eviction drops whole least-recently-used leaves until enough pages are free (it may free more
  than asked: a leaf is never trimmed); a parent left childless and unlocked becomes a candidate;
* a request locks the deepest node of its hit (splitting the node the hit ends in), allocates
  pages for the rest of its tokens, and when it finishes inserts its written tokens (whole pages),
  frees the pages of what another request cached in the meantime (duplicates) and its partial
  last page, and unlocks its old node.

Not kept: SGLang's heap rebuilt on every eviction (a sorted set of `(tick, node id)` of unlocked
leaves serves instead, O(log n) per leaf) and its wall clock (a logical clock: one tick per lock,
stamped on every node of the path). Only page counts are tracked: the benchmark never reads KV,
so a page needs no id.

Invariants (`check_integrity`): free + cached + private pages == num_pages; the index holds
exactly the unlocked non-root leaves; evictable pages == pages of unlocked nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sortedcontainers import SortedList


@dataclass(slots=True, eq=False)
class _Node:
    node_id: int
    parent: _Node | None
    tokens: bytes  # int32 token ids, a whole number of pages
    children: dict[bytes, _Node]  # keyed by the child's first page (bytes)
    lock_ref: int = 0
    tick: int = 0
    indexed: bool = False  # in the eviction index (an unlocked leaf)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) >> 2


@dataclass(frozen=True, slots=True)
class PageMatch:
    """Read-only result of `match`: `num_cached_tokens` (whole pages) on the path to `node`,
    possibly ending inside it. Valid only until the cache next mutates."""

    num_query_tokens: int
    num_cached_tokens: int
    node: _Node  # deepest node touched
    node_start: int  # position where `node` starts


@dataclass(frozen=True, slots=True)
class PageStats:
    num_pages: int
    page_size: int
    num_free_pages: int
    num_cached_pages: int
    num_query_tokens: int
    num_hit_tokens: int
    num_evicted_blocks: int  # pages
    num_evicted_tokens: int


def _common_len(qb: bytes, pos_bytes: int, seg: bytes) -> int:
    """Leading tokens that agree between seg and qb[pos_bytes:]."""
    n = min(len(seg), len(qb) - pos_bytes) >> 2
    if qb.startswith(seg[: 4 * n], pos_bytes):
        return n
    a = np.frombuffer(qb, dtype=np.int32, count=n, offset=pos_bytes)
    b = np.frombuffer(seg, dtype=np.int32, count=n)
    return int(np.flatnonzero(a != b)[0])


class PageRadixCache:
    """A radix tree over token ids storing `num_pages` pages of `page_size` tokens."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive: {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.root = _Node(0, None, b"", {}, lock_ref=1)  # never evicted
        self._next_id = 1
        self._clock = 0
        self.num_free_pages = num_pages
        self.num_private_pages = 0
        self.num_cached_pages = 0
        self.num_evictable_pages = 0
        self._index: SortedList = SortedList()  # (tick, node_id) of unlocked leaves
        self._by_id: dict[int, _Node] = {}
        self._num_query_tokens = 0
        self._num_hit_tokens = 0
        self._num_evicted_pages = 0
        self._num_evicted_tokens = 0

    # ----------------------------------------------------------------- reading
    def match(self, qb: bytes, limit: int) -> PageMatch:
        """Longest cached whole-page prefix of the int32 token bytes `qb`, at most `limit`
        tokens. Mutates nothing."""
        P = self.page_size
        limit = min(limit, len(qb) >> 2) // P * P
        node, pos = self.root, 0
        while pos < limit:
            child = node.children.get(qb[4 * pos : 4 * (pos + P)])
            if child is None:
                break
            k = min(_common_len(qb, 4 * pos, child.tokens), limit - pos) // P * P
            if k < child.num_tokens:
                return PageMatch(len(qb) >> 2, pos + k, child, pos)
            node, pos = child, pos + k
        return PageMatch(len(qb) >> 2, pos, node, pos - node.num_tokens)

    # ----------------------------------------------------------------- locking
    def acquire(self, match: PageMatch) -> _Node:
        """Lock the path of the hit (splitting the node it ends in) and stamp it recent; counts
        the query. Returns the locked node, for `insert` and `unlock`."""
        self._num_query_tokens += match.num_query_tokens
        self._num_hit_tokens += match.num_cached_tokens
        return self._lock_match(match)

    def unlock(self, node: _Node) -> None:
        while node is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0
            if node.lock_ref == 0:
                self.num_evictable_pages += node.num_tokens // self.page_size
                if not node.children:
                    self._index_add(node)
            node = node.parent  # type: ignore[assignment]

    # -------------------------------------------------------------- allocation
    def allocate(self, num_pages: int) -> bool:
        """Take `num_pages` private pages, evicting LRU leaves as needed. False (and nothing
        evicted) when free + evictable pages are too few."""
        if num_pages > self.num_free_pages + self.num_evictable_pages:
            return False
        if num_pages > self.num_free_pages:
            self.evict(num_pages - self.num_free_pages)
        self.num_free_pages -= num_pages
        self.num_private_pages += num_pages
        return True

    def free(self, num_pages: int) -> None:
        self.num_private_pages -= num_pages
        self.num_free_pages += num_pages
        assert self.num_private_pages >= 0

    def evict(self, num_pages: int) -> int:
        """Drop whole LRU unlocked leaves until `num_pages` pages are freed (or none is left);
        returns the pages freed."""
        P = self.page_size
        freed = 0
        while freed < num_pages and self._index:
            _, node_id = self._index.pop(0)
            leaf = self._by_id.pop(node_id)
            leaf.indexed = False
            parent = leaf.parent
            assert parent is not None and not leaf.children and leaf.lock_ref == 0
            del parent.children[leaf.tokens[: 4 * P]]
            pages = leaf.num_tokens // P
            freed += pages
            self.num_evictable_pages -= pages
            self.num_cached_pages -= pages
            self._num_evicted_tokens += leaf.num_tokens
            if parent.lock_ref == 0 and not parent.children:
                self._index_add(parent)
        self.num_free_pages += freed
        self._num_evicted_pages += freed
        return freed

    # ---------------------------------------------------------------- insertion
    def insert(self, qb: bytes, num_private_pages: int, locked: _Node) -> _Node:
        """Cache the whole pages of `qb` (a finished request's written tokens), whose uncached
        part lives in the caller's `num_private_pages` pages; free those the tree does not adopt
        (duplicates, the partial last page). Moves the caller's lock from `locked` to the new
        deepest node (then released by the caller). Returns that node."""
        P = self.page_size
        n = (len(qb) >> 2) // P * P
        m = self.match(qb, n)
        node = self._lock_match(m)
        self.unlock(locked)
        pos = m.num_cached_tokens
        adopted = (n - pos) // P
        if adopted:
            # The new leaf takes the lock just put on its parent's path (locked, so neither
            # indexed nor evictable).
            leaf = _Node(self._new_id(), node, qb[4 * pos : 4 * n], {}, 1, self._clock)
            node.children[qb[4 * pos : 4 * (pos + P)]] = leaf
            if node.indexed:
                self._index_discard(node)
            self.num_private_pages -= adopted
            self.num_cached_pages += adopted
            node = leaf
        self.free(num_private_pages - adopted)
        return node

    # ------------------------------------------------------------------ reports
    def stats(self) -> PageStats:
        return PageStats(
            num_pages=self.num_pages,
            page_size=self.page_size,
            num_free_pages=self.num_free_pages,
            num_cached_pages=self.num_cached_pages,
            num_query_tokens=self._num_query_tokens,
            num_hit_tokens=self._num_hit_tokens,
            num_evicted_blocks=self._num_evicted_pages,
            num_evicted_tokens=self._num_evicted_tokens,
        )

    def check_integrity(self) -> None:
        P = self.page_size
        cached = evictable = 0
        leaves = set()
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node and key == child.tokens[: 4 * P]
                assert child.num_tokens > 0 and child.num_tokens % P == 0
                stack.append(child)
            if node is self.root:
                continue
            pages = node.num_tokens // P
            cached += pages
            if node.lock_ref == 0:
                evictable += pages
                if not node.children:
                    leaves.add(node.node_id)
        assert cached == self.num_cached_pages, (cached, self.num_cached_pages)
        assert evictable == self.num_evictable_pages, (evictable, self.num_evictable_pages)
        assert leaves == {nid for _, nid in self._index} == set(self._by_id)
        total = self.num_free_pages + self.num_cached_pages + self.num_private_pages
        assert total == self.num_pages, "pages leaked"

    # ---------------------------------------------------------------- internals
    def _lock_match(self, match: PageMatch) -> _Node:
        node = match.node
        end = match.node_start + node.num_tokens
        if match.node_start < match.num_cached_tokens < end:
            node = self._split(node, match.num_cached_tokens - match.node_start)
        elif match.num_cached_tokens == match.node_start and node is not self.root:
            node = node.parent  # type: ignore[assignment]  # the hit ends where node starts
        self._lock_path(node)
        return node

    def _lock_path(self, node: _Node) -> None:
        self._clock += 1
        while node is not None:
            if node.lock_ref == 0:
                if node.indexed:
                    self._index_discard(node)
                self.num_evictable_pages -= node.num_tokens // self.page_size
            node.lock_ref += 1
            node.tick = self._clock
            node = node.parent  # type: ignore[assignment]

    def _split(self, node: _Node, k: int) -> _Node:
        """Split `node` after its first k tokens (a whole number of pages); returns the prefix."""
        parent = node.parent
        assert parent is not None and 0 < k < node.num_tokens and k % self.page_size == 0
        P = self.page_size
        suffix_key = node.tokens[4 * k : 4 * (k + P)]
        head = node.tokens[: 4 * k]
        prefix = _Node(self._new_id(), parent, head, {suffix_key: node}, node.lock_ref, node.tick)
        parent.children[node.tokens[: 4 * P]] = prefix
        node.tokens = node.tokens[4 * k :]
        node.parent = prefix
        return prefix

    def _index_add(self, node: _Node) -> None:
        if node is self.root:
            return
        self._index.add((node.tick, node.node_id))
        self._by_id[node.node_id] = node
        node.indexed = True

    def _index_discard(self, node: _Node) -> None:
        self._index.remove((node.tick, node.node_id))
        del self._by_id[node.node_id]
        node.indexed = False

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

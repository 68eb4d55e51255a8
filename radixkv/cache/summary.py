"""A bounded picture of one namespace's tree, for a live view (`PrefixCache.summary`).

At most `max_nodes` nodes are listed: the path a given prompt matches first (so the last
request's path is always visible), then the rest breadth-first, shallow before deep. The children
a listed node has beyond that are folded into one `FoldedChildren` per parent with their counts,
so the listed part is a connected tree whose every node has its true last use and subtree totals.

Cost: one visit of every node of the namespace (the folded ones only counted), no sorting beyond
the listed nodes' children. Nothing in the cache changes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from radixkv.cache.node import TreeNode
from radixkv.cache.tokens import unpack_tokens

HEAD_TOKENS = 24  # tokens of each listed node's segment kept for a text preview


@dataclass(frozen=True, slots=True)
class SummaryNode:
    """One listed node; `parent_id` None for the namespace's root (which holds no tokens)."""

    node_id: int
    parent_id: int | None
    start: int  # absolute token positions [start, end)
    end: int
    num_blocks: int  # block ids it owns (its first may be co-owned with its parent)
    head_shared: bool  # its first block is also its parent's last (a split inside a block)
    lock_ref: int
    last_use: int  # logical tick of the last use of it or anything below it
    num_host_blocks: int  # of its full blocks, those with a copy in the host tier
    head_tokens: tuple[int, ...]  # the first HEAD_TOKENS tokens of its segment


@dataclass(frozen=True, slots=True)
class FoldedChildren:
    """The children of `parent_id` left out of the listing, with everything under them."""

    parent_id: int
    num_subtrees: int
    num_nodes: int
    num_tokens: int
    last_use: int


@dataclass(frozen=True, slots=True)
class TreeSummary:
    nodes: tuple[SummaryNode, ...]  # parents before children
    folded: tuple[FoldedChildren, ...]
    num_nodes: int  # every node of the namespace, root excluded
    num_tokens: int  # tokens the namespace's tree holds
    path: tuple[int, ...]  # node ids the given prompt's match walks, root excluded
    num_path_tokens: int  # tokens of the prompt the tree holds now


EMPTY = TreeSummary((), (), 0, 0, (), 0)


def summarize(
    root: TreeNode,
    max_nodes: int,
    path: list[TreeNode],
    num_path_tokens: int,
    num_on_host: Callable[[TreeNode], int],
) -> TreeSummary:
    """The summary of the tree under `root`, listing at most `max_nodes` nodes besides the root
    (`path`: nodes from the root's child down, listed first; `num_on_host` is asked only of
    listed nodes)."""
    assert max_nodes >= 0, "max_nodes must be >= 0"
    listed = _choose(root, max_nodes, path)
    listed_ids = {id(n) for n in listed}
    folded: list[FoldedChildren] = []
    last_use: dict[int, int] = {}
    num_nodes = num_tokens = 0
    for node in reversed(listed):  # children before parents
        last = node.tick
        hidden = [c for c in node.children.values() if id(c) not in listed_ids]
        if hidden:
            count = _count(hidden)
            folded.append(FoldedChildren(node.node_id, len(hidden), *count))
            num_nodes += count[0]
            num_tokens += count[1]
            last = max(last, count[2])
        for child in node.children.values():
            last = max(last, last_use.get(child.node_id, 0))
        last_use[node.node_id] = last
        if node is not root:
            num_nodes += 1
            num_tokens += node.end - node.start
    nodes = tuple(_node_of(n, root, last_use[n.node_id], num_on_host) for n in listed)
    path_ids = tuple(n.node_id for n in path)
    return TreeSummary(
        nodes, tuple(reversed(folded)), num_nodes, num_tokens, path_ids, num_path_tokens
    )


def _choose(root: TreeNode, max_nodes: int, path: list[TreeNode]) -> list[TreeNode]:
    """The root, the path, then other nodes breadth-first (children by first token), at most
    `max_nodes` besides the root; parents always before their children."""
    listed = [root, *path[:max_nodes]]
    seen = {id(n) for n in listed}
    queue = deque([root])
    while queue and len(listed) <= max_nodes:
        node = queue.popleft()
        for key in sorted(node.children):
            child = node.children[key]
            if id(child) not in seen:
                if len(listed) > max_nodes:
                    break
                seen.add(id(child))
                listed.append(child)
            queue.append(child)  # a path node's children come in their turn
    listed.sort(key=lambda n: n.start)  # a parent ends where its children start
    return listed


def _count(tops: list[TreeNode]) -> tuple[int, int, int]:
    """(nodes, tokens, last use) of the subtrees under `tops`."""
    num_nodes = num_tokens = last = 0
    stack = list(tops)
    while stack:
        node = stack.pop()
        num_nodes += 1
        num_tokens += node.end - node.start
        if node.tick > last:
            last = node.tick
        if node.children:
            stack.extend(node.children.values())
    return num_nodes, num_tokens, last


def _node_of(
    node: TreeNode, root: TreeNode, last_use: int, num_on_host: Callable[[TreeNode], int]
) -> SummaryNode:
    is_root = node is root
    parent = node.parent
    return SummaryNode(
        node_id=node.node_id,
        parent_id=None if is_root or parent is None else parent.node_id,
        start=node.start,
        end=node.end,
        num_blocks=len(node.blocks),
        head_shared=node.head_shared,
        lock_ref=node.lock_ref,
        last_use=last_use,
        num_host_blocks=0 if is_root else num_on_host(node),
        head_tokens=tuple(unpack_tokens(node.tokens[: 4 * HEAD_TOKENS])),
    )

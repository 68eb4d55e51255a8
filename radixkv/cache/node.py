"""TreeNode: one node of the radix tree, the record the tree, the eviction index and the key chain
all read (`tree.py` explains the block map of a path)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any


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
    parent: TreeNode | None = field(default=None, repr=False)  # None for a namespace root
    start: int = 0
    end: int = 0
    tokens: bytes = field(default=b"", repr=False)  # packed uint32, (end - start) tokens
    blocks: list[int] = field(default_factory=list)
    head_shared: bool = False
    # keyed by first token
    children: dict[int, TreeNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0  # locks (block tables) on this node or a descendant
    tick: int = 0  # last admit/commit that ended here, or at a descendant since evicted
    evict_key: Any = None  # key in the eviction index while an unlocked leaf, else None
    namespace: str | None = None  # the namespace of a root (None on every other node)
    gdsf_base: int = 0  # the tree's inflation at the last use of this node (or, lazily, below)
    # the keys of the full blocks ending here (`radixkv.cache.keys.BlockKey`; typed Any so that
    # the node imports nothing of the cache), read by KV events and the lower tiers alike, kept
    # once computed (at once when the cache records events); None: not computed yet
    block_keys: list[Any] | None = field(default=None, repr=False)

    @property
    def num_own_blocks(self) -> int:
        return len(self.blocks) - self.head_shared

    @property
    def first_token(self) -> int:
        return struct.unpack_from("=I", self.tokens)[0]

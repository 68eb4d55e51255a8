"""The lower tiers' block keys of tree paths, computed once and kept on the nodes.

The host and disk tiers name a full block by its `BlockKey` (`chain_keys`): a chain over every
block from the start of its path, so keying block i from scratch hashes blocks 0 .. i. Instead a
node keeps `block_keys`, the keys of the full blocks ending in it (as the KV events' recorder
keeps their hashes), and a chain goes on from the last key kept above (B = 16):

    positions   0 ......... 16 ......... 32 ... 36 ......... 48 ......... 60
    node a      [0 ............................ 36)                            keys of blocks 0, 1
    node b                                      [36 ........................ 60)  key of block 2
    b's keys = chain_keys(after=a's last key, tokens [32, 48))

So a block's key is hashed once while it stays in the tree, whether a demotion or a lookup asks
first, and a lookup past the tree hashes only the prompt's blocks past the tree's hit.
`chain_keys` stays the one code that hashes: the keys are the ones it gives from position 0.
A node's keys depend only on its path's tokens, which change only where the tree cuts a node:
a split cuts its list in two (`split_keys`), a trim drops the list's tail (`trim_keys`).
`check_block_keys` recomputes every kept list from the path's start.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixkv.cache.disk_store import BlockKey, chain_keys
from radixkv.cache.events import namespace_of, path_bytes, token_bytes_le
from radixkv.cache.node import TreeNode
from radixkv.cache.tokens import TOKEN_BYTES


def node_block_keys(node: TreeNode, block_size: int) -> list[BlockKey]:
    """Keys of the full blocks ending in the non-root `node` (block indices start // B ..
    end // B - 1), kept on it. Chained from the last key kept on the path above (or from the
    namespace's start), keeping the keys of every node on the way too. Do not change the list."""
    B = block_size
    if node.block_keys is not None:
        return node.block_keys
    on_the_way = []
    anchor = node
    while anchor.parent is not None and not anchor.block_keys:  # not kept, or no full block
        on_the_way.append(anchor)
        anchor = anchor.parent
    after = anchor.block_keys[-1] if anchor.block_keys else None
    lo = anchor.end // B  # a root's end is 0: its chain starts at the namespace's seed
    tokens = path_bytes(node, lo * B, node.end // B * B)
    keys = chain_keys(anchor.namespace, token_bytes_le(tokens), B, after=after)
    for n in on_the_way:
        n.block_keys = keys[n.start // B - lo : n.end // B - lo]
    return node.block_keys  # type: ignore[return-value]


def last_key(node: TreeNode, block_size: int) -> BlockKey | None:
    """The key of the last full block of `node`'s path ending at or before `node.end` (None: a
    root, or a path shorter than a block)."""
    while node.parent is not None:
        keys = node_block_keys(node, block_size)
        if keys:
            return keys[-1]
        node = node.parent
    return None


def prompt_keys(
    qb: bytes, num_full: int, m: int, node: TreeNode | None, namespace: str | None, block_size: int
) -> list[BlockKey]:
    """Keys of the full blocks [m // B, num_full) of the packed prompt `qb`, whose first m tokens a
    walk matched, ending at `node` (None: `namespace` has no root, and m is 0). Only those blocks
    are hashed: the chain goes on from the key of block m // B - 1, which the path keeps."""
    B = block_size
    i0 = m // B
    after = None
    if node is not None and node.parent is not None and i0 > node.start // B:
        after = node_block_keys(node, B)[i0 - 1 - node.start // B]  # block i0 - 1 ends in node
    elif node is not None and i0:
        after = last_key(node.parent, B)  # type: ignore[arg-type]
    block_bytes = TOKEN_BYTES * B
    tokens = qb[i0 * block_bytes : num_full * block_bytes]
    return chain_keys(namespace, token_bytes_le(tokens), B, after=after)


def split_keys(prefix: TreeNode, suffix: TreeNode, p: int, block_size: int) -> None:
    """`suffix` [s, e) is being split at p into `prefix` [s, p) and itself [p, e): the blocks
    ending at or before p now end in the prefix. Call before `suffix.start` changes."""
    keys = suffix.block_keys
    if keys is not None:
        k = p // block_size - suffix.start // block_size
        prefix.block_keys, suffix.block_keys = keys[:k], keys[k:]


def trim_keys(leaf: TreeNode, keep: int) -> None:
    """`leaf` keeps only its first `keep` blocks (a trim back to a block boundary)."""
    if leaf.block_keys is not None:
        del leaf.block_keys[keep:]


def check_block_keys(nodes: Iterable[TreeNode], block_size: int) -> None:
    """Every kept list of keys equals the keys `chain_keys` gives over its path from position 0.
    Raises AssertionError naming the node's segment."""
    B = block_size
    for node in nodes:
        if node.block_keys is None:
            continue
        tokens = token_bytes_le(path_bytes(node, 0, node.end // B * B))
        if node.block_keys != chain_keys(namespace_of(node), tokens, B)[node.start // B :]:
            raise AssertionError(f"[{node.start},{node.end}) keeps stale block keys")

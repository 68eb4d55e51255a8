"""Draw the radix tree as text for people: one line per node, children indented under parents.

Reads `PrefixCache.nodes()` snapshots only, so drawing never changes the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from radixkv.cache.prefix_cache import NodeView

Decoder = Callable[[Sequence[int]], str]


def render_tree(
    nodes: Iterable[NodeView],
    *,
    decode: Decoder | None = None,
    max_nodes: int = 200,
    preview_chars: int = 32,
    snapshots: Mapping[int, int] | None = None,
) -> str:
    """Return a multi-line picture of the tree.

    Each node shows its token range, token and block counts, lock state and last use (logical
    tick); `decode`, when given, turns the node's first tokens into a short text preview. A node
    whose first block is the same physical block as its parent's last one (a split inside a block)
    is marked with `~` before its block count: that block is co-owned. Blocks that also have a
    copy in the host tier are counted after it ("+3 on host"); every block of a node is on the
    device (what leaves it lives on, below the tree, keyed by its prefix). A hybrid model's node
    in which recurrent-state snapshots end (`snapshots`: node id -> how many, on the device) is
    marked "[1 snapshot]": a hit resumes there. At most `max_nodes` lines are drawn.
    """
    snapshots = snapshots or {}
    views = list(nodes)
    children: dict[int | None, list[NodeView]] = {}
    for v in views:
        children.setdefault(v.parent_id, []).append(v)
    roots = [v for v in views if v.parent_id is None]
    if not roots:
        return "(empty tree)"
    root = roots[0]
    by_id = {v.node_id: v for v in views}
    cached_tokens = sum(v.end - v.start for v in views)
    blocks = {b for v in views for b in v.block_ids}
    lines = [
        f"root  {len(views) - 1} nodes, {cached_tokens} tokens in {len(blocks)} blocks"
        f"{'  [locked x' + str(root.lock_ref) + ']' if root.lock_ref else ''}"
    ]

    def line(v: NodeView) -> str:
        parent = by_id.get(v.parent_id) if v.parent_id is not None else None
        shared_first = bool(
            parent and parent.block_ids and v.block_ids and parent.block_ids[-1] == v.block_ids[0]
        )
        lock = f"locked x{v.lock_ref}" if v.lock_ref else "unlocked"
        text = f"#{v.node_id} [{v.start},{v.end}) {v.end - v.start} tok "
        text += f"{'~' if shared_first else ''}{len(v.block_ids)} blk"
        text += f" (+{v.num_host_blocks} on host)" if v.num_host_blocks else ""
        text += f"  {lock}  t={v.last_access}"
        if snapshots.get(v.node_id):
            n = snapshots[v.node_id]
            text += f"  [{n} snapshot{'s' if n > 1 else ''}]"
        if decode is not None and v.head_tokens:
            preview = decode(v.head_tokens).replace("\n", "\\n")
            if len(preview) > preview_chars:
                preview = preview[: preview_chars - 1] + "…"
            text += f'  "{preview}"'
        return text

    # Iterative depth-first walk: trees from long chats can be deeper than Python's recursion limit.
    stack: list[tuple[NodeView, str, bool]] = [
        (c, "", i == len(kids) - 1)
        for kids in [children.get(root.node_id, [])]
        for i, c in reversed(list(enumerate(kids)))
    ]
    drawn = 0
    while stack:
        v, prefix, last = stack.pop()
        if drawn == max_nodes:
            lines.append(f"… {len(views) - 1 - drawn} more nodes")
            break
        lines.append(f"{prefix}{'└─ ' if last else '├─ '}{line(v)}")
        drawn += 1
        kids = children.get(v.node_id, [])
        child_prefix = prefix + ("   " if last else "│  ")
        for i in reversed(range(len(kids))):
            stack.append((kids[i], child_prefix, i == len(kids) - 1))
    return "\n".join(lines)

"""The /tree picture: drawn from real cache state, read-only, and faithful to the tree's shape."""

from __future__ import annotations

from radixkv import PrefixCache
from radixkv.chat.tree_view import render_tree


def _serve(cache: PrefixCache, tokens: list[int]) -> None:
    table = cache.admit(tokens, max_hit=len(tokens))
    assert table is not None
    cache.commit(table, tokens)
    cache.close(table)


def test_tree_shows_shared_branches_locks_and_is_read_only() -> None:
    cache = PrefixCache(num_blocks=32, block_size=4)
    shared = list(range(100, 110))  # 10 tokens: the branches split mid-block
    _serve(cache, [*shared, 1, 2, 3])
    _serve(cache, [*shared, 7, 8])
    held = cache.admit([*shared, 7, 8], max_hit=12)
    before = cache.stats()

    picture = render_tree(cache.nodes(), decode=lambda ids: " ".join(map(str, ids)))

    assert cache.stats() == before  # drawing changed nothing
    cache.check_integrity()
    lines = picture.splitlines()
    assert lines[0].startswith("root  3 nodes, 15 tokens")
    shared_line, first, second = lines[1:]
    assert shared_line.startswith("└─ ") and "[0,10) 10 tok" in shared_line
    assert "locked x1" in shared_line  # an ancestor of the held branch
    # Both branches hang under the shared node; the one split mid-block co-owns its first block.
    assert first.startswith("   ├─ ") and second.startswith("   └─ ")
    branch_lines = {first, second}
    held_line = next(line for line in branch_lines if '"7 8"' in line)
    free_line = next(line for line in branch_lines if '"1 2 3"' in line)
    assert "locked x1" in held_line and "unlocked" in free_line
    assert "~" in free_line  # position 10 is inside block 2, owned by both halves
    cache.close(held)


def test_empty_tree_and_node_limit() -> None:
    cache = PrefixCache(num_blocks=64, block_size=1)
    assert render_tree(cache.nodes()).startswith("root  0 nodes")
    for first in range(10):
        _serve(cache, [first, 1, 2])
    picture = render_tree(cache.nodes(), max_nodes=4)
    assert picture.splitlines()[-1] == "… 6 more nodes"

"""Namespaces isolate tenants (cache_salt): what one caches never matches under another, equal
namespaces share, a table stays in its namespace, an emptied namespace is dropped."""

from __future__ import annotations

from lifecycle import put

from radixkv import PackedTokens, PrefixCache

PROMPT = list(range(10, 30))  # 20 tokens, B = 4


def test_namespaces_share_nothing_and_equal_namespaces_share(make_cache) -> None:
    cache = make_cache(32, 4)
    first = put(cache, PROMPT, namespace="alice")
    assert cache.match(PROMPT).num_cached_tokens == 0  # the shared namespace sees nothing
    assert cache.match(PROMPT, namespace="bob").num_cached_tokens == 0
    again = cache.match(PackedTokens(PROMPT), namespace="alice")
    assert again.num_cached_tokens == 20 and again.block_ids == first
    assert again.namespace == "alice"
    # The same tokens under another namespace get blocks of their own.
    other = put(cache, PROMPT, namespace="bob")
    assert not set(other) & set(first)
    shared = put(cache, PROMPT)
    assert not set(shared) & (set(first) | set(other))
    assert cache.stats().num_namespaces == 3
    # A table commits into the namespace it was admitted in.
    table = cache.admit([*PROMPT, 1], max_hit=20, namespace="alice")
    assert table.num_cached_tokens == 20 and table.blocks[:5] == first
    cache.commit(table, [*PROMPT, 1])
    assert cache.stats().num_inserted_tokens == 3 * 20 + 1
    assert cache.match([*PROMPT, 1], namespace="alice").num_cached_tokens == 21
    assert cache.match([*PROMPT, 1], namespace="bob").num_cached_tokens == 20
    assert cache.match([*PROMPT, 1]).num_cached_tokens == 20
    cache.close(table)


def test_an_emptied_namespace_is_dropped(make_cache) -> None:
    cache = make_cache(8, 4)
    blocks = put(cache, PROMPT[:8], namespace="t")
    assert cache.stats().num_namespaces == 2
    assert cache.evict(2) == list(blocks)[::-1]
    assert cache.stats().num_namespaces == 1
    assert cache.match(PROMPT[:8], namespace="t").num_cached_tokens == 0


def test_a_table_keeps_its_new_namespace_alive(make_cache) -> None:
    cache = make_cache(8, 4)
    table = cache.admit(PROMPT[:8], max_hit=7, namespace="new")  # nothing cached there yet
    assert table.locked and cache.stats().num_namespaces == 2
    cache.close(table)
    assert cache.stats().num_namespaces == 1  # nothing cached, no lock: dropped


def test_namespaces_compete_for_one_pool(make_cache) -> None:
    cache: PrefixCache = make_cache(10, 4)
    for ns in ("a", "b"):
        put(cache, PROMPT, namespace=ns)
    s = cache.stats()
    assert s.num_free_blocks == 0 and s.num_evictable_blocks == 10
    table = cache.admit([1, 2, 3, 4, 5, 6, 7, 8, 9], max_hit=None)  # 3 blocks: evicts a's tail
    assert cache.match(PROMPT, namespace="a").num_cached_tokens == 8
    assert cache.match(PROMPT, namespace="b").num_cached_tokens == 20
    cache.close(table)

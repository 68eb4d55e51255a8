"""Copies of a lock handle share one lease (F8); namespaces isolate tenants (cache_salt)."""

from __future__ import annotations

import copy
import dataclasses
import gc
import warnings

import pytest

from radixkv import PackedTokens, PrefixCache

PROMPT = list(range(10, 30))  # 20 tokens, B = 4


def locked_handle(cache):
    r = cache.insert(PROMPT, cache.allocate(5))
    return r.handle


@pytest.mark.parametrize(
    "make_copy",
    [copy.copy, copy.deepcopy, lambda h: dataclasses.replace(h)],
    ids=["copy", "deepcopy", "replace"],
)
def test_dropping_a_copy_of_a_live_handle_is_no_leak(make_cache, make_copy) -> None:
    cache = make_cache(16, 4)
    handle = locked_handle(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        dup = make_copy(handle)
        assert dup == handle
        del dup
        gc.collect()
    assert cache.stats().num_leaked_handles == 0
    # Any copy releases the lock; the original is then released too.
    cache.release(make_copy(handle))
    with pytest.raises(ValueError, match="not a live handle"):
        cache.release(handle)
    del handle
    gc.collect()
    s = cache.stats()
    assert s.num_leaked_handles == 0 and s.num_live_handles == 0 and s.num_in_use_blocks == 0


def test_dropping_every_copy_of_a_live_handle_is_one_leak(make_cache) -> None:
    cache = make_cache(16, 4)
    handle = locked_handle(cache)
    copies = [copy.copy(handle), copy.deepcopy(handle), dataclasses.replace(handle)]
    with pytest.warns(ResourceWarning, match="without PrefixCache.release"):
        del handle, copies
        gc.collect()
    s = cache.stats()
    assert s.num_leaked_handles == 1 and s.num_live_handles == 1  # the lock is kept
    assert s.num_in_use_blocks == 5


def test_namespaces_share_nothing_and_equal_namespaces_share(make_cache, serve) -> None:
    cache = make_cache(32, 4)
    first = cache.insert(PROMPT, cache.allocate(5), namespace="alice")
    cache.release(first.handle)
    assert cache.match(PROMPT).num_cached_tokens == 0  # the shared namespace sees nothing
    assert cache.match(PROMPT, namespace="bob").num_cached_tokens == 0
    again = cache.match(PackedTokens(PROMPT), namespace="alice")
    assert again.num_cached_tokens == 20 and again.block_ids == first.block_ids
    assert again.namespace == "alice"
    # The same tokens under another namespace get blocks of their own.
    other = cache.insert(PROMPT, cache.allocate(5), namespace="bob")
    assert not set(other.block_ids) & set(first.block_ids)
    cache.release(other.handle)
    shared = cache.insert(PROMPT, cache.allocate(5))
    assert not set(shared.block_ids) & (set(first.block_ids) | set(other.block_ids))
    cache.release(shared.handle)
    assert cache.stats().num_namespaces == 3
    # An insert under a handle stays in the handle's namespace.
    h = cache.acquire(cache.match(PROMPT, namespace="alice"))
    (tail,) = cache.allocate(1)
    r = cache.insert([*PROMPT, 1], [*first.block_ids, tail], handle=h)
    assert r.num_new_tokens == 1
    assert cache.match([*PROMPT, 1], namespace="alice").num_cached_tokens == 21
    assert cache.match([*PROMPT, 1], namespace="bob").num_cached_tokens == 20
    with pytest.raises(ValueError, match="differs from the handle's namespace"):
        cache.insert([*PROMPT, 1], r.block_ids, handle=r.handle, namespace="bob")
    cache.release(r.handle)


def test_an_emptied_namespace_is_dropped(make_cache) -> None:
    cache = make_cache(8, 4)
    r = cache.insert(PROMPT[:8], cache.allocate(2), namespace="t")
    cache.release(r.handle)
    assert cache.stats().num_namespaces == 2
    assert cache.evict(2) == list(r.block_ids)[::-1]
    assert cache.stats().num_namespaces == 1
    assert cache.match(PROMPT[:8], namespace="t").num_cached_tokens == 0


def test_namespaces_compete_for_one_pool(make_cache) -> None:
    cache: PrefixCache = make_cache(10, 4)
    for ns in ("a", "b"):
        r = cache.insert(PROMPT, cache.allocate(5), namespace=ns)
        cache.release(r.handle)
    assert cache.num_free_blocks == 0 and cache.num_evictable_blocks == 10
    cache.allocate(3)  # evicts the least recently used namespace's tail
    assert cache.match(PROMPT, namespace="a").num_cached_tokens == 8
    assert cache.match(PROMPT, namespace="b").num_cached_tokens == 20

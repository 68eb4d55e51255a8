"""`PrefixCache.summary`: the bounded picture of one namespace's tree that the live page shows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from lifecycle import CheckedCache, serve_request

from radixkv import PrefixCache
from radixkv.cache.summary import EMPTY


def _branches(serve: Callable[..., Any], cache: Any, n: int, namespace: str | None = None) -> None:
    """A shared 20-token stem, then `n` branches of 10 tokens each."""
    stem = list(range(1000, 1020))
    for i in range(n):
        serve(cache, stem + [2000 + i] * 10, namespace=namespace)


def test_small_tree_is_listed_whole_with_totals(make_cache, serve) -> None:
    cache = make_cache(num_blocks=64, block_size=4)
    _branches(serve, cache, 3)
    s = cache.summary()
    views = {v.node_id: v for v in cache.nodes() if v.parent_id is not None}
    listed = {n.node_id: n for n in s.nodes if n.parent_id is not None}
    assert listed.keys() == views.keys()
    assert s.folded == ()
    assert s.num_nodes == 4  # the stem and three branches
    assert s.num_tokens == 20 + 3 * 10 == sum(n.end - n.start for n in listed.values())
    for node_id, view in views.items():
        n = listed[node_id]
        assert (n.start, n.end, n.lock_ref) == (view.start, view.end, view.lock_ref)
        assert n.last_use == view.last_access
        assert n.num_blocks == len(view.block_ids)
        assert n.head_tokens[: len(view.head_tokens)] == view.head_tokens


def test_over_the_limit_children_fold_with_their_counts(make_cache, serve) -> None:
    cache = make_cache(num_blocks=256, block_size=4)
    _branches(serve, cache, 12)
    s = cache.summary(max_nodes=5)
    assert len(s.nodes) == 1 + 5  # the root and five nodes
    assert s.num_nodes == 13 and s.num_tokens == 20 + 12 * 10
    (fold,) = s.folded
    stem = next(n for n in s.nodes if n.start == 0 and n.end == 20)
    assert fold.parent_id == stem.node_id
    assert (fold.num_subtrees, fold.num_nodes, fold.num_tokens) == (8, 8, 80)
    ids = [n.node_id for n in s.nodes]
    for child in s.nodes[1:]:  # parents before children
        assert child.parent_id is not None and ids.index(child.parent_id) < ids.index(child.node_id)


def test_the_prompts_path_is_listed_first_even_when_folding(make_cache, serve) -> None:
    cache = make_cache(num_blocks=256, block_size=4)
    _branches(serve, cache, 12)
    last = list(range(1000, 1020)) + [2011] * 10
    s = cache.summary(max_nodes=3, prompt=last + [7, 7])
    assert s.num_path_tokens == 30
    path = [n for n in s.nodes if n.node_id in s.path]
    assert [(n.start, n.end) for n in path] == [(0, 20), (20, 30)]
    assert path[1].head_tokens == (2011,) * 10


def test_another_namespace_is_never_read(make_cache, serve) -> None:
    cache = make_cache(num_blocks=256, block_size=4)
    assert cache.summary() == EMPTY or cache.summary().num_nodes == 0
    _branches(serve, cache, 2, namespace="tenant-a")
    shared = cache.summary()
    assert shared.num_nodes == 0 and [n.parent_id for n in shared.nodes] in ([], [None])
    tenant = cache.summary(namespace="tenant-a")
    assert tenant.num_nodes == 3
    secret = list(range(1000, 1020)) + [2000] * 10
    assert cache.summary(prompt=secret).path == ()


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(
            st.sampled_from([None, "t"]),
            st.lists(st.integers(0, 3), min_size=2, max_size=14),
        ),
        min_size=1,
        max_size=12,
    ),
    max_nodes=st.integers(0, 6),
    pick=st.integers(0, 11),
)
def test_summary_accounts_for_every_shared_node(
    prompts: list[tuple[str | None, list[int]]], max_nodes: int, pick: int
) -> None:
    """Listed and folded nodes together are the shared namespace's tree, exactly; the listing
    is connected, bounded, and holds the prompt's path."""
    cache = CheckedCache(PrefixCache(num_blocks=96, block_size=2))
    for namespace, prompt in prompts:
        serve_request(cache, prompt, namespace=namespace)
    prompt = prompts[pick % len(prompts)][1]
    s = cache.summary(max_nodes=max_nodes, prompt=prompt)
    shared = _shared_views(cache)
    assert s.num_nodes == len(shared) == len(s.nodes) - 1 + sum(f.num_nodes for f in s.folded)
    assert s.num_tokens == sum(v.end - v.start for v in shared)
    assert len(s.nodes) <= max_nodes + 1
    listed = {n.node_id for n in s.nodes}
    assert all(n.parent_id in listed for n in s.nodes[1:])
    assert set(s.path[:max_nodes]) <= listed
    assert s.num_path_tokens == cache.match(prompt, namespace=None).num_cached_tokens


def _shared_views(cache: Any) -> list[Any]:
    """The shared namespace's nodes (its root comes first; another namespace's root ends them)."""
    views = []
    for i, view in enumerate(cache.nodes()):
        if view.parent_id is None and i > 0:
            break
        views.append(view)
    return views[1:]

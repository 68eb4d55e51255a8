"""The block keys kept on tree nodes (`radixkv.cache.keys`): equal to the keys
`chain_keys` gives over the whole path after any sequence of splits, evictions, demotions and
lookups, and computed once: a lookup hashes only the prompt's blocks past the tree's hit, a
demotion only the node's blocks not keyed yet."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lifecycle import CheckedCache, HashCount, put, serve_request

from radixkv import PrefixCache
from radixkv.cache.keys import (
    BlockKey,
    KeyChain,
    chain_keys,
    namespace_of,
    path_bytes,
    token_bytes_le,
)
from radixkv.cache.tokens import TOKEN_BYTES, pack_tokens


def fresh_keys(namespace: str | None, tokens: bytes, block_size: int) -> list[BlockKey]:
    """Keys of every full block of the packed `tokens`, hashed from position 0."""
    num_full = len(tokens) // TOKEN_BYTES // block_size
    return chain_keys(
        namespace, token_bytes_le(tokens[: TOKEN_BYTES * block_size * num_full]), block_size
    )


def check_node_keys(cache: PrefixCache, deepest_first: bool) -> None:
    """Every node's block keys and last key, reused where kept, equal fresh ones."""
    B = cache.block_size
    chain = KeyChain(B)
    nodes = [n for n, _ in cache._tree.iter_nodes() if n.parent is not None]
    for node in reversed(nodes) if deepest_first else nodes:
        fresh = fresh_keys(namespace_of(node), path_bytes(node, 0, node.end), B)
        assert chain.node_keys(node) == fresh[node.start // B :], node
        assert chain.last_key(node) == (fresh[-1] if fresh else None), node


def check_prompt_keys(cache: PrefixCache, prompt: Sequence[int], namespace: str | None) -> None:
    """The keys a lookup past the tree's hit uses equal the prompt's fresh ones (the cache's
    own chain, whose kept prompt keys serve a prompt looked up before)."""
    B = cache.block_size
    qb = pack_tokens(prompt)
    m, node, _ = cache._tree.walk(qb, len(prompt), namespace)
    num_full = len(prompt) // B
    keys = (cache._keys or KeyChain(B)).prompt_keys(qb, num_full, m, node, namespace)
    assert keys == fresh_keys(namespace, qb, B)[m // B :], (m, node)


BASES = [[int(t) for t in np.random.default_rng(seed).integers(0, 3, 40)] for seed in range(3)]
branch = st.lists(st.integers(0, 2), max_size=6)  # tokens after a base's prefix: paths fork
namespace = st.sampled_from([None, "t"])
operation = st.one_of(
    # serve: admit (lookup + load), grow, commit (split), close; evicts under pressure
    st.tuples(st.just("serve"), namespace, st.integers(0, 2), st.integers(1, 36), branch),
    st.tuples(st.just("match"), namespace, st.integers(0, 2), st.integers(1, 40), branch),
    st.tuples(st.just("evict"), st.integers(1, 6)),
)
# after an operation, the nodes that compute their keys: none, or all from the deepest up, or
# all from the root down
computed = st.sampled_from([None, True, False])


@pytest.mark.parametrize("block_size", [1, 4])
@settings(max_examples=100, deadline=None)
@given(
    steps=st.lists(st.tuples(operation, computed), min_size=4, max_size=40),
    write_through=st.booleans(),
)
def test_kept_keys_equal_fresh_ones_after_every_operation(
    block_size: int, steps: list, write_through: bool
) -> None:
    """A small device pool over a host tier: forks split nodes inside and at block boundaries,
    evictions trim and remove leaves (demoting their blocks), lookups go on into the host tier.
    After each operation the cache's own check recomputes every kept key (`CheckedCache`) and
    the prompt's lookup keys equal fresh ones; then all nodes, or none, compute their keys (from
    the deepest up or from the root down) and must equal fresh ones too."""
    B = block_size
    # Room for a request of up to 45 tokens beside a locked path as long: an admission locks the
    # whole node its hit ends in (the engine's scheduler then retries without the hit).
    cache = CheckedCache(
        PrefixCache(-(-96 // B) + 4, B, host_blocks=24 // B + 2, write_through=write_through)
    )
    for op, deepest_first in steps:
        if op[0] == "evict":
            cache.evict(op[1])
        else:
            _, ns, base, n, fork = op
            prompt = BASES[base][:n] + fork
            if op[0] == "serve":
                serve_request(cache, prompt, BASES[base][n : n + 3], ns)
            else:
                cache.match(prompt, namespace=ns)
            check_prompt_keys(cache.inner, prompt, ns)
        if deepest_first is not None:
            check_node_keys(cache.inner, deepest_first)
            cache.check_integrity()


def test_a_lookup_past_the_tree_hashes_only_the_blocks_past_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    B = 4
    cache = PrefixCache(num_blocks=256, block_size=B, host_blocks=128, write_through=True)
    count = HashCount(monkeypatch)
    prompt = list(range(1000, 1000 + 64 * B))  # 64 blocks
    longer = [*prompt, *range(3000, 3000 + 8 * B)]  # 8 blocks more
    put(cache, prompt)  # written through to the host: every block keyed
    assert count.take() == 64
    put(cache, longer)  # a leaf of 8 blocks under the prompt's node, chained from its last key
    assert count.take() == 8  # (the old code: 72)
    cache.evict(8)  # the leaf goes, its keys known; its blocks stay on the host
    assert count.take() == 0  # (the old code: 72)
    assert cache.match(longer, max_tokens=len(longer) - 1).num_host_blocks == 8
    assert count.take() == 8  # only the blocks past the tree's hit (the old code: 72)


def test_a_waiting_prompt_scored_at_every_step_is_hashed_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A longest-prefix-first scheduler matches every waiting prompt at every step: with lower
    tiers the blocks past the tree are hashed at its first match only, and the keys read back
    later are the chain's, also after the tree grew under the prompt."""
    B = 4
    cache = PrefixCache(num_blocks=256, block_size=B, host_blocks=128, write_through=True)
    count = HashCount(monkeypatch)
    shared = list(range(1000, 1000 + 8 * B))
    put(cache, shared)
    waiting = [[*shared, *range(2000 + 100 * i, 2000 + 100 * i + 16 * B)] for i in range(3)]
    count.take()
    for step in range(4):
        for prompt in waiting:
            assert cache.match(prompt, max_tokens=len(prompt) - 1).num_cached_tokens == 8 * B
        assert count.take() == (3 * 16 if step == 0 else 0)
    put(cache, waiting[0][: 12 * B])  # the tree grows into the first prompt: 4 blocks, chained
    assert count.take() == 4
    for prompt in waiting:
        cache.match(prompt, max_tokens=len(prompt) - 1)
    assert count.take() == 0  # the first prompt's tree blocks keyed, its others kept
    for prompt in waiting:
        check_prompt_keys(cache, prompt, None)  # the cache's keys equal fresh ones
    cache.check_integrity()


def test_the_prompt_keys_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    B = 4
    cache = PrefixCache(num_blocks=256, block_size=B, host_blocks=128, write_through=True)
    monkeypatch.setattr(KeyChain, "MEMO_KEYS", 40)
    put(cache, list(range(1000, 1000 + 4 * B)))
    prompts = [list(range(5000 + 1000 * i, 5000 + 1000 * i + 16 * B)) for i in range(4)]
    for prompt in prompts:  # 16 blocks each, none in the tree: only the last two are kept
        cache.match(prompt)
        cache.check_integrity()
    count = HashCount(monkeypatch)
    cache.match(prompts[3])
    cache.match(prompts[2])
    assert count.take() == 0
    cache.match(prompts[0])
    assert count.take() == 16
    cache.check_integrity()


def test_a_demotion_hashes_only_the_demoted_nodes_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    B = 4
    cache = PrefixCache(num_blocks=512, block_size=B, host_blocks=64)
    trunk = list(range(1000, 1000 + 64 * B))  # 64 blocks
    put(cache, trunk)
    for branch in range(3):
        put(cache, [*trunk, *range(2000 + 100 * branch, 2000 + 100 * branch + 4 * B)])
    count = HashCount(monkeypatch)
    cache.evict(4)  # one branch leaf: its 4 blocks, chained from the trunk's keys (computed now)
    assert count.take() == 64 + 4
    cache.evict(8)  # the two others: 4 blocks each (the old code: 68 each)
    assert count.take() == 8
    assert cache.stats().num_host_cached_blocks == 12


def test_a_leaf_trimmed_twice_is_keyed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    B = 4
    cache = PrefixCache(num_blocks=64, block_size=B, host_blocks=64)
    put(cache, list(range(1000, 1000 + 16 * B)))  # one leaf of 16 blocks
    count = HashCount(monkeypatch)
    cache.evict(4)  # trimmed to 12 blocks: its 16 keys computed, the last 4 demoted
    assert count.take() == 16
    cache.evict(4)  # trimmed to 8: its kept keys serve (the old code: 12)
    assert count.take() == 0
    assert cache.stats().num_host_cached_blocks == 8

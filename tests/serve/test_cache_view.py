"""What the live page is sent about the tree (`cache_view.tree_payload`) tells nothing of
another tenant: the same shared requests give the same payload whether or not salted requests
came in between (their nodes take ids and clock ticks from the same counters)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")

from radixkv import PrefixCache
from radixkv.serve.cache_view import NodeAliases, tree_payload

SHARED = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9], [1, 2, 3, 4, 5, 6, 11, 12, 13]]
TENANT = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 30, 31, 32]]


def _serve(cache: PrefixCache, prompt: list[int], namespace: str | None = None) -> None:
    table = cache.admit(prompt, max_hit=len(prompt) - 1, namespace=namespace)
    assert table is not None
    cache.commit(table, prompt)
    cache.close(table)
    cache.check_integrity()


def _payload(with_tenant: bool, max_nodes: int) -> dict[str, Any]:
    cache = PrefixCache(num_blocks=64, block_size=2)
    for i, prompt in enumerate(SHARED):
        if with_tenant:
            _serve(cache, TENANT[i % len(TENANT)], namespace="tenant")
        _serve(cache, prompt)
    aliases = NodeAliases()
    payload = tree_payload(cache.summary(max_nodes=max_nodes, prompt=SHARED[-1]), None, aliases)
    aliases.check_integrity()
    return payload


@pytest.mark.parametrize("max_nodes", [1, 2, 300])
def test_a_tenants_requests_change_nothing_the_page_is_sent(max_nodes: int) -> None:
    alone = _payload(with_tenant=False, max_nodes=max_nodes)
    assert alone == _payload(with_tenant=True, max_nodes=max_nodes)
    assert alone["num_nodes"] == 5 and alone["path"]  # the shared tree is really there


def test_a_payload_forgets_the_aliases_of_nodes_it_no_longer_lists() -> None:
    cache = PrefixCache(num_blocks=64, block_size=2)
    for prompt in SHARED:
        _serve(cache, prompt)
    aliases = NodeAliases()
    before = tree_payload(cache.summary(max_nodes=300), None, aliases)
    assert len(aliases) == len(before["nodes"]) == 1 + before["num_nodes"]  # the root too
    assert cache.reset()
    _serve(cache, SHARED[0])
    after = tree_payload(cache.summary(max_nodes=300), None, aliases)
    assert len(aliases) == len(after["nodes"]) < len(before["nodes"])
    aliases.check_integrity()


def test_aliases_stay_while_listed_and_are_never_reused() -> None:
    alias = NodeAliases()
    first = [alias(i) for i in (40, 7, 93)]
    assert first == [0, 1, 2] and alias(7) == 1
    alias.keep_only({93})
    assert alias(93) == 2 and alias(40) == 3  # 40 was forgotten: a new alias, never 0 again
    alias.check_integrity()

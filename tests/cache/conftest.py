"""Factories for the core cache tests.

`make_cache` builds a cache wrapped so that every public call is followed by `check_integrity()`;
`serve` runs one request's whole life the way the scheduler does (match with the prefill cap, lock,
copy-on-write of a partial block, allocate, insert, release, free what the tree did not adopt).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
from checked import Checked as CheckedCache

from radixkv import InsertResult, MatchResult, PrefixCache


@dataclass(frozen=True)
class Served:
    match: MatchResult
    result: InsertResult
    table: tuple[int, ...]  # the table the request wrote into (before insert)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def serve_request(
    cache: PrefixCache | CheckedCache, prompt: Sequence[int], reply: Sequence[int] = ()
) -> Served:
    """One request: match (prefill cap), acquire, CoW, allocate, insert prompt + reply, release."""
    prompt = list(prompt)
    written = prompt + list(reply)
    match = cache.match(prompt, max_tokens=len(prompt) - 1)
    handle = cache.acquire(match)
    table = list(match.block_ids)
    B = cache.block_size
    if match.last_block_partial:
        (fresh,) = cache.allocate(1)  # copy-on-write target: the shared block is never written
        table[-1] = fresh
    new = cache.allocate(ceil_div(len(written), B) - len(table))
    assert new is not None, "test cache too small"
    table += new
    result = cache.insert(written, table, handle=handle)
    cache.release(result.handle)
    cache.free(result.owned_block_ids)
    return Served(match, result, tuple(table))


@pytest.fixture
def make_cache() -> Callable[..., CheckedCache]:
    def make(num_blocks: int = 64, block_size: int = 16) -> CheckedCache:
        return CheckedCache(PrefixCache(num_blocks=num_blocks, block_size=block_size))

    return make


@pytest.fixture
def serve() -> Callable[..., Served]:
    return serve_request

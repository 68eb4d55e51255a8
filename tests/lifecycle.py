"""Factories for the core cache tests.

`make_cache` builds a cache wrapped so that every public call is followed by `check_integrity()`;
`serve` runs one request's whole life the way the scheduler does (admit the prompt with the
prefill cap, grow for the reply, commit what was written, close); `put` stores tokens whole;
`HashCount` counts the blocks the key chain hashes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from radixkv import MatchResult, PrefixCache
from radixkv.cache import keys as keys_module


class CheckedCache:
    """Proxy of a PrefixCache (or any object with check_integrity(), such as a DiskStore) that
    runs check_integrity() after every public method call."""

    def __init__(self, cache: Any) -> None:
        self.inner = cache

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                self.inner.check_integrity()

        return checked


class HashCount:
    """Counts the blocks `chain_keys` hashes (its one hashing call, the default hasher's
    `block`): in all, and per block (its parent's link and its tokens)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.num_blocks = 0
        self.per_block: Counter[tuple[int | None, bytes]] = Counter()
        real = keys_module.hash_block

        def counting(parent: int | None, tokens: bytes) -> int:
            self.num_blocks += 1
            self.per_block[parent, tokens] += 1
            return real(parent, tokens)

        monkeypatch.setattr(keys_module.Xxh64Hasher, "block", staticmethod(counting))

    def take(self) -> int:
        n, self.num_blocks = self.num_blocks, 0
        self.per_block.clear()
        return n


@dataclass(frozen=True)
class Served:
    match: MatchResult  # the prompt's score just before admission
    table: tuple[int, ...]  # the table the request wrote into (before commit)
    block_ids: tuple[int, ...]  # the canonical table commit gave back


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def serve_request(
    cache: PrefixCache | CheckedCache,
    prompt: Sequence[int],
    reply: Sequence[int] = (),
    namespace: str | None = None,
) -> Served:
    """One request: admit the prompt (prefill cap), grow for the reply, commit prompt + reply,
    close."""
    prompt = list(prompt)
    written = prompt + list(reply)
    match = cache.match(prompt, max_tokens=len(prompt) - 1, namespace=namespace)
    table = cache.admit(prompt, max_hit=len(prompt) - 1, namespace=namespace)
    assert table is not None, "test cache too small"
    assert cache.grow(table, ceil_div(len(written), cache.block_size) - len(table.blocks))
    written_into = table.blocks
    cache.commit(table, written)
    canonical = table.blocks
    cache.close(table)
    return Served(match, written_into, canonical)


def put(
    cache: PrefixCache | CheckedCache, tokens: Sequence[int], namespace: str | None = None
) -> tuple[int, ...]:
    """Store `tokens` written into fresh blocks (no hit: what the tree holds already is freed as
    a duplicate) and close; the canonical table."""
    table = cache.admit(tokens, max_hit=0, namespace=namespace)
    assert table is not None, "test cache too small"
    cache.commit(table, tokens)
    blocks = table.blocks
    cache.close(table)
    return blocks

"""Factories for the core cache tests: `make_cache` builds a cache wrapped so that every public
call is followed by `check_integrity()`; `serve` runs one request's whole life (see
`tests/lifecycle.py`, shared with the engine's disk-store tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from lifecycle import CheckedCache, Served, serve_request

from radixkv import PrefixCache


@pytest.fixture
def make_cache() -> Callable[..., CheckedCache]:
    def make(num_blocks: int = 64, block_size: int = 16, **options: Any) -> CheckedCache:
        return CheckedCache(PrefixCache(num_blocks=num_blocks, block_size=block_size, **options))

    return make


@pytest.fixture
def serve() -> Callable[..., Served]:
    return serve_request

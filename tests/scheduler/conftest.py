"""The scheduler tests' fixture: `harness`, a factory of `scheduler_harness.Harness`."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from scheduler_harness import Harness, make_harness


@pytest.fixture(scope="session")
def harness() -> Callable[..., Harness]:
    """Factory: harness(num_blocks=, block_size=, **EngineConfig fields)."""
    return make_harness

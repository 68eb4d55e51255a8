"""A grouped cache of the tree's group and a window group, as a model with window layers has."""

from __future__ import annotations

from typing import Any

from radixkv.cache.group import GroupSpec
from radixkv.cache.grouped import GroupedCache
from radixkv.cache.kinds import build_cache
from radixkv.cache.window import WindowSpec


def window_cache(
    num_blocks: int,
    num_window_blocks: int,
    block_size: int,
    window: int,
    *,
    host_blocks: int = 0,
    window_host_blocks: int = 0,
    disk: Any = None,
    window_disk: Any = None,
    **settings: Any,
) -> GroupedCache:
    """`build_cache` of a "full" and a "window" group; `settings` as `build_cache`'s."""
    return build_cache(
        [GroupSpec(), WindowSpec(window)],
        [num_blocks, num_window_blocks],
        block_size,
        host_blocks=[host_blocks, window_host_blocks],
        disks=[disk, window_disk],
        **settings,
    )

"""The registry of cache-group kinds, and the grouped cache built from a model's group specs.

`GROUP_KINDS` maps a spec's `kind` to the class that caches its layers: "full" (the tree's group,
`PrefixCache`), "window" (`radixkv.cache.window`) and "state" (`radixkv.cache.state`). The engine
reads a model's layers into specs (its model-reading code is the one place above the cache that
names a kind), sizes each group's pool with its kind's `plan_blocks` and builds the cache with
`build_cache`; nothing else above the cache asks which kinds there are. A new kind plugs in by a
module of its own and an entry here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixkv.cache.group import GroupKind, GroupSetup, GroupSpec
from radixkv.cache.grouped import GroupedCache
from radixkv.cache.keys import BlockHasher
from radixkv.cache.prefix_cache import FullKind
from radixkv.cache.state import StateKind
from radixkv.cache.tiers import DiskIndex
from radixkv.cache.window import WindowKind

GROUP_KINDS: dict[str, GroupKind] = {
    FullKind.name: FullKind(),
    WindowKind.name: WindowKind(),
    StateKind.name: StateKind(),
}


def build_cache(
    specs: Sequence[GroupSpec],
    num_blocks: Sequence[int],
    block_size: int,
    *,
    eviction: str = "gdsf",
    kv_events: bool | BlockHasher = False,
    host_blocks: Sequence[int] = (),
    disks: Sequence[DiskIndex | None] = (),
    write_through: bool = False,
    config: Any = None,
) -> GroupedCache:
    """One group per spec (the first the tree's: a "full" spec), `num_blocks[g]` blocks of
    `block_size` tokens each; `host_blocks[g]` / `disks[g]`: group g's lower tiers (empty: none),
    which every group has or none has. `eviction`, `kv_events`, `write_through` as
    `PrefixCache`'s; every group records into the tree group's event queue and names its
    blocks by its key chain; `config`: the engine's settings, for kinds with settings of their
    own (None: their defaults). ValueError for tiers some groups have and others lack."""
    n = len(specs)
    assert n == len(num_blocks) and specs[0].kind == FullKind.name, (specs, num_blocks)
    hosts = list(host_blocks) or [0] * n
    disk_of = list(disks) or [None] * n
    if len({bool(h) for h in hosts}) > 1 or len({d is None for d in disk_of}) > 1:
        raise ValueError("every KV cache group has lower tiers exactly when the others have")
    groups: list = []
    for index, spec in enumerate(specs):
        tree = groups[0] if groups else None
        setup = GroupSetup(
            index,
            num_blocks[index],
            block_size,
            eviction=eviction,
            kv_events=kv_events,
            host_blocks=hosts[index],
            disk=disk_of[index],
            write_through=write_through,
            events=None if tree is None else tree.event_recorder,
            keys=None if tree is None else tree.key_chain,
            tree=tree,
            config=config,
        )
        groups.append(GROUP_KINDS[spec.kind].build(spec, setup))
    return GroupedCache(groups)

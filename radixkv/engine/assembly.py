"""The parts of an engine, assembled from its model's layout: one function, `assemble`.

    model ─► ModelRunner     the layout read from the model (`attention_layout`): its layers in
                             KV cache groups, one pair of KV tensors per group, each group's
                             pool sized by its kind (`kv_tensors`)
          ─► tier movers     one per group, the host and disk budgets split between them (the
                             recurrent states' group takes `snapshot_share` of each)
          ─► GroupedCache    one group per tensor pair (and the recurrent layers' state slots),
                             of the kind its spec names, each with its host tier's blocks and
                             disk store (`radixkv.cache.kinds`)
          ─► Scheduler       over the grouped cache
          ─► KVEventFeed     where the cache's events go (None: nowhere)

Nothing here names a kind of group: the specs the runner read say which there are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixkv.cache.grouped import GroupedCache
from radixkv.cache.keys import make_block_hasher
from radixkv.cache.kinds import build_cache
from radixkv.engine.config import EngineConfig
from radixkv.engine.step.model_runner import ModelRunner
from radixkv.engine.tiers.host_state import make_state_tier_io
from radixkv.engine.tiers.tier_io import TierIO, make_tier_ios
from radixkv.kv_events import KVEventFeed
from radixkv.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class EngineParts:
    runner: ModelRunner
    tier_ios: tuple[TierIO | None, ...]  # per KV cache group; None each without a host tier
    cache: GroupedCache
    scheduler: Scheduler
    kv_events: KVEventFeed | None


def assemble(model: Any, config: EngineConfig) -> EngineParts:
    """The runner over `model` (warmed up), its groups' tier movers, the grouped cache over
    their pools and tiers, the scheduler and the event feed that `config` asks for. ValueError
    for pools or tiers the settings cannot hold one request's blocks in."""
    runner = ModelRunner(model, config)
    runner.warm_up()
    tier_ios = _tier_ios(model, runner, config)
    events = config.kv_events
    hasher = events is not None and make_block_hasher(config.block_hash, config.block_hash_seed)
    cache = build_cache(
        runner.group_specs,
        runner.group_sizes,
        config.block_size,
        kv_events=hasher,
        host_blocks=[0 if t is None else t.host.num_blocks for t in tier_ios],
        disks=[None if t is None else t.disk for t in tier_ios],
        write_through=config.host_cache_write_through,
        config=config,
    )
    feed = None if events is None else _event_feed(config)
    return EngineParts(runner, tier_ios, cache, Scheduler(cache, config), feed)


def _tier_ios(model: Any, runner: ModelRunner, config: EngineConfig) -> tuple[TierIO | None, ...]:
    """One tier mover per cache group: the KV groups' over their tensors; the recurrent states'
    group's, when there is one, over its slots, with `snapshot_share` of the host and disk
    budgets (the KV groups split the rest)."""
    states = runner.states
    if states is None or not config.host_cache_bytes:
        return make_tier_ios(model, runner.kv, config) + ((None,) if states is not None else ())
    host_bytes = int(config.snapshot_share * config.host_cache_bytes)
    disk_bytes = int(config.snapshot_share * config.disk_cache_bytes)
    kv = make_tier_ios(
        model,
        runner.kv,
        config,
        host_bytes=config.host_cache_bytes - host_bytes,
        disk_bytes=config.disk_cache_bytes - disk_bytes,
    )
    state = make_state_tier_io(
        model,
        states,
        config,
        host_bytes=host_bytes,
        disk_bytes=disk_bytes,
        block_size=config.block_size,
    )
    return (*kv, state)


def _event_feed(config: EngineConfig) -> KVEventFeed:
    """Where the cache's drained events go: a callable, or a publisher on an address."""
    assert config.kv_events is not None
    if not isinstance(config.kv_events, str):
        return KVEventFeed(config.kv_events)
    return KVEventFeed(
        config.kv_events,
        event_layout=config.kv_events_layout,
        topic=config.kv_events_topic,
        replay_endpoint=config.kv_events_replay,
        connect=config.kv_events_connect,
    )

"""KV events on the wire: the bytes decode with vLLM's own struct definitions, over real ZeroMQ.

The msgspec structs of `vllm_kv_events` mirror `vllm/distributed/kv_events.py` of vLLM 0.33
(the current release) field for field (order, types, defaults and struct options): a router
built on vLLM's definitions decodes what radixkv sends. The batch is `array_like` (`[ts, events,
data_parallel_rank]`); events are tagged maps by default (vLLM 0.33) or, as an option, the
`array_like` tagged arrays of older releases (what llm-d's and AIBrix's readers decode). NVIDIA
Dynamo's reader takes either.
"""

from __future__ import annotations

import stat
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from router_index import BlockHashIndex
from vllm_kv_events import (
    DECODER,
    DECODERS,
    STRUCTS,
    KVCacheEvent,
    KVEventBatch,
    VllmBlockRemoved,
    VllmBlockStored,
)
from window_cache import window_cache

from radixkv.cache import PackedTokens, PrefixCache
from radixkv.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from radixkv.cache.keys import chain_hashes
from radixkv.kv_events import END_SEQ, ZmqEventPublisher, encode_batch

msgpack = pytest.importorskip("msgpack")  # the kv-events extra: absent on the GPU machine
msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

B = 4
TOKENS = [7, 0, 2**31, 2**32 - 1, 128, 255, 65535, 65536]  # every msgpack int width
HASHES = chain_hashes(None, b"".join(t.to_bytes(4, "little") for t in TOKENS), B)
EVENTS = [
    BlockStored(tuple(HASHES), None, tuple(TOKENS), B),
    BlockStored((2**64 - 1,), HASHES[1], (1, 2, 3, 4), B),
    BlockRemoved((2**64 - 1, HASHES[1])),
    AllBlocksCleared(),
]


def vllm_events(medium: str | None, layout: str = "map") -> list[KVCacheEvent]:
    """EVENTS as vLLM 0.33 builds them (`vllm/v1/core/block_pool.py`: one extra key entry per
    block, group 0); the array layout's older structs carry neither."""
    _, stored, removed, cleared = STRUCTS[layout]
    if layout == "array":
        return [
            stored(HASHES, None, TOKENS, B, None, medium, None),
            stored([2**64 - 1], HASHES[1], [1, 2, 3, 4], B, None, medium, None),
            removed([2**64 - 1, HASHES[1]], medium),
            cleared(),
        ]
    return [
        stored(HASHES, None, TOKENS, B, None, medium, None, [None, None], 0),
        stored([2**64 - 1], HASHES[1], [1, 2, 3, 4], B, None, medium, None, [None], 0),
        removed([2**64 - 1, HASHES[1]], medium, 0),
        cleared(),
    ]


def test_hashes_are_unsigned_64_bit_and_chained() -> None:
    assert all(0 <= h < 2**64 for h in HASHES)
    assert HASHES[0] != HASHES[1]
    # The second hash covers the first block through its parent: a change there changes it.
    other = chain_hashes(None, b"".join(t.to_bytes(4, "little") for t in [8, *TOKENS[1:]]), B)
    assert other[1] != HASHES[1] and other[0] != HASHES[0]


@pytest.mark.parametrize("medium", ["GPU", "CPU", None])
@pytest.mark.parametrize("layout", ["array", "map"])
def test_batch_decodes_with_vllm_structs_and_equals_their_encoding(
    medium: str | None, layout: str
) -> None:
    payload = encode_batch(
        EVENTS, ts=1757500000.25, data_parallel_rank=3, medium=medium, event_layout=layout
    )
    batch = DECODERS[layout].decode(payload)
    assert batch.ts == 1757500000.25 and batch.data_parallel_rank == 3
    assert batch.events == vllm_events(medium, layout)
    if layout == "map":
        # The values vLLM's publisher (msgspec's encoder over these structs) sends, the same
        # fields in the same order (msgspec writes a struct's map header at a fixed width,
        # msgpack at the shortest: the bytes differ there only).
        expected = KVEventBatch(
            ts=1757500000.25, events=vllm_events(medium, layout), data_parallel_rank=3
        )
        assert in_order(payload) == in_order(msgspec.msgpack.encode(expected))
    else:
        # Arrays stop at lora_name, the last field every vLLM version declares without a
        # default: older structs (without the later fields) and newer ones (defaults filled in,
        # as the decode above shows) both read them.
        _, wire, _ = msgpack.unpackb(payload)
        assert [len(e) for e in wire] == [8, 8, 3, 1]


def in_order(payload: bytes) -> Any:
    """A msgpack payload as Python values, each map as its list of (key, value) pairs."""
    return msgpack.unpackb(payload, object_pairs_hook=list)


def test_a_salted_paths_first_block_carries_the_salt_as_vllm_does() -> None:
    # vLLM 0.33 publishes block 0's cache salt untagged, one extra-keys entry per block
    salted = BlockStored(tuple(HASHES), None, tuple(TOKENS), B, "tenant-a")
    for layout in ("map", "array"):
        payload = encode_batch([salted], ts=0.0, data_parallel_rank=0, event_layout=layout)
        (event,) = DECODERS[layout].decode(payload).events
        assert event.extra_keys == ([("tenant-a",), None] if layout == "map" else None)


def test_an_unknown_layout_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="event_layout must be one of"):
        encode_batch(EVENTS, ts=0.0, data_parallel_rank=0, event_layout="json")
    with pytest.raises(ValueError, match="event_layout must be one of"):
        ZmqEventPublisher("inproc://radixkv-never-bound", event_layout="json")


def test_unknown_event_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="not a KV event"):
        encode_batch(["BlockStored"], ts=0.0, data_parallel_rank=0)  # type: ignore[list-item]


def test_a_non_event_fails_its_batch_and_the_publisher_goes_on(caplog) -> None:
    # An array compares elementwise: looking for close()'s marker must not compare items to None.
    with ZmqEventPublisher("inproc://radixkv-non-event") as publisher:
        publisher(np.array([1, 2]))  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while "failed to send" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.005)
        assert "failed to send 1 events" in caplog.text
        publisher(EVENTS[0])
        while publisher.num_batches_sent == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert publisher.num_batches_sent == 1


def test_bad_endpoint_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="endpoint must be a ZeroMQ address"):
        ZmqEventPublisher("localhost:5557")


def test_an_ipc_publisher_is_its_owners_alone_and_delivers(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    endpoint = f"ipc://{tmp_path}/events.sock"
    publisher = ZmqEventPublisher(endpoint, replay_endpoint="ipc://~/replay.sock")
    sub = subscriber(zmq.Context.instance(), endpoint)
    try:
        for name in ("events.sock", "replay.sock"):
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
        wait_for_subscription(publisher, sub)
        publisher(BlockRemoved((7,)))
        (batch,) = recv_batches(sub, 1)
        assert DECODER.decode(batch[2]).events[0].block_hashes == [7]
    finally:
        sub.close(linger=0)
        publisher.close()


def recv_batches(sub: zmq.Socket, num_events: int, timeout_s: float = 10.0) -> list[list[bytes]]:
    """Multipart messages until `num_events` events have arrived (or the timeout)."""
    messages: list[list[bytes]] = []
    got = 0
    deadline = time.monotonic() + timeout_s
    while got < num_events and time.monotonic() < deadline:
        if sub.poll(100):
            frames = sub.recv_multipart()
            messages.append(frames)
            got += len(DECODER.decode(frames[2]).events)
    return messages


def subscriber(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def wait_for_subscription(publisher: ZmqEventPublisher, sub: zmq.Socket) -> None:
    """PUB drops messages until a SUB has joined: send probes until one arrives, then drain."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        publisher(AllBlocksCleared())
        if sub.poll(100):
            break
    else:
        pytest.fail("the subscriber never received a probe")
    time.sleep(0.2)
    while sub.poll(100):
        sub.recv_multipart()


def test_pub_sub_over_tcp_frames_and_payloads() -> None:
    ctx = zmq.Context()
    with ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv", context=ctx) as publisher:
        sub = subscriber(ctx, publisher.last_endpoint, b"kv")
        wait_for_subscription(publisher, sub)
        for event in EVENTS:
            publisher(event)
        messages = recv_batches(sub, len(EVENTS))
        sub.close(linger=0)
    ctx.term()
    assert messages, "no batch arrived"
    topics = {m[0] for m in messages}
    assert topics == {b"kv"} and all(len(m) == 3 for m in messages)
    seqs = [int.from_bytes(m[1], "big") for m in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence numbers must be dense"
    events = [e for m in messages for e in DECODER.decode(m[2]).events]
    assert events == vllm_events("GPU")
    assert all(DECODER.decode(m[2]).data_parallel_rank == 0 for m in messages)


def test_replay_serves_buffered_batches_then_end_marker() -> None:
    ctx = zmq.Context()
    replay_endpoint = "inproc://radixkv-replay-test"
    with ZmqEventPublisher(
        "inproc://radixkv-pub-test", replay_endpoint=replay_endpoint, context=ctx
    ) as publisher:
        for k, event in enumerate(EVENTS):  # one batch each: wait for each to be sent
            publisher(event)
            deadline = time.monotonic() + 10
            while publisher.num_batches_sent == k and time.monotonic() < deadline:
                time.sleep(0.005)
        assert publisher.num_batches_sent == len(EVENTS)
        dealer = ctx.socket(zmq.DEALER)  # several answers to one request: not a REQ socket
        dealer.connect(replay_endpoint)
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))  # from sequence number 1 on
        replies = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                break
            replies.append((int.from_bytes(seq, "big"), payload))
        dealer.close(linger=0)
    ctx.term()
    seqs = [s for s, _ in replies]
    assert seqs == [1, 2, 3], "every buffered batch from sequence number 1 on, in order"
    events = [e for _, p in replies for e in DECODER.decode(p).events]
    assert events == vllm_events("GPU")[1:]


def from_wire(event: KVCacheEvent) -> KVEvent:
    """A decoded vLLM event as radixkv's (what a router's index applies)."""
    if isinstance(event, VllmBlockStored):
        hashes = tuple(int(h) for h in event.block_hashes)
        parent, group = event.parent_block_hash, event.group_idx or 0
        window = event.kv_cache_spec_sliding_window
        assert (window is not None) == (event.kv_cache_spec_kind == "sliding_window")
        tokens = tuple(event.token_ids)
        return BlockStored(hashes, parent, tokens, event.block_size, None, None, group, window)  # type: ignore[arg-type]
    if isinstance(event, VllmBlockRemoved):
        hashes = tuple(int(h) for h in event.block_hashes)
        return BlockRemoved(hashes, None, event.group_idx or 0)  # type: ignore[arg-type]
    return AllBlocksCleared()


def _hybrid_workload() -> Iterator[list[KVEvent]]:
    """A window model's cache under eviction in both groups: each request's events."""
    cache = window_cache(
        num_blocks=16, num_window_blocks=10, block_size=4, window=6, kv_events=True
    )
    for k in range(12):
        tokens = [1, 2, 3, 4, 5, 6, 7, *range(100 * k, 100 * k + 3 + k % 5)]
        table = cache.admit(tokens, max_hit=len(tokens) - 1)
        assert table is not None
        cache.commit(table, tokens)
        qb = PackedTokens(tokens).tobytes()
        cache.groups[1].keep_tail(table.tables[1], qb, len(tokens) - 1)  # where a repeat resumes
        cache.close(table)
        cache.check_integrity()
        yield cache.take_events()
    assert cache.groups[1].num_evicted_tails > 0 and cache.stats().num_evicted_blocks > 0


def test_a_window_models_events_carry_their_group_on_the_wire() -> None:
    """Map layout: vLLM's structs decode group_idx 1 with the window's kind and size, and the
    index rebuilt from the bytes equals the one fed directly, both groups."""
    direct, wire = BlockHashIndex(), BlockHashIndex()
    groups = set()
    for k, events in enumerate(_hybrid_workload()):
        for event in events:
            direct.apply(event)
        batch = DECODER.decode(encode_batch(events, ts=float(k), data_parallel_rank=0))
        for event in batch.events:
            wire.apply(from_wire(event))
            groups.add(getattr(event, "group_idx", None))
        assert wire.hashes == direct.hashes and wire.window_hashes == direct.window_hashes
    assert groups == {0, 1} and direct.window_hashes


def test_the_array_layout_carries_the_full_group_only() -> None:
    """Its arrays end before group_idx: a window event there would read as a full one, so the
    layout leaves the window group out and sends what the full group alone would."""
    for events in _hybrid_workload():
        full = [e for e in events if not getattr(e, "group_idx", 0)]
        payload = encode_batch(events, ts=1.0, data_parallel_rank=0, event_layout="array")
        alone = encode_batch(full, ts=1.0, data_parallel_rank=0, event_layout="array")
        assert payload == alone
        assert len(DECODERS["array"].decode(payload).events) == len(full)


def test_a_full_attention_models_bytes_are_the_vllm_group_0_encoding() -> None:
    """No field a window brought: a full-attention cache's batch is byte for byte what vLLM's
    structs give with group_idx 0 and nothing after it (msgpack at vLLM's map header widths)."""
    cache = PrefixCache(12, 4, kv_events=True)
    for k in range(6):
        tokens = [1, 2, 3, 4, 5, 6, *range(100 * k, 100 * k + 7)]
        table = cache.admit(tokens, max_hit=len(tokens))
        assert table is not None
        cache.commit(table, tokens)
        cache.close(table)
    events = cache.take_events()
    assert any(isinstance(e, BlockRemoved) for e in events)
    _, stored, removed, _ = STRUCTS["map"]
    expected = [
        stored(
            list(e.block_hashes),
            e.parent_block_hash,
            list(e.token_ids),
            4,
            None,
            "GPU",
            None,
            [None] * len(e.block_hashes),
            0,
        )
        if isinstance(e, BlockStored)
        else removed(list(e.block_hashes), "GPU", 0)
        for e in events
    ]
    payload = encode_batch(events, ts=2.5, data_parallel_rank=1)
    vllm = msgspec.msgpack.encode(KVEventBatch(ts=2.5, events=expected, data_parallel_rank=1))
    assert in_order(payload) == in_order(vllm)
    fields = [list(dict(f)) for f in in_order(payload)[1]]
    assert {tuple(f[-1:]) for f in fields} == {("group_idx",)}


def test_a_real_caches_events_survive_the_wire() -> None:
    """A workload with splits, trims and evictions: the index rebuilt from the decoded bytes equals
    the one fed directly, batch after batch."""
    cache = PrefixCache(12, 4, kv_events=True)
    direct = BlockHashIndex()
    wire = BlockHashIndex()
    for k in range(12):
        tokens = [1, 2, 3, 4, 5, 6, *range(100 * k, 100 * k + 3 + k % 5)]
        table = cache.admit(tokens, max_hit=len(tokens))
        assert table is not None
        cache.commit(table, tokens)
        cache.close(table)
        events = cache.take_events()
        for event in events:
            direct.apply(event)
        batch = DECODER.decode(encode_batch(events, ts=float(k), data_parallel_rank=0))
        for event in batch.events:
            wire.apply(from_wire(event))
        assert wire.hashes == direct.hashes
    assert cache.stats().num_evicted_blocks > 0


def test_a_lower_tiers_event_keeps_its_own_medium() -> None:
    """The publisher's `medium` names the device pool; host and disk events carry theirs."""
    events = [
        BlockStored((5,), None, (1, 2, 3, 4), B, medium="CPU"),
        BlockRemoved((5,), "DISK"),
        BlockRemoved((6,)),
    ]
    batch = DECODER.decode(encode_batch(events, ts=1.0, data_parallel_rank=0, medium="GPU"))
    assert [e.medium for e in batch.events] == ["CPU", "DISK", "GPU"]


def _state_cache_events() -> list[KVEvent]:
    """A hybrid model's cache (the tree and the recurrent-state group, one snapshot slot beside
    the running one, a host tier): three finished requests, the third evicting the first's
    snapshot to the host."""
    from radixkv.cache.group import GroupSpec
    from radixkv.cache.kinds import build_cache
    from radixkv.cache.state import StateSpec
    from radixkv.engine.config import EngineConfig

    config = EngineConfig(block_size=B, snapshot_min_gap_tokens=4, max_num_seqs=1)
    specs = [GroupSpec(), StateSpec(slot_bytes=64)]
    cache = build_cache(specs, [64, 2], B, kv_events=True, host_blocks=[8, 4], config=config)
    for k in (1, 2, 3):
        tokens = list(range(100 * k, 100 * k + 14))
        table = cache.admit(tokens[:10], max_hit=9)
        assert table is not None and cache.extend(table, 13)
        cache.commit(table, tokens[:13])
        cache.close(table)
        cache.check_integrity()
    return cache.take_events()


def test_snapshot_events_carry_the_state_group_and_vllms_mamba_kind_on_the_wire() -> None:
    """Map layout: a snapshot's events decode with vLLM's structs as group 1 of kind "mamba"
    (no window), on the device and the host; the array layout, which cannot name a group,
    leaves them out."""
    events = _state_cache_events()
    batch = DECODER.decode(encode_batch(events, ts=1.0, data_parallel_rank=0))
    state = [e for e in batch.events if getattr(e, "group_idx", 0) == 1]
    stored = [e for e in state if isinstance(e, VllmBlockStored)]
    assert {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored} == {
        ("mamba", None)
    }
    assert {e.medium for e in stored} == {"GPU", "CPU"}
    assert all(len(e.block_hashes) == 1 and 1 <= len(e.token_ids) <= B for e in stored)
    assert [e for e in state if isinstance(e, VllmBlockRemoved)]
    full = [e for e in batch.events if not getattr(e, "group_idx", 0)]
    assert all(getattr(e, "kv_cache_spec_kind", None) is None for e in full)
    payload = encode_batch(events, ts=1.0, data_parallel_rank=0, event_layout="array")
    assert len(DECODERS["array"].decode(payload).events) == len(full)

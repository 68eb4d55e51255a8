"""KV events on the wire: a ZeroMQ publisher in vLLM's KV-events format, and the feed an engine
hands its drained events to.

Cache-aware routers (llm-d's KV-cache manager, NVIDIA Dynamo's KV router) subscribe to vLLM
replicas over ZeroMQ and decode msgpack `KVEventBatch`es (`vllm/distributed/kv_events.py`).
radixkv speaks the same format, so those routers consume a radixkv replica unmodified.

Each ZeroMQ message is three frames, as vLLM sends them:

    topic (utf-8, "" by default) | sequence number (8 bytes, big-endian) | payload

The payload is a `KVEventBatch` encoded the way vLLM's msgspec structs encode it (vLLM 0.33):

    EventBatch      array_like: [ts, events, data_parallel_rank]
    KVCacheEvent    tagged, tag first, in one of two layouts (`event_layout`):
                    "map" (default): {"type": "BlockStored", field: value, ...}, the layout of
                        current vLLM (0.33's `Decoder(type=KVEventBatch)` reads only this;
                        vllm-router's kv_aware too);
                    "array": ["BlockStored", value, value, ...], older vLLM releases'
                        `array_like` events, which llm-d's and AIBrix's readers decode; they
                        stop at lora_name, the last field every vLLM version declares without
                        a default. (NVIDIA Dynamo's reader takes either.)
    BlockStored     block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                    lora_name, and in the map layout extra_keys (one entry per block: (salt,)
                    on a salted path's block 0, else None), group_idx (the KV cache group: 0
                    full attention, then a hybrid model's window layers' and its recurrent
                    state's) and, for the window group, kv_cache_spec_kind ("sliding_window")
                    and kv_cache_spec_sliding_window (its window, in tokens), for the state
                    group kv_cache_spec_kind "mamba" (vLLM's kind of every recurrent state: a
                    snapshot is one hash, its token_ids the tail after its prefix's last full
                    block, `radixkv.cache.state_tiers`); the later fields
                    (locality, ownership, session_id, lookahead_token_ids ...) keep their
                    defaults and so are omitted, as vLLM omits them (omit_defaults=True)
    BlockRemoved    block_hashes, medium (map layout: group_idx)
    AllBlocksCleared  (no fields)

The array layout cannot carry group_idx (its arrays stop before it): a consumer reading it
would take a window block or a snapshot for a full block, so that layout carries the full
group's events only.
A model without window layers sends the same bytes in either layout as before groups existed.

Block hashes are sent as unsigned 64-bit ints (vLLM's integer form of `ExternalBlockHash`).
`ts` is the wall-clock time of publication (seconds since the epoch, float64).

The PUB socket binds its endpoint (`tcp://127.0.0.1:5557`: loopback only; `tcp://*:5557`: every
interface; `ipc:///PATH`: a socket file, made readable and writable by its owner only), so that
routers which connect to their replicas (vllm-router's kv_aware, Dynamo) find it; `connect=True`
connects it instead, to a consumer that binds. With `replay_endpoint`, a ROUTER
socket serves missed batches as vLLM's does: a request
`[start sequence (8 bytes, big-endian)]` is answered with one `[seq, payload]` message per
buffered batch from `start` on, then `[-1 (8 bytes, signed), b""]`.

Events are handed over one by one (`__call__`, a cheap queue put: the engine drains its cache
after each step); a background thread groups everything queued since its last send into one
batch, encodes and sends it. This module imports only `radixkv.cache`: the transport is its own
business, and the engine loads zmq and msgpack only for an address.
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import count
from typing import TYPE_CHECKING, Any

from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

if TYPE_CHECKING:
    import zmq

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # how long the publisher thread waits for events before checking replays


EVENT_LAYOUTS = ("map", "array")
# Fields (tag included) every vLLM version declares without a default: the array layout's length.
_ARRAY_LENGTH = {"BlockStored": 8, "BlockRemoved": 3, "AllBlocksCleared": 1}


def wire_fields(event: KVEvent, medium: str | None) -> dict[str, Any]:
    """One event as current vLLM's tagged msgspec struct encodes it: field -> value in
    declaration order, the tag first, fields at their defaults left out; `medium` names the
    device pool (a lower tier's event names its own). Raises TypeError for a non-event."""
    if isinstance(event, BlockStored):
        extra_keys: list[tuple[str] | None] = [None] * len(event.block_hashes)
        if event.namespace:  # vLLM: an unsalted request has no extra key, as does salt ""
            extra_keys[0] = (event.namespace,)
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium or medium,
            "lora_name": None,
            "extra_keys": extra_keys,
            "group_idx": event.group_idx,
            **_cache_spec(event),
        }
    if isinstance(event, BlockRemoved):
        hashes, group = list(event.block_hashes), event.group_idx
        medium = event.medium or medium
        return {
            "type": "BlockRemoved",
            "block_hashes": hashes,
            "medium": medium,
            "group_idx": group,
        }
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def _cache_spec(event: BlockStored) -> dict[str, Any]:
    """vLLM's cache-spec fields of a store event: a window group's kind and window, the state
    group's kind ("mamba"); none for full attention."""
    if event.kind is not None:
        return {"kv_cache_spec_kind": event.kind}
    if event.sliding_window is None:
        return {}
    window = event.sliding_window
    return {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": window}


def check_event_layout(event_layout: str, name: str = "event_layout") -> None:
    if event_layout not in EVENT_LAYOUTS:
        raise ValueError(f"{name} must be one of {EVENT_LAYOUTS}, got {event_layout!r}")


def check_address(name: str, value: object) -> None:
    """Raises ValueError unless `value` is a ZeroMQ address (a string with a scheme)."""
    if not isinstance(value, str) or "://" not in value:
        raise ValueError(f"{name} must be a ZeroMQ address like tcp://*:5557, got {value!r}")


def _home_expanded(endpoint: str) -> str:
    """`ipc://~/x` in the user's home folder, as every path radixkv takes."""
    if endpoint.startswith("ipc://~"):
        return "ipc://" + os.path.expanduser(endpoint[len("ipc://") :])
    return endpoint


def _owner_only(endpoint: str) -> None:
    """A bound `ipc://PATH` socket file becomes this user's alone (0600: others cannot connect):
    the events carry every tenant's token ids and salts. ZeroMQ creates it under the umask, so
    a folder only its owner can enter is what also closes the moment before this chmod."""
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):  # @: no file
        os.chmod(endpoint[len("ipc://") :], 0o600)


def encode_batch(
    events: Sequence[KVEvent],
    *,
    ts: float,
    data_parallel_rank: int,
    medium: str | None = "GPU",
    event_layout: str = "map",
) -> bytes:
    """The msgpack payload of one `KVEventBatch`, events in `event_layout` ("array" or "map";
    "array" leaves out the window group's events, which it cannot name). Mutates nothing;
    raises ValueError for another layout, TypeError for a non-event."""
    check_event_layout(event_layout)
    msgpack = _wire_module("msgpack")
    fields = [wire_fields(event, medium) for event in events]
    if event_layout == "array":
        full = (f for f in fields if not f.get("group_idx"))  # no group_idx there: full only
        wire: list[Any] = [list(f.values())[: _ARRAY_LENGTH[f["type"]]] for f in full]
    else:
        wire = fields
    return msgpack.packb([float(ts), wire, data_parallel_rank], use_bin_type=True)


def _wire_module(name: str) -> Any:
    """`zmq` or `msgpack`, imported on first use: they are the `kv-events` extra, which an engine
    that publishes no events (or only to Python callbacks) does not need. Raises ImportError
    naming the extra."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(
            f"KV events over ZeroMQ need {name}: pip install 'radixkv[kv-events]'"
        ) from exc


class ZmqEventPublisher:
    """Publishes KV events as vLLM `KVEventBatch`es on a ZeroMQ PUB socket.

    A callable taking one event (`LLM(kv_events=publisher)`, or an address, which makes one).
    The PUB socket binds `endpoint` (connects to it with `connect=True`); `topic` is the first
    frame of every message (llm-d reads a replica's identity from it). `close()` flushes what is
    queued (up to `close_timeout_s`), stops the thread and closes the sockets; events handed over
    after `close()` are dropped. Raises ValueError for an endpoint that is not a ZeroMQ address
    or an unknown layout, zmq.ZMQError when it cannot bind/connect (nothing started).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        connect: bool = False,
        data_parallel_rank: int = 0,
        medium: str | None = "GPU",
        event_layout: str = "map",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        close_timeout_s: float = 2.0,
        context: zmq.Context | None = None,
    ) -> None:
        check_address("endpoint", endpoint)
        endpoint = _home_expanded(endpoint)
        if replay_endpoint is not None:
            check_address("replay_endpoint", replay_endpoint)
            replay_endpoint = _home_expanded(replay_endpoint)
        check_event_layout(event_layout)
        self.topic = topic.encode("utf-8")
        self._encode = partial(
            encode_batch,
            data_parallel_rank=data_parallel_rank,
            medium=medium,
            event_layout=event_layout,
        )
        self.close_timeout_s = close_timeout_s
        _wire_module("msgpack")  # fail here, not in the publisher thread
        zmq = self._zmq = _wire_module("zmq")
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(hwm)
            if connect:
                self._pub.connect(endpoint)
            else:
                self._pub.bind(endpoint)
                _owner_only(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
                _owner_only(replay_endpoint)
        except Exception:
            self._close_sockets()
            raise
        self._queue: queue.SimpleQueue[KVEvent | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = count()
        self._closed = False
        self.num_batches_sent = 0
        self._thread = threading.Thread(target=self._run, name="radixkv-kv-events", daemon=True)
        self._thread.start()

    @property
    def last_endpoint(self) -> str:
        """The bound address (with the port ZeroMQ chose for `tcp://...:*`)."""
        return self._pub.getsockopt_string(self._zmq.LAST_ENDPOINT)

    def __call__(self, event: KVEvent) -> None:
        """Queue one event for the next batch (any thread)."""
        if not self._closed:
            self._queue.put(event)

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=self.close_timeout_s)
        if self._thread.is_alive():
            logger.warning("KV event publisher did not drain within %.1f s", self.close_timeout_s)
        else:
            self._close_sockets()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        stop = False
        while not stop:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                items = [self._queue.get(timeout=_POLL_S)]
            except queue.Empty:
                continue
            while not self._queue.empty():  # this thread is the only consumer
                items.append(self._queue.get_nowait())
            # close() queued its marker: send what came before, then stop. By identity: `in`
            # would compare every item to None, and an array's == raises in this thread.
            stop = any(item is None for item in items)
            events = [item for item in items if item is not None]
            if events:
                self._send(events)

    def _send(self, events: list[KVEvent]) -> None:
        try:
            payload = self._encode(events, ts=time.time())
            seq = next(self._seq)
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.num_batches_sent += 1
        except Exception:
            logger.exception("KV event publisher failed to send %d events", len(events))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("invalid KV event replay request: %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


KVEventsTarget = str | Callable[[KVEvent], None]  # a ZeroMQ address, or a callable


def check_kv_events(kv_events: object) -> None:
    """The engine's `kv_events` option: None, a ZeroMQ address or a callable taking each event.
    Raises TypeError for anything else and ValueError for a string that is not a ZeroMQ
    address."""
    if kv_events is None or callable(kv_events):
        return
    if not isinstance(kv_events, str):
        raise TypeError(
            "kv_events must be None, a ZeroMQ address (e.g. 'tcp://*:5557') or a callable"
            f" taking each event, got {type(kv_events).__name__}"
        )
    check_address("kv_events", kv_events)


class KVEventFeed:
    """Where an engine's drained KV events go: `target` (checked by `check_kv_events`) gets every
    event, in order; an address becomes a `ZmqEventPublisher` (`options` go to it). A callback
    that raises is logged and counted (`num_callback_errors`): the engine's step around it always
    completes. `close()` stops delivery and closes the publisher. Raises like
    `ZmqEventPublisher` (nothing started then).
    """

    def __init__(self, target: KVEventsTarget, **options: Any) -> None:
        self.publisher = ZmqEventPublisher(target, **options) if isinstance(target, str) else None
        self._callback: Callable[[KVEvent], None] | None = self.publisher or target
        self.num_callback_errors = 0

    def publish(self, events: Iterable[KVEvent]) -> None:
        """Hand each event to the target (after `close()`: to nothing)."""
        callback = self._callback
        if callback is None:
            return
        for event in events:
            try:
                callback(event)
            except Exception:
                self.num_callback_errors += 1
                logger.exception("KV event subscriber %r failed on %r", callback, event)

    def close(self) -> None:
        """Stop delivery and close the publisher. Idempotent."""
        self._callback = None
        if self.publisher is not None:
            self.publisher.close()

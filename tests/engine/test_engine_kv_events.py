"""The engine's `kv_events` option: a router's index fed by a live engine (which drains its
cache's events after each step) scores each prompt with exactly the full blocks the engine's cache
holds of it; an endpoint publishes vLLM batches; the feed between them."""

from __future__ import annotations

import logging
import time

import pytest
from router_index import BlockHashIndex
from tiny_llama import random_prompts
from vllm_kv_events import DECODER, VllmBlockStored, vllm_chain

from radixkv import LLM, SamplingParams
from radixkv.cache.events import AllBlocksCleared, BlockRemoved, KVEvent
from radixkv.kv_events import END_SEQ, KVEventFeed

msgpack = pytest.importorskip("msgpack")  # the kv-events extra: absent on the GPU machine
zmq = pytest.importorskip("zmq")

B = 4


def test_router_index_scores_prompts_with_the_cached_full_blocks(tiny_model_dir) -> None:
    index = BlockHashIndex()
    llm = LLM(str(tiny_model_dir("gqa")), block_size=B, num_blocks=40, kv_events=index.apply)
    prompts = random_prompts(5, 6, shared_prefix=9, min_len=12, max_len=30)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert llm.cache.stats().num_evicted_blocks > 0, "a small pool: evictions happened too"
    written = [p + list(o.token_ids) for p, o in zip(prompts, outputs, strict=True)]
    assert len(index) > 0
    for tokens in written:
        cached = llm.cache.match(tokens).num_cached_tokens
        assert index.longest_prefix_blocks(tokens, B) == cached // B
    assert llm.kv_events.num_callback_errors == 0
    assert llm.cache.take_events() == []  # each step's events were drained
    llm.kv_events.close()
    before = index.hashes
    llm.generate([random_prompts(7, 1, min_len=20, max_len=24)[0]], params)  # new blocks...
    assert index.hashes == before  # ...no longer delivered


def test_an_engine_without_kv_events_records_none(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("gqa")), block_size=B, num_blocks=40)
    llm.generate(random_prompts(8, 2, min_len=12, max_len=20), SamplingParams(max_tokens=2))
    assert llm.kv_events is None and llm.cache.tree.event_recorder is None
    assert llm.cache.take_events() == []


def receive(sub: zmq.Socket, until: float) -> list[list[bytes]]:
    """Every message that arrives before `until` (monotonic), after the first."""
    messages: list[list[bytes]] = []
    while time.monotonic() < until and (not messages or sub.poll(500)):
        if sub.poll(100):
            messages.append(sub.recv_multipart())
    return messages


def replay() -> list[tuple[int, bytes]]:
    """The batches the replica's replay endpoint serves from sequence number 0 on."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect("inproc://radixkv-engine-replay")
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    replies = []
    while dealer.poll(10_000):
        _, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            break
        replies.append((int.from_bytes(seq, "big"), payload))
    dealer.close(linger=0)
    return replies


@pytest.mark.parametrize("seed", [None, "0"])
def test_a_bound_endpoint_publishes_what_vllm_decodes_with_vllms_hashes(tiny_model_dir, seed):
    """Bound on loopback (the default) with a topic and sha256_cbor: every message decodes with
    vLLM 0.33's structs, carries the topic, and the prompt's blocks have vLLM's hashes."""
    llm = LLM(
        str(tiny_model_dir("gqa")),
        block_size=B,
        num_blocks=40,
        kv_events="tcp://127.0.0.1:*",
        kv_events_topic="replica-7",
        kv_events_replay="inproc://radixkv-engine-replay",
        block_hash="sha256_cbor",
        block_hash_seed=seed,
    )
    publisher = llm.kv_events.publisher
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"replica-7")
    sub.connect(publisher.last_endpoint)  # connects: the replica bound it
    time.sleep(0.5)  # a TCP SUB joins asynchronously; PUB drops what comes before
    prompt = random_prompts(6, 1, min_len=17, max_len=17)[0]
    llm.generate([prompt], SamplingParams(max_tokens=2))
    messages = receive(sub, time.monotonic() + 10)
    sub.close(linger=0)
    replayed = replay()
    llm.kv_events.close()
    assert messages and publisher.num_batches_sent == len(messages)
    assert replayed == [(int.from_bytes(m[1], "big"), m[2]) for m in messages]
    assert {m[0] for m in messages} == {b"replica-7"}
    batches = [DECODER.decode(m[2]) for m in messages]  # every one decodes, or this raises
    events = [e for b in batches for e in b.events]
    assert all(b.data_parallel_rank == 0 for b in batches)
    stored = [e for e in events if isinstance(e, VllmBlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    assert hashes == vllm_chain(seed or "vllm-none-hash", prompt[:16], B)
    assert all(e.group_idx == 0 and e.medium == "GPU" for e in stored)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (5557, TypeError, "kv_events must be None, a ZeroMQ address"),
        ("localhost:5557", ValueError, "ZeroMQ address like tcp://"),
    ],
)
def test_bad_kv_events_is_refused_before_the_model_loads(value, error, match) -> None:
    with pytest.raises(error, match=match):
        LLM("/no/such/model/dir", kv_events=value)


def test_a_failing_callback_is_logged_and_the_feed_goes_on(caplog) -> None:
    got: list[KVEvent] = []

    def flaky(event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            raise RuntimeError("router down")
        got.append(event)

    feed = KVEventFeed(flaky)
    with caplog.at_level(logging.ERROR, logger="radixkv.kv_events"):
        feed.publish([BlockRemoved((1,)), AllBlocksCleared(), BlockRemoved((2,))])
    assert got == [BlockRemoved((1,)), BlockRemoved((2,))]
    assert feed.num_callback_errors == 1 and "router down" in caplog.text
    feed.close()
    feed.close()  # idempotent
    feed.publish([BlockRemoved((3,))])
    assert got == [BlockRemoved((1,)), BlockRemoved((2,))]


def test_the_wire_modules_load_only_for_the_wire(monkeypatch) -> None:
    import subprocess
    import sys

    code = "import sys, radixkv.engine, radixkv.serve.cli; print('zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "the engine imports without the kv-events extra"
    monkeypatch.setitem(sys.modules, "zmq", None)  # as if pyzmq were not installed
    with pytest.raises(ImportError, match=r"pip install 'radixkv\[kv-events\]'"):
        KVEventFeed("inproc://radixkv-no-zmq")
    received: list[object] = []
    feed = KVEventFeed(received.append)  # Python callbacks need no extra
    feed.publish([AllBlocksCleared()])
    feed.close()
    assert received == [AllBlocksCleared()]

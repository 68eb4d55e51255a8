"""The engine's `kv_events` option: a router's index fed by a live engine (which drains its
cache's events after each step) scores each prompt with exactly the full blocks the engine's cache
holds of it; an endpoint publishes vLLM batches; the feed between them."""

from __future__ import annotations

import logging
import time

import msgpack
import pytest
import zmq
from router_index import BlockHashIndex
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams
from radixkv.cache.events import AllBlocksCleared, BlockRemoved, KVEvent
from radixkv.kv_events import KVEventFeed

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
    assert llm.kv_events is None and llm.cache._events is None
    assert llm.cache.take_events() == []


def test_an_endpoint_publishes_vllm_batches(tiny_model_dir) -> None:
    endpoint = "inproc://radixkv-engine-kv-events"
    llm = LLM(str(tiny_model_dir("gqa")), block_size=B, num_blocks=40, kv_events=endpoint)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.2)  # inproc SUB joins at once; the pause only covers the connect
    llm.generate(random_prompts(6, 2, min_len=12, max_len=20), SamplingParams(max_tokens=2))
    kinds: list[str] = []
    deadline = time.monotonic() + 10
    while not kinds and time.monotonic() < deadline:
        if sub.poll(100):
            _, seq, payload = sub.recv_multipart()
            ts, events, rank = msgpack.unpackb(payload)
            assert rank == 0 and ts > 0 and int.from_bytes(seq, "big") >= 0
            kinds += [e[0] for e in events]  # tagged arrays: the tag first
    sub.close(linger=0)
    llm.kv_events.close()
    assert kinds and set(kinds) <= {"BlockStored", "BlockRemoved"}


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

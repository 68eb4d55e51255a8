"""The engine's `kv_events` option: a router's index fed by a live engine scores each prompt with
exactly the full blocks the engine's cache holds of it; an endpoint publishes vLLM batches."""

from __future__ import annotations

import time

import pytest
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams
from radixkv.cache import PrefixCache
from radixkv.cache.events import BlockHashIndex
from radixkv.engine.kv_events import publish_kv_events

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
    assert llm.cache.events.num_callback_errors == 0
    llm.kv_events.close()
    before = index.hashes
    llm.generate([random_prompts(7, 1, min_len=20, max_len=24)[0]], params)  # new blocks...
    assert index.hashes == before  # ...no longer delivered
    assert not llm.cache.events.active


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


def test_publish_refuses_none() -> None:
    with pytest.raises(TypeError, match="got None"):
        publish_kv_events(PrefixCache(4, 2), None)  # type: ignore[arg-type]


def test_the_wire_modules_load_only_for_the_wire(monkeypatch) -> None:
    import subprocess
    import sys

    code = "import sys, radixkv.engine, radixkv.serve.cli; print('zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "the engine imports without the kv-events extra"
    monkeypatch.setitem(sys.modules, "zmq", None)  # as if pyzmq were not installed
    with pytest.raises(ImportError, match=r"pip install 'radixkv\[kv-events\]'"):
        publish_kv_events(PrefixCache(4, 2), "inproc://radixkv-no-zmq")
    received: list[object] = []
    cache = PrefixCache(4, 2)
    publishing = publish_kv_events(cache, received.append)  # Python callbacks need no extra
    cache.insert([1, 2, 3], cache.allocate(2))
    publishing.close()
    assert received, "a full block was announced to the callback"

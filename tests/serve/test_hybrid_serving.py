"""A hybrid model served over HTTP: `/metrics` counts its recurrent-state snapshots and the
requests that resumed from one."""

from __future__ import annotations

import pytest
from serve_helpers import metric, read_metrics, user_message
from tiny_archs import build_arch

pytest.importorskip("openai")  # a test extra: absent on the GPU machine


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2"])  # Mamba 2: no KV pool at all
def test_metrics_count_snapshots_and_the_requests_resumed_from_them(
    make_server, tmp_path, family
) -> None:
    """Three chats sharing a system prompt: the second is snapshotted where it leaves the
    first's path, the third resumes there."""
    path = build_arch(family, tmp_path)
    server = make_server({"block_size": 4, "snapshot_min_gap_tokens": 4}, model=path)
    client = server.client()
    system = {"role": "system", "content": user_message(7, 30)}
    cached = []
    for i in range(3):
        messages = [system, {"role": "user", "content": user_message(600 + i)}]
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    samples = read_metrics(server.base_url)
    state = server.llm.cache.groups[-1]
    assert cached[:2] == [0, 0] and cached[2] > 30
    assert metric(samples, "radixkv_state_snapshot_hits_total") == 1
    assert metric(samples, "radixkv_state_snapshot_hit_tokens_total") == cached[2]
    snapshots = metric(samples, "radixkv_state_snapshots")
    assert snapshots == state.num_snapshots >= 2  # the junction and the chats' ends
    assert metric(samples, "radixkv_state_snapshot_bytes") == snapshots * state.slot_bytes

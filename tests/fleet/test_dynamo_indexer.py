"""Dynamo's standalone KV indexer (ai-dynamo-runtime), fed the replicas' KV events over ZeroMQ,
credits the replica that served each conversation with its prompt's full blocks.

The indexer binds its HTTP port on every interface and the replicas' publishers bind tcp://*, so
the whole fleet runs in a network namespace that has only loopback (`unshare -n`, root), started
from here as `tests/fleet/dynamo_probe.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import fleet
import pytest
from tiny_archs import build_arch

PROBE = Path(__file__).with_name("dynamo_probe.py")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_dynamo_indexer_credits_the_serving_replica(
    arch: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """gemma3: a model with window layers, whose replicas also publish the window group's
    events (group_idx 1, kind sliding_window): the indexer still credits the full blocks."""
    if fleet.router_python("ai-dynamo-runtime") is None:
        pytest.skip("ai-dynamo-runtime is not installed: run scripts/setup_routers.sh")
    if not fleet.namespace_available():
        pytest.skip(
            "needs `unshare -n` (a loopback-only network namespace; root): Dynamo's "
            "indexer and the replicas' publishers bind every interface"
        )
    model = tiny_model_dir("gqa") if arch == "llama" else build_arch(arch, tmp_path / arch)
    probe = [sys.executable, str(PROBE), str(model), str(tmp_path)]
    argv = fleet.namespace_command(probe)
    env = {**os.environ, fleet.IN_NAMESPACE_ENV: "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    conversations = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(conversations) == 4
    for c in conversations:
        scores = {
            int(worker): sum(ranks.values()) for worker, ranks in c["answer"]["scores"].items()
        }
        full_blocks = (len(c["token_ids"]) - 1) // 16  # the last prompt token's KV is computed
        # only the serving replica holds the prompt's blocks; the other was never sent it
        assert scores == {c["served_by"]: full_blocks * 16}, (c["served_by"], c["answer"])

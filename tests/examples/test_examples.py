"""The examples run as a user would run them (a subprocess, from outside the repository root)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(name: str, cwd: Path) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_prefix_cache_example_gets_token_granular_hits(tmp_path: Path) -> None:
    lines = _run("prefix_cache_example.py", tmp_path).splitlines()
    # The second request shares 37 tokens (two full blocks + 5 slots) and gets all 37.
    assert re.match(
        r"prompt\s+43 tokens:\s+37 cached,\s+6 computed, copy-on-write \[\(\d+, \d+, 5\)\]",
        lines[1],
    )
    assert re.match(r"prompt\s+44 tokens:\s+43 cached,\s+1 computed", lines[2])
    assert lines[3].endswith("0 in use")
    assert re.match(r"evicted blocks \[\d+(, \d+){3}\] \(GDSF: ", lines[4])


def test_kv_event_router_example_scores_what_the_cache_holds(tmp_path: Path) -> None:
    lines = _run("kv_event_router.py", tmp_path).splitlines()
    line = re.compile(r"request \d: the router scores (\d+) full blocks, the cache holds (\d+)")
    scores = [line.match(text) for text in lines[:6]]
    assert all(s is not None and s.group(1) == s.group(2) for s in scores)
    assert min(int(s.group(1)) for s in scores if s) < 3, "some prompts were partly evicted"
    assert re.match(r"\d+ block hashes known, [1-9]\d* blocks evicted", lines[6])


@pytest.mark.slow
def test_chat_example_hits_the_cache_on_later_turns(tmp_path: Path) -> None:
    out = _run("chat_example.py", tmp_path)
    cached = [int(c) for c in re.findall(r"cached (\d+),", out)]
    assert len(cached) == 3 and cached[0] == 0 and all(c > 0 for c in cached[1:])
    assert out.count("assistant> ") == 3

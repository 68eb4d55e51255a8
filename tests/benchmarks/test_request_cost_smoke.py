"""The per-request cost benchmark runs end to end on a tiny chat, with every token input kind.

No timing assertions: only that the lifecycle it drives is sound and its report prints.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "request_cost.py"


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("request_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "request_cost", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tokens", ["numpy", "list", "packed"])
def test_request_cost_runs(bench, capsys, tokens: str) -> None:
    argv = ["--tokens", tokens, "--conversations", "3", "--turns", "7", "--repeat", "2"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert f"21 requests ({tokens} tokens" in out and "per call: admit" in out


def test_chat_turns_extend_the_previous_turn(bench) -> None:
    requests = bench.prepare(bench.make_chat(2, 3), "list")
    by_conv: dict[int, list] = {}
    for conv, prompt, written, new, reply in requests:
        if conv in by_conv:  # the previous written tokens + its last reply token come first
            prev_written, prev_reply = by_conv[conv]
            assert prompt[: len(prev_written) + 1] == [*prev_written, prev_reply[-1]]
        assert written == prompt + reply[:-1] and prompt[-len(new) :] == new
        by_conv[conv] = (written, reply)

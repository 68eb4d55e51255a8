"""The tier benchmark's copy part runs end to end on a few blocks (no model), and its chat part's
workload interleaves the conversations' turns. No timing assertions."""

from __future__ import annotations

import argparse

from benchmarks import tier_bench


def test_copies_runs_and_prints_every_row(capsys, tmp_path) -> None:
    tier_bench.main(["copies", "--quick", "--no-prefill", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    for row in ("offload device->host", "load host->device", "disk write", "disk read, cold"):
        assert row in out


def test_chat_turns_come_round_robin_and_the_first_carries_the_system_prompt() -> None:
    args = argparse.Namespace(convs=3, turns=2, system_tokens=5, user_tokens=4)
    turns = tier_bench.chat_prompts(args)
    assert [conv for conv, _ in turns] == [0, 1, 2, 0, 1, 2]
    assert [len(user) for _, user in turns] == [9, 9, 9, 4, 4, 4]
    assert len({tuple(user[:5]) for _, user in turns[:3]}) == 1  # one system prompt

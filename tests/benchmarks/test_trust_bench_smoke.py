"""The trust benchmark runs end to end in a small configuration (real `radixkv serve` processes
on 127.0.0.1, the tiny test model) and every hostile request gets the answer its kind should.
No timing assertions: only what must hold whatever the machine."""

from __future__ import annotations

import pytest

from benchmarks import trust_bench


def test_every_option_error_is_one_line_and_exit_2(tiny_model_dir) -> None:
    args = trust_bench.parse_args(["--model", str(tiny_model_dir("gqa")), "--rounds", "1"])
    rows = trust_bench.run_options(args)
    assert len(rows) == 7 and all(r["ok"] for r in rows), rows
    assert "goal < 2 s" in trust_bench.options_report(rows)


def test_hostile_requests_get_their_answers_and_chats_are_served(tiny_model_dir) -> None:
    pytest.importorskip("xgrammar")
    args = trust_bench.parse_args(
        [
            "--model", str(tiny_model_dir("gqa")), "--chats", "2", "--hold-s", "3",
            "--settle-s", "0.5", "--tools-bytes", "200000", "--rate-tokens", "40",
            "--server-arg=--grammar-compile-timeout", "--server-arg=1",
        ]
    )  # fmt: skip
    with trust_bench.running_server(args) as base_url:
        row = trust_bench.run_hostile(args, base_url)
        rate = trust_bench.run_rate(args, base_url)
    statuses = row["statuses"]
    assert all(len(v) == 3 for v in statuses.values()), statuses
    assert statuses["text/plain body"] == [415] * 3
    assert statuses["rebound Host"] == [403] * 3
    assert statuses["schema 600 deep"] == [400] * 3
    assert statuses["2 MB of tool text"] == [400] * 3
    assert statuses["held page stream"] == [200] * 3
    assert statuses["slow grammar"] == [400] * 3  # killed at the 1 s limit
    assert all(s in (200, 400) for s in statuses["16,000-dot regex"]), statuses
    assert len(row["under"]) == 2 and "hostile answers" in trust_bench.hostile_report(row)
    assert rate["decode_tok_s"] > 0 and "tok/s" in trust_bench.rate_report(rate)

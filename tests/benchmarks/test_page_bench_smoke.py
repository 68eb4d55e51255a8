"""The page benchmark's run with the page open works end to end in its small configuration (a
real `radixkv serve` process on 127.0.0.1, the tiny test model, headless chromium), and its
report pairs the runs of each round. No timing assertions: only what must hold whatever the
machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import page_bench


def test_a_run_with_the_page_open_serves_everything_and_watches_frames(tiny_model_dir) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("selenium")
    if not Path("/usr/bin/chromium").exists() or not Path("/usr/bin/chromedriver").exists():
        pytest.skip("chromium and chromium-driver are not installed")
    args = page_bench.parse_args(["--tiny", "--model", str(tiny_model_dir("gqa"))])
    row = page_bench.run_once(args, args.model, with_page=True)
    assert row["page"] and row["requests"] == 4  # every turn of every client
    assert row["output_tokens"] == 4 * 4
    assert row["longest_task_ms"] >= 0 and row["num_long_tasks"] >= 0
    assert row["longest_frame_ms"] > 0  # the page drew frames while it was watched


def _row(number: int, page: bool, tok_s: float) -> dict:
    row = {"round": number, "page": page, "requests": 4, "output_tok_s": tok_s}
    row |= {"ttft_p50_s": 0.1, "longest_task_ms": 60.0, "num_long_tasks": 2}
    return row | {"longest_frame_ms": 40.0}


def test_report_pairs_the_runs_of_each_round() -> None:
    rows = [_row(1, False, 10.0), _row(1, True, 9.9), _row(2, False, 10.0), _row(2, True, 9.5)]
    text = page_bench.report(rows)
    assert "| 1 | none | 4 | 10.0 | 100 ms | - | - |" in text
    assert "| 1 | open | 4 | 9.9 | 100 ms | 60 ms (2) | 40 ms |" in text
    assert "median x0.970 (rounds: x0.990, x0.950; goal >= x0.97)" in text

"""The page benchmark runs end to end in its small configuration (real `radixkv serve`
processes on 127.0.0.1, the tiny test model, headless chromium). No timing assertions: only
that both runs served every request, the page watched its frames, and the report prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import page_bench


def test_page_bench_tiny_runs(tiny_model_dir, capsys) -> None:
    pytest.importorskip("selenium")
    if not Path("/usr/bin/chromium").exists() or not Path("/usr/bin/chromedriver").exists():
        pytest.skip("chromium and chromium-driver are not installed")
    assert page_bench.main(["--tiny", "--model", str(tiny_model_dir("gqa"))]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| 1 |")]
    assert [r[2].strip() for r in rows] == ["none", "open"]
    assert all(r[3].strip() == "4" for r in rows)  # requests: every turn of every client
    assert rows[0][6].strip() == "-" and rows[1][6].strip().endswith(")")
    assert rows[1][7].strip().endswith(" ms")  # frames were watched
    assert "output tok/s with the page / without: median x" in out

"""The serving benchmark runs end to end in its small configuration (a real `radixkv serve`
process on 127.0.0.1, the tiny test model). No timing assertions: only that every request of the
workload completed and the report prints."""

from __future__ import annotations

from benchmarks import serve_bench


def test_serve_bench_tiny_runs(tiny_model_dir, capsys) -> None:
    assert serve_bench.main(["--tiny", "--model", str(tiny_model_dir("gqa"))]) == 0
    out = capsys.readouterr().out
    assert "2 clients x 2 turns" in out
    row = next(line for line in out.splitlines() if line.startswith("| radixkv |"))
    assert row.split("|")[2].strip() == "4"  # requests: every turn of every client

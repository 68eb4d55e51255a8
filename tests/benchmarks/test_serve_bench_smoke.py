"""The serving benchmark runs end to end in its small configuration (a real `radixkv serve`
process on 127.0.0.1, the tiny test model). No timing assertions: only that every request of the
workload completed and the report prints."""

from __future__ import annotations

import pytest

from benchmarks import serve_bench


def test_serve_bench_tiny_runs(tiny_model_dir, capsys) -> None:
    assert serve_bench.main(["--tiny", "--model", str(tiny_model_dir("gqa"))]) == 0
    out = capsys.readouterr().out
    assert "2 clients x 2 turns" in out
    row = next(line for line in out.splitlines() if line.startswith("| 1 | radixkv |"))
    cells = [c.strip() for c in row.split("|")]
    assert cells[3] == "4"  # requests: every turn of every client
    assert cells[8] != "n/a ms"  # the server overhead came from /metrics
    assert cells[10] != "n/a ms"  # and so did the receive time
    assert cells[11] != "n/a s" and float(cells[11].removesuffix(" s")) >= 0  # from /proc


def _row(number: int, server: str, ttft_s: float, tok_s: float) -> dict:
    return {
        "round": number,
        "server": server,
        "requests": 4,
        "ttft_p50_s": ttft_s,
        "ttft_p99_s": ttft_s,
        "output_tok_s": tok_s,
        "hit_rate": None,
        "overhead_p50_ms": 1.0 if server.startswith("radixkv") else None,
        "admission_p50_ms": None,
        "wall_s": 1.0,
    }


def test_report_pairs_the_servers_of_each_round() -> None:
    text = serve_bench.report(
        [
            _row(1, "radixkv", 0.2, 30.0),
            _row(1, "transformers", 0.8, 10.0),
            _row(2, "radixkv", 1, 1),
        ]
    )
    ratios = [line for line in text.splitlines() if line.startswith("round ")]
    assert len(ratios) == 1  # round 2 has no transformers row to compare with
    assert "TTFT p50 x0.25" in ratios[0] and "output tok/s x3.00" in ratios[0]


def test_report_compares_radixkv_with_radixkv_from_another_source() -> None:
    rows = [_row(1, "radixkv@/src/main", 0.4, 20.0), _row(1, "radixkv", 0.2, 30.0)]
    (line,) = [line for line in serve_bench.report(rows).splitlines() if line.startswith("round ")]
    assert "radixkv / radixkv@/src/main" in line
    assert "TTFT p50 x0.50" in line and "output tok/s x1.50" in line
    assert serve_bench.is_radixkv("radixkv@/src/main") and not serve_bench.is_radixkv("vllm")


def test_a_server_from_another_source_imports_that_source(tmp_path) -> None:
    # Run from the repository root, `python -m radixkv` would import this checkout's radixkv
    # whatever PYTHONPATH says: an A/B of one tree against itself.
    (tmp_path / "radixkv").mkdir()
    (tmp_path / "radixkv" / "__init__.py").write_text("")
    args = serve_bench.parse_args(["--threads", "1"])
    assert serve_bench.server_source(f"radixkv@{tmp_path}", args) == tmp_path.resolve()
    assert serve_bench.server_source("radixkv", args) == serve_bench.ROOT
    serve_bench.check_source(f"radixkv@{tmp_path}", args)
    serve_bench.check_source(f"radixkv@{tmp_path}+schema", args)


def test_a_source_without_radixkv_is_refused_before_timing(tmp_path) -> None:
    args = serve_bench.parse_args([])
    with pytest.raises(SystemExit, match="would import radixkv from"):
        serve_bench.check_source(f"radixkv@{tmp_path}", args)


def test_report_compares_schema_constrained_requests_with_free_ones() -> None:
    constrained = {**_row(1, "radixkv+schema", 0.2, 27.0), "wall_s": 1.08}
    rows = [_row(1, "radixkv", 0.2, 30.0), constrained]
    (line,) = [line for line in serve_bench.report(rows).splitlines() if line.startswith("round ")]
    assert "schema-constrained / unconstrained: wall x1.08" in line and "tok/s x0.90" in line
    assert serve_bench.is_radixkv("radixkv+schema")
    assert serve_bench.server_env("radixkv@/src+schema", serve_bench.parse_args([]))[
        "PYTHONPATH"
    ].startswith("/src")

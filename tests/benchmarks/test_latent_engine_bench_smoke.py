"""Smoke test of the latent engine benchmark at tiny sizes: both sides run in one process to the
same greedy tokens, the KV sizes are each layout's, and the report has its ratio lines (no timing
is asserted: the figures are the benchmark's, measured on an idle machine)."""

from __future__ import annotations

import re

from benchmarks.latent_engine_bench import parse_args, report, run

TINY = dict(
    rounds=2, layers=2, heads=2, hidden=64, q_lora_rank=16, kv_lora_rank=32, rope_dim=8,
    nope_dim=8, v_dim=8, batch=2, context=40, decode=3, conversation=48, reply=3, turn=5,
    chunk=16, block_size=4,
)  # fmt: skip
RATIO = r"wall (\d+\.\d\d)x, cpu (\d+\.\d\d)x"


def test_both_sides_run_and_the_report_has_the_goals_ratios() -> None:
    args = parse_args([f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()])
    result = run(args)
    assert result["same_tokens"]  # latent and expanded K / V: one function
    assert result["kv_bytes_per_token"] == {
        "latent": (32 + 8) * 2 * 4,  # (L + R) x layers x fp32
        "expanded": 2 * 2 * (8 + 8) * 2 * 4,  # K and V (padded to K's size) x heads x layers
    }
    lines: list[str] = []
    report(result, args, print_=lines.append)
    text = "\n".join(lines)
    for pattern in (
        rf"decode latent / expanded: {RATIO} \(goal <= 1.2x\)",
        rf"ttft warm / cold, latent: {RATIO} \(goal <= 0.3x\)",
        rf"ttft warm / cold, expanded: {RATIO}",
        r"load average \(1 / 5 / 15 min\) at the start: [\d. /]+, at the end: [\d. /]+",
    ):
        match = re.search(pattern, text)
        assert match, f"{pattern!r} not in:\n{text}"
        assert all(float(x) > 0 for x in match.groups())
    assert "greedy tokens of the two sides equal: True" in text

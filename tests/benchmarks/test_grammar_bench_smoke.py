"""The structured-output benchmark runs end to end on a tiny model, every part. No timing
assertions: only that each part reports, n = 8 computes its prompt once, and nothing leaks."""

from __future__ import annotations

import json

import pytest

from benchmarks import grammar_bench

pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")


def test_grammar_bench_runs_and_reports(capsys):
    from tiny_llama import build_char_tokenizer, build_model

    from radixkv import LLM

    llm = LLM(build_model("gqa"), tokenizer=build_char_tokenizer(), num_blocks=256)
    argv = ["--rounds", "1", "--batch", "2", "--tokens", "8", "--jump-tokens", "120"]
    assert grammar_bench.main([*argv, "--choice-tokens", "4"], llm=llm) == 0
    out = capsys.readouterr().out
    assert "decode per token: unconstrained" in out and "jump-forward: steps" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["overhead"]["plain_ms"] > 0 and result["overhead"]["schema_ms"] > 0
    assert result["jump"]["steps_on"] < result["jump"]["steps_off"]
    for n, rounds in result["choices"]["rounds"].items():
        for r in rounds:  # the n choices' prompt computed once (in-batch prefix caching)
            assert r["computed"] <= r["prompt"] + int(n), r
    llm.check_integrity()
    assert llm.cache.stats().num_in_use_blocks == 0

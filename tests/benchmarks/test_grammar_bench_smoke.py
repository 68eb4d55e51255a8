"""The grammar overhead benchmark runs end to end on a tiny model. No timing assertions: only
that both cases decode the tokens asked for and the report prints."""

from __future__ import annotations

import json

import pytest

from benchmarks import grammar_bench

pytest.importorskip("xgrammar")


def test_grammar_bench_runs_and_reports(capsys):
    from tiny_llama import build_char_tokenizer, build_model

    from radixkv import LLM

    llm = LLM(build_model("gqa"), tokenizer=build_char_tokenizer(), num_blocks=128)
    assert grammar_bench.main(["--rounds", "1", "--batch", "2", "--tokens", "8"], llm=llm) == 0
    out = capsys.readouterr().out
    assert "decode per token: unconstrained" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["plain_ms"] > 0 and result["schema_ms"] > 0
    llm.check_integrity()
    assert llm.cache.stats().num_in_use_blocks == 0

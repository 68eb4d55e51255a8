"""The recipes run as a user runs them: `examples/fleet/fleet.py RECIPE -- SERVE_ARGS` starts the
fleet, prints where to send requests, serves until Ctrl-C (or SIGTERM, or SIGINT when a shell's
`&` started it with SIGINT ignored), then stops every process it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import fleet
import pytest
from processes import sigint_restored

RECIPE = Path(fleet.__file__)


def run_recipe(
    recipe: str,
    model_dir: Path,
    log_dir: Path,
    last: str,
    while_up: Callable[[list[str]], None] | None = None,
    stop_signal: signal.Signals = signal.SIGINT,
    preexec: Callable[[], None] = sigint_restored,
) -> list[str]:
    """Start `recipe` (`preexec` in the child first), read what it prints up to the line
    starting with `last`, call `while_up(lines)`, then send it `stop_signal`. Returns the lines;
    fails unless it exits 0."""
    argv = [sys.executable, str(RECIPE), recipe, "--served-model-name", "tiny"]
    argv += ["--log-dir", str(log_dir), "--"]
    argv += ["--model", str(model_dir), "--num-blocks", "256"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, preexec_fn=preexec, start_new_session=True
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        while not lines or not lines[-1].startswith(last):
            line = proc.stdout.readline()
            assert line, f"the recipe stopped: {lines}"
            lines.append(line.rstrip("\n"))
        if while_up is not None:
            while_up(lines)
    finally:
        proc.send_signal(stop_signal)
        try:
            returncode = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the recipe and every process it started
            raise
    assert returncode == 0
    return lines


def test_session_hash_recipe_serves_and_stops(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    if fleet.router_python("vllm-router") is None:
        pytest.skip("vllm-router is not installed: run scripts/setup_routers.sh")
    import openai

    def chat(lines: list[str]) -> None:
        base_url = lines[-1].split()[1]
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w10 w11"}], max_tokens=2
        )
        assert reply.usage.completion_tokens == 2

    lines = run_recipe("session-hash", tiny_model_dir("gqa"), tmp_path, "router", chat)
    assert lines[0] == f"logs     {tmp_path}"  # where a user finds what went wrong
    assert [line.split()[0] for line in lines[1:]] == ["replica", "replica", "router"]
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "replica0.log",
        "replica1.log",
        "router.log",
    ]


def sigint_ignored() -> None:
    """`preexec_fn`: SIGINT ignored, as a non-interactive shell starts a command with `&`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_recipe_and_every_process_it_started(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path, stop_signal: signal.Signals
) -> None:
    if fleet.router_python("vllm-router") is None:
        pytest.skip("vllm-router is not installed: run scripts/setup_routers.sh")
    if not os.path.isdir("/proc"):
        pytest.skip("reads processes' states from /proc")
    pids: list[int] = []

    def note_pids(lines: list[str]) -> None:
        pids.extend(int(line.rsplit("pid ", 1)[1]) for line in lines[1:])

    left: list[int] = []
    try:
        run_recipe(
            "session-hash",
            tiny_model_dir("gqa"),
            tmp_path,
            "router",
            note_pids,
            stop_signal=stop_signal,
            preexec=sigint_ignored,
        )
    finally:
        left = [pid for pid in pids if running(pid)]
        for pid in left:  # each runs in a session of its own: its group is itself and children
            os.killpg(pid, signal.SIGKILL)
    assert len(pids) == 3
    assert left == [], f"{stop_signal.name} left the replicas or router running"


def test_dynamo_recipe_runs_in_its_own_namespace(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    if fleet.router_python("ai-dynamo-runtime") is None:
        pytest.skip("ai-dynamo-runtime is not installed: run scripts/setup_routers.sh")
    if not fleet.namespace_available():
        pytest.skip("needs `unshare -n` (a loopback-only network namespace; root)")

    def enter_and_ask(lines: list[str]) -> None:
        # the printed command reaches the indexer from the user's shell (this test's namespace)
        enter = lines[-1].split()[1:5]
        indexer = lines[-2].split()[1].removesuffix("/query")
        ask = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)"
        argv = [*enter, sys.executable, "-c", ask, f"{indexer}/health"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]

    lines = run_recipe("dynamo-indexer", tiny_model_dir("gqa"), tmp_path, "enter", enter_and_ask)
    assert [line.split()[0] for line in lines[1:]] == ["replica", "replica", "indexer", "enter"]
    assert all("events tcp://127.0.0.1:" in line for line in lines[1:3])


def test_no_replicas_is_refused_naming_the_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        fleet.main(["session-hash", "--replicas", "0"])
    assert "--replicas must be >= 1" in capsys.readouterr().err


def test_the_routers_folder_is_one_variable_with_a_default_outside_the_checkout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(fleet.ROUTERS_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert fleet.routers_dir() == tmp_path / "cache" / "radixkv" / "routers"
    monkeypatch.setenv(fleet.ROUTERS_DIR_ENV, str(tmp_path / "mine"))
    assert fleet.routers_dir() == tmp_path / "mine"


def test_setup_routers_reads_the_same_variable(tmp_path: Path) -> None:
    """Routers already installed (stamped with their pins) where RADIXKV_ROUTERS_DIR points:
    the script installs nothing, anywhere."""
    script = Path(fleet.__file__).parents[2] / "scripts" / "setup_routers.sh"
    pins = re.search(r"^PINS=\((.*)\)$", script.read_text(), re.M)
    assert pins is not None
    routers = tmp_path / "routers"
    for pin in pins.group(1).replace('"', "").split():
        (routers / pin.split("==")[0]).mkdir(parents=True)
        (routers / pin.split("==")[0] / ".radixkv-pin").write_text(pin + "\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home")}
    env[fleet.ROUTERS_DIR_ENV] = str(routers)
    proc = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "installed" not in proc.stdout
    assert not (tmp_path / "home").exists()  # not the default folder either

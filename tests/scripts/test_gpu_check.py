"""scripts/gpu_check.sh on the CPU: its stages' plumbing (--dry-run), the summary it prints, the
budget and the failure report; and `pytest -m gpu` collecting without the packages the GPU
machine lacks. A GPU-only failure found here costs nothing; found there, minutes of a short loan."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, **env}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=environ, capture_output=True, text=True, timeout=600
    )


def test_dry_run_of_the_cheap_stages(tmp_path):
    """env, install (pip's --dry-run) and the tiny profile pass, each with its log and summary
    line; the summary file holds what stdout showed."""
    result = run(tmp_path, "--dry-run", "env", "install", "profile")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for stage in ("env", "install", "import", "profile"):
        assert f"{stage}: ok in" in out
    logs = sorted(f.name for f in (tmp_path / "out").iterdir())
    assert logs == ["env.log", "install.log", "profile.log", "summary.txt"]  # import: install's
    assert "device: no CUDA" in out  # the env stage's versions
    assert "## 1. decode workload" in out and "median decode step" in out
    assert "stages not passed: none" in out
    assert (tmp_path / "out" / "summary.txt").read_text().strip() in out.strip()


def test_a_failing_stage_fails_the_run_and_shows_its_log(tmp_path):
    result = run(tmp_path, "--dry-run", "install", PYTHON="false")
    assert result.returncode != 0
    assert "install: FAILED (rc 1)" in result.stdout
    assert "stages not passed: install import" in result.stdout
    assert "---- tail of install.log (install)" in result.stdout
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "---- tail of install.log (import)" in summary  # the tails reach the summary too


def test_every_stage_leaves_at_most_seven_files(tmp_path):
    """Eight files come back from the GPU machine's output folder: six logs and the summary."""
    result = run(tmp_path, "--dry-run", GPU_CHECK_BUDGET_S="1")
    assert result.returncode != 0
    assert len(list((tmp_path / "out").iterdir())) <= 7


def test_runs_with_home_unset(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HOME"}
    # The script makes a scratch HOME with `mktemp -d` and leaves it, as a bare machine may:
    # here it lands in this test's folder, not the machine's temp folder.
    environ = {**env, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    environ["TMPDIR"] = str(tmp_path)
    result = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "env"], env=environ, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "env: ok in" in result.stdout


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A Python whose environment has every dependency but not radixkv: the GPU machine as a
    rerun finds it, the machine before it was given back having taken the install with it."""
    root = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # The dependencies by path: a path line adds the folder without running its .pth files, so
    # the editable radixkv install of this environment stays out.
    import sysconfig

    Path(purelib, "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    probe = subprocess.run([str(python), "-P", "-c", "import torch, radixkv"], capture_output=True)
    assert b"No module named 'radixkv'" in probe.stderr
    return python


def fake_python(tmp_path: Path, python: Path, refuse: str) -> Path:
    """`python`, except that a pip install whose arguments hold `refuse` exits 1."""
    script = tmp_path / "python"
    script.write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ "$*" == *"pip install"*"{refuse}"* ]]; then echo refused >&2; exit 1; fi\n'
        f'exec {python} "$@"\n'
    )
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(
    ("refuse", "fallback"),
    [(" -e ", "a plain one into"), ("", "the source folders linked into")],
)
def test_a_rerun_on_a_bare_machine_installs_first(tmp_path, bare_python, refuse, fallback):
    """A rerun of one stage on a machine without radixkv installs it first; an editable install
    that is refused falls back to a plain install into a folder on PYTHONPATH, and a pip that
    refuses everything to the source folders linked there. The stage then imports radixkv."""
    python = fake_python(tmp_path, bare_python, refuse)
    site = tmp_path / "site"
    result = run(tmp_path, "env", PYTHON=str(python), GPU_CHECK_SITE=str(site))
    out = result.stdout
    assert "install: radixkv is not importable here; installing first" in out, out
    assert "install: FAILED" in out  # the editable install, refused
    assert fallback in out
    assert "import: ok in" in out and "radixkv.kernels from " + str(site) in out, out


def test_a_small_budget_still_installs(tmp_path):
    """A rerun of a few stages with a small budget: the install is not skipped to save time for
    the stages that need it."""
    result = run(tmp_path, "--dry-run", "install", GPU_CHECK_BUDGET_S="60")
    assert "install: ok in" in result.stdout and "import: ok in" in result.stdout, result.stdout


def test_stages_beyond_the_budget_are_skipped(tmp_path):
    result = run(tmp_path, "--dry-run", "env", "profile", GPU_CHECK_BUDGET_S="10")
    assert result.returncode != 0
    assert "env: SKIPPED" in result.stdout and "profile: SKIPPED" in result.stdout


def test_unknown_stage_is_a_usage_error(tmp_path):
    result = run(tmp_path, "benchmarks")
    assert result.returncode == 2 and "unknown stage" in result.stderr
    assert "Stages, in order" in run(tmp_path, "--help").stdout


def test_gpu_tests_collect_without_the_extras_the_gpu_machine_lacks(tmp_path):
    """What the GPU machine's `pytest -m gpu` sees: the dry run's pytest stage collects the files
    the script names with openai, msgspec, zmq, fastapi and the rest hidden
    (scripts/without_extras); collection succeeds and finds the GPU tests. The GPU machine runs
    those files only, so every file that marks a test gpu must be among them."""
    result = run(tmp_path, "--dry-run", "pytest")
    log = (tmp_path / "out" / "pytest.log").read_text()
    assert result.returncode == 0, result.stdout + log[-3000:]
    assert "tests/kernels/test_kernel_gpu.py::test_rope_store_kv_gpu" in log
    assert "tests/engine/test_engine_gpu.py::" in log
    named = re.search(r"^GPU_TESTS=\(([^)]*)\)", SCRIPT.read_text(), re.M)
    assert named is not None
    marks_gpu = re.compile(r"pytest\.mark\.gpu\b")
    marked = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("*.py")
        if marks_gpu.search(path.read_text())
    }
    assert marked == set(named.group(1).split())


@pytest.mark.parametrize("name", ["openai", "zmq", "fastapi"])
def test_the_hidden_extras_are_really_hidden(name):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "scripts" / "without_extras")}
    code = f"import importlib.util as u; assert u.find_spec({name!r}) is None; import {name}"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "ModuleNotFoundError" in result.stderr

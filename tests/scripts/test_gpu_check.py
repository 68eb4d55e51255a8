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


def test_the_dry_run_runs_every_stage(tmp_path):
    """The whole --dry-run (every stage on the CPU, a minute and a half): one test, so that a
    run of the suite on several workers runs it once."""
    env = {"GPU_CHECK_STATE": str(tmp_path / "state"), "GPU_CHECK_SITE": str(tmp_path / "site")}
    result = run(tmp_path, "--dry-run", **env)
    out_dir = tmp_path / "out"
    assert result.returncode == 0, result.stdout + result.stderr
    _check_stages(result.stdout, out_dir)
    _check_bench_and_hf((out_dir / "bench.log").read_text())
    _check_kernels((out_dir / "kernels.log").read_text(), result.stdout)
    _check_collection((out_dir / "pytest.log").read_text())


def _check_stages(out: str, out_dir: Path) -> None:
    stages = ("env", "install", "import", "bench", "kernels", "pytest", "profile", "hf")
    positions = [out.index(f"{stage}: ok in") for stage in stages]
    assert positions == sorted(positions)  # the headline figures and the peers' table first
    assert "stages not passed: none" in out
    assert (out_dir / "summary.txt").read_text().strip() in out.strip()
    assert "device: no CUDA" in out  # the env stage's versions
    assert "## 1. decode workload" in out and "median decode step" in out
    # At most 7 files: 8 come back from the GPU machine's output folder.
    logs = {f.name for f in out_dir.iterdir()}
    stage_logs = {f"{name}.log" for name in ("env", "install", "bench", "kernels", "pytest")}
    assert logs == stage_logs | {"profile.log", "summary.txt"}


def _check_bench_and_hf(log: str) -> None:
    """gpu_bench's `sync` system beside the others as the bench stage runs it; then the hf
    stage's transformers systems, in the same log."""
    names = "radixkv cache on | radixkv cache on, steps not overlapped | radixkv cache off"
    head = "on vs sync, x | on vs off, x | on vs on, x"
    assert f"| metric | {names} | radixkv cache on | {head} |" in log
    own = "| replies equal to radixkv cache on's (share) |"
    assert f"{own} 1.00 | 1.00 (must be 1.00) | 1.00 | 1.00 (must be 1.00) |" in log
    for peer in ("sync (radixkv cache on, steps not overlapped)", "on (radixkv cache on)"):
        assert f"| replies: on = {peer}, token for token | 1.00 | 1.00 | met |" in log
    hf = "| metric | radixkv cache on | transformers continuous batching | transformers generate |"
    assert hf in log and "--systems on,batch,generate" in log


def _check_kernels(log: str, out: str) -> None:
    """Every section of the kernel bench under the interpreter, its progress recorded for the
    host-timed fallback, and the peers' kernels beside radixkv's where they are fetched."""
    for section in ("decode", "extend", "splits", "decode-tiles", "extend-tiles"):
        assert f"({section}: " in log
    assert "### Goals" in log and "0 failed" in log
    assert "--progress" in log and "--budget-s" in log
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import peer_kernels

    if peer_kernels.fetched():
        assert "peers: vLLM 0.32 and SGLang 0.5.23 Triton kernels" in log
        decode = [line for line in log.splitlines() if line.startswith("| 16 | 2 | 40 | 16 |")]
        assert decode and "| - | - |" not in decode[0]  # both peers timed and checked
    else:
        assert "kernels: .peers/ is not here" in out


def _check_collection(log: str) -> None:
    """What the GPU machine's pytest sees: the files the script names collect with openai,
    msgspec, zmq, fastapi and the rest hidden (scripts/without_extras)."""
    assert "tests/kernels/test_kernel_gpu.py::test_rope_store_kv_gpu" in log
    assert "tests/engine/test_engine_gpu.py::" in log
    assert "tests/engine/test_architectures.py::test_unsupported_architectures" in log
    assert "tests/kernels/test_kernel_attention_kinds.py::" in log


def test_a_failing_stage_fails_the_run_and_shows_its_log(tmp_path):
    result = run(tmp_path, "--dry-run", "install", PYTHON="false")
    assert result.returncode != 0
    assert "install: FAILED (rc 1)" in result.stdout
    assert "stages not passed: install import" in result.stdout
    assert "---- tail of install.log (install)" in result.stdout
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "---- tail of install.log (import)" in summary  # the tails reach the summary too


def test_a_crashed_kernel_bench_resumes_timed_from_the_host(tmp_path):
    """The real kernels stage, its kernel bench faked: the first run records a point in flight
    and dies as a segfault would; the fallback gets the same progress file and host timing."""
    state = tmp_path / "state"
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$*" != *kernel_bench.py* ]]; then exec ' + sys.executable + ' "$@"; fi\n'
        'progress=$(echo "$*" | sed -E "s/.*--progress ([^ ]+).*/\\1/")\n'
        'if [[ "$*" != *"--timing host"* ]]; then\n'
        '    echo \'{"key": "p", "state": "started"}\' >>"$progress"; echo graph run; exit 139\n'
        "fi\n"
        'echo "host run resuming from $(cat "$progress")"\n'
    )
    fake.chmod(0o755)
    result = run(tmp_path, "kernels", PYTHON=str(fake), GPU_CHECK_STATE=str(state))
    assert "kernels: FAILED (rc 139)" in result.stdout
    assert "kernels-host: ok in" in result.stdout
    log = (tmp_path / "out" / "kernels.log").read_text()
    assert "graph run" in log and 'host run resuming from {"key": "p", "state": "started"}' in log
    assert "--quick" in log and "--budget-s" in log


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


def test_every_file_that_marks_a_test_gpu_is_run():
    """The GPU machine runs the gpu-marked tests of GPU_TESTS only, so every file that marks a
    test gpu must be among them; the files it runs whole on CUDA (CUDA_TESTS) mark none (the
    dry run collects both lists)."""
    script = SCRIPT.read_text()
    named = {
        name: set(re.search(rf"^{name}=\(([^)]*)\)", script, re.M).group(1).split())
        for name in ("GPU_TESTS", "CUDA_TESTS")
    }
    marks_gpu = re.compile(r"pytest\.mark\.gpu\b")
    marked = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("*.py")
        if marks_gpu.search(path.read_text())
    }
    assert marked == named["GPU_TESTS"]
    assert all((ROOT / f).is_file() for f in named["CUDA_TESTS"])
    assert not named["CUDA_TESTS"] & marked


@pytest.mark.parametrize("name", ["openai", "zmq", "fastapi"])
def test_the_hidden_extras_are_really_hidden(name):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "scripts" / "without_extras")}
    code = f"import importlib.util as u; assert u.find_spec({name!r}) is None; import {name}"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "ModuleNotFoundError" in result.stderr

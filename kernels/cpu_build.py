"""Building the CPU kernels' C sources (`cpu_attention.c`, `cpu_linear.c`) at first use.

Each source is compiled with the machine's C compiler for this machine (`-march=native`), into the
user's cache folder under a key of the source, the compiler, the flags and the CPU, and loaded with
ctypes. A process that cannot build one (no compiler) says so once in the log and its caller runs
the torch code instead; `RADIXKV_CPU_KERNELS=0` turns them all off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def load(source: Path, flags: tuple[str, ...], what: str) -> ctypes.CDLL | None:
    """`source` built with `flags` (and OpenMP where the compiler has it) and loaded; None, logged
    as a warning naming `what`, when it cannot be built or loaded or kernels are turned off."""
    if os.environ.get("RADIXKV_CPU_KERNELS", "1") == "0":
        return None
    try:
        return ctypes.CDLL(str(_built(source, flags)))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("%s unavailable, using torch: %s", what, exc)
        return None


def _built(source: Path, flags: tuple[str, ...]) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (set CC)")
    text = source.read_bytes()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    key = hashlib.sha256(
        b"\0".join([text, version.encode(), " ".join(flags).encode(), _cpu_identity().encode()])
    ).hexdigest()[:16]
    folder = _cache_folder()
    target = folder / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        built = Path(scratch) / target.name
        for openmp in (["-fopenmp"], []):  # a compiler without OpenMP builds it single-threaded
            done = subprocess.run(
                [compiler, *flags, *openmp, "-o", str(built), str(source), "-lm"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode == 0:
                break
        else:
            raise OSError(f"compiling {source.name} failed: {done.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: a concurrent build of the same key is the same file
    logger.info("built %s: %s", source.name, target)
    return target


def _cache_folder() -> Path:
    configured = os.environ.get("RADIXKV_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "radixkv" / "cpu-kernels"


def _cpu_identity() -> str:
    """What `-march=native` compiles for: the CPU's model and feature flags where Linux says them
    (a cache folder shared by machines of different CPUs keeps one build each)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return platform.machine() + "\n".join(sorted(set(lines)))

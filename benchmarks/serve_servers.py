"""The server side of `serve_bench`: which servers, how each starts, and what is read off them.

A server is named on the command line as `BASE[:OPTION...]`:

    radixkv            this checkout's `radixkv serve`
    radixkv@DIR        the radixkv source in DIR (an A/B against another tree, e.g. `git archive`)
    vllm               vLLM's CPU build from the venv `scripts/setup_vllm.sh` made
    transformers       `transformers serve --continuous-batching`
    BASE+schema        (radixkv) every chat request constrained by a JSON schema

    options: tN (N compute threads; default --threads), bf16 / fp32 (the dtype; default fp32),
             eager (vLLM: --enforce-eager, no inductor compile), inproc (radixkv: the engine on
             a thread of the server's process, `--no-engine-process`)

e.g. `radixkv:t2`, `vllm:eager`, `radixkv:bf16`. Both radixkv and vLLM get the same KV cache
bytes (`--kv-cache-gib`) and the same bound on running requests.

What a run reads off a server: CPU-seconds of its whole process tree (vLLM runs its API server and
its engine core as two processes, radixkv its front end and engine), and the prefix cache's
queries and hits from `/metrics` under vLLM's names, which radixkv also exports.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Servers start here, not in the repository root: `python -m` puts its working directory first on
# sys.path, where this checkout's radixkv/ would shadow radixkv@DIR's.
SERVER_CWD = tempfile.gettempdir()
SCHEMA_SUFFIX = "+schema"
VLLM_DIR = Path(
    os.environ.get("RADIXKV_VLLM_DIR")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "radixkv" / "vllm"
)
_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True, slots=True)
class ServerSpec:
    name: str  # as given on the command line
    kind: str  # "radixkv" | "vllm" | "transformers"
    source: Path | None  # radixkv@DIR: DIR
    schema: bool
    threads: int
    dtype: str  # "float32" | "bfloat16"
    eager: bool
    in_process: bool = False  # radixkv: --no-engine-process


def parse_server(name: str, default_threads: int) -> ServerSpec:
    """A server name as the module docstring spells it; ValueError for anything else."""
    base, *options = name.split(":")
    schema = base.endswith(SCHEMA_SUFFIX)
    base = base.removesuffix(SCHEMA_SUFFIX)
    kind, _, source = base.partition("@")
    if kind not in ("radixkv", "vllm", "transformers") or (source and kind != "radixkv"):
        raise ValueError(f"unknown server {name!r}")
    if schema and kind != "radixkv":
        raise ValueError(f"{name!r}: +schema is radixkv's")
    threads, dtype, eager, in_process = default_threads, "float32", False, False
    for option in options:
        if option in _DTYPES:
            dtype = _DTYPES[option]
        elif option == "eager" and kind == "vllm":
            eager = True
        elif option == "inproc" and kind == "radixkv":
            in_process = True
        elif option[:1] == "t" and option[1:].isdigit() and int(option[1:]) > 0:
            threads = int(option[1:])
        else:
            raise ValueError(f"{name!r}: unknown option {option!r}")
    path = Path(source) if source else None
    return ServerSpec(name, kind, path, schema, threads, dtype, eager, in_process)


def is_radixkv(name: str) -> bool:
    """Whether `name` names a radixkv server (this checkout's or another source's)."""
    return name.split(":")[0].removesuffix(SCHEMA_SUFFIX).partition("@")[0] == "radixkv"


def server_command(
    spec: ServerSpec, model_path: str, port: int, max_num_seqs: int, kv_cache_gib: float
) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port)]
    if spec.kind == "radixkv":
        cmd = [sys.executable, "-m", "radixkv", "serve", *common, "--log-level", "warning"]
        cmd += ["--max-num-seqs", str(max_num_seqs), "--num-threads", str(spec.threads)]
        cmd += ["--cache-mb", str(int(kv_cache_gib * 1024)), "--dtype", spec.dtype]
        if spec.in_process:
            cmd.append("--no-engine-process")
        return [*cmd, "--model", model_path]
    if spec.kind == "vllm":
        launch = str(ROOT / "benchmarks" / "vllm_launch.py")
        cmd = [str(VLLM_DIR / "bin" / "python"), launch, "serve", model_path, *common]
        cmd += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
        cmd += ["--dtype", spec.dtype, "--max-num-seqs", str(max_num_seqs)]
        cmd += ["--uvicorn-log-level", "warning"]
        return [*cmd, "--enforce-eager"] if spec.eager else cmd
    main = "import sys; from transformers.cli.transformers import main; sys.exit(main())"
    cmd = [sys.executable, "-c", main, "serve", "--continuous-batching", "--device", "cpu"]
    return [*cmd, *common, model_path]


def server_env(spec: ServerSpec, kv_cache_gib: float) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(spec.threads)}
    if spec.kind == "radixkv" and spec.source is not None:
        # Found before this checkout's editable install. Its `radixkv.kernels` and
        # `radixkv.scheduler` must be inside DIR/radixkv (symlinks to DIR/kernels, DIR/scheduler).
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(spec.source), env.get("PYTHONPATH")]))
    if spec.kind == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_cache_gib)))
        env.pop("OMP_NUM_THREADS")  # vLLM sets its own from the binding below
        if spec.threads > 1:
            # By default vLLM binds one OpenMP thread and reserves a core for its front end.
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{spec.threads - 1}"
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def server_source(spec: ServerSpec) -> Path:
    """The folder whose radixkv a radixkv server imports, found the way the server will find it."""
    # find_spec runs none of radixkv's code (its imports take seconds)
    probe = (
        "import importlib.util, pathlib;"
        "print(pathlib.Path(importlib.util.find_spec('radixkv').origin).resolve().parent.parent)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=server_env(spec, 1),
        cwd=SERVER_CWD,
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def check_server(spec: ServerSpec) -> None:
    """Fail before timing anything: radixkv@DIR that would not run DIR's radixkv (an A/B of one
    tree against itself reads as a result), or vLLM without its venv."""
    if spec.kind == "vllm" and not (VLLM_DIR / "bin" / "python").exists():
        raise SystemExit(f"serve_bench: no vLLM venv at {VLLM_DIR}: run scripts/setup_vllm.sh")
    if spec.kind != "radixkv":
        return
    want = spec.source or ROOT
    got = server_source(spec)
    if got != want.resolve():
        raise SystemExit(f"serve_bench: {spec.name} would import radixkv from {got}, not {want}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server at {base_url} was not healthy after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s; a server's children (vLLM's engine core, radixkv's
    engine process) exit with it."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def process_tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) used so far by process `pid` and every process
    below it; None without /proc. On a shared machine this moves far less with the other jobs
    than wall times do."""
    if not Path(f"/proc/{pid}").exists():
        return None
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        parents[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent and p not in tree]
        tree.update(children)
        frontier += children
    return sum(cpu.get(p, 0.0) for p in tree)


def metric_totals(base_url: str, names: tuple[str, ...]) -> dict[str, float]:
    """The current value of each counter in `names` on the server's /metrics (summed over label
    sets; 0 for one the server does not export)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def histogram_p50(base_url: str, name: str) -> float | None:
    """p50 of the histogram `name` on the server's /metrics, interpolated in its buckets."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    buckets = []
    for family in text_string_to_metric_families(text):
        if family.name == name:
            buckets = [
                (float(s.labels["le"]), s.value)
                for s in family.samples
                if s.name.endswith("_bucket")
            ]
    if not buckets or buckets[-1][1] == 0:
        return None
    half = buckets[-1][1] / 2
    low_edge, low_count = 0.0, 0.0
    for edge, count in sorted(buckets):
        if count >= half:
            if edge == float("inf"):
                return low_edge
            return low_edge + (edge - low_edge) * (half - low_count) / max(count - low_count, 1)
        low_edge, low_count = edge, count
    return None

"""A fleet: N `radixkv serve` replicas behind a router people already run. The recipes:

    python examples/fleet/fleet.py session-least-loaded    # new conversation: fewest sessions
    python examples/fleet/fleet.py vllm-kv-aware-session   # kv_aware + session affinity
    python examples/fleet/fleet.py session-hash            # consistent hash on x-session-id
    python examples/fleet/fleet.py vllm-kv-aware           # vllm-router kv_aware
    python examples/fleet/fleet.py sglang-cache-aware      # sglang-router cache_aware
    python examples/fleet/fleet.py dynamo-indexer          # Dynamo's KV indexer

Each starts the replicas on 127.0.0.1, waits until they answer, starts the router (or indexer)
and prints where to send requests; Ctrl-C, SIGINT or SIGTERM stops everything. Options after `--`
go to every `radixkv serve` (e.g. `-- --model PATH --block-size 32`). The session recipes route
on the `x-session-id` header: send one per conversation. The routers come from
`scripts/setup_routers.sh` (`make test` runs it): one venv each under $RADIXKV_ROUTERS_DIR
(default: `radixkv/routers` in the user's cache folder, `~/.cache` or $XDG_CACHE_HOME).

A replica's KV-event publisher binds `tcp://127.0.0.1:PORT` (`--kv-events`; vllm-router and
Dynamo connect to it) in vLLM's current layout. Dynamo's indexer binds its HTTP port on 0.0.0.0
with no host flag, so the `dynamo-indexer` recipe re-runs itself in a network namespace that has
only loopback (`unshare -n`, as root); it prints the `nsenter` command that runs a client there.

The routers log at `info`; RADIXKV_ROUTER_LOG_LEVEL=debug shows vllm-router's routing decisions
(for kv_aware, the prefix each worker was credited from its events).

This file is also the harness of `benchmarks/fleet_bench.py` and the fleet tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROUTERS_DIR_ENV = "RADIXKV_ROUTERS_DIR"
IN_NAMESPACE_ENV = "RADIXKV_FLEET_IN_NETNS"
SESSION_HEADER = "x-session-id"  # what the session recipes key on
SESSION_TTL_S = 600  # session recipes: a conversation idle this long may move
# vllm-router's sticky_least_loaded reads its session expiry from this variable (default 2 h);
# an idle session still counts toward its replica's load until it expires.
SLL_EXPIRY_ENV = "VLLM_ROUTER_SLL_SESSION_EXPIRATION_IN_S"

# cache_aware (sglang-router; vllm-router's is the same algorithm) tuned for multi-turn chat.
# When the in-flight loads are imbalanced (max - min > abs AND max > rel * min) it sends a
# request to the least-loaded worker; otherwise to the worker whose tree of past request TEXT
# matches the largest share of it, if that share exceeds cache_threshold, else to the least
# loaded / smallest tree. Two facts of chat decide the values:
# - The router never sees replies, so a conversation's second turn matches only its first
#   request (about 68 % of the text in benchmarks/fleet_bench.py), while a new conversation's
#   first turn matches the shared system prompt (about 77 %): no threshold tells them apart.
#   At the default 0.3 every first turn follows the system prompt to one worker (the issue
#   measured 32 of 32 requests on one replica).
# - A chat client waits for its reply, so when its next turn arrives its home worker has just
#   finished one request: the home is the less loaded worker, or loads are equal.
# So: rebalance on any difference in load (abs 0, rel 1.0), which spreads the first turns evenly
# and sends later turns home, and a threshold under the second-turn match (0.6), so that with
# equal loads a conversation still follows its history rather than the shared prompt.
# That second fact holds only in a closed loop (each next turn right after its reply, replies of
# one length). With think time and replies of natural length it fails, and so do these values
# (issue 32: a median cached fraction of .67 against one replica's .85): for chat, prefer a
# session recipe (vllm-kv-aware-session, session-hash), which routes on x-session-id.
SGLANG_CHAT_THRESHOLDS = {
    "--cache-threshold": "0.6",
    "--balance-abs-threshold": "0",
    "--balance-rel-threshold": "1.0",
}

ROUTER_KINDS = (
    "round-robin",
    "sglang-cache-aware",
    "vllm-cache-aware",
    "vllm-kv-aware",
    "vllm-kv-aware-session",
    "session-hash",
    "session-least-loaded",
)
RECIPES = (*ROUTER_KINDS, "dynamo-indexer")
USES_SESSION_HEADER = ("vllm-kv-aware-session", "session-hash", "session-least-loaded")
NEEDS_NAMESPACE = ("dynamo-indexer",)  # binds 0.0.0.0
NEEDS_EVENTS = ("vllm-kv-aware", "vllm-kv-aware-session", "dynamo-indexer")


def routers_dir() -> Path:
    """Where scripts/setup_routers.sh installs the routers: $RADIXKV_ROUTERS_DIR, else
    radixkv/routers in the user's cache folder (outside any checkout, shared by all of them)."""
    if os.environ.get(ROUTERS_DIR_ENV):
        return Path(os.environ[ROUTERS_DIR_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "radixkv" / "routers"


def router_python(package: str) -> Path | None:
    """The python of a router's venv (`sglang-router`, `vllm-router`, `ai-dynamo-runtime`)."""
    python = routers_dir() / package / "bin" / "python"
    return python if python.exists() else None


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def get_json(url: str, timeout: float = 10.0) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def post_json(url: str, body: object, timeout: float = 30.0) -> object:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def namespace_available() -> bool:
    """Whether `unshare -n` (a network namespace with loopback only) works here."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


def in_namespace() -> bool:
    return os.environ.get(IN_NAMESPACE_ENV) == "1"


def namespace_command(argv: Sequence[str]) -> list[str]:
    """`argv` run in a new network namespace with its loopback up."""
    inner = "ip link set lo up && exec " + " ".join(_quote(a) for a in argv)
    return ["unshare", "-n", "sh", "-c", inner]


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""


@dataclass
class Replica:
    url: str
    events_port: int | None
    process: Process

    @property
    def events_endpoint(self) -> str | None:
        """Where a subscriber connects (the replica binds tcp://*:port)."""
        return None if self.events_port is None else f"tcp://127.0.0.1:{self.events_port}"


@dataclass
class Fleet:
    """Replicas and a router (or Dynamo's indexer), started by `start_fleet`."""

    replicas: list[Replica]
    url: str | None  # where clients send requests (None for the indexer: ask it, then a replica)
    router: Process | None = None
    indexer_url: str | None = None
    processes: list[Process] = field(default_factory=list)
    log_dir: Path | None = None  # each process's log, NAME.log


def start(
    name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None
) -> Process:
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # Ctrl-C in the terminal reaches us, and we stop them
        )
    return Process(name, popen, log)


def wait_for(process: Process, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not answers(url):
        if not process.alive():
            raise RuntimeError(f"{process.name} exited:\n{process.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{process.name} did not answer {url} in {timeout_s:.0f} s")
        time.sleep(0.2)


def stop(processes: Sequence[Process]) -> None:
    for p in reversed(processes):
        if p.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, signal.SIGTERM)
    for p in reversed(processes):
        try:
            p.popen.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, signal.SIGKILL)
            p.popen.wait(timeout=10)


def replica_command(port: int, events_port: int | None, serve_args: Sequence[str]) -> list[str]:
    cmd = [sys.executable, "-m", "radixkv", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--num-threads", "1", "--log-level", "warning"]
    if events_port is not None:
        cmd += ["--kv-events", f"tcp://127.0.0.1:{events_port}"]  # bound, loopback only
    return cmd + list(serve_args)


def router_command(
    kind: str, port: int, replicas: Sequence[Replica], *, model: str, block_size: int
) -> list[str]:
    """The command line of router `kind` (one of ROUTER_KINDS) in front of `replicas`."""
    urls = [r.url for r in replicas]
    metrics_port = str(free_ports(1)[0])
    if kind == "sglang-cache-aware":
        python = _router_python("sglang-router")
        cmd = [str(python), "-m", "sglang_router.launch_router", "--policy", "cache_aware"]
        cmd += [a for pair in SGLANG_CHAT_THRESHOLDS.items() for a in pair]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", metrics_port]
    else:
        python = _router_python("vllm-router")
        policy = {
            "round-robin": "round_robin",
            "vllm-cache-aware": "cache_aware",
            "vllm-kv-aware": "kv_aware",
            "vllm-kv-aware-session": "kv_aware",
            "session-hash": "consistent_hash",  # keyed by the x-session-id header
            # a new x-session-id goes to the replica with the fewest sessions, then stays there
            "session-least-loaded": "sticky_least_loaded",
        }[kind]
        cmd = [str(python), "-m", "vllm_router.launch_router", "--policy", policy]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", metrics_port]
        if kind == "vllm-cache-aware":
            cmd += [a for pair in SGLANG_CHAT_THRESHOLDS.items() for a in pair]
        if kind in NEEDS_EVENTS:
            for r in replicas:
                cmd += ["--kv-event-source", f"{r.url}={r.events_endpoint}"]
            cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
        if kind == "vllm-kv-aware-session":  # a conversation's turns stay on its first worker
            cmd += ["--kv-aware-session-affinity-ttl-secs", str(SESSION_TTL_S)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
    return cmd + ["--log-level", os.environ.get("RADIXKV_ROUTER_LOG_LEVEL", "info")]


def router_env(kind: str) -> dict[str, str]:
    """Settings router `kind` reads from its environment only."""
    if kind == "session-least-loaded":
        return {SLL_EXPIRY_ENV: str(SESSION_TTL_S)}
    return {}


def indexer_command(port: int, replicas: Sequence[Replica], block_size: int) -> list[str]:
    """Dynamo's standalone indexer subscribed to every replica's events (worker id = index+1)."""
    python = _router_python("ai-dynamo-runtime")
    workers = ",".join(f"{i + 1}={r.events_endpoint}" for i, r in enumerate(replicas))
    return [str(python), "-m", "dynamo.indexer", "--block-size", str(block_size)] + [
        "--port",
        str(port),
        "--threads",
        "1",
        "--workers",
        workers,
    ]


def _router_python(package: str) -> Path:
    python = router_python(package)
    if python is None:
        raise RuntimeError(
            f"{package} is not installed in {routers_dir()} (${ROUTERS_DIR_ENV}): "
            "run scripts/setup_routers.sh"
        )
    return python


@contextlib.contextmanager
def start_fleet(
    kind: str,
    num_replicas: int,
    serve_args: Sequence[str] = (),
    *,
    model: str,
    block_size: int = 16,
    log_dir: Path | None = None,
    timeout_s: float = 300.0,
    replicas: Sequence[Replica] | None = None,
) -> Iterator[Fleet]:
    """Start `num_replicas` replicas and router `kind` (or "dynamo-indexer", or "none");
    stop them all on exit. `model` is the name the replicas serve (`--served-model-name`).
    `replicas`: running ones (from `start_replicas`) to put the router in front of instead; they
    keep running at exit."""
    events = kind in NEEDS_EVENTS
    if kind in NEEDS_NAMESPACE and not in_namespace():
        raise RuntimeError(f"{kind} binds every interface: run it under unshare -n")
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="radixkv-fleet-"))
    processes: list[Process] = []
    try:
        if replicas is None:
            replicas = launch_replicas(
                processes, num_replicas, serve_args, model, block_size, events, log_dir, timeout_s
            )
        assert not events or all(r.events_port for r in replicas), f"{kind} reads KV events"
        fleet = Fleet(list(replicas), None, processes=processes, log_dir=log_dir)
        front = free_ports(1)[0]
        if kind == "dynamo-indexer":
            indexer = start("indexer", indexer_command(front, replicas, block_size), log_dir)
            processes.append(indexer)
            fleet.indexer_url = f"http://127.0.0.1:{front}"
            wait_for(indexer, f"{fleet.indexer_url}/health", 60)
        elif kind != "none":
            argv = router_command(kind, front, replicas, model=model, block_size=block_size)
            fleet.router = start("router", argv, log_dir, router_env(kind))
            processes.append(fleet.router)
            fleet.url = f"http://127.0.0.1:{front}"
            wait_for(fleet.router, f"{fleet.url}/v1/models", 60)
        yield fleet
    finally:
        stop(processes)


@contextlib.contextmanager
def start_replicas(
    num_replicas: int,
    serve_args: Sequence[str],
    *,
    model: str,
    block_size: int = 16,
    events: bool = True,
    log_dir: Path,
    timeout_s: float = 300.0,
) -> Iterator[list[Replica]]:
    """Replicas alone (each publishing KV events when `events`), stopped on exit: several
    routers can take turns in front of them (`start_fleet(..., replicas=)`)."""
    processes: list[Process] = []
    try:
        yield launch_replicas(
            processes, num_replicas, serve_args, model, block_size, events, log_dir, timeout_s
        )
    finally:
        stop(processes)


def launch_replicas(
    processes: list[Process],
    num_replicas: int,
    serve_args: Sequence[str],
    model: str,
    block_size: int,
    events: bool,
    log_dir: Path,
    timeout_s: float,
) -> list[Replica]:
    """Start the replicas (each appended to `processes` at once, so that the caller stops it
    whatever happens next) and wait until every one answers."""
    ports = free_ports(2 * num_replicas)
    replicas = []
    for i in range(num_replicas):
        events_port = ports[num_replicas + i] if events else None
        argv = replica_command(ports[i], events_port, serve_args)
        argv += ["--served-model-name", model, "--block-size", str(block_size)]
        process = start(f"replica{i}", argv, log_dir)
        processes.append(process)
        replicas.append(Replica(f"http://127.0.0.1:{ports[i]}", events_port, process))
    for r in replicas:
        wait_for(r.process, f"{r.url}/health", timeout_s)
    return replicas


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in args_list:
        i = args_list.index("--")
        args_list, serve_args = args_list[:i], args_list[i + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", choices=RECIPES)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--served-model-name", default="radixkv")
    parser.add_argument(
        "--log-dir", type=Path, help="where the processes' logs go (default: a new temp folder)"
    )
    args = parser.parse_args(args_list)
    if args.replicas < 1:
        parser.error(f"--replicas must be >= 1, got {args.replicas}")
    if args.recipe in NEEDS_NAMESPACE and not in_namespace():
        if not namespace_available():
            print(f"{args.recipe} needs unshare -n (as root)", file=sys.stderr)
            return 2
        cmd = namespace_command([sys.executable, __file__, *(argv or sys.argv[1:])])
        # exec, not a child: Ctrl-C (SIGINT to this pid) must reach the fleet's owner
        os.execvpe(cmd[0], cmd, {**os.environ, IN_NAMESPACE_ENV: "1"})
    stop_on_signals()
    # A signal at any moment, starting up included, stops everything (start_fleet's finally).
    with (
        contextlib.suppress(KeyboardInterrupt),
        start_fleet(
            args.recipe,
            args.replicas,
            serve_args,
            model=args.served_model_name,
            block_size=args.block_size,
            log_dir=args.log_dir,
        ) as fleet,
    ):
        for line in describe(fleet, args.recipe, args.served_model_name):
            print(line, flush=True)
        while all(p.alive() for p in fleet.processes):
            time.sleep(1)
    return 0


def stop_on_signals() -> None:
    """SIGTERM and SIGINT stop the fleet. The replicas and the router run in sessions of their
    own (a terminal's Ctrl-C reaches only this process), so this process must never end without
    stopping them: SIGTERM's default would orphan them, and a shell's `&` starts it with SIGINT
    ignored. A second signal while stopping is ignored: stopping is already bounded."""

    def interrupt(signum: int, frame: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)


def describe(fleet: Fleet, recipe: str, model: str) -> list[str]:
    """What a user needs: the logs, each process and where to send requests."""
    lines = [f"logs     {fleet.log_dir}"]
    for r in fleet.replicas:
        events = r.events_endpoint or "-"
        lines.append(f"replica  {r.url}  events {events}  pid {r.process.popen.pid}")
    if fleet.url:
        header = f"  header {SESSION_HEADER}" if recipe in USES_SESSION_HEADER else ""
        pid = fleet.router.popen.pid if fleet.router else "-"
        lines.append(f"router   {fleet.url}/v1  (model {model!r}){header}  pid {pid}")
    if fleet.indexer_url:
        query = '{"token_ids": [...], "model_name": "default"}'
        lines.append(f"indexer  {fleet.indexer_url}/query  POST {query}")
    if in_namespace():  # only loopback here: a client must run in this network namespace
        lines.append(f"enter    nsenter --target {os.getpid()} --net  (as root; then curl, python)")
    return lines


if __name__ == "__main__":
    sys.exit(main())

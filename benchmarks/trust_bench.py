"""Does a hostile client cost a user anything, and is the first minute short? (issue 43's goals)

    python -m benchmarks.trust_bench                          # the embedded SmolLM2, all parts
    python -m benchmarks.trust_bench --parts options --rounds 5
    python -m benchmarks.trust_bench --model DIR --rounds 1   # any model folder

Parts, each against a real `radixkv serve` process on 127.0.0.1:
- `options`: the wall time of `radixkv serve` (and `radixkv chat`) with a bad option, from
  start to exit; each must be one line and exit 2 (goal: under 2 s on a quiet 2-core machine).
- `hostile`: a one-token chat's latency, alone and while three hostile requests of each kind
  are in flight (grammars that compile for minutes, a 16,000-dot regex, 2 MB of tool text, a
  schema 600 deep, cross-site text/plain bodies, a rebound Host reading the page, held page
  streams, half-sent bodies; goal: under 0.5 s on a quiet machine).
- `rate`: the live page's output tokens/s (its snapshots' `gauges.tokens_per_s`) against the
  client's own count over the same two seconds, while a reply streams (goal: within 20 %).

The load average is printed beside each figure: on a shared machine they time the neighbours
too, and only a run alone says whether a goal is met.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from benchmarks.serve_servers import free_port, stop, wait_healthy

CHAT = "/v1/chat/completions"
PARTS = ("options", "hostile", "rate")
OPTION_GOAL_S = 2.0
CHAT_GOAL_S = 0.5
RATE_GOAL = 0.2


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


# ---------------------------------------------------------------------- options


def option_cases(model: str | None, taken_port: int, a_file: str) -> list[tuple[str, list[str]]]:
    model_flag = [] if model is None else ["--model", model]
    return [
        ("--block-size 0", ["serve", "--block-size", "0"]),
        ("--port 99999", ["serve", "--port", "99999"]),
        ("a port in use", ["serve", "--port", str(taken_port)]),
        ("a missing --model", ["serve", "--model", "/no/such/model/folder"]),
        (
            "--kv-cache-dir a file",
            ["serve", *model_flag, "--host-cache", "1MiB", "--kv-cache-dir", a_file],
        ),
        ("chat: a missing --model", ["chat", "--model", "/no/such/model/folder"]),
        ("chat --web: a port in use", ["chat", "--web", "--port", str(taken_port)]),
    ]


def run_options(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as scratch, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        a_file = os.path.join(scratch, "file")
        with open(a_file, "w") as f:
            f.write("not a folder")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        for name, argv in option_cases(args.model, taken.getsockname()[1], a_file):
            times, ok = [], True
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, "-m", "radixkv", *argv],
                    capture_output=True,
                    text=True,
                    env=env,
                    cwd=scratch,
                    timeout=300,
                )
                times.append(time.perf_counter() - t0)
                ok &= done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
            rows.append(
                {
                    "case": name,
                    "median_s": statistics.median(times),
                    "max_s": max(times),
                    "ok": ok,
                    "load": load(),
                }
            )
    return rows


def options_report(rows: list[dict[str, Any]]) -> str:
    lines = ["| option error | median | max | one line, exit 2 | load |", "|---|---|---|---|---|"]
    for r in rows:
        ok = "yes" if r["ok"] else "NO"
        lines.append(
            f"| {r['case']} | {r['median_s']:.2f} s | {r['max_s']:.2f} s | {ok} | {r['load']} |"
        )
    worst = max(r["max_s"] for r in rows)
    lines.append(f"worst {worst:.2f} s (goal < {OPTION_GOAL_S:g} s on a quiet 2-core machine)")
    return "\n".join(lines)


# ---------------------------------------------------------------------- a server


@contextmanager
def running_server(args: argparse.Namespace) -> Iterator[str]:
    """`radixkv serve` on a free port with the page on; yields its base URL."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "radixkv",
        "serve",
        "--port",
        str(port),
        "--ui",
        "--num-threads",
        "1",
    ]
    if args.model is not None:
        cmd += ["--model", args.model]
    cmd += args.server_arg
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=tempfile.gettempdir(),
        stdout=subprocess.DEVNULL,
        stderr=None if args.verbose else subprocess.DEVNULL,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, proc, 600)
        yield base_url
    finally:
        stop(proc)


def post(
    base_url: str,
    body: bytes,
    content_type: str | None = "application/json",
    path: str = CHAT,
    timeout: float = 300,
) -> int:
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    headers = {} if content_type is None else {"Content-Type": content_type}
    try:
        conn.request("POST", path, body, headers)
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


def chat_body(**fields: Any) -> bytes:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
    return json.dumps(body | fields).encode()


def one_token_chat(base_url: str) -> float:
    t0 = time.perf_counter()
    status = post(base_url, chat_body())
    assert status == 200, f"a plain chat got {status}"
    return time.perf_counter() - t0


# ---------------------------------------------------------------------- hostile


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def _tool(description: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": "f", "description": description}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _hold_stream(base_url: str, path: str, seconds: float, host: str | None = None) -> int:
    """GET `path` and hold the connection `seconds` (a page stream's holder, or a page read
    under a rebound Host); the status."""
    h, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(h, int(port), timeout=seconds + 60)
    conn.putrequest("GET", path, skip_host=host is not None)
    if host is not None:
        conn.putheader("Host", host)
    conn.endheaders()
    response = conn.getresponse()
    status = response.status
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and status == 200 and path == "/ui/events":
        if not response.readline():
            break
    conn.close()
    return status


def _half_body(base_url: str, seconds: float) -> int:
    """A body that never arrives whole: its connection is held until the door's read timeout."""
    h, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((h, int(port)), timeout=seconds + 60) as sock:
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: 1000\r\n\r\n{{".encode())
        sock.settimeout(seconds)
        try:
            return int(sock.recv(64).split(b" ", 2)[1])
        except (OSError, IndexError, ValueError):
            return 0


def hostile_kinds(
    base_url: str, hold_s: float, tools_bytes: int
) -> dict[str, list[Callable[[], int]]]:
    """Kind -> three requests of it (each returns the status it got)."""

    def slow(i: int) -> bytes:
        return chat_body(guided_json={"type": "string", "pattern": f"^.{{0,{4000 + i}}}$"})

    def big(i: int) -> bytes:
        return chat_body(guided_regex="." * 16000 + str(i))

    def tools(i: int) -> bytes:
        text = "w " * (tools_bytes // 2) + str(i)
        return chat_body(tools=[_tool(text)], tool_choice="none")

    def deep(i: int) -> bytes:
        return chat_body(tools=[_tool(str(i), _nested(600))])

    return {
        "slow grammar": [lambda i=i: post(base_url, slow(i)) for i in range(3)],
        "16,000-dot regex": [lambda i=i: post(base_url, big(i)) for i in range(3)],
        "2 MB of tool text": [lambda i=i: post(base_url, tools(i)) for i in range(3)],
        "schema 600 deep": [lambda i=i: post(base_url, deep(i)) for i in range(3)],
        "text/plain body": [lambda: post(base_url, chat_body(), "text/plain") for _ in range(3)],
        "rebound Host": [
            lambda: _hold_stream(base_url, "/ui/events", 0, host="evil.example") for _ in range(3)
        ],
        "held page stream": [
            lambda: _hold_stream(base_url, "/ui/events", hold_s) for _ in range(3)
        ],
        "half-sent body": [lambda: _half_body(base_url, hold_s) for _ in range(3)],
    }


def run_hostile(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    one_token_chat(base_url)  # nobody's first request is timed
    alone = [one_token_chat(base_url) for _ in range(args.chats)]
    kinds = hostile_kinds(base_url, args.hold_s, args.tools_bytes)
    statuses: dict[str, list[int]] = {k: [] for k in kinds}
    threads = []
    for kind, requests in kinds.items():
        for request in requests:
            thread = threading.Thread(
                target=lambda k=kind, r=request: statuses[k].append(r()), daemon=True
            )
            thread.start()
            threads.append(thread)
    time.sleep(args.settle_s)  # all of them in flight
    under = [one_token_chat(base_url) for _ in range(args.chats)]
    for thread in threads:
        thread.join(args.hold_s + 600)
    return {"alone": alone, "under": under, "statuses": statuses, "load": load()}


def hostile_report(row: dict[str, Any]) -> str:
    alone, under = row["alone"], row["under"]
    ms = {
        name: (statistics.median(t) * 1000, max(t) * 1000)
        for name, t in (("a", alone), ("u", under))
    }
    ratio = statistics.median(under) / statistics.median(alone)
    answers = "; ".join(f"{k} {sorted(v)}" for k, v in row["statuses"].items())
    lines = [
        "| one-token chat | median | max |",
        "|---|---|---|",
        "| alone | {:.0f} ms | {:.0f} ms |".format(*ms["a"]),
        "| 3 hostile of each kind in flight | {:.0f} ms | {:.0f} ms |".format(*ms["u"]),
        f"ratio of medians x{ratio:.2f}; worst {ms['u'][1]:.0f} ms (goal < "
        f"{CHAT_GOAL_S * 1000:.0f} ms on a quiet machine); {row['load']}",
        f"hostile answers (0: none yet when released): {answers}",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------- rate


def run_rate(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    """Stream one reply while reading the page's snapshots; pair each snapshot taken once the
    reply has streamed for a window with the client's own rate over the window before it."""
    snapshots: list[tuple[float, float]] = []
    stop_reading = threading.Event()

    def read_snapshots() -> None:
        h, port = base_url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(h, int(port), timeout=60)
        conn.request("GET", "/ui/events")
        response = conn.getresponse()
        while not stop_reading.is_set():
            line = response.readline()
            if not line:
                return
            if line.startswith(b"data: "):
                snapshots.append((time.monotonic(), json.loads(line[6:])["gauges"]["tokens_per_s"]))
        conn.close()

    reader = threading.Thread(target=read_snapshots, daemon=True)
    reader.start()
    arrivals: list[float] = []
    h, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(h, int(port), timeout=600)
    body = {
        "prompt": "Once upon a time",
        "max_tokens": args.rate_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    for line in conn.getresponse():
        if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
            arrivals.append(time.monotonic())
    stop_reading.set()
    window = 2.0
    pairs = []
    for t, page in snapshots:
        if arrivals and arrivals[0] + window + 0.5 <= t <= arrivals[-1]:
            client = sum(t - window < a <= t for a in arrivals) / window
            if client > 0:
                pairs.append(page / client)
    decode = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else 0.0
    return {"ratios": pairs, "decode_tok_s": decode, "load": load()}


def rate_report(row: dict[str, Any]) -> str:
    ratios = row["ratios"]
    if not ratios:
        return f"no snapshot while the reply streamed (decode {row['decode_tok_s']:.1f} tok/s)"
    worst = max(abs(r - 1) for r in ratios)
    return (
        f"page tok/s / client tok/s over the same 2 s: median x{statistics.median(ratios):.3f}, "
        f"worst off by {worst:.1%} over {len(ratios)} snapshots (goal within {RATE_GOAL:.0%}); "
        f"decode {row['decode_tok_s']:.1f} tok/s; {row['load']}"
    )


# ---------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    p.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated of {', '.join(PARTS)}"
    )
    p.add_argument("--rounds", type=int, default=3, help="runs of each option error")
    p.add_argument(
        "--chats", type=int, default=5, help="one-token chats timed, alone and under load"
    )
    p.add_argument(
        "--hold-s",
        type=float,
        default=20.0,
        help="how long held streams and half-sent bodies are held",
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=2.0,
        help="wait before timing, once the hostile requests are sent",
    )
    p.add_argument("--tools-bytes", type=int, default=1_900_000, help="tool text per hostile body")
    p.add_argument("--rate-tokens", type=int, default=160, help="tokens of the streamed reply")
    p.add_argument(
        "--server-arg", action="append", default=[], help="more `radixkv serve` arguments"
    )
    p.add_argument("--verbose", action="store_true", help="the server's log on stderr")
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts: {', '.join(sorted(unknown))}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"trust_bench: {', '.join(args.parts)}; {os.cpu_count()} cores; {load()}")
    if "options" in args.parts:
        print(options_report(run_options(args)))
    if "hostile" in args.parts or "rate" in args.parts:
        with running_server(args) as base_url:
            if "hostile" in args.parts:
                print(hostile_report(run_hostile(args, base_url)))
            if "rate" in args.parts:
                print(rate_report(run_rate(args, base_url)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

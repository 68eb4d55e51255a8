"""Serving benchmark: N concurrent multi-turn chat clients over HTTP (the official openai client,
asyncio), against `radixkv serve` and, in the same run on the same model and machine,
`transformers serve --continuous-batching`.

    python -m benchmarks.serve_bench                       # default model, 16 clients x 4 turns
    python -m benchmarks.serve_bench --clients 8 --turns 3 --max-tokens 24
    python -m benchmarks.serve_bench --tiny --model DIR    # seconds: 2 clients x 2 turns, radixkv
    python -m benchmarks.serve_bench --servers radixkv,radixkv@/tmp/main --rounds 3
        # A/B: this checkout against radixkv's source in another folder (e.g. `git archive main`),
        # alternating in one run

Each client holds one conversation: a system prompt, then `--turns` user messages, each request
carrying the whole history (as OpenAI clients do), greedy, streamed with usage. Reported per
server: time to first token p50 / p99 (client side: request sent -> first content chunk), output
tokens/s (all completion tokens / wall time of the whole run), prompt cache hit rate (from
`usage.prompt_tokens_details.cached_tokens`, where the server reports it) and, for radixkv, from
its /metrics histograms: the server overhead p50 (HTTP request in -> parsed, templated, tokenized
and handed to the engine thread), the admission p50 (HTTP request in -> queued in the engine by
`add_request`, which also waits for the step in flight to end) and the receive p50 (headers in ->
body in). A request is in when the server has its headers and its body: the openai client (httpx)
writes the two separately, and under load its own event loop may take milliseconds between them.

`transformers serve` sends usage on its last chunk but no `prompt_tokens_details`: its hit rate is
n/a (it does not report cached tokens).

The peer needs the `serving` extra of transformers: `pip install "transformers[serving]"` (fastapi,
uvicorn, openai, rich); `radixkv serve` needs `pip install -e ".[serve]"`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Servers start here, not in the repository root: `python -m` puts its working directory first on
# sys.path, where this checkout's radixkv/ would shadow radixkv@DIR's.
SERVER_CWD = tempfile.gettempdir()

SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTIONS = [
    "What is the capital of France?",
    "Name a river that flows through it.",
    "Give one fun fact about that river.",
    "How long is it, roughly?",
    "Which sea does it flow into?",
    "Name a famous bridge over it.",
    "Who built that bridge?",
    "Summarise our conversation in one sentence.",
]
TOPICS = ["France", "Italy", "Japan", "Egypt", "Peru", "Canada", "India", "Kenya"]


@dataclass(frozen=True, slots=True)
class Turn:
    ttft_s: float
    num_prompt_tokens: int
    num_cached_tokens: int | None  # None: the server does not report it
    num_output_tokens: int


def user_message(client: int, turn: int) -> str:
    question = QUESTIONS[turn % len(QUESTIONS)]
    topic = TOPICS[client % len(TOPICS)]
    return question.replace("France", topic) + f" (client {client})"


# The reply schema of `radixkv+schema`: every request constrained (issue 29's overhead goal).
REPLY_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "reply",
        "schema": {
            "type": "object",
            "properties": {"answer": {"type": "string"}, "confident": {"type": "boolean"}},
            "required": ["answer", "confident"],
        },
    },
}


async def one_turn(
    client, model: str, messages: list[dict], max_tokens: int, schema: bool = False
) -> tuple[str, Turn]:
    t0 = time.perf_counter()
    extra = {"response_format": REPLY_FORMAT} if schema else {}
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    parts: list[str] = []
    ttft = None
    usage = None
    num_chunks = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
            num_chunks += 1
        usage = chunk.usage or usage
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    cached = getattr(details, "cached_tokens", None) if details else None
    turn = Turn(
        ttft_s=ttft if ttft is not None else time.perf_counter() - t0,
        num_prompt_tokens=usage.prompt_tokens if usage else 0,
        num_cached_tokens=cached,
        num_output_tokens=usage.completion_tokens if usage else num_chunks,
    )
    return "".join(parts), turn


async def conversation(
    client, model: str, index: int, turns: int, max_tokens: int, schema: bool = False
) -> list[Turn]:
    messages = [{"role": "system", "content": SYSTEM}]
    results = []
    for t in range(turns):
        messages.append({"role": "user", "content": user_message(index, t)})
        text, turn = await one_turn(client, model, messages, max_tokens, schema)
        messages.append({"role": "assistant", "content": text})
        results.append(turn)
    return results


async def run_clients(
    base_url: str, model: str, args: argparse.Namespace, schema: bool = False
) -> tuple[list, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=3600)
    try:
        t0 = time.perf_counter()
        convs = await asyncio.gather(
            *(
                conversation(client, model, i, args.turns, args.max_tokens, schema)
                for i in range(args.clients)
            )
        )
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    return [turn for conv in convs for turn in conv], wall


# Report key -> radixkv's /metrics histogram (radixkv_<name>_seconds) whose p50 it shows.
SERVER_HISTOGRAMS = {
    "overhead": "server_overhead",
    "admission": "admission",
    "receive": "request_receive",
}


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


def server_command(name: str, args: argparse.Namespace, model_path: str, port: int) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port)]
    if is_radixkv(name):
        cmd = [sys.executable, "-m", "radixkv", "serve", *common, "--log-level", "warning"]
        cmd += ["--max-num-seqs", str(args.clients), "--num-threads", str(args.threads)]
        return [*cmd, "--model", model_path]
    main = "import sys; from transformers.cli.transformers import main; sys.exit(main())"
    cmd = [sys.executable, "-c", main, "serve", "--continuous-batching", "--device", "cpu"]
    return [*cmd, *common, model_path]


def is_radixkv(name: str) -> bool:
    """ "radixkv" (this checkout) or "radixkv@DIR" (the radixkv source in DIR), either with
    "+schema" (every request constrained by `REPLY_FORMAT`)."""
    base = name.removesuffix(SCHEMA_SUFFIX)
    return base == "radixkv" or base.startswith("radixkv@")


SCHEMA_SUFFIX = "+schema"


def server_env(name: str, args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    name = name.removesuffix(SCHEMA_SUFFIX)
    if name.startswith("radixkv@"):
        # Found before this checkout's editable install. Its `radixkv.kernels` and
        # `radixkv.scheduler` must be inside DIR/radixkv (symlinks to DIR/kernels, DIR/scheduler).
        source = name.split("@", 1)[1]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    return env


def server_source(name: str, args: argparse.Namespace) -> Path:
    """The folder whose radixkv a server `name` imports, found the way the server will find it."""
    # find_spec runs none of radixkv's code (its imports take seconds)
    probe = (
        "import importlib.util, pathlib;"
        "print(pathlib.Path(importlib.util.find_spec('radixkv').origin).resolve().parent.parent)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=server_env(name, args),
        cwd=SERVER_CWD,
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def check_source(name: str, args: argparse.Namespace) -> None:
    """Fail before timing anything when radixkv@DIR would not run DIR's radixkv (an A/B of one
    tree against itself reads as a result)."""
    if not is_radixkv(name):
        return
    base = name.removesuffix(SCHEMA_SUFFIX)
    want = Path(base.split("@", 1)[1]) if "@" in base else ROOT
    got = server_source(name, args)
    if got != want.resolve():
        raise SystemExit(f"serve_bench: {name} would import radixkv from {got}, not {want}")


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


def bench_server(name: str, args: argparse.Namespace, model_path: str, say) -> dict:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    say(f"{name}: starting on {base_url}")
    proc = subprocess.Popen(
        server_command(name, args, model_path, port),
        env=server_env(name, args),
        cwd=SERVER_CWD,
        stdout=subprocess.DEVNULL,
        stderr=None if args.verbose else subprocess.DEVNULL,
    )
    try:
        wait_healthy(base_url, proc, args.start_timeout)
        model = model_path if name == "transformers" else _served_model(base_url)
        # One short request first: nobody's first request (lazy init, allocations) is timed.
        asyncio.run(_warm_up(base_url, model))
        say(f"{name}: {args.clients} clients x {args.turns} turns")
        cpu_before = process_cpu_s(proc.pid)
        schema = name.endswith(SCHEMA_SUFFIX)
        turns, wall = asyncio.run(run_clients(base_url, model, args, schema))
        cpu_after = process_cpu_s(proc.pid)
        server_p50s: dict[str, float | None] = {}
        if is_radixkv(name):
            for key, metric in SERVER_HISTOGRAMS.items():
                server_p50s[key] = histogram_p50(base_url, f"radixkv_{metric}_seconds")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return {**summarize(name, turns, wall, server_p50s), "server_cpu_s": cpu}


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) process `pid` has used; None without /proc.
    On a shared machine this moves far less with the other jobs than wall times do."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _served_model(base_url: str) -> str:
    import json

    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


async def _warm_up(base_url: str, model: str) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=600)
    try:
        await one_turn(client, model, [{"role": "user", "content": "Hi"}], 2)
    finally:
        await client.close()


def summarize(
    name: str, turns: list[Turn], wall: float, server_p50s: dict[str, float | None]
) -> dict:
    ttfts = sorted(t.ttft_s for t in turns)
    p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
    prompt = sum(t.num_prompt_tokens for t in turns)
    reported = [t.num_cached_tokens for t in turns if t.num_cached_tokens is not None]
    hit = sum(reported) / prompt if reported and prompt else None
    return {
        "server": name,
        "requests": len(turns),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": p99,
        "output_tok_s": sum(t.num_output_tokens for t in turns) / wall,
        "output_tokens": sum(t.num_output_tokens for t in turns),
        "hit_rate": hit,
        **{
            f"{key}_p50_ms": None if server_p50s.get(key) is None else server_p50s[key] * 1e3
            for key in SERVER_HISTOGRAMS
        },
        "wall_s": wall,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def report(rows: list[dict]) -> str:
    """The results table (one row per server and round) and, per round where both servers ran,
    radixkv's ratios to transformers serve next to the goals."""
    lines = [
        "| round | server | requests | TTFT p50 | TTFT p99 | output tok/s | hit rate "
        "| overhead p50 | admission p50 | receive p50 | server CPU | wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['round']} | {r['server']} | {r['requests']} | {r['ttft_p50_s'] * 1e3:.0f} ms "
            f"| {r['ttft_p99_s'] * 1e3:.0f} ms | {r['output_tok_s']:.1f} "
            f"| {_fmt(r['hit_rate'], '.1%')} | {_fmt(r['overhead_p50_ms'], '.2f')} ms "
            f"| {_fmt(r['admission_p50_ms'], '.2f')} ms "
            f"| {_fmt(r.get('receive_p50_ms'), '.2f')} ms "
            f"| {_fmt(r.get('server_cpu_s'), '.2f')} s | {r['wall_s']:.1f} s |"
        )
    by_round: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_round.setdefault(r["round"], {})[r["server"]] = r
    for number, pair in sorted(by_round.items()):
        for name, other in pair.items():
            if name.startswith("radixkv@") and "radixkv" in pair:
                ours = pair["radixkv"]
                lines.append(
                    f"round {number}, radixkv / {name}: "
                    f"TTFT p50 x{ours['ttft_p50_s'] / other['ttft_p50_s']:.2f}, "
                    f"TTFT p99 x{ours['ttft_p99_s'] / other['ttft_p99_s']:.2f}, "
                    f"output tok/s x{ours['output_tok_s'] / other['output_tok_s']:.2f}, "
                    f"overhead p50 {_fmt(ours['overhead_p50_ms'], '.2f')} vs "
                    f"{_fmt(other['overhead_p50_ms'], '.2f')} ms, server CPU "
                    f"{_fmt(ours.get('server_cpu_s'), '.1f')} vs "
                    f"{_fmt(other.get('server_cpu_s'), '.1f')} s"
                )
        if {"radixkv", "radixkv" + SCHEMA_SUFFIX} <= pair.keys():
            plain, constrained = pair["radixkv"], pair["radixkv" + SCHEMA_SUFFIX]
            lines.append(
                f"round {number}, every request schema-constrained / unconstrained: wall "
                f"x{constrained['wall_s'] / plain['wall_s']:.2f} (goal <= 1.1), output tok/s "
                f"x{constrained['output_tok_s'] / plain['output_tok_s']:.2f}"
            )
        if {"radixkv", "transformers"} <= pair.keys():
            ours, peer = pair["radixkv"], pair["transformers"]
            lines.append(
                f"round {number}, radixkv / transformers: "
                f"TTFT p50 x{ours['ttft_p50_s'] / peer['ttft_p50_s']:.2f} (goal <= 0.3), "
                f"output tok/s x{ours['output_tok_s'] / peer['output_tok_s']:.2f} (goal >= 1.5); "
                f"radixkv overhead p50 {_fmt(ours['overhead_p50_ms'], '.2f')} ms (goal <= 2)"
            )
    return "\n".join(lines)


def workload_parser(description: str, clients: int, turns: int) -> argparse.ArgumentParser:
    """The options of the client workload and the servers' threads (`page_bench` shares them)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--clients", type=int, default=clients)
    p.add_argument("--turns", type=int, default=turns)
    p.add_argument("--max-tokens", type=int, default=32, help="reply length limit per turn")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of each server")
    p.add_argument("--rounds", type=int, default=1, help="run each server this many times")
    p.add_argument("--start-timeout", type=float, default=600.0)
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = workload_parser(__doc__.split("\n\n")[0], clients=16, turns=4)
    p.add_argument(
        "--servers",
        default="radixkv,transformers",
        help="comma-separated: radixkv, transformers, radixkv@DIR (radixkv's source in DIR);"
        " a radixkv name + '+schema': every request constrained by a JSON schema",
    )
    p.add_argument("--tiny", action="store_true", help="2 clients x 2 turns x 4 tokens, radixkv")
    p.add_argument("--verbose", action="store_true", help="show the servers' logs")
    args = p.parse_args(argv)
    if args.tiny:
        args.clients, args.turns, args.max_tokens, args.servers = 2, 2, 4, "radixkv"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = {s for s in servers if not (is_radixkv(s) or s == "transformers")}
    if unknown:
        print(f"serve_bench: unknown servers {sorted(unknown)}", file=sys.stderr)
        return 2
    for name in servers:
        check_source(name, args)
    model_path = args.model and os.path.abspath(args.model)
    if model_path is None:
        from radixkv.bundled_model import ensure_converted

        model_path = str(ensure_converted())

    def say(msg: str) -> None:
        print(f"[serve_bench] {msg}", file=sys.stderr, flush=True)

    rows = []
    for number in range(1, args.rounds + 1):  # servers alternate: both see the machine's swings
        for name in servers:
            rows.append({"round": number, **bench_server(name, args, model_path, say)})
    print(f"model {model_path}; {args.clients} clients x {args.turns} turns, ", end="")
    print(f"max {args.max_tokens} tokens per reply, greedy, {args.threads} thread(s) per server")
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

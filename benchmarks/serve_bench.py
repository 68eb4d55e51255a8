"""Serving benchmark: radixkv against the servers a user would pick instead, same model, same
machine, same clients (the official openai client, asyncio), one server alive at a time.

    python -m benchmarks.serve_bench --vllm                # radixkv vs vLLM, 3 workloads x 3 rounds
    python -m benchmarks.serve_bench --vllm --servers radixkv:t2,vllm,radixkv,vllm:t2
    python -m benchmarks.serve_bench                       # chat, radixkv vs transformers serve
    python -m benchmarks.serve_bench --tiny --model DIR    # seconds: 2 clients x 2 turns, radixkv
    python -m benchmarks.serve_bench --servers radixkv,radixkv@/tmp/main --rounds 3
        # A/B: this checkout against radixkv's source in another folder (e.g. `git archive main`)

Servers and their options (threads, dtype, vLLM eager) are named as `benchmarks/serve_servers.py`
says; the workloads (`chat`, `shared-prefix`, `no-sharing`) are `benchmarks/serve_workloads.py`'s.
vLLM runs from the venv `scripts/setup_vllm.sh` makes (outside the checkout; not part of `make
test`). Rounds interleave the servers, in reverse order every other round, so that both see the
machine's swings; each server starts once a round and runs every workload.

Reported per workload, server and round: TTFT p50 / p99 (client side: request sent -> first content
chunk), output tokens/s (completion tokens / the workload's wall time), wall, CPU-seconds of the
server's whole process tree and the cores that makes while requests run, the prefix cache's hit
rate from `/metrics` (vLLM's `prefix_cache_hits / queries`, which radixkv exports too), the replies
identical to the first server's in the same round (greedy), and the load average. Then the
ratios of each radixkv server to each peer, per round and the median over rounds. For radixkv the
server overhead p50 (HTTP request in -> handed to the engine), admission p50 and receive p50 come
from its own histograms.

`transformers serve` needs `pip install "transformers[serving]"`; its hit rate is n/a.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from benchmarks.serve_servers import (
    SCHEMA_SUFFIX,
    ServerSpec,
    check_server,
    free_port,
    histogram_p50,
    is_radixkv,
    metric_totals,
    parse_server,
    process_tree_cpu_s,
    server_command,
    server_env,
    server_source,
    stop,
    wait_healthy,
)
from benchmarks.serve_servers import SERVER_CWD as SERVER_CWD
from benchmarks.serve_workloads import (
    SHORT_SYSTEM,
    Chat,
    Completions,
    Reply,
    long_system_prompt,
    no_sharing,
    shared_prefix,
    stream_chat,
)

__all__ = ["is_radixkv", "server_source"]  # re-exported: the tests and page_bench use them

WORKLOADS = ("chat", "shared-prefix", "no-sharing")
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
# Report key -> radixkv's /metrics histogram (radixkv_<name>_seconds) whose p50 it shows.
SERVER_HISTOGRAMS = {
    "overhead": "server_overhead",
    "admission": "admission",
    "receive": "request_receive",
}
HIT_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")

Workload = Chat | Completions


@dataclass(frozen=True, slots=True)
class Running:
    """A started server: where it answers, its process, the seconds it took to become healthy."""

    spec: ServerSpec
    base_url: str
    proc: subprocess.Popen
    model: str  # the name its /v1/models gives the model
    start_s: float


@contextmanager
def running_server(
    spec: ServerSpec, args: argparse.Namespace, model_path: str, say: Any, extra: Sequence[str] = ()
) -> Iterator[Running]:
    """Start `spec`, wait until it is healthy and has answered one short request (nobody's first
    request is timed), yield it, stop it."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    say(f"{spec.name}: starting on {base_url}")
    cmd = server_command(spec, model_path, port, args.max_num_seqs, args.kv_cache_gib)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, *extra],
        env=server_env(spec, args.kv_cache_gib),
        cwd=SERVER_CWD,
        stdout=subprocess.DEVNULL,
        stderr=None if args.verbose else subprocess.DEVNULL,
    )
    try:
        wait_healthy(base_url, proc, args.start_timeout)
        start_s = time.perf_counter() - t0
        model = model_path if spec.kind == "transformers" else _served_model(base_url)
        asyncio.run(_warm_up(base_url, model))
        yield Running(spec, base_url, proc, model, start_s)
    finally:
        stop(proc)


def bench_workload(server: Running, workload: Workload) -> tuple[dict, dict[str, str]]:
    """Run one workload on a started server: its row of figures and its replies by key."""
    radixkv = server.spec.kind == "radixkv"
    counters_before = _hit_counters(server) if server.spec.kind != "transformers" else None
    cpu_before = process_tree_cpu_s(server.proc.pid)
    schema = REPLY_FORMAT if server.spec.schema else None
    replies, wall = asyncio.run(_run(server, workload, schema))
    cpu_after = process_tree_cpu_s(server.proc.pid)
    hit_rate = None
    if counters_before is not None:
        after = _hit_counters(server)
        queries = after[HIT_COUNTERS[0]] - counters_before[HIT_COUNTERS[0]]
        hits = after[HIT_COUNTERS[1]] - counters_before[HIT_COUNTERS[1]]
        hit_rate = hits / queries if queries else None
    server_p50s = {}
    if radixkv:
        for key, metric in SERVER_HISTOGRAMS.items():
            server_p50s[key] = histogram_p50(server.base_url, f"radixkv_{metric}_seconds")
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    row = {
        **summarize(server.spec.name, replies, wall, server_p50s),
        "workload": workload.name,
        "server_cpu_s": cpu,
        "metrics_hit_rate": hit_rate,
        "load": os.getloadavg()[0],
        "start_s": server.start_s,
    }
    return row, {r.key: r.text for r in replies}


def _hit_counters(server: Running) -> dict[str, float]:
    return metric_totals(server.base_url, HIT_COUNTERS)


async def _run(server: Running, workload: Workload, schema: dict | None) -> tuple[list, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=3600)
    try:
        t0 = time.perf_counter()
        replies = await workload.run(client, server.model, schema)
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    return replies, wall


async def run_clients(base_url: str, model: str, args: argparse.Namespace) -> tuple[list, float]:
    """The chat workload of `args` against a server at `base_url` (page_bench's load)."""
    import openai

    chat = Chat(args.clients, args.turns, args.max_tokens, SHORT_SYSTEM)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=3600)
    try:
        t0 = time.perf_counter()
        replies = await chat.run(client, model)
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    return replies, wall


def _served_model(base_url: str) -> str:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


async def _warm_up(base_url: str, model: str) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=600)
    try:
        await stream_chat(client, model, "warm-up", [{"role": "user", "content": "Hi"}], 2, {})
    finally:
        await client.close()


def summarize(
    name: str, replies: list[Reply], wall: float, server_p50s: dict[str, float | None]
) -> dict:
    ttfts = sorted(r.ttft_s for r in replies)
    p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
    prompt = sum(r.num_prompt_tokens for r in replies)
    reported = [r.num_cached_tokens for r in replies if r.num_cached_tokens is not None]
    hit = sum(reported) / prompt if reported and prompt else None
    return {
        "server": name,
        "requests": len(replies),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": p99,
        "output_tok_s": sum(r.num_output_tokens for r in replies) / wall,
        "output_tokens": sum(r.num_output_tokens for r in replies),
        "hit_rate": hit,
        **{
            f"{key}_p50_ms": None if server_p50s.get(key) is None else server_p50s[key] * 1e3
            for key in SERVER_HISTOGRAMS
        },
        "wall_s": wall,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _cores(r: dict) -> float | None:
    cpu = r.get("server_cpu_s")
    return None if cpu is None or not r["wall_s"] else cpu / r["wall_s"]


def report(rows: list[dict]) -> str:
    """One table per workload (a row per round and server), then the ratios of radixkv servers
    to the other servers of each round, and their medians over the rounds."""
    lines: list[str] = []
    for workload in dict.fromkeys(r.get("workload", "chat") for r in rows):
        mine = [r for r in rows if r.get("workload", "chat") == workload]
        lines += [f"### {workload}", *_table(mine), *_ratios(mine), ""]
    return "\n".join(lines).rstrip()


def _table(rows: list[dict]) -> list[str]:
    lines = [
        "| round | server | requests | TTFT p50 | TTFT p99 | output tok/s | wall | server CPU "
        "| cores | hit rate (/metrics) | hit rate (usage) | identical | overhead p50 "
        "| admission p50 | receive p50 | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['round']} | {r['server']} | {r['requests']} | {r['ttft_p50_s'] * 1e3:.0f} ms "
            f"| {r['ttft_p99_s'] * 1e3:.0f} ms | {r['output_tok_s']:.1f} | {r['wall_s']:.1f} s "
            f"| {_fmt(r.get('server_cpu_s'), '.2f')} s | {_fmt(_cores(r), '.2f')} "
            f"| {_fmt(r.get('metrics_hit_rate'), '.1%')} | {_fmt(r['hit_rate'], '.1%')} "
            f"| {r.get('identical', 'n/a')} | {_fmt(r.get('overhead_p50_ms'), '.2f')} ms "
            f"| {_fmt(r.get('admission_p50_ms'), '.2f')} ms "
            f"| {_fmt(r.get('receive_p50_ms'), '.2f')} ms | {_fmt(r.get('load'), '.1f')} |"
        )
    return lines


# (label, row key): the figures each ratio line compares
_RATIOS = (
    ("TTFT p50", "ttft_p50_s"),
    ("TTFT p99", "ttft_p99_s"),
    ("output tok/s", "output_tok_s"),
    ("wall", "wall_s"),
    ("server CPU", "server_cpu_s"),
)


def _ratio_text(ours: dict, other: dict) -> str:
    parts = []
    for label, key in _RATIOS:
        a, b = ours.get(key), other.get(key)
        parts.append(f"{label} x{a / b:.2f}" if a is not None and b else f"{label} n/a")
    return ", ".join(parts)


def _ratios(rows: list[dict]) -> list[str]:
    by_round: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_round.setdefault(r["round"], {})[r["server"]] = r
    lines = []
    pairs: dict[tuple[str, str], list[tuple[dict, dict]]] = {}
    for number, servers in sorted(by_round.items()):
        for ours_name, ours in servers.items():
            if not is_radixkv(ours_name) or ours_name.endswith(SCHEMA_SUFFIX):
                continue
            for name, other in servers.items():
                if name == ours_name or (is_radixkv(name) and "@" not in name):
                    continue  # radixkv against radixkv only where the other is another tree
                pairs.setdefault((ours_name, name), []).append((ours, other))
                lines.append(f"round {number}, {ours_name} / {name}: {_ratio_text(ours, other)}")
        constrained = [n for n in servers if n.endswith(SCHEMA_SUFFIX)]
        for name in constrained:
            plain = servers.get(name.removesuffix(SCHEMA_SUFFIX))
            if plain is not None:
                c = servers[name]
                lines.append(
                    f"round {number}, every request schema-constrained / unconstrained: wall "
                    f"x{c['wall_s'] / plain['wall_s']:.2f} (goal <= 1.1), output tok/s "
                    f"x{c['output_tok_s'] / plain['output_tok_s']:.2f}"
                )
    for (ours_name, name), rounds in pairs.items():
        if len(rounds) > 1:
            medians = []
            for label, key in _RATIOS:
                values = [a[key] / b[key] for a, b in rounds if a.get(key) is not None and b[key]]
                medians.append(f"{label} x{statistics.median(values):.2f}" if values else "")
            text = ", ".join(m for m in medians if m)
            lines.append(f"median of {len(rounds)} rounds, {ours_name} / {name}: {text}")
    return lines


def mark_identical(rows: list[dict], replies: dict[tuple[int, str, str], dict[str, str]]) -> None:
    """Each row's `identical`: how many of its replies equal, text for text, those of the first
    server of the same round and workload (greedy on both: they should all)."""
    firsts: dict[tuple[int, str], str] = {}
    for r in rows:
        firsts.setdefault((r["round"], r["workload"]), r["server"])
    for r in rows:
        mine = replies[(r["round"], r["workload"], r["server"])]
        reference = replies[(r["round"], r["workload"], firsts[(r["round"], r["workload"])])]
        same = sum(reference.get(key) == text for key, text in mine.items())
        r["identical"] = f"{same}/{len(mine)}"


def build_workloads(args: argparse.Namespace, model_path: str) -> list[Workload]:
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"serve_bench: unknown workloads {sorted(unknown)}; known: {WORKLOADS}")
    tokenizer = None
    if args.system_tokens or set(names) - {"chat"}:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    workloads: list[Workload] = []
    for name in names:
        if name == "chat":
            system = SHORT_SYSTEM
            if args.system_tokens:
                system = long_system_prompt(tokenizer, args.system_tokens)
            workloads.append(Chat(args.clients, args.turns, args.max_tokens, system))
        elif name == "shared-prefix":
            workloads.append(
                shared_prefix(
                    tokenizer,
                    groups=args.gsp_groups,
                    prompts_per_group=args.gsp_prompts,
                    system_tokens=args.gsp_system_tokens,
                    question_tokens=args.gsp_question_tokens,
                    max_tokens=args.gsp_max_tokens,
                    concurrency=args.concurrency,
                    seed=args.seed,
                )
            )
        else:
            workloads.append(
                no_sharing(
                    tokenizer,
                    prompts=args.ns_prompts,
                    prompt_tokens=args.ns_prompt_tokens,
                    max_tokens=args.ns_max_tokens,
                    concurrency=args.concurrency,
                    seed=args.seed + 1,
                )
            )
    return workloads


def workload_parser(description: str, clients: int, turns: int) -> argparse.ArgumentParser:
    """The options of the chat workload and the servers' threads (`page_bench` shares them)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--clients", type=int, default=clients)
    p.add_argument("--turns", type=int, default=turns)
    p.add_argument("--max-tokens", type=int, default=32, help="reply length limit per turn")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of each server")
    p.add_argument("--rounds", type=int, default=1, help="run each server this many times")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument(
        "--kv-cache-gib", type=float, default=2.0, help="KV cache of radixkv and vLLM alike"
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the clients")
    p.add_argument("--verbose", action="store_true", help="show the servers' logs")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = workload_parser(__doc__.split("\n\n")[0], clients=16, turns=4)
    p.add_argument(
        "--servers",
        default="radixkv,transformers",
        help="comma-separated server names (benchmarks/serve_servers.py): radixkv, radixkv@DIR, "
        "vllm, transformers, with +schema and :options such as radixkv:t2, vllm:eager, :bf16",
    )
    p.add_argument("--workloads", default="chat", help=f"comma-separated, of {WORKLOADS}")
    p.add_argument(
        "--vllm",
        action="store_true",
        help="the comparison with vLLM: servers radixkv,vllm (unless --servers), all three "
        "workloads, 3 rounds, chat of 12 clients x 5 turns over a 700-token system prompt",
    )
    p.add_argument("--system-tokens", type=int, default=0, help="chat: system prompt length")
    p.add_argument("--concurrency", type=int, default=8, help="completions in flight at once")
    p.add_argument("--gsp-groups", type=int, default=4)
    p.add_argument("--gsp-prompts", type=int, default=8, help="prompts per group")
    p.add_argument("--gsp-system-tokens", type=int, default=512)
    p.add_argument("--gsp-question-tokens", type=int, default=128)
    p.add_argument("--gsp-max-tokens", type=int, default=64)
    p.add_argument("--ns-prompts", type=int, default=16)
    p.add_argument("--ns-prompt-tokens", type=int, default=500)
    p.add_argument("--ns-max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=1, help="of the random prompts")
    p.add_argument("--tiny", action="store_true", help="2 clients x 2 turns x 4 tokens, radixkv")
    args = p.parse_args(argv)
    given = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)}
    if args.vllm:  # the preset fills in what the command line did not say
        preset = {
            "clients": 12,
            "turns": 5,
            "system_tokens": 700,
            "workloads": ",".join(WORKLOADS),
            "servers": "radixkv,vllm",
            "rounds": 3,
        }
        for name, value in preset.items():
            if "--" + name.replace("_", "-") not in given:
                setattr(args, name, value)
    if args.tiny:
        args.clients, args.turns, args.max_tokens = 2, 2, 4
        args.servers = args.servers if "--servers" in given else "radixkv"
    if args.max_num_seqs is None:
        args.max_num_seqs = max(args.clients, args.concurrency)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        specs = [parse_server(s.strip(), args.threads) for s in args.servers.split(",") if s]
    except ValueError as exc:
        print(f"serve_bench: {exc}", file=sys.stderr)
        return 2
    for spec in specs:
        check_server(spec)
    model_path = args.model and os.path.abspath(args.model)
    if model_path is None:
        from radixkv.bundled_model import ensure_converted

        model_path = str(ensure_converted())
    workloads = build_workloads(args, model_path)

    def say(msg: str) -> None:
        print(f"[serve_bench] {msg}", file=sys.stderr, flush=True)

    rows: list[dict] = []
    replies: dict[tuple[int, str, str], dict[str, str]] = {}
    for number in range(1, args.rounds + 1):
        order = specs if number % 2 else specs[::-1]  # both sides see the machine's swings
        for spec in order:
            with running_server(spec, args, model_path, say) as server:
                say(f"{spec.name}: started in {server.start_s:.1f} s")
                for workload in workloads:
                    say(f"{spec.name}: {workload.name}: {workload.describe()}")
                    row, texts = bench_workload(server, workload)
                    rows.append({"round": number, **row})
                    replies[(number, workload.name, spec.name)] = texts
    rows.sort(key=lambda r: (r["round"], [s.name for s in specs].index(r["server"])))
    mark_identical(rows, replies)
    print(f"model {model_path}; greedy; {os.cpu_count()} CPUs; KV cache {args.kv_cache_gib} GiB")
    for workload in workloads:
        print(f"- {workload.name}: {workload.describe()}")
    starts = {}
    for r in rows:
        starts.setdefault(r["server"], {})[r["round"]] = r["start_s"]
    for name, by_round in starts.items():
        print(f"- {name} started in " + ", ".join(f"{s:.0f} s" for s in by_round.values()))
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

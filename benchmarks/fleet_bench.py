"""N radixkv replicas behind the routers people run, on multi-turn chat; what a router costs.

    python -m benchmarks.fleet_bench                        # closed loop, every policy
    python -m benchmarks.fleet_bench --traffic users        # users: think time, shuffled arrivals
    python -m benchmarks.fleet_bench --mode router-cost     # TTFT through each router vs direct
    python -m benchmarks.fleet_bench --mode scale-out       # output tok/s of N replicas vs one
    python -m benchmarks.fleet_bench --tiny --model DIR     # the tiny test model (smoke test)

It needs the routers of `scripts/setup_routers.sh` (sglang-router, vllm-router) in the folder
$RADIXKV_ROUTERS_DIR names (default: radixkv/routers in the user's cache folder). Every run
starts fresh `radixkv serve` replicas (cold caches) and the router on 127.0.0.1 only, on free
ports, and stops them after; nothing else is served. How long: on a CPU with the embedded model,
about 1-2 minutes per run (start-up included; the banner says how many runs), so the default
(7 policies x 2 prompt kinds x 3 repeats) takes about an hour. Its figures mean something only on
a machine nothing else loads (the `load` column says how busy it was).

Chat modes (`--mode chat`): each conversation sends its whole history every turn (openai
client), once with a shared system prompt and once with no system message.
- `--traffic closed`: every conversation at once, each next turn right after its reply, replies
  of exactly `--max-tokens` (greedy, `ignore_eos`): the load signal in its cleanest form.
- `--traffic users`: traffic that looks like users: conversations arrive in a shuffled order
  over the first think time, think 0-`--think-s` s between turns, at most `--in-flight`
  requests at once, replies of natural length (max_tokens drawn per request, the model may
  stop earlier); more conversations than replicas. Seeded (`--seed`).
Per policy, as min / median / max over `--repeats` runs: the fraction of prompt tokens served
from cache and its ratio to one replica's (the ceiling: one cache sees every conversation), the
largest share of requests on one replica (from the replicas' own /metrics), the share of later
turns served by their conversation's home replica (the one that served its first turn: each
reply's `system_fingerprint` names its replica), output tokens/s. Session headers
(`x-session-id`) go with the recipes that route on them.

`--mode router-cost`: the TTFT a router adds, p50 / p99 of streamed one-token requests sent
alternately to a replica directly and through the router (`--requests` each; half the pairs
routed first), with the machine's load as they ended, and the render
calls each routed request cost the replicas (vllm-router renders every request on every worker).

`--mode scale-out`: output tokens/s of `--replicas` replicas behind the router against one,
closed loop. It needs a free core per replica plus one for the router and one for the client;
without them it says so and prints no ratio.

Policies: `one-replica` (the baseline, no router) and the routers of `examples/fleet/fleet.py`.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "fleet"))

import fleet  # noqa: E402  (examples/fleet/fleet.py: the recipes' launcher)

SYSTEM = (
    "You are a travel assistant for a small agency. Answer in one or two short sentences, "
    "name concrete places, and never invent prices, opening hours or phone numbers. If a "
    "question is unclear, answer the most likely reading instead of asking back."
)
TOPICS = ["Lisbon", "Kyoto", "Cusco", "Nairobi", "Oslo", "Hanoi", "Quebec", "Tbilisi"]
QUESTIONS = [
    "I am planning three days in {t}. Which neighbourhood should I stay in?",
    "What is one museum there worth the time?",
    "Where can I eat something local near it?",
    "Suggest a short walk for the last evening.",
]
TINY_WORDS = [f"w{i}" for i in range(10, 250)]
POLICIES = ("one-replica", *fleet.ROUTER_KINDS)
REQUEST_TIMEOUT_S = 300.0  # one request; a run's requests are bounded in number
REFUSED_EXIT = 3  # scale-out on a machine without the cores


@dataclass(frozen=True, slots=True)
class Users:
    """Traffic that looks like users (`--traffic users`)."""

    think_s: float = 4.0  # think time between turns drawn from [0, think_s); first arrivals too
    in_flight: int = 4  # requests at once, at most
    seed: int = 0

    def __post_init__(self) -> None:
        if self.think_s < 0:
            raise ValueError(f"--think-s must be >= 0, got {self.think_s}")
        if self.in_flight < 1:
            raise ValueError(f"--in-flight must be >= 1, got {self.in_flight}")


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: int = 8
    turns: int = 4
    max_tokens: int = 24  # each reply's length (closed loop), its upper bound (users)
    system: bool = True  # a shared system prompt, or no system message
    tiny: bool = False  # word prompts of the tiny test tokenizer
    users: Users | None = None  # None: the closed loop

    def system_message(self) -> list[dict[str, str]]:
        if not self.system:
            return []
        text = " ".join(TINY_WORDS[:24]) if self.tiny else SYSTEM
        return [{"role": "system", "content": text}]

    def user_message(self, conversation: int, turn: int) -> str:
        if self.tiny:
            return " ".join(TINY_WORDS[(conversation * 37 + turn * 11 + i) % 240] for i in range(8))
        return QUESTIONS[turn % len(QUESTIONS)].format(t=TOPICS[conversation % len(TOPICS)])


@dataclass(frozen=True, slots=True)
class Reply:
    """One request as its client saw it."""

    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    fingerprint: str | None  # system_fingerprint: which replica served it


@dataclass
class Result:
    policy: str
    system: bool
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    seconds: float
    per_replica: list[int]  # finished requests per replica, from its /metrics
    replica_prompt_tokens: int  # summed over the replicas' /metrics
    replica_cached_tokens: int
    load_1min: float = 0.0  # the machine's 1-minute load average as the workload ended
    later_turns: int = 0  # turns after the first
    later_turns_home: int = 0  # ... served by the replica that served the conversation's first
    replica_refusals: int = 0  # bad_request on the replicas' /metrics (no client sent one)

    @property
    def cached_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def max_share(self) -> float:
        return max(self.per_replica) / max(1, sum(self.per_replica))

    @property
    def home_share(self) -> float:
        return self.later_turns_home / self.later_turns if self.later_turns else 1.0


def chat_client(base_url: str, session: str | None) -> object:
    import openai

    headers = {fleet.SESSION_HEADER: session} if session else None
    return openai.OpenAI(
        base_url=f"{base_url}/v1",
        api_key="none",
        max_retries=0,
        timeout=REQUEST_TIMEOUT_S,
        default_headers=headers,
    )


def run_conversations(
    base_url: str, model: str, workload: Workload, session_headers: bool = True
) -> tuple[list[Reply], float]:
    """Every conversation in its own thread, as `workload` says; returns every request's reply
    and the wall time. With `session_headers`, a conversation's requests carry x-session-id."""
    users = workload.users
    gate = threading.BoundedSemaphore(users.in_flight if users else workload.conversations)
    replies: list[Reply] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def conversation(index: int, start_after_s: float, rng: random.Random) -> None:
        client = chat_client(base_url, f"conversation-{index}" if session_headers else None)
        messages = workload.system_message()
        try:
            time.sleep(start_after_s)
            for turn in range(workload.turns):
                if turn and users:
                    time.sleep(rng.uniform(0, users.think_s))
                messages.append({"role": "user", "content": workload.user_message(index, turn)})
                with gate:
                    reply = client.chat.completions.create(  # type: ignore[attr-defined]
                        model=model, messages=messages, **reply_settings(workload, rng)
                    )
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                with lock:
                    replies.append(reply_of(index, turn, reply))
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=conversation, args=plan)
        for plan in arrivals(workload.conversations, users)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return replies, seconds


def arrivals(conversations: int, users: Users | None) -> list[tuple[int, float, random.Random]]:
    """(conversation, when it starts, its own random draws), in the order they start. Closed
    loop: all at once. Users: shuffled, spread over the first think time."""
    if users is None:
        return [(i, 0.0, random.Random(i)) for i in range(conversations)]
    rng = random.Random(users.seed)
    order = rng.sample(range(conversations), conversations)
    starts = sorted(rng.uniform(0, users.think_s) for _ in order)
    plans = zip(order, starts, strict=True)
    return [(c, s, random.Random(users.seed * 1_000_003 + c)) for c, s in plans]


def reply_settings(workload: Workload, rng: random.Random) -> dict[str, object]:
    """Closed loop: greedy, exactly max_tokens. Users: a length drawn per request, and the model
    may stop before it."""
    if workload.users is None:
        return {
            "max_tokens": workload.max_tokens,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
    low = max(1, workload.max_tokens // 4)
    return {"max_tokens": rng.randint(low, workload.max_tokens), "temperature": 0}


def reply_of(conversation: int, turn: int, reply: object) -> Reply:
    usage = reply.usage  # type: ignore[attr-defined]
    return Reply(
        conversation,
        turn,
        usage.prompt_tokens,
        usage.prompt_tokens_details.cached_tokens,
        usage.completion_tokens,
        reply.system_fingerprint,  # type: ignore[attr-defined]
    )


def later_turns_home(replies: Sequence[Reply]) -> tuple[int, int]:
    """(turns after the first, those served by the replica that served the first)."""
    home = {r.conversation: r.fingerprint for r in replies if r.turn == 0}
    later = [r for r in replies if r.turn > 0]
    return len(later), sum(r.fingerprint == home.get(r.conversation) for r in later)


def replica_counters(url: str) -> dict[str, float]:
    """A replica's own counters: finished requests, refusals, prompt, cached tokens, renders."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts = dict.fromkeys(("finished", "refused", "prompt", "cached", "renders"), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "radixkv_requests_total" and s.labels["outcome"] in ("stop", "length"):
                counts["finished"] += s.value
            elif s.name == "radixkv_requests_total" and s.labels["outcome"] == "bad_request":
                counts["refused"] += s.value
            elif s.name == "radixkv_prompt_tokens_total":
                counts["prompt"] += s.value
            elif s.name == "radixkv_cached_tokens_total":
                counts["cached"] += s.value
            elif s.name == "radixkv_render_requests_total":
                counts["renders"] += s.value
    return counts


def fleet_of(policy: str, replicas: int) -> tuple[str, int]:
    """(fleet.start_fleet's kind, number of replicas) of `policy`."""
    return ("none", 1) if policy == "one-replica" else (policy, replicas)


def run_policy(
    policy: str,
    workload: Workload,
    replicas: int,
    serve_args: Sequence[str],
    model: str,
    log_dir: Path | None = None,
    running: Sequence[fleet.Replica] | None = None,
) -> Result:
    """Run `workload` through `policy` on fresh replicas (their and the router's logs in
    `log_dir`: a temporary folder if None), or on `running` ones (`fleet.start_replicas`, their
    caches emptied by the caller): the replicas' counters are what this run added."""
    kind, n = fleet_of(policy, replicas)
    start = fleet.start_fleet(kind, n, serve_args, model=model, log_dir=log_dir, replicas=running)
    with start as f:
        before = [replica_counters(r.url) for r in f.replicas]
        url = f.url or f.replicas[0].url
        sessions = policy in fleet.USES_SESSION_HEADER
        replies, seconds = run_conversations(url, model, workload, sessions)
        counts = [
            {k: v - b[k] for k, v in replica_counters(r.url).items()}
            for r, b in zip(f.replicas, before, strict=True)
        ]
    later, home = later_turns_home(replies)
    return Result(
        policy=policy,
        system=workload.system,
        num_requests=len(replies),
        prompt_tokens=sum(r.prompt_tokens for r in replies),
        cached_tokens=sum(r.cached_tokens for r in replies),
        output_tokens=sum(r.output_tokens for r in replies),
        seconds=seconds,
        per_replica=[int(c["finished"]) for c in counts],
        replica_prompt_tokens=int(sum(c["prompt"] for c in counts)),
        replica_cached_tokens=int(sum(c["cached"] for c in counts)),
        load_1min=os.getloadavg()[0],
        later_turns=later,
        later_turns_home=home,
        replica_refusals=int(sum(c["refused"] for c in counts)),
    )


# ----------------------------------------------------------------------------- the report


def spread(values: Sequence[float], fmt: str) -> str:
    """min / median / max of `values` (one value alone when they are equal)."""
    low, mid, high = min(values), statistics.median(values), max(values)
    if low == high:
        return format(low, fmt)
    return f"{low:{fmt}} / {mid:{fmt}} / {high:{fmt}}"


def grouped(results: Sequence[Result]) -> dict[tuple[bool, str], list[Result]]:
    """Runs by (prompt kind, policy), in the order they first ran."""
    groups: dict[tuple[bool, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.system, r.policy), []).append(r)
    return groups


def report(results: Sequence[Result]) -> str:
    """One row per policy and prompt kind; each figure as min / median / max over its runs.
    "vs one replica" divides a policy's median cached fraction by one replica's median."""
    lines = [
        "| routing | system prompt | runs | cached fraction | vs one replica "
        "| max share of requests | later turns home | output tok/s | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups = grouped(results)
    for (system, policy), runs in groups.items():
        one = groups.get((system, "one-replica"))
        fractions = [r.cached_fraction for r in runs]
        ratio = "-"
        if one and statistics.median(r.cached_fraction for r in one):
            base = statistics.median(r.cached_fraction for r in one)
            ratio = f"{statistics.median(fractions) / base:.2f}x"
        lines.append(
            f"| {policy} | {'shared' if system else 'none'} | {len(runs)} "
            f"| {spread(fractions, '.3f')} | {ratio} "
            f"| {spread([r.max_share for r in runs], '.0%')} "
            f"| {spread([r.home_share for r in runs], '.0%')} "
            f"| {spread([r.output_tok_s for r in runs], '.1f')} "
            f"| {spread([r.load_1min for r in runs], '.1f')} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- router cost


@dataclass
class RouterCost:
    policy: str
    direct_ttft_s: list[float] = field(default_factory=list)
    routed_ttft_s: list[float] = field(default_factory=list)
    renders: int = 0  # render calls on all replicas while the routed requests ran
    routed_requests: int = 0
    load_1min: float = 0.0  # the machine's 1-minute load average as the pairs ended

    @property
    def renders_per_request(self) -> float:
        return self.renders / self.routed_requests if self.routed_requests else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-th percentile (q in (0, 100])."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) * q / 100) - 1)]


def stream_ttft_s(client: object, model: str, content: str) -> float:
    """Seconds from sending a streamed one-token chat request to its first content."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(  # type: ignore[attr-defined]
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=1,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    ttft = None
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("a streamed request brought no content")
    return ttft


def measure_router_cost(
    policy: str,
    requests: int,
    serve_args: Sequence[str],
    model: str,
    *,
    tiny: bool = False,
    replicas: int = 2,
    log_dir: Path | None = None,
    running: Sequence[fleet.Replica] | None = None,
) -> RouterCost:
    """`requests` pairs, each a direct call to a replica (in turn) and one through the router,
    alternating so that a drifting machine load hits both alike, and in turn first within a pair
    (ABBA). Prompts never repeat. `running`: replicas to route to, as `run_policy` takes them."""
    cost = RouterCost(policy)
    start = fleet.start_fleet(
        policy, replicas, serve_args, model=model, log_dir=log_dir, replicas=running
    )
    with start as f:
        assert f.url is not None, f"{policy} has no router"
        session = "router-cost" if policy in fleet.USES_SESSION_HEADER else None
        routed = chat_client(f.url, session)
        direct = [chat_client(r.url, None) for r in f.replicas]
        prompt = unique_prompts(tiny)
        for i in range(2):  # warm-up: first calls pay for connections and lazy set-up
            stream_ttft_s(routed, model, prompt())
            stream_ttft_s(direct[i % replicas], model, prompt())
        before = sum(replica_counters(r.url)["renders"] for r in f.replicas)
        for i in range(requests):
            # NOTE: with the direct call always first, every router "added" -1 to -14 ms: the
            # order, not the router. Half the pairs go routed first, each replica taking both
            # orders of direct call in turn.
            pair = [(cost.direct_ttft_s, direct[i // 2 % replicas]), (cost.routed_ttft_s, routed)]
            for times, client in pair if i % 2 == 0 else pair[::-1]:
                times.append(stream_ttft_s(client, model, prompt()))
        cost.renders = int(sum(replica_counters(r.url)["renders"] for r in f.replicas) - before)
        cost.routed_requests = requests
        cost.load_1min = os.getloadavg()[0]
    return cost


def unique_prompts(tiny: bool) -> Callable[[], str]:
    """A maker of prompts that share no prefix past the chat template."""
    counter = iter(range(10**9))

    def make() -> str:
        n = next(counter)
        if tiny:
            return " ".join(TINY_WORDS[(n * 13 + i * 7) % 240] for i in range(12))
        return f"Request {n}: " + QUESTIONS[n % len(QUESTIONS)].format(t=TOPICS[n % len(TOPICS)])

    return make


def router_cost_report(costs: Sequence[RouterCost]) -> str:
    lines = [
        "| router | direct TTFT p50 / p99 (ms) | routed TTFT p50 / p99 (ms) "
        "| added p50 / p99 (ms) | render calls per routed request (all replicas) | load (1 min) |",
        "|---|---|---|---|---|---|",
    ]
    for c in costs:
        d50, d99 = percentile(c.direct_ttft_s, 50) * 1e3, percentile(c.direct_ttft_s, 99) * 1e3
        r50, r99 = percentile(c.routed_ttft_s, 50) * 1e3, percentile(c.routed_ttft_s, 99) * 1e3
        lines.append(
            f"| {c.policy} | {d50:.1f} / {d99:.1f} | {r50:.1f} / {r99:.1f} "
            f"| {r50 - d50:+.1f} / {r99 - d99:+.1f} | {c.renders_per_request:.2f} "
            f"| {c.load_1min:.1f} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- scale-out


def scale_out_refusal(cores: int, load_1min: float, replicas: int) -> str | None:
    """Why this machine cannot measure scale-out (None when it can): each replica needs a core
    of its own, plus one for the router and one for the client, free of other work."""
    needed = replicas + 2
    free = max(0.0, cores - load_1min)  # a load above the cores leaves none free, not fewer
    if free >= needed:
        return None
    return (
        f"scale-out needs {needed} free cores ({replicas} replicas, the router, the client); "
        f"this machine has {cores} with a load of {load_1min:.1f} ({free:.1f} free): "
        "no ratio printed, as it would measure the machine, not the fleet"
    )


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def scale_out_report(alone: Sequence[Result], fleet_runs: Sequence[Result]) -> str:
    one = statistics.median(r.output_tok_s for r in alone)
    ratios = [r.output_tok_s / one for r in fleet_runs] if one else [0.0]
    return "\n".join(
        [
            f"one replica   output tok/s {spread([r.output_tok_s for r in alone], '.1f')}",
            f"{fleet_runs[0].policy:13s} output tok/s "
            f"{spread([r.output_tok_s for r in fleet_runs], '.1f')}",
            f"ratio to one replica's median: {spread(ratios, '.2f')}",
        ]
    )


# ----------------------------------------------------------------------------- the command


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mode", choices=["chat", "router-cost", "scale-out"], default="chat")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--traffic", choices=["closed", "users"], default="closed")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--think-s", type=float, default=4.0, help="users: think time bound")
    parser.add_argument("--in-flight", type=int, default=4, help="users: requests at once")
    parser.add_argument("--seed", type=int, default=0, help="users: arrivals, think, lengths")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each figure")
    parser.add_argument("--requests", type=int, default=50, help="router-cost: pairs per router")
    parser.add_argument("--system", choices=["both", "shared", "none"], default="both")
    parser.add_argument("--model", default=None, help="model for every replica (default: theirs)")
    parser.add_argument("--tiny", action="store_true", help="word prompts for the tiny test model")
    parser.add_argument("--log-dir", type=Path, help="processes' logs (default: a temp folder)")
    args = parser.parse_args(argv)
    for name in ("replicas", "conversations", "turns", "max_tokens", "repeats", "requests"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.traffic == "users" and args.conversations <= args.replicas:
        parser.error("--conversations must exceed --replicas for --traffic users")
    try:
        args.users = Users(args.think_s, args.in_flight, args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def run_chat(args: argparse.Namespace, serve_args: Sequence[str]) -> int:
    systems = {"both": [True, False], "shared": [True], "none": [False]}[args.system]
    users = args.users if args.traffic == "users" else None
    runs = args.repeats * len(systems) * len(args.policies)
    print(
        f"fleet_bench: {args.replicas} replicas, {args.traffic} traffic, {args.conversations} "
        f"conversations x {args.turns} turns, up to {args.max_tokens} tokens per reply; "
        f"{runs} runs",
        flush=True,
    )
    results = []
    for repeat in range(args.repeats):  # interleaved: a drifting load hits every policy alike
        for system in systems:
            workload = Workload(
                args.conversations, args.turns, args.max_tokens, system, args.tiny, users
            )
            for policy in args.policies:
                logs = run_logs(args, f"{repeat + 1}-{policy}-{'shared' if system else 'none'}")
                result = run_policy(policy, workload, args.replicas, serve_args, "bench", logs)
                print(
                    f"  run {repeat + 1} {policy:22s} system={'shared' if system else 'none':6s} "
                    f"cached {result.cached_fraction:.3f}  per replica {result.per_replica}  "
                    f"home {result.later_turns_home}/{result.later_turns}  "
                    f"{result.output_tok_s:.1f} tok/s  load {result.load_1min:.1f}",
                    flush=True,
                )
                results.append(result)
    print(report(results))
    return 0


def run_router_cost(args: argparse.Namespace, serve_args: Sequence[str]) -> int:
    routers = [p for p in args.policies if p != "one-replica"]
    print(f"fleet_bench router-cost: {args.requests} direct / routed pairs per router", flush=True)
    costs = []
    for policy in routers:
        cost = measure_router_cost(
            policy,
            args.requests,
            serve_args,
            "bench",
            tiny=args.tiny,
            replicas=args.replicas,
            log_dir=run_logs(args, policy),
        )
        print(router_cost_report([cost]).splitlines()[-1], flush=True)
        costs.append(cost)
    print(router_cost_report(costs))
    return 0


def run_scale_out(args: argparse.Namespace, serve_args: Sequence[str]) -> int:
    why_not = scale_out_refusal(usable_cores(), os.getloadavg()[0], args.replicas)
    if why_not is not None:
        print(f"fleet_bench: {why_not}", flush=True)
        return REFUSED_EXIT
    router = next((p for p in args.policies if p != "one-replica"), "round-robin")
    workload = Workload(args.conversations, args.turns, args.max_tokens, True, args.tiny)
    alone, together = [], []
    for repeat in range(args.repeats):
        logs = run_logs(args, f"{repeat + 1}-one-replica")
        alone.append(run_policy("one-replica", workload, 1, serve_args, "bench", logs))
        logs = run_logs(args, f"{repeat + 1}-{router}")
        together.append(run_policy(router, workload, args.replicas, serve_args, "bench", logs))
    print(scale_out_report(alone, together))
    return 0


def run_logs(args: argparse.Namespace, run: str) -> Path:
    """A run's own folder for its processes' logs, under --log-dir (made, and said, once)."""
    if args.log_dir is None:
        args.log_dir = Path(tempfile.mkdtemp(prefix="radixkv-fleet-bench-"))
        print(f"fleet_bench: the replicas' and routers' logs go to {args.log_dir}", flush=True)
    folder = args.log_dir / run
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    serve_args = [] if args.model is None else ["--model", args.model]
    run = {"chat": run_chat, "router-cost": run_router_cost, "scale-out": run_scale_out}
    return run[args.mode](args, serve_args)


if __name__ == "__main__":
    sys.exit(main())

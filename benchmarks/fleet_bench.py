"""N radixkv replicas behind each router and policy, on a multi-turn chat workload.

    python -m benchmarks.fleet_bench                     # 2 replicas, every policy, both prompts
    python -m benchmarks.fleet_bench --policies round-robin sglang-cache-aware --replicas 3
    python -m benchmarks.fleet_bench --tiny --model DIR  # the tiny test model (smoke test)

The workload: 8 conversations x 4 turns, all conversations at once, each request carrying the
whole history (openai client, greedy, fixed reply length), once with a shared system prompt and
once with no system message. Every policy runs on fresh replicas (cold caches). Reported per
policy: the fraction of prompt tokens served from cache and its ratio to one replica's (the
ceiling: one cache sees every conversation), each replica's share of requests (from the
replicas' own /metrics), and output tokens/s and its ratio to one replica's.

Policies: `one-replica` (the baseline, no router) and the routers of `examples/fleet/fleet.py`;
`dynamo-indexer` is left out (an indexer, not a router).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: int = 8
    turns: int = 4
    max_tokens: int = 24
    system: bool = True  # a shared system prompt, or no system message
    tiny: bool = False  # word prompts of the tiny test tokenizer

    def system_message(self) -> list[dict[str, str]]:
        if not self.system:
            return []
        text = " ".join(TINY_WORDS[:24]) if self.tiny else SYSTEM
        return [{"role": "system", "content": text}]

    def user_message(self, conversation: int, turn: int) -> str:
        if self.tiny:
            return " ".join(TINY_WORDS[(conversation * 37 + turn * 11 + i) % 240] for i in range(8))
        return QUESTIONS[turn % len(QUESTIONS)].format(t=TOPICS[conversation % len(TOPICS)])


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

    @property
    def cached_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def run_conversations(base_url: str, model: str, workload: Workload) -> tuple[list, float]:
    """Every conversation in its own thread; returns the usage of every request and the wall
    time. A conversation's requests carry the header x-session-id (what session-hash keys on)."""
    import openai

    usages: list = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def conversation(index: int) -> None:
        client = openai.OpenAI(
            base_url=f"{base_url}/v1",
            api_key="none",
            max_retries=0,
            timeout=600,
            default_headers={"x-session-id": f"conversation-{index}"},
        )
        messages = workload.system_message()
        try:
            for turn in range(workload.turns):
                messages.append({"role": "user", "content": workload.user_message(index, turn)})
                reply = client.chat.completions.create(
                    model=model,
                    messages=messages,
                    max_tokens=workload.max_tokens,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                with lock:
                    usages.append(reply.usage)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=conversation, args=(i,)) for i in range(workload.conversations)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return usages, seconds


def replica_counts(url: str) -> tuple[int, int, int]:
    """(finished requests, prompt tokens, cached tokens) from a replica's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    finished = prompt = cached = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "radixkv_requests_total" and s.labels["outcome"] in ("stop", "length"):
                finished += s.value
            elif s.name == "radixkv_prompt_tokens_total":
                prompt += s.value
            elif s.name == "radixkv_cached_tokens_total":
                cached += s.value
    return int(finished), int(prompt), int(cached)


def run_policy(
    policy: str,
    workload: Workload,
    replicas: int,
    serve_args: Sequence[str],
    model: str,
    log_dir: Path | None = None,
) -> Result:
    """Run `workload` through `policy` on fresh replicas (their and the router's logs in
    `log_dir`: a temporary folder if None)."""
    kind = "none" if policy == "one-replica" else policy
    n = 1 if policy == "one-replica" else replicas
    with fleet.start_fleet(kind, n, serve_args, model=model, log_dir=log_dir) as f:
        url = f.url or f.replicas[0].url
        usages, seconds = run_conversations(url, model, workload)
        counts = [replica_counts(r.url) for r in f.replicas]
    return Result(
        policy=policy,
        system=workload.system,
        num_requests=len(usages),
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        cached_tokens=sum(u.prompt_tokens_details.cached_tokens for u in usages),
        output_tokens=sum(u.completion_tokens for u in usages),
        seconds=seconds,
        per_replica=[c[0] for c in counts],
        replica_prompt_tokens=sum(c[1] for c in counts),
        replica_cached_tokens=sum(c[2] for c in counts),
        load_1min=os.getloadavg()[0],
    )


def nearest_baseline(results: Sequence[Result], i: int) -> Result | None:
    """The one-replica run of the same prompt kind nearest in time to run `i` (the earlier of
    two equally near): on a shared machine the load drifts, so a policy listed between
    one-replica runs (`--policies one-replica A one-replica B ...`) is compared with its
    neighbour."""
    same = [j for j, r in enumerate(results) if r.policy == "one-replica"]
    same = [j for j in same if results[j].system == results[i].system]
    return results[min(same, key=lambda j: (abs(j - i), j))] if same else None


def report(results: Sequence[Result]) -> str:
    lines = [
        "| routing | system prompt | cached fraction | vs one replica | requests per replica "
        "| max share | output tok/s | vs one replica | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(results):
        one = nearest_baseline(results, i)
        frac = (
            f"{r.cached_fraction / one.cached_fraction:.2f}x"
            if one and one.cached_fraction
            else "-"
        )
        speed = f"{r.output_tok_s / one.output_tok_s:.2f}x" if one and one.output_tok_s else "-"
        share = max(r.per_replica) / max(1, sum(r.per_replica))
        lines.append(
            f"| {r.policy} | {'shared' if r.system else 'none'} | {r.cached_fraction:.3f} | "
            f"{frac} | {' / '.join(map(str, r.per_replica))} | {share:.0%} | "
            f"{r.output_tok_s:.1f} | {speed} | {r.load_1min:.1f} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--system", choices=["both", "shared", "none"], default="both")
    parser.add_argument("--model", default=None, help="model for every replica (default: theirs)")
    parser.add_argument("--tiny", action="store_true", help="word prompts for the tiny test model")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    serve_args = [] if args.model is None else ["--model", args.model]
    systems = {"both": [True, False], "shared": [True], "none": [False]}[args.system]
    print(
        f"fleet_bench: {args.replicas} replicas, {args.conversations} conversations x "
        f"{args.turns} turns, {args.max_tokens} tokens per reply",
        flush=True,
    )
    results = []
    for system in systems:
        workload = Workload(args.conversations, args.turns, args.max_tokens, system, args.tiny)
        for policy in args.policies:
            result = run_policy(policy, workload, args.replicas, serve_args, "bench")
            print(
                f"  {policy:20s} system={'shared' if system else 'none':6s} "
                f"cached {result.cached_fraction:.3f}  per replica {result.per_replica}  "
                f"{result.output_tok_s:.1f} tok/s  load {result.load_1min:.1f}",
                flush=True,
            )
            results.append(result)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

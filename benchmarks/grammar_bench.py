"""Structured output's goals (issue 29), each side of a comparison interleaved in one run.

Run from the repository root (alone on the machine: a loaded machine's figure is noise):
    python -m benchmarks.grammar_bench                    # the embedded SmolLM2, CPU, all parts
    python -m benchmarks.grammar_bench --parts jump --rounds 3
    python -m benchmarks.grammar_bench --model PATH --rounds 7 --batch 8

Three parts (`--parts`), each a series of rounds running its cases back to back (A, B, A, B ...),
so that both meet the same machine load; greedy throughout:

* overhead: per-token decode time with a JSON schema (jump-forward off: the mask alone) against
  the same decode unconstrained, `--batch` requests of up to `--tokens` tokens; the unconstrained
  replies ignore EOS and are as long as the schema's, so both decode the same number of tokens
  at the same contexts. The time per decoded token is the round's decode time (first token to
  last) over its tokens; the report gives each case's median and their ratio (goal: <= 1.05).
* jump: a schema of 10 keys of 15-30 characters, jump-forward on against off, `--batch`
  different prompts at once: forward steps per request (steps that computed a row of it and
  sampled its token, the prefill's included: a count noise does not move; goal <= 0.6x), wall
  time per round (goal <= 0.8x), outputs valid against the schema, and how many greedy texts
  differ between the two.
* choices: n = 8 against n = 1 on a prompt of about 700 tokens, a fresh one each round (so
  nothing is cached before): prompt tokens computed (the cache's `num_computed_tokens`; goal:
  one prompt's, plus each other choice's last prompt token, which is always computed), time to
  the first token of the last choice (goal <= 1.3x n = 1), and the most KV blocks in use at
  once against one prompt's blocks plus n tails (a tail: the prompt's partial last block, which
  each choice copies, and its reply).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "notes": {"type": "string"},
    },
    "required": ["name", "tags", "notes"],
    "additionalProperties": False,
}
PROMPT = "Describe a city as JSON with its name, a list of tags and long notes."

LONG_KEYS = {  # 10 keys of 15-30 characters, short values: most of the reply is forced
    "customer_full_name": {"type": "string", "maxLength": 16},
    "shipping_street_address": {"type": "string", "maxLength": 16},
    "billing_postal_code_number": {"type": "integer"},
    "preferred_delivery_weekday": {"type": "string", "enum": ["monday", "friday"]},
    "is_priority_order": {"type": "boolean"},
    "number_of_items_ordered": {"type": "integer"},
    "gift_wrapping_requested": {"type": "boolean"},
    "customer_loyalty_tier_level": {"type": "string", "enum": ["gold", "silver"]},
    "estimated_delivery_days_count": {"type": "integer"},
    "special_handling_instructions": {"type": "string", "maxLength": 16},
}
LONG_KEYS_SCHEMA = {
    "type": "object",
    "properties": LONG_KEYS,
    "required": list(LONG_KEYS),
    "additionalProperties": False,
}
ORDER_PROMPTS = [
    "Write the order of Ada Lovelace, who wants three books sent to London, as JSON.",
    "Write the order of Alan Turing, who wants a chess set sent to Manchester, as JSON.",
    "Write the order of Grace Hopper, who wants a compass sent to New York, as JSON.",
    "Write the order of Edsger Dijkstra, who wants ten pencils sent to Austin, as JSON.",
    "Write the order of Barbara Liskov, who wants a lamp sent to Boston, as JSON.",
    "Write the order of Donald Knuth, who wants an organ sent to Stanford, as JSON.",
    "Write the order of Frances Allen, who wants two chairs sent to Albany, as JSON.",
    "Write the order of John Backus, who wants a kite sent to Ashland, as JSON.",
]


def decode_seconds_per_token(llm: Any, prompt: Any, params: Sequence[Any]) -> float:
    """One case's decode time per generated token (the prefill, to the first token, excluded)."""
    outs = llm.generate([prompt] * len(params), list(params))
    decode = max(o.stats.total_s - o.stats.ttft_s for o in outs)
    return decode / max(1, sum(len(o.token_ids) - 1 for o in outs))


def overhead(llm: Any, rounds: int, batch: int, tokens: int) -> dict[str, Any]:
    """The mask's cost: the schema's replies (jump-forward off) against unconstrained replies of
    exactly their lengths (ignoring EOS), so both decode the same tokens at the same contexts."""
    from radixkv import SamplingParams

    prompt = llm.encode_chat([{"role": "user", "content": PROMPT}])
    schema = [SamplingParams(max_tokens=tokens, json_schema=SCHEMA, jump_forward=False)] * batch
    lengths = [len(o.token_ids) for o in llm.generate([prompt] * batch, schema)]  # and warm
    plain = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    times: dict[str, list[float]] = {"plain": [], "schema": []}
    for _ in range(rounds):
        times["plain"].append(decode_seconds_per_token(llm, prompt, plain))
        times["schema"].append(decode_seconds_per_token(llm, prompt, schema))
    p, c = statistics.median(times["plain"]), statistics.median(times["schema"])
    return {
        "plain_ms": 1e3 * p,
        "schema_ms": 1e3 * c,
        "ratio": c / p,
        "tokens": lengths,
        "load": _load(),
    }


def run_stepped(llm: Any, prompts: Sequence[Any], params: Sequence[Any]) -> dict[str, Any]:
    """Step the engine through one request per (prompt, params): their outputs, the steps that
    sampled a token for each, the most KV blocks in use at once and the wall time."""
    t0 = time.perf_counter()
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    steps = dict.fromkeys(ids, 0)
    outputs: dict[str, Any] = {}
    peak = 0
    while llm.has_unfinished_requests():
        for u in llm.step():
            steps[u.request_id] += bool(u.new_token_ids)
            if u.output is not None:
                outputs[u.request_id] = u.output
        peak = max(peak, llm.cache.stats().num_in_use_blocks)
    wall = time.perf_counter() - t0
    return {
        "outputs": [outputs[i] for i in ids],
        "steps": [steps[i] for i in ids],
        "peak_blocks": peak,
        "wall_s": wall,
    }


def jump(llm: Any, rounds: int, batch: int, tokens: int) -> dict[str, Any]:
    """Jump-forward on against off on the long-keys schema (see the module docstring)."""
    import jsonschema

    from radixkv import SamplingParams

    texts = [ORDER_PROMPTS[i % len(ORDER_PROMPTS)] for i in range(batch)]
    prompts = [llm.encode_chat([{"role": "user", "content": t}]) for t in texts]
    base = SamplingParams(max_tokens=tokens, json_schema=LONG_KEYS_SCHEMA)
    sides = {on: [replace(base, jump_forward=on)] * batch for on in (False, True)}
    run_stepped(llm, prompts[:1], [replace(base, max_tokens=4)])  # warm: compile
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(rounds):
        for on in (False, True):
            runs[on].append(run_stepped(llm, prompts, sides[on]))
    valid = {on: 0 for on in runs}
    for on, side in runs.items():
        for r in side:
            for o in r["outputs"]:
                ok = o.finish_reason == "stop"
                try:
                    jsonschema.validate(json.loads(o.text), LONG_KEYS_SCHEMA)
                except ValueError:
                    ok = False
                valid[on] += ok
    first_off, first_on = runs[False][0]["outputs"], runs[True][0]["outputs"]
    differ = sum(a.text != b.text for a, b in zip(first_off, first_on, strict=True))
    steps = {on: statistics.mean(s for r in side for s in r["steps"]) for on, side in runs.items()}
    wall = {on: statistics.median(r["wall_s"] for r in side) for on, side in runs.items()}
    tokens_out = {
        on: statistics.mean(len(o.token_ids) for r in side for o in r["outputs"])
        for on, side in runs.items()
    }
    return {
        "steps_off": steps[False],
        "steps_on": steps[True],
        "steps_ratio": steps[True] / steps[False],
        "wall_off_s": wall[False],
        "wall_on_s": wall[True],
        "wall_ratio": wall[True] / wall[False],
        "tokens_off": tokens_out[False],
        "tokens_on": tokens_out[True],
        "valid_off": f"{valid[False]}/{rounds * batch}",
        "valid_on": f"{valid[True]}/{rounds * batch}",
        "greedy_texts_differ": f"{differ}/{batch}",
        "example_off": first_off[0].text,
        "example_on": first_on[0].text,
        "load": _load(),
    }


def long_prompt(llm: Any, seed: int, num_tokens: int = 700) -> list[int]:
    """A chat prompt of about `num_tokens` tokens whose text depends on `seed`: uncached."""
    words = [
        "river",
        "stone",
        "lamp",
        "garden",
        "copper",
        "window",
        "harbor",
        "maple",
        "violet",
        "engine",
        "ladder",
    ]
    rng = random.Random(seed)
    text = " ".join(rng.choice(words) for _ in range(num_tokens))
    ids = llm.encode_chat([{"role": "user", "content": f"Summarize: {text}"}])
    return ids[-num_tokens:] if len(ids) > num_tokens else ids


def choices(llm: Any, rounds: int, tokens: int) -> dict[str, Any]:
    """n = 8 against n = 1 on a fresh ~700-token prompt each (see the module docstring)."""
    from radixkv import SamplingParams

    block = llm.config.block_size
    rows: dict[int, list[dict[str, float]]] = {1: [], 8: []}
    run_stepped(llm, [long_prompt(llm, -1, 64)], [SamplingParams(max_tokens=2)])  # warm
    for r in range(rounds):
        for n in (1, 8):
            prompt = long_prompt(llm, 2 * r + (n == 8))
            params = SamplingParams(max_tokens=tokens, temperature=0.8, seed=r, n=n)
            before = llm.cache.stats().num_computed_tokens
            run = run_stepped(llm, [prompt] * n, params.choices())
            computed = llm.cache.stats().num_computed_tokens - before
            tail = len(prompt) % block + tokens
            bound = -(-len(prompt) // block) + n * -(-tail // block)  # a prompt + n tails
            rows[n].append(
                {
                    "prompt": len(prompt),
                    "computed": computed,
                    "ttft_s": max(o.stats.ttft_s for o in run["outputs"]),
                    "peak_blocks": run["peak_blocks"],
                    "bound_blocks": bound,
                }
            )
    ttft = {n: statistics.median(x["ttft_s"] for x in side) for n, side in rows.items()}
    return {
        "rounds": rows,
        "ttft_1_s": ttft[1],
        "ttft_8_s": ttft[8],
        "ttft_ratio": ttft[8] / ttft[1],
        "load": _load(),
    }


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: Sequence[str] | None = None, llm: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder or id (default: embedded)")
    parser.add_argument("--parts", default="overhead,jump,choices")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="overhead: tokens per request")
    parser.add_argument("--jump-tokens", type=int, default=320, help="jump: max_tokens")
    parser.add_argument("--choice-tokens", type=int, default=16, help="choices: max_tokens")
    args = parser.parse_args(argv)
    if llm is None:
        from radixkv import LLM

        llm = LLM(args.model, num_threads=1)
    parts = args.parts.split(",")
    results: dict[str, Any] = {}
    if "overhead" in parts:
        t0 = time.perf_counter()
        r = results["overhead"] = overhead(llm, args.rounds, args.batch, args.tokens)
        print(
            f"decode per token: unconstrained {r['plain_ms']:.3f} ms, JSON schema "
            f"{r['schema_ms']:.3f} ms, ratio {r['ratio']:.3f} ({args.rounds} interleaved "
            f"rounds of {args.batch} replies of {r['tokens']} tokens, "
            f"{time.perf_counter() - t0:.1f} s, load {r['load']})"
        )
    if "jump" in parts:
        r = results["jump"] = jump(llm, args.rounds, args.batch, args.jump_tokens)
        print(
            f"jump-forward: steps per request {r['steps_on']:.1f} vs {r['steps_off']:.1f} "
            f"token by token ({r['steps_ratio']:.2f}x), wall {r['wall_on_s']:.2f} s vs "
            f"{r['wall_off_s']:.2f} s ({r['wall_ratio']:.2f}x), valid {r['valid_on']} vs "
            f"{r['valid_off']}, greedy texts differing {r['greedy_texts_differ']} "
            f"(load {r['load']})"
        )
    if "choices" in parts:
        r = results["choices"] = choices(llm, args.rounds, args.choice_tokens)
        print(
            f"n = 8 vs n = 1: time to the last choice's first token {r['ttft_8_s']:.2f} s vs "
            f"{r['ttft_1_s']:.2f} s ({r['ttft_ratio']:.2f}x) (load {r['load']})"
        )
        for n, side in r["rounds"].items():
            for x in side:
                print(f"  n = {n}: {x}")
    print(json.dumps(results, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

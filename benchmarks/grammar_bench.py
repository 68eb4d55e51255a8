"""Per-token decode time with a JSON schema against the same decode unconstrained.

Run from the repository root (alone on the machine: a loaded machine's figure is noise):
    python -m benchmarks.grammar_bench                    # the embedded SmolLM2, CPU
    python -m benchmarks.grammar_bench --model PATH --rounds 7 --batch 8

Each round runs the two cases back to back (interleaved, so both meet the same machine load):
`--batch` requests of one prompt, up to `--tokens` new tokens each (the unconstrained ones
ignore EOS; the constrained ones end where the schema's object does, or at `--tokens`), greedy.
The time per decoded token is the round's decode time (first token to last) over its tokens;
the report gives each case's median over the rounds and their ratio (the issue's goal: <= 1.05
on a CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
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


def decode_seconds_per_token(llm: Any, prompt: Any, batch: int, tokens: int, schema: bool) -> float:
    """One case's decode time per generated token (the prefill, to the first token, excluded)."""
    from radixkv import SamplingParams

    # The schema's reply may end before max_tokens (its grammar allows EOS only at its end):
    # the figure is per token, so lengths need not match.
    fields: dict[str, Any] = {"json_schema": SCHEMA} if schema else {"ignore_eos": True}
    params = SamplingParams(max_tokens=tokens, **fields)
    outs = llm.generate([prompt] * batch, params)
    decode = max(o.stats.total_s - o.stats.ttft_s for o in outs)
    return decode / max(1, sum(len(o.token_ids) - 1 for o in outs))


def run(llm: Any, rounds: int, batch: int, tokens: int) -> dict[str, float]:
    prompt = llm.encode_chat([{"role": "user", "content": PROMPT}])
    decode_seconds_per_token(llm, prompt, batch, 4, schema=True)  # warm: compile, first calls
    plain, constrained = [], []
    for _ in range(rounds):
        plain.append(decode_seconds_per_token(llm, prompt, batch, tokens, schema=False))
        constrained.append(decode_seconds_per_token(llm, prompt, batch, tokens, schema=True))
    p, c = statistics.median(plain), statistics.median(constrained)
    return {"plain_ms": 1e3 * p, "schema_ms": 1e3 * c, "ratio": c / p}


def main(argv: Sequence[str] | None = None, llm: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder or id (default: embedded)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if llm is None:
        from radixkv import LLM

        llm = LLM(args.model, num_threads=1)
    t0 = time.perf_counter()
    result = run(llm, args.rounds, args.batch, args.tokens)
    print(
        f"decode per token: unconstrained {result['plain_ms']:.3f} ms, JSON schema "
        f"{result['schema_ms']:.3f} ms, ratio {result['ratio']:.3f} "
        f"({args.rounds} interleaved rounds of {args.batch} x {args.tokens} tokens, "
        f"{time.perf_counter() - t0:.1f} s)"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

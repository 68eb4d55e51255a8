"""How far compact snapshots (`snapshot_dtype` "bf16" / "int8") move greedy output from the exact
mode's, on every hybrid family's tiny random model (`tests/tiny_archs.HYBRIDS`).

The hybrid tests' chat workload, three times (seeds 31, 41, 51): three prompts sharing a 28-token
prefix (the first alone), then a warm round of the first and third conversations' next turns and
the second prompt again, 32 greedy tokens each (EOS ignored), resuming from snapshots; then six
more turns of the first conversation, 16 tokens each, each resuming from the snapshot of the
turn before (in a compact mode a state rounded once a turn, so errors may compound). Per family
and mode: the warm round's tokens equal position by position to the exact mode's, the replies
equal whole, and the round trip error of the states the exact mode kept as snapshots (max abs,
and relative to the largest magnitude of the layer's state), fp32 models. The cold rounds resume
from nothing and equal the exact mode's by construction.

    python benchmarks/compact_snapshots.py [--families qwen3_5,mamba2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch
from tiny_archs import HYBRIDS, build_arch
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams
from radixkv.engine.step.recurrent.compact import dequantize_int8, quantize_int8

MODES = ("exact", "bf16", "int8")
SEEDS = (31, 41, 51)
SETTINGS = dict(block_size=16, num_blocks=128, snapshot_min_gap_tokens=4)
WARM_TOKENS = 32
TURNS, TURN_TOKENS = 6, 16


def _rounds(llm: LLM, seed: int) -> tuple[list[list[int]], list[list[float]], int]:
    """The workload of one seed: the warm round's replies, their tokens' logprobs, and the
    prompt tokens it resumed past."""
    first = random_prompts(seed, 3, shared_prefix=28, min_len=6, max_len=14)
    news = random_prompts(seed + 2, 2, min_len=5, max_len=9)
    cold = llm.generate(first[:1], SamplingParams(max_tokens=7))
    cold += llm.generate(first[1:], [SamplingParams(max_tokens=6), SamplingParams(max_tokens=8)])
    r0, r2 = list(cold[0].token_ids), list(cold[2].token_ids)
    warm = [first[0] + r0 + news[0], first[1], first[2] + r2 + news[1]]
    params = SamplingParams(max_tokens=WARM_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(warm, params)
    llm.check_integrity()
    conversation = warm[0] + list(outs[0].token_ids)
    for turn in random_prompts(seed + 3, TURNS, min_len=4, max_len=8):
        conversation += turn
        params = SamplingParams(max_tokens=TURN_TOKENS, ignore_eos=True, logprobs=0)
        (out,) = llm.generate([conversation], params)
        outs.append(out)
        conversation += list(out.token_ids)
    llm.check_integrity()
    logprobs = [[t.logprob for t in o.logprobs or ()] for o in outs]
    resumed = sum(o.stats.num_cached_tokens for o in outs)
    return [list(o.token_ids) for o in outs], logprobs, resumed


def _state_errors(llm: LLM) -> dict[str, tuple[float, float]]:
    """Round trip errors of every state slot the exact engine holds (its snapshots after the
    run): mode -> (max abs error, max error / the layer's largest |state|)."""
    states = llm.runner.states
    assert states is not None
    errors = {"bf16": (0.0, 0.0), "int8": (0.0, 0.0)}
    for i, ssm in states.ssm.items():
        top = float(ssm.abs().max())
        if top == 0:
            continue
        q, scale = quantize_int8(ssm, states.specs[i].quant_axis + 1)  # + the slot axis
        for mode, back in (
            ("bf16", ssm.to(torch.bfloat16).to(ssm.dtype)),
            ("int8", dequantize_int8(q, scale, ssm.dtype)),
        ):
            err = float((back - ssm).abs().max())
            worst, rel = errors[mode]
            errors[mode] = (max(worst, err), max(rel, err / top))
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(HYBRIDS))
    args = parser.parse_args()
    families = args.families.split(",")
    header = "| family | mode | resumed | tokens equal | replies equal | logprob diff |"
    header += " state error max abs | relative |"
    print(header + "\n|---|---|---:|---:|---:|---:|---:|---:|")
    totals = {m: [0, 0, 0, 0] for m in MODES[1:]}
    worst = dict.fromkeys(MODES[1:], 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            path = build_arch(family, Path(tmp) / family)
            replies: dict[str, list[list[int]]] = {}
            logprobs: dict[str, list[list[float]]] = {}
            resumed: dict[str, int] = {}
            errors: dict[str, tuple[float, float]] = {}
            for mode in MODES:
                llm = LLM(str(path), snapshot_dtype=mode, **SETTINGS)
                runs = [_rounds(llm, seed) for seed in SEEDS]
                replies[mode] = [r for run in runs for r in run[0]]
                logprobs[mode] = [lp for run in runs for lp in run[1]]
                resumed[mode] = sum(run[2] for run in runs)
                if mode == "exact":
                    errors = _state_errors(llm)
            for mode in MODES[1:]:
                pairs = list(zip(replies[mode], replies["exact"], strict=True))
                same = sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True))
                total = sum(len(y) for _, y in pairs)
                whole = sum(x == y for x, y in pairs)
                t = totals[mode]
                t[0], t[1], t[2], t[3] = t[0] + same, t[1] + total, t[2] + whole, t[3] + len(pairs)
                err, rel = errors.get(mode, (0.0, 0.0))
                # the sampled tokens' logprobs, up to each reply's first differing token
                diff = max(
                    (
                        abs(a - b)
                        for x, y, lx, ly in zip(
                            replies[mode],
                            replies["exact"],
                            logprobs[mode],
                            logprobs["exact"],
                            strict=True,
                        )
                        for a, b in zip(lx[: _agree(x, y)], ly[: _agree(x, y)], strict=True)
                    ),
                    default=0.0,
                )
                worst[mode] = max(worst[mode], diff)
                print(
                    f"| {family} | {mode} | {resumed[mode]} ({resumed['exact']} exact) | "
                    f"{same}/{total} ({same / total:.1%}) | {whole}/{len(pairs)} | {diff:.1e} | "
                    f"{err:.2e} | {rel:.2e} |"
                )
    for mode, (same, total, whole, n) in totals.items():
        line = f"| all | {mode} | | {same}/{total} ({same / total:.1%}) | {whole}/{n} |"
        print(line + f" {worst[mode]:.1e} | | |")


def _agree(x: list[int], y: list[int]) -> int:
    """How many leading tokens two replies share (a token past a difference has another past)."""
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


if __name__ == "__main__":
    main()

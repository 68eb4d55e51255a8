"""What the engine holds per running request of a model with sliding-window layers.

A tiny random Gemma-3-like model (5 window layers of W tokens to 1 full layer, transformers'
`gemma3_text`) runs one long prompt through `LLM` with chunked prefill, then decodes; after every
step the running request's window blocks in use (its window table's live entries) and full
blocks are counted. KV bytes held = layers x blocks of each group, against the same model with
every layer full (6 layers x the full blocks). Counts only: the figures hold for any head size.

    python benchmarks/window_engine_bench.py [--window 64] [--prompt 1024] [--chunk 128]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny_archs import build_config, save_tiny_model
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams

NUM_WINDOW_LAYERS, NUM_FULL_LAYERS = 5, 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--decode", type=int, default=64)
    args = parser.parse_args()
    config = build_config(
        "gemma3_text",
        num_hidden_layers=NUM_WINDOW_LAYERS + NUM_FULL_LAYERS,
        layer_types=["sliding_attention"] * NUM_WINDOW_LAYERS + ["full_attention"],
        sliding_window=args.window,
        max_position_embeddings=4 * args.prompt,
        head_dim=16,
    )
    print("block size | held at the end / all full | peak in a step / all full | window blocks")
    for block_size in (1, 16, 64):
        with tempfile.TemporaryDirectory() as folder:
            path = save_tiny_model(config, Path(folder))
            llm = LLM(
                str(path),
                block_size=block_size,
                num_blocks=-(-4 * args.prompt // block_size),
                chunked_prefill_size=args.chunk,
                max_num_batched_tokens=args.chunk,
            )
        print(f"{block_size:>10} | " + " | ".join(_measure(llm, args)))


def _measure(llm: LLM, args: argparse.Namespace) -> list[str]:
    """(KV held between steps at the end / all full, its peak inside a step / all full, the
    most window blocks the request listed) for one request."""
    (prompt,) = random_prompts(7, 1, min_len=args.prompt, max_len=args.prompt)
    llm.add_request(prompt, SamplingParams(max_tokens=args.decode, ignore_eos=True))
    scheduler, peaks = llm.scheduler, [0.0, 0.0]
    schedule = scheduler.schedule

    def counted_schedule() -> object:  # after extend, before slide: a step's peak
        output = schedule()
        for req in scheduler.running_requests:
            peaks[0] = max(peaks[0], _held(req))
            peaks[1] = max(peaks[1], req.table.tables[1].num_live_blocks)
        return output

    scheduler.schedule = counted_schedule  # type: ignore[method-assign]
    held = 0.0
    while llm.has_unfinished_requests():
        llm.step()
        held = max((_held(req) for req in scheduler.running_requests), default=held)
    llm.check_integrity()
    return [f"{held:.3f}", f"{peaks[0]:.3f}", f"{peaks[1]:.0f}"]


def _held(req: object) -> float:
    """KV bytes a running request holds / the same request's with every layer full."""
    window, full = req.table.tables[1].num_live_blocks, len(req.table.tables[0].blocks)  # type: ignore[attr-defined]
    held = NUM_WINDOW_LAYERS * window + NUM_FULL_LAYERS * full
    return held / ((NUM_WINDOW_LAYERS + NUM_FULL_LAYERS) * full)


if __name__ == "__main__":
    main()

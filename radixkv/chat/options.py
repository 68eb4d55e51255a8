"""The engine options `radixkv chat` and `radixkv serve` share: one home for their names, defaults
and help, and for how they become `LLM` arguments."""

from __future__ import annotations

import argparse
from typing import Any


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Add --model, --block-size, --cache-mb / --num-blocks, --no-prefix-cache and --seed."""
    parser.add_argument(
        "--model",
        default=None,
        help="local path or Hugging Face id (default: embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (default 16)"
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--cache-mb", type=int, default=None, help="KV cache size in MiB")
    size.add_argument("--num-blocks", type=int, default=None, help="KV cache size in blocks")
    parser.add_argument("--no-prefix-cache", action="store_true", help="recompute every prompt")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of requests without their own (default 0)"
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM` keyword arguments of the options `add_engine_options` added."""
    return {
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "kv_cache_bytes": None if args.cache_mb is None else args.cache_mb * 2**20,
        "enable_prefix_cache": not args.no_prefix_cache,
        "seed": args.seed,
    }

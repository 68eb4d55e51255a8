"""Hierarchical KV cache benchmark (issue 18).

`copies`: the raw speeds the tier policy rests on, with the KV shape of the embedded model
(SmolLM2-135M: 30 layers x 3 KV heads x 64, fp32, 46 KB per token): batched block copies between
the device pool and the host pool (`KVCopier`), block files written to and read from the disk tier
(`DiskStore`), cold (after the page cache dropped them) and warm, the hashing of block keys, and,
for scale, what recomputing the same tokens costs (a prefill on one thread). The systems are
interleaved round by round; each row keeps its fastest and median round.

    .venv/bin/python benchmarks/tier_bench.py copies            # 128 blocks of 16 = 2,048 tokens
    .venv/bin/python benchmarks/tier_bench.py copies --quick    # smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from radixkv.cache.disk_store import DiskStore, chain_keys
from radixkv.engine.host_kv import HostKVPool, KVCopier

try:
    from benchmarks.cache_bench import machine_line
except ImportError:  # run as a script: benchmarks/ is on the path, never the repository root
    from cache_bench import machine_line  # type: ignore[no-redef]

DEFAULT_SHAPE = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}  # SmolLM2-135M


def model_shape() -> dict[str, int]:
    """The embedded model's KV shape, read from its config (converted once if need be)."""
    from transformers import AutoConfig

    from radixkv.engine.model_loader import ensure_default_model

    cfg = AutoConfig.from_pretrained(ensure_default_model())
    return {
        "num_layers": cfg.num_hidden_layers,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
    }


def drop_from_page_cache(directory: Path) -> None:
    """Make the next reads of every file under `directory` come from the disk."""
    for path in directory.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def time_once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copies(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    shape = DEFAULT_SHAPE if args.quick else model_shape()
    n, B = args.blocks, args.block_size
    dtype = torch.float32
    L, H, D = shape["num_layers"], shape["num_kv_heads"], shape["head_dim"]
    k = torch.randn((L, 2 * n, B, H, D), dtype=dtype)
    v = torch.randn((L, 2 * n, B, H, D), dtype=dtype)
    host = HostKVPool(
        2 * n, num_layers=L, block_size=B, num_kv_heads=H, head_dim=D, dtype=dtype, pin_memory=False
    )
    copier = KVCopier(k, v, host)
    nbytes = n * host.bytes_per_block
    rng = np.random.default_rng(0)
    scattered_dev = rng.permutation(2 * n)[:n].tolist()
    scattered_host = rng.permutation(2 * n)[:n].tolist()
    contiguous = list(range(n))
    tokens = rng.integers(0, 49152, n * B, dtype=np.uint32).astype("<u4").tobytes()
    root = Path(tempfile.mkdtemp(prefix="radixkv-tier-bench-", dir=args.dir))
    copier.offload(contiguous, contiguous)  # every host block written once before timing
    print(f"# machine: {machine_line()}, torch {torch.__version__}, 1 torch thread")
    print(f"# disk: {root} (file system of {args.dir or tempfile.gettempdir()})")
    print(
        f"# KV shape: {L} layers x {H} KV heads x {D}, {dtype}, block {B} tokens ="
        f" {host.bytes_per_block / 1024:.0f} KiB; {n} blocks per operation"
        f" ({n * B} tokens, {nbytes / 2**20:.1f} MiB)"
    )
    print(f"# command: python benchmarks/tier_bench.py {' '.join(sys.argv[1:])}")

    def store(fingerprint: dict[str, object]) -> DiskStore:
        return DiskStore(
            root,
            fingerprint,
            block_size=B,
            block_nbytes=host.bytes_per_block,
            budget_bytes=4 * n * host.bytes_per_block,
        )

    def write_all() -> None:
        for i, key in enumerate(keys):
            assert disk.put(key, host.block_buffer(i))

    def read_all() -> None:
        for i, key in enumerate(keys):
            assert disk.get(key, host.block_buffer(n + i))

    timings: dict[str, list[float]] = {}
    for r in range(args.rounds):
        rows: dict[str, Callable[[], object]] = {
            "offload device->host, contiguous ids": lambda: copier.offload(contiguous, contiguous),
            "offload device->host, scattered ids": lambda: copier.offload(
                scattered_dev, scattered_host
            ),
            "load host->device, contiguous ids": lambda: copier.load(contiguous, contiguous),
            "load host->device, scattered ids": lambda: copier.load(scattered_host, scattered_dev),
        }
        for name, fn in rows.items():
            timings.setdefault(name, []).append(time_once(fn))
        disk = store({"round": r})  # a fresh layout folder each round: every put writes
        keys = chain_keys(f"round-{r}", tokens, B)
        timings.setdefault("hash block keys (xxh64 + blake2b chain)", []).append(
            time_once(lambda: chain_keys("hashing", tokens, B))
        )
        timings.setdefault("disk write (temp file + rename)", []).append(time_once(write_all))
        drop_from_page_cache(disk.directory)
        timings.setdefault("disk read, cold (page cache dropped)", []).append(time_once(read_all))
        timings.setdefault("disk read, warm (page cache)", []).append(time_once(read_all))
        disk.clear()
    shutil.rmtree(root, ignore_errors=True)
    if not args.quick and not args.no_prefill:
        timings["recompute: prefill on one thread"] = prefill_seconds(n * B, args.rounds)

    print()
    print("| operation | MiB/s (best) | ms (best) | ms (median) | ms per block |")
    print("|---|---:|---:|---:|---:|")
    for name, ts in timings.items():
        best, median = min(ts), statistics.median(ts)
        rate = f"{nbytes / 2**20 / best:,.0f}" if "prefill" not in name else "-"
        print(
            f"| {name} | {rate} | {best * 1e3:,.1f} | {median * 1e3:,.1f} | {best * 1e3 / n:.3f} |"
        )


def prefill_seconds(num_tokens: int, rounds: int) -> list[float]:
    """Seconds to prefill `num_tokens` fresh tokens with the embedded model (no cache hit)."""
    from radixkv import LLM, SamplingParams

    llm = LLM(num_threads=1, enable_prefix_cache=False)  # default chunks, as a real recompute
    rng = np.random.default_rng(1)
    params = SamplingParams(max_tokens=1)
    times = []
    for _ in range(max(1, min(rounds, 3))):
        prompt = rng.integers(100, 40000, num_tokens).tolist()
        times.append(time_once(lambda p=prompt: llm.generate([p], params)))
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    p = sub.add_parser("copies", help="copy, disk and hashing speeds with the model's KV shape")
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the disk files go (default: temp dir)")
    p.add_argument("--no-prefill", action="store_true", help="skip the recompute row")
    p.add_argument("--quick", action="store_true", help="smoke run: small, no model")
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.rounds = min(args.blocks, 8), min(args.rounds, 2)
    copies(args)


if __name__ == "__main__":
    main()

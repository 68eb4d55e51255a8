"""Hierarchical KV cache benchmark (issue 18).

`copies`: the raw speeds the tier policy rests on, with the KV shape of the embedded model
(SmolLM2-135M: 30 layers x 3 KV heads x 64, fp32, 46 KB per token): batched block copies between
the device pool and the host pool (`KVCopier`), block files written to and read from the disk tier
(`DiskStore`), cold (after the page cache dropped them) and warm, the hashing of block keys, and,
for scale, what recomputing the same tokens costs (a prefill on one thread). The systems are
interleaved round by round; each row keeps its fastest and median round.

    .venv/bin/python benchmarks/tier_bench.py copies            # 128 blocks of 16 = 2,048 tokens
    .venv/bin/python benchmarks/tier_bench.py copies --quick    # smoke run

`chat`: the embedded model on one thread, a multi-turn chat whose working set (every
conversation's history) is 4x the device pool, one request at a time, turns of the conversations
interleaved so each comes back after the others pushed it out. Systems: no tier; a host tier
holding the whole working set, written back (what the device evicts) or written through (every
committed block); host + disk tier (the host at a quarter of the working set); a device pool large
enough for everything, without and with a host tier (what the tier costs when nothing is evicted).
Then the restart scenario: a conversation of `--restart-tokens` cached tokens, written to the disk
tier at exit; the first request of a restarted process over the same directory (warm) against
one over an empty directory (cold). One table with ratios.

    .venv/bin/python benchmarks/tier_bench.py chat              # ~15 minutes on a shared 2-core VM
    .venv/bin/python benchmarks/tier_bench.py chat --quick      # smoke run
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
from typing import Any

import numpy as np
import torch

from radixkv.cache.keys import chain_keys
from radixkv.engine.tiers.disk_store import DiskStore
from radixkv.engine.tiers.host_kv import HostKVPool, KVCopier

try:
    from benchmarks.cache_bench import machine_line
except ImportError:  # run as a script: benchmarks/ is on the path, never the repository root
    from cache_bench import machine_line  # type: ignore[no-redef]

DEFAULT_SHAPE = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}  # SmolLM2-135M


def model_shape() -> dict[str, int]:
    """The embedded model's KV shape, read from its config (converted once if need be)."""
    from transformers import AutoConfig

    from radixkv.engine.model.model_loader import ensure_default_model

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


# ---------------------------------------------------------------------------------------- chat
def chat_prompts(args: argparse.Namespace) -> list[tuple[int, list[int]]]:
    """(conversation, user tokens) per request: turn t of every conversation before turn t+1."""
    rng = np.random.default_rng(7)
    system = rng.integers(100, 40000, args.system_tokens).tolist()
    turns = []
    for t in range(args.turns):
        for c in range(args.convs):
            user = rng.integers(100, 40000, args.user_tokens).tolist()
            turns.append((c, system + user if t == 0 else user))
    return turns


def run_chat(llm: Any, turns: list[tuple[int, list[int]]], reply_tokens: int) -> dict[str, float]:
    """Each request alone (greedy, `reply_tokens`); a conversation's prompt is its history."""
    from radixkv import SamplingParams

    params = SamplingParams(max_tokens=reply_tokens, ignore_eos=True)
    history: dict[int, list[int]] = {}
    ttfts, computed, prompt_tokens = [], 0, 0
    t0 = time.perf_counter()
    for conv, user in turns:
        prompt = history.get(conv, []) + user
        (out,) = llm.generate([prompt], params)
        history[conv] = prompt + list(out.token_ids)
        ttfts.append(out.stats.ttft_s)
        computed += out.stats.num_prompt_tokens - out.stats.num_cached_tokens
        prompt_tokens += out.stats.num_prompt_tokens
    return {
        "total_s": time.perf_counter() - t0,
        "ttft_p50_s": statistics.median(ttfts),
        "computed": computed,
        "prompt_tokens": prompt_tokens,
    }


def chat(args: argparse.Namespace) -> None:
    from radixkv import LLM

    turns = chat_prompts(args)
    B = args.block_size
    final_len = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens)
    working_set = args.convs * -(-final_len // B)
    pool = max(working_set // 4, -(-final_len // B) + 2)
    block_bytes = 2 * 30 * B * 3 * 64 * 4  # the embedded model's KV, fp32
    host_all = working_set * block_bytes
    base = dict(block_size=B, num_threads=1)
    tmp = Path(tempfile.mkdtemp(prefix="tier-bench-"))
    systems = {
        "no tier": dict(num_blocks=pool),
        "host (write-back)": dict(num_blocks=pool, host_cache_bytes=host_all),
        "host (write-through)": dict(
            num_blocks=pool, host_cache_bytes=host_all, host_cache_write_through=True
        ),
        "host + disk": dict(
            num_blocks=pool, host_cache_bytes=host_all // 4, kv_cache_dir=str(tmp / "run")
        ),
        "big pool": dict(num_blocks=working_set + pool),
        "big pool + host": dict(num_blocks=working_set + pool, host_cache_bytes=host_all),
        "big pool + host (write-through)": dict(
            num_blocks=working_set + pool, host_cache_bytes=host_all, host_cache_write_through=True
        ),
    }
    print(f"# machine: {machine_line()}")
    print(
        f"# chat: {args.convs} conversations x {args.turns} turns, system {args.system_tokens},"
        f" user {args.user_tokens}, reply {args.reply_tokens} tokens; working set {working_set}"
        f" blocks of {B}, device pool {pool} ({100 * pool / working_set:.0f} %)"
    )
    results: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name, settings in systems.items():
            if "kv_cache_dir" in settings:
                shutil.rmtree(settings["kv_cache_dir"], ignore_errors=True)
            llm = LLM(**base, **settings)
            results[name].append(run_chat(llm, turns, args.reply_tokens))
            if llm.tier_ios[0] is not None and llm.tier_ios[0].disk is not None:
                d = llm.tier_ios[0].disk.stats()
                print(
                    f"# {name}: disk {d.num_bytes:,} bytes in {d.num_files} files, budget"
                    f" {d.budget_bytes:,}"
                )
            del llm
    print(f"# peak RSS of the process: {_peak_rss_mib():,.0f} MiB")
    best = {name: min(runs, key=lambda r: r["total_s"]) for name, runs in results.items()}
    ref, full = best["no tier"], best["big pool"]
    print(
        "\n| system | prefill tokens computed | vs big pool | TTFT p50 ms | vs no tier |"
        " total s | vs no tier |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in best.items():
        print(
            f"| {name} | {r['computed']:,} | {r['computed'] / full['computed']:.2f} |"
            f" {r['ttft_p50_s'] * 1e3:,.0f} | {r['ttft_p50_s'] / ref['ttft_p50_s']:.2f} |"
            f" {r['total_s']:,.1f} | {r['total_s'] / ref['total_s']:.2f} |"
        )
    restart(args, base, tmp, block_bytes)
    shutil.rmtree(tmp, ignore_errors=True)


def restart(args: argparse.Namespace, base: dict, tmp: Path, block_bytes: int) -> None:
    """TTFT of a restarted process's first request on a long cached conversation: warm disk
    tier (written by the first process at exit) against cold (an empty directory)."""
    from radixkv import LLM, SamplingParams

    rng = np.random.default_rng(11)
    history = rng.integers(100, 40000, args.restart_tokens).tolist()
    follow_up = history + rng.integers(100, 40000, 16).tolist()
    params = SamplingParams(max_tokens=1)
    tiers = dict(
        host_cache_bytes=(args.restart_tokens // args.block_size + 8) * block_bytes,
        num_blocks=args.restart_tokens // args.block_size + 16,
    )
    warm_dir, cold_dir = tmp / "warm", tmp / "cold"
    first = LLM(**base, **tiers, kv_cache_dir=str(warm_dir))
    first.generate([history], params)
    first.save_kv_cache()
    del first
    ttft = {}
    for name, folder in (("cold", cold_dir), ("warm", warm_dir), ("cold ", cold_dir)):
        shutil.rmtree(cold_dir, ignore_errors=True)
        llm = LLM(**base, **tiers, kv_cache_dir=str(folder))
        (out,) = llm.generate([follow_up], params)
        ttft.setdefault(name.strip(), []).append(out.stats.ttft_s)
        print(
            f"# restart {name.strip()}: TTFT {out.stats.ttft_s * 1e3:,.0f} ms,"
            f" {out.stats.num_cached_tokens} of {len(follow_up)} prompt tokens cached"
        )
        del llm
    cold, warm = min(ttft["cold"]), min(ttft["warm"])
    print(f"\n| restart, {len(follow_up):,}-token prompt | TTFT ms | vs cold |")
    print("|---|---:|---:|")
    print(f"| cold (empty directory) | {cold * 1e3:,.0f} | 1.00 |")
    print(f"| warm (disk tier of the earlier process) | {warm * 1e3:,.0f} | {warm / cold:.3f} |")


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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
    c = sub.add_parser("chat", help="end to end: the systems on a multi-turn chat, and a restart")
    c.add_argument("--convs", type=int, default=6)
    c.add_argument("--turns", type=int, default=4)
    c.add_argument("--system-tokens", type=int, default=64)
    c.add_argument("--user-tokens", type=int, default=96)
    c.add_argument("--reply-tokens", type=int, default=8)
    c.add_argument("--block-size", type=int, default=16)
    c.add_argument("--rounds", type=int, default=1)
    c.add_argument("--restart-tokens", type=int, default=2048)
    c.add_argument("--quick", action="store_true", help="smoke run: tiny sizes")
    args = parser.parse_args(argv)
    if args.part == "chat":
        if args.quick:
            args.convs, args.turns, args.user_tokens, args.restart_tokens = 3, 2, 24, 64
        chat(args)
        return
    if args.quick:
        args.blocks, args.rounds = min(args.blocks, 8), min(args.rounds, 2)
    copies(args)


if __name__ == "__main__":
    main()

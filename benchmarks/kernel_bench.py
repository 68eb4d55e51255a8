"""Kernel benchmark: radixkv's paged attention beside vLLM's and SGLang's Triton kernels and torch
SDPA, on identical inputs, against the device's measured copy bandwidth and matrix rate.

    python3 -P benchmarks/kernel_bench.py --quick    # the issue's shapes (what gpu_check runs)
    python3 -P benchmarks/kernel_bench.py            # more extend shapes and contexts
    python3 -P benchmarks/kernel_bench.py --tiny     # the CPU: every section's plumbing, the
                                                     #   interpreter, tiny shapes (no figures)
    python3 -P benchmarks/kernel_bench.py --check    # compiled kernels vs reference, bf16 too

Sections, in this order, each printed as it runs, row by row:
  decode        32 q heads over 8 kv heads, head_dim 64 (the bench model) and 128, bf16, permuted
                block tables; batch x context x block size: radixkv's ms, GB/s and share of the
                copy bandwidth, SDPA on contiguous K/V, vLLM's and SGLang's kernels (block sizes
                16 / 64), and the ratio to the faster peer
  extend        prefill over a cached prefix (the last over the chat's turn-6 shape): TFLOP/s,
                share of the matrix rate, SDPA and the peers
  splits        decode ms at fixed split counts beside the default's choice and a wave-aware
                candidate's, with the decode variant's occupancy; the engine's graph tables
                hold 2,624 tokens at the bench's max_model_len (the default splits by the
                table), so the batch-64 row runs at both a 640 and a 2,624-token table
  decode-tiles  the decode kernel's tile (keys per step, warps, pipeline stages)
  extend-tiles  the extend kernel's tile, each at the default split count and at one split
and the issue's goals as measured ratios.

Every figure is the median time of one call over CUDA-graph replays (`--timing host`: launched
from the host, L2 flushed). Every sweep point is guarded: one that raises prints its error in its
row and the run goes on. `--progress FILE` records each point as it starts and ends: a rerun
with the same file (gpu_check's host-timed fallback after a crash) reprints what is done,
measures what is not, and retries last a point that was in flight when the process died.
`--budget-s` stops measuring once spent (the rest is listed as skipped) so the goals still print.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # siblings by name: these scripts run with -P
import peer_kernels  # noqa: E402
import roofline  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS = 32, 8
DTYPE = torch.bfloat16
DEVICE = "cuda"  # --tiny swaps in "cpu" (with the Triton interpreter)
REPO = Path(__file__).resolve().parent.parent
TIMING = "graph"  # how `_bench` times a call: "graph", "host" or "once" (--tiny)
REP_MS = 25  # per timing: ten replays of a graph of calls that takes about this long


@dataclass(frozen=True, slots=True)
class Grid:
    """The shapes of one run."""

    head_dims: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    block_sizes: tuple[int, ...]  # radixkv's (the spread goal)
    peer_block_sizes: tuple[int, ...]  # where the peers run too
    extend: tuple[tuple[int, int, int], ...]  # (batch, cached prefix, new tokens)
    splits: tuple[tuple[int, int, int], ...]  # (batch, context, block-table capacity)
    decode_tiles: tuple[tuple[int, int, int], ...]
    extend_tiles: tuple[tuple[int, int, int], ...]
    check_limit: int  # outputs checked against the reference when batch * context <= this


TURN_6 = (32, 2303, 129)  # gpu_bench's chat, turn 6: 32 prompts of 129 new over 2,432 tokens
QUICK = Grid(
    head_dims=(64, 128),
    batches=(1, 16, 64),
    contexts=(640, 4096, 16384),
    block_sizes=(16, 64, 256),
    peer_block_sizes=(16, 64),
    extend=((1, 4096, 512), TURN_6),
    splits=(
        (1, 4096, 4096),
        (1, 16384, 16384),
        (4, 16384, 16384),
        (16, 4096, 4096),
        (64, 640, 640),
        (64, 640, 2624),
    ),
    decode_tiles=((1, 16384, 16384), (16, 4096, 4096), (64, 640, 2624)),
    extend_tiles=((1, 4096, 512),),
    check_limit=16 * 4096,
)
FULL = replace(
    QUICK,
    contexts=(640, 1024, 4096, 16384),
    extend=(*QUICK.extend, (1, 1024, 512), (4, 4096, 512), (1, 16384, 1024)),
    extend_tiles=((1, 4096, 512), TURN_6, (1, 16384, 1024)),
)
TINY = Grid(  # with 4 q heads over 2 kv heads (`_use_tiny`)
    head_dims=(16,),
    batches=(2,),
    contexts=(40,),
    block_sizes=(4, 16),
    peer_block_sizes=(16,),
    extend=((1, 24, 16),),
    splits=((1, 40, 40), (2, 40, 64)),
    decode_tiles=((2, 40, 64),),
    extend_tiles=((1, 24, 16),),
    check_limit=1 << 30,
)

SPLIT_SWEEP = (1, 2, 4, 8, 16, 32, 64)
# Decode tiles (BLOCK_M, BLOCK_N, warps, stages), the default first. The block-table lookup
# keeps the loop single-buffered below 5 stages at sm_90 (benchmarks/sm90_compile.py: one K/V
# buffer, nothing in flight at the loop's wait); 5 double-buffers K and V. Each compiles for
# sm_90 without spills at head_dim 64 and 128 (16 x 64, 4 warps, 5 stages spills at 128).
DECODE_SWEEP = (
    (16, 64, 4, 2),
    (16, 64, 8, 2),
    (16, 64, 8, 5),
    (16, 32, 4, 2),
    (16, 32, 4, 5),
)
# Extend tiles, the default first; 128 x 64 and 128 x 32 with 4 warps spill at head_dim 128.
EXTEND_SWEEP = (
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 64, 8, 5),
    (128, 32, 8, 2),
    (128, 32, 8, 3),
    (64, 64, 8, 2),
    (64, 64, 4, 2),
)


# ------------------------------------------------------------------------------------ timing


def _bench(fn: Callable[[], object], timing: str | None = None) -> float:
    """Median milliseconds per call, timed as `timing` says (default: TIMING). "graph": over
    replays of a CUDA graph of many calls (triton's do_bench_cudagraph), because timing launches
    from the host times the host: at batch 1 a call's Python outlasts its kernel, as it never
    does in the engine, whose decode steps replay graphs. L2 is not flushed between calls, so a
    working set that fits in L2 (batch 1 at 4k: 16 MiB) reads faster than from memory; the
    goals' configurations do not fit. "host": triton's do_bench, L2 flushed before every call.
    "once": one call's host time (the CPU dry run: the plumbing, not a figure)."""
    mode = timing or TIMING
    if mode == "once":
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    import triton.testing

    if mode == "graph":
        return float(triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=10, rep=4 * REP_MS, return_mode="median"))


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ inputs


def _paged_cache(
    batch: int, context: int, block_size: int, head_dim: int, table: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K, V caches holding `batch * context` tokens and permuted block tables of `table` tokens'
    capacity (default: the context); entries past the context point at block 0, as padding."""
    blocks_per_req = -(-context // block_size)
    num_blocks = batch * blocks_per_req
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    perm = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int64)
    width = max(blocks_per_req, -(-(table or context) // block_size))
    tables = torch.zeros(batch, width, dtype=torch.int32, device=DEVICE)
    tables[:, :blocks_per_req] = perm.view(batch, blocks_per_req).to(torch.int32)
    return k_cache, v_cache, tables


def _decode_args(
    batch: int, context: int, block_size: int, head_dim: int, table: int | None = None
) -> tuple[tuple[Any, ...], torch.Tensor]:
    """`paged_attention`'s arguments for one new token per request over `context` tokens each,
    and an output buffer."""
    k_cache, v_cache, tables = _paged_cache(batch, context, block_size, head_dim, table)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, NUM_Q_HEADS, head_dim, device=DEVICE, dtype=DTYPE)
    return (q, k_cache, v_cache, tables, seq_lens, cu, head_dim**-0.5), torch.empty_like(q)


def _extend_args(
    batch: int, prefix: int, new: int, block_size: int, head_dim: int
) -> tuple[tuple[Any, ...], torch.Tensor]:
    total = prefix + new
    k_cache, v_cache, tables = _paged_cache(batch, total, block_size, head_dim)
    seq_lens = torch.full((batch,), total, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch * new, NUM_Q_HEADS, head_dim, device=DEVICE, dtype=DTYPE)
    return (q, k_cache, v_cache, tables, seq_lens, cu, head_dim**-0.5), torch.empty_like(q)


def _error(run: Callable[[], object], out: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs difference from the reference of one call writing `out` (poisoned first: every
    element must be written)."""
    out.fill_(float("nan"))
    run()
    return (out.float() - expected).abs().max().item()


def _reference(args: tuple[Any, ...]) -> torch.Tensor:
    from radixkv.kernels import reference

    return reference.paged_attention(*args).float()


def _attention_flops(batch: int, prefix: int, new: int, head_dim: int) -> float:
    # Query j (0-based) of a request sees prefix + j + 1 keys; QK^T and PV are 2 flops per MAC each.
    visible = batch * (new * prefix + new * (new + 1) / 2)
    return 4.0 * NUM_Q_HEADS * head_dim * visible


def _decode_bytes(batch: int, context: int, head_dim: int, table_entries: int) -> int:
    """What a decode call must move: K and V of every context token, the block table, q and
    the output."""
    elem = torch.empty(0, dtype=DTYPE).element_size()
    kv = 2 * batch * context * NUM_KV_HEADS * head_dim * elem
    return kv + 4 * table_entries + 2 * batch * NUM_Q_HEADS * head_dim * elem


# ------------------------------------------------------------------------- peers and SDPA


@dataclass
class Peers:
    """The peers' launchers, or why there are none."""

    loaded: peer_kernels.Peers | None
    why_not: str = ""

    @classmethod
    def load(cls) -> Peers:
        try:
            return cls(peer_kernels.load())
        except peer_kernels.PeersMissing as e:
            return cls(None, str(e))
        except Exception as e:  # a peer file that does not import: the rest still runs
            return cls(None, f"{type(e).__name__}: {e}")

    def time(
        self, args: tuple[Any, ...], expected: torch.Tensor | None
    ) -> tuple[dict[str, float | None], float | None]:
        """ms per call of each peer (None where it raised), and their max error."""
        times: dict[str, float | None] = dict.fromkeys(peer_kernels.LAUNCHERS)
        if self.loaded is None:
            return times, None
        errors = []
        for name, make in peer_kernels.LAUNCHERS.items():
            try:
                out = torch.empty_like(args[0])
                run = make(self.loaded, peer_kernels.Batch.of(args), out)
                if expected is not None:
                    errors.append(_error(run, out, expected))
                times[name] = _bench(run)
            except Exception as e:
                print(f"  ({name} at this point: {type(e).__name__}: {str(e)[:200]})", flush=True)
        return times, max(errors, default=None)


def _sdpa_decode_ms(batch: int, context: int, head_dim: int) -> float:
    q = torch.randn(batch, NUM_Q_HEADS, 1, head_dim, device=DEVICE, dtype=DTYPE)
    k = torch.randn(batch, NUM_KV_HEADS, context, head_dim, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    return _bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def _sdpa_extend_ms(batch: int, prefix: int, new: int, head_dim: int) -> float:
    from torch.nn.attention.bias import causal_lower_right

    total = prefix + new
    q = torch.randn(batch, NUM_Q_HEADS, new, head_dim, device=DEVICE, dtype=DTYPE)
    k = torch.randn(batch, NUM_KV_HEADS, total, head_dim, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    # Bottom-right causal: the new tokens sit at the end of the context. K/V are expanded to the
    # query heads before timing (SDPA's causal bias path does not take enable_gqa everywhere).
    k = k.repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, dim=1)
    v = v.repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, dim=1)
    bias = causal_lower_right(new, total)
    return _bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias))


# --------------------------------------------------------------------------------- the rows


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _best(*values: float | None, lowest: bool = True) -> float | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return min(known) if lowest else max(known)


@dataclass(frozen=True, slots=True)
class DecodeRow:
    head_dim: int
    batch: int
    context: int
    block_size: int
    ms: float
    gbps: float
    sdpa_ms: float | None
    vllm_ms: float | None
    sglang_ms: float | None
    err: float | None  # radixkv against the torch reference, where it was checked
    peer_err: float | None  # the peers' worst
    timing: str

    HEADER = (
        "| head_dim | batch | context | block | radixkv ms | GB/s | of copy | SDPA ms | /SDPA "
        "| vLLM ms | SGLang ms | /faster peer | max err (radixkv, peers) | timing |"
    )

    def cells(self, ceilings: roofline.Ceilings) -> str:
        peer = _best(self.vllm_ms, self.sglang_ms)
        return (
            f"| {self.head_dim} | {self.batch} | {self.context} | {self.block_size} | "
            f"{self.ms:.4f} | {self.gbps:.0f} | {self.gbps / ceilings.copy_gbps:.2f} | "
            f"{_cell(self.sdpa_ms, '.4f')} | {_cell(_ratio(self.ms, self.sdpa_ms), '.2f')} | "
            f"{_cell(self.vllm_ms, '.4f')} | {_cell(self.sglang_ms, '.4f')} | "
            f"{_cell(_ratio(self.ms, peer), '.2f')} | "
            f"{_cell(self.err, '.1e')}, {_cell(self.peer_err, '.1e')} | {self.timing} |"
        )


@dataclass(frozen=True, slots=True)
class ExtendRow:
    head_dim: int
    batch: int
    prefix: int
    new: int
    block_size: int
    flops: float
    ms: float
    sdpa_ms: float | None
    vllm_ms: float | None
    sglang_ms: float | None
    err: float
    peer_err: float | None
    timing: str

    HEADER = (
        "| head_dim | batch | prefix | new | block | radixkv ms | TFLOP/s | of matmul | SDPA "
        "TFLOP/s | /SDPA | vLLM TFLOP/s | SGLang TFLOP/s | /faster peer | max err (radixkv, "
        "peers) | timing |"
    )

    def tflops(self, ms: float | None) -> float | None:
        return None if ms is None else self.flops / ms / 1e9

    def cells(self, ceilings: roofline.Ceilings) -> str:
        ours = self.flops / self.ms / 1e9
        peer = _best(self.tflops(self.vllm_ms), self.tflops(self.sglang_ms), lowest=False)
        sdpa = self.tflops(self.sdpa_ms)
        return (
            f"| {self.head_dim} | {self.batch} | {self.prefix} | {self.new} | {self.block_size} | "
            f"{self.ms:.3f} | {ours:.1f} | {ours / ceilings.matmul_tflops:.2f} | "
            f"{_cell(sdpa, '.1f')} | {_cell(_ratio(ours, sdpa), '.2f')} | "
            f"{_cell(self.tflops(self.vllm_ms), '.1f')} | "
            f"{_cell(self.tflops(self.sglang_ms), '.1f')} | {_cell(_ratio(ours, peer), '.2f')} | "
            f"{self.err:.1e}, {_cell(self.peer_err, '.1e')} | {self.timing} |"
        )


@dataclass(frozen=True, slots=True)
class SplitRow:
    head_dim: int
    batch: int
    context: int
    table: int
    default: int  # the kernel's choice for this shape
    wave_aware: int  # the candidate's
    slots: int  # CTAs the device runs at once of the decode variant (0: not known)
    ms: dict[str, float | None]  # split count -> ms (None: it raised)
    timing: str

    HEADER = (
        "| head_dim | batch | context | table | slots | default | wave-aware | "
        + " | ".join(str(n) for n in SPLIT_SWEEP)
        + " | fastest, of copy | timing |"
    )

    def cells(self, ceilings: roofline.Ceilings) -> str:
        fastest = _best(*self.ms.values())
        entries = self.batch * -(-self.table // 16)
        gbps = None
        if fastest:
            gbps = _decode_bytes(self.batch, self.context, self.head_dim, entries) / fastest / 1e6
        share = None if gbps is None else gbps / ceilings.copy_gbps
        marks = []
        for n in SPLIT_SWEEP:
            mark = ("*" if n == self.default else "") + ("w" if n == self.wave_aware else "")
            marks.append(f"{_cell(self.ms.get(str(n)), '.4f')}{mark}")
        default = f"{self.default}: {_cell(self.ms.get(str(self.default)), '.4f')}"
        wave = f"{self.wave_aware}: {_cell(self.ms.get(str(self.wave_aware)), '.4f')}"
        return (
            f"| {self.head_dim} | {self.batch} | {self.context} | {self.table} | {self.slots} | "
            f"{default} | {wave} | " + " | ".join(marks) + f" | {_cell(share, '.2f')} | "
            f"{self.timing} |"
        )


@dataclass(frozen=True, slots=True)
class DecodeTileRow:
    head_dim: int
    batch: int
    context: int
    table: int
    tile: tuple[int, ...]
    ms: float
    default_ms: float | None  # the default tile's, at this shape
    err: float | None
    timing: str

    HEADER = (
        "| head_dim | batch | context | table | tile (M x N, warps, stages) | ms | of copy | "
        "/default | max err | timing |"
    )

    def cells(self, ceilings: roofline.Ceilings) -> str:
        entries = self.batch * -(-self.table // 16)
        moved = _decode_bytes(self.batch, self.context, self.head_dim, entries)
        return (
            f"| {self.head_dim} | {self.batch} | {self.context} | {self.table} | "
            f"{_tile_name(self.tile)} | {self.ms:.4f} | "
            f"{moved / self.ms / 1e6 / ceilings.copy_gbps:.2f} | "
            f"{_cell(_ratio(self.ms, self.default_ms), '.2f')} | {_cell(self.err, '.1e')} | "
            f"{self.timing} |"
        )


@dataclass(frozen=True, slots=True)
class ExtendTileRow:
    head_dim: int
    batch: int
    prefix: int
    new: int
    tile: tuple[int, ...]
    flops: float
    splits: int  # the default's split count at this shape
    ms: float
    one_split_ms: float | None
    err: float
    timing: str

    HEADER = (
        "| head_dim | batch | prefix | new | tile (M x N, warps, stages) | TFLOP/s (default "
        "splits) | TFLOP/s (1 split) | of matmul | max err | timing |"
    )

    def cells(self, ceilings: roofline.Ceilings) -> str:
        ours = self.flops / self.ms / 1e9
        one = None if self.one_split_ms is None else self.flops / self.one_split_ms / 1e9
        best = _best(ours, one, lowest=False) or 0.0
        return (
            f"| {self.head_dim} | {self.batch} | {self.prefix} | {self.new} | "
            f"{_tile_name(self.tile)} | {ours:.1f} ({self.splits}) | {_cell(one, '.1f')} | "
            f"{best / ceilings.matmul_tflops:.2f} | {self.err:.1e} | {self.timing} |"
        )


ROWS: dict[str, Any] = {
    "decode": DecodeRow,
    "extend": ExtendRow,
    "splits": SplitRow,
    "decode-tiles": DecodeTileRow,
    "extend-tiles": ExtendTileRow,
}


def _tile_name(tile: Sequence[int]) -> str:
    m, n, warps, stages = tile
    return f"{m}x{n} w{warps} s{stages}"


# ------------------------------------------------------------------------------- the points


@contextlib.contextmanager
def _tiles(name: str, tile: Sequence[int]) -> Iterator[None]:
    """The kernel module's `name` tile (EXTEND_TILES or _DECODE_TILES) swapped for the run."""
    from radixkv.kernels import triton_paged_attention as module

    default = getattr(module, name)
    setattr(module, name, module.Tiles(*tile))
    try:
        yield
    finally:
        setattr(module, name, default)


def _paged(args: tuple[Any, ...], out: torch.Tensor, **options: Any) -> Callable[[], object]:
    from radixkv.kernels.triton_paged_attention import paged_attention

    return lambda: paged_attention(*args, out=out, **options)


class Measure:
    """The measurements of each section's points (state: the SDPA times shared by rows)."""

    def __init__(self, grid: Grid, peers: Peers, rows: dict[str, list[Any]]) -> None:
        self.grid, self.peers, self.rows = grid, peers, rows  # rows: the runner's, so far
        self.sdpa: dict[tuple[int, ...], float | None] = {}

    def _sdpa(self, key: tuple[int, ...], run: Callable[[], float]) -> float | None:
        if key not in self.sdpa:
            try:
                self.sdpa[key] = run()
            except Exception as e:
                print(f"  (SDPA at {key}: {type(e).__name__}: {str(e)[:200]})", flush=True)
                self.sdpa[key] = None
        return self.sdpa[key]

    def decode(self, head_dim: int, batch: int, context: int, block_size: int) -> DecodeRow:
        args, out = _decode_args(batch, context, block_size, head_dim)
        checked = batch * context <= self.grid.check_limit
        expected = _reference(args) if checked else None
        run = _paged(args, out)
        err = _error(run, out, expected) if expected is not None else None
        ms = _bench(run)
        gbps = _decode_bytes(batch, context, head_dim, args[3].numel()) / ms / 1e6
        sdpa = self._sdpa(
            ("decode", head_dim, batch, context), lambda: _sdpa_decode_ms(batch, context, head_dim)
        )
        peers: dict[str, float | None] = {}
        peer_err = None
        if block_size in self.grid.peer_block_sizes:
            peers, peer_err = self.peers.time(args, expected)
        return DecodeRow(
            head_dim,
            batch,
            context,
            block_size,
            ms,
            gbps,
            sdpa,
            peers.get("vLLM"),
            peers.get("SGLang"),
            err,
            peer_err,
            TIMING,
        )

    def extend(
        self, head_dim: int, batch: int, prefix: int, new: int, block_size: int
    ) -> ExtendRow:
        args, out = _extend_args(batch, prefix, new, block_size, head_dim)
        expected = _reference(args)
        run = _paged(args, out)
        err = _error(run, out, expected)
        ms = _bench(run)
        sdpa = self._sdpa(
            ("extend", head_dim, batch, prefix, new),
            lambda: _sdpa_extend_ms(batch, prefix, new, head_dim),
        )
        peers, peer_err = self.peers.time(args, expected)
        flops = _attention_flops(batch, prefix, new, head_dim)
        return ExtendRow(
            head_dim,
            batch,
            prefix,
            new,
            block_size,
            flops,
            ms,
            sdpa,
            peers.get("vLLM"),
            peers.get("SGLang"),
            err,
            peer_err,
            TIMING,
        )

    def splits(self, head_dim: int, batch: int, context: int, table: int) -> SplitRow:
        from radixkv.kernels.triton_paged_attention import default_num_kv_splits

        args, out = _decode_args(batch, context, 16, head_dim, table)
        span = args[3].shape[1] * 16  # the block table's capacity, as the engine's launch
        device = out.device
        chosen = default_num_kv_splits(batch * NUM_KV_HEADS, span, device)
        slots = decode_slots(args, out)
        wave = wave_aware_num_kv_splits(batch * NUM_KV_HEADS, span, slots)
        times: dict[str, float | None] = {}
        # Beyond one BLOCK_N tile of keys a split, more splits only add empty programs.
        counts = [n for n in SPLIT_SWEEP if n == 1 or context // n >= 64]
        for n in sorted({*counts, chosen, wave}):
            try:
                times[str(n)] = _bench(_paged(args, out, num_kv_splits=n))
            except Exception as e:
                print(f"  ({n} splits: {type(e).__name__}: {str(e)[:200]})", flush=True)
                times[str(n)] = None
        return SplitRow(head_dim, batch, context, table, chosen, wave, slots, times, TIMING)

    def decode_tile(
        self, head_dim: int, batch: int, context: int, table: int, tile: tuple[int, ...]
    ) -> DecodeTileRow:
        args, out = _decode_args(batch, context, 16, head_dim, table)
        checked = batch * context <= self.grid.check_limit
        with _tiles("_DECODE_TILES", tile):
            run = _paged(args, out)
            err = _error(run, out, _reference(args)) if checked else None
            ms = _bench(run)
        shape = (head_dim, batch, context, table)
        default = ms if tile == DECODE_SWEEP[0] else None
        for row in self.rows["decode-tiles"]:  # the default tile's, measured first
            if (
                row.head_dim,
                row.batch,
                row.context,
                row.table,
            ) == shape and row.tile == DECODE_SWEEP[0]:
                default = row.ms
        return DecodeTileRow(head_dim, batch, context, table, tile, ms, default, err, TIMING)

    def extend_tile(
        self, head_dim: int, batch: int, prefix: int, new: int, tile: tuple[int, ...]
    ) -> ExtendTileRow:
        args, out = _extend_args(batch, prefix, new, 16, head_dim)
        with _tiles("EXTEND_TILES", tile):
            run = _paged(args, out)
            err = _error(run, out, _reference(args))
            ms = _bench(run)
            try:
                one = _bench(_paged(args, out, num_kv_splits=1))
            except Exception as e:
                print(f"  (one split: {type(e).__name__}: {str(e)[:200]})", flush=True)
                one = None
            ((grid, _),) = _launches(args, out)  # the default split count: grid[2]
        flops = _attention_flops(batch, prefix, new, head_dim)
        return ExtendTileRow(
            head_dim, batch, prefix, new, tile, flops, grid[2], ms, one, err, TIMING
        )


# ------------------------------------------------------------ occupancy and the wave candidate


def ctas_per_sm(n_regs: int, shared_bytes: int, num_warps: int, props: Any = None) -> int:
    """CTAs of one kernel an SM holds at once: registers (allocated per warp in 256s), threads
    and shared memory (1 KiB reserved per CTA) each bound it. The limits are read off `props`
    (torch's device properties) where it has them, else Hopper's."""
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    threads = getattr(props, "max_threads_per_multi_processor", 2048)
    shared = getattr(props, "shared_memory_per_multiprocessor", 233472)
    per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = regs // max(1, per_warp * num_warps)
    by_threads = threads // (32 * num_warps)
    by_shared = shared // (shared_bytes + 1024)
    return max(0, min(by_regs, by_threads, by_shared, 32))


def _launches(args: tuple[Any, ...], out: torch.Tensor, **options: Any) -> list[tuple[Any, Any]]:
    """(grid, compiled kernel) of each launch of the attention kernel by one call (the compiled
    kernel is None under the interpreter)."""
    from radixkv.kernels import triton_paged_attention as module

    kernel = module._paged_attention_kernel
    seen: list[tuple[Any, Any]] = []
    own = kernel.__dict__.get("run")
    inner = kernel.run

    def recording(*a: Any, grid: Any, **kw: Any) -> Any:
        result = inner(*a, grid=grid, **kw)
        seen.append((grid, result))
        return result

    kernel.run = recording
    try:
        _paged(args, out, **options)()
    finally:
        if own is None:
            del kernel.run
        else:
            kernel.run = own
    return seen


def decode_slots(args: tuple[Any, ...], out: torch.Tensor) -> int:
    """CTAs the device runs at once of the decode variant these arguments launch (registers and
    shared memory of the compiled kernel); 0 where nothing is compiled (the interpreter)."""
    ((_, compiled),) = _launches(args, out, num_kv_splits=1)
    n_regs = getattr(compiled, "n_regs", None)
    if n_regs is None or out.device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(out.device)
    meta = compiled.metadata
    return ctas_per_sm(n_regs, meta.shared, meta.num_warps, props) * props.multi_processor_count


def wave_aware_num_kv_splits(num_programs: int, span: int, slots: int) -> int:
    """A candidate split count (not the kernel's): the one that minimises waves of programs
    times key tiles per program, ties to fewer splits. The default rounds its target of
    programs up (at batch 16 / 4k: 640 programs for 528 slots, 1.2 waves); this counts what
    the device holds (`slots`) and never starts a wave it cannot fill usefully."""
    from radixkv.kernels import triton_paged_attention as module

    if slots <= 0 or num_programs >= slots:
        return 1
    block_n = module._DECODE_TILES.block_n
    useful = max(1, min(-(-span // module._MIN_TOKENS_PER_SPLIT), module._MAX_KV_SPLITS))

    def cost(splits: int) -> tuple[int, int]:
        waves = -(-num_programs * splits // slots)
        return waves * -(-span // (splits * block_n)), splits

    return min(range(1, useful + 1), key=cost)


# --------------------------------------------------------------------------------- the runner


class Progress:
    """Each point's state in a JSON-lines file: started, done (with its row) or failed."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.done: dict[str, dict[str, Any]] = {}
        self.crashed: set[str] = set()
        if path is None or not path.exists():
            return
        started = set()
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry["state"] == "started":
                started.add(entry["key"])
            else:
                started.discard(entry["key"])
                if entry["state"] == "done":
                    self.done[entry["key"]] = entry
        self.crashed = started  # in flight when the process died

    def write(self, **entry: Any) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")


@dataclass
class Section:
    name: str
    title: str
    points: list[tuple[str, Callable[[], Any]]] = field(default_factory=list)


class Runner:
    """Runs the sections' points in order, guarded, printing each row as it completes."""

    def __init__(self, ceilings: roofline.Ceilings, progress: Progress, budget_s: float | None):
        self.ceilings, self.progress, self.budget_s = ceilings, progress, budget_s
        self.start = time.monotonic()
        self.rows: dict[str, list[Any]] = {name: [] for name in ROWS}
        self.failed: list[str] = []
        self.skipped: list[str] = []
        self.deferred: list[tuple[Section, str, Callable[[], Any]]] = []

    def _over_budget(self) -> bool:
        return self.budget_s is not None and time.monotonic() - self.start > self.budget_s

    def run(self, section: Section) -> None:
        t0 = time.monotonic()
        print(f"\n### {section.title}\n\n{ROWS[section.name].HEADER}", flush=True)
        print("|" + "---:|" * ROWS[section.name].HEADER.count(" |"), flush=True)
        skipped = 0
        for key, measure in section.points:
            if key in self.progress.done:
                row = ROWS[section.name](**_unjson(self.progress.done[key]["row"]))
                self._add(section, row)
            elif key in self.progress.crashed:
                print(f"| {key}: in flight when the earlier run died; retried last |", flush=True)
                self.deferred.append((section, key, measure))
            elif self._over_budget():
                skipped += 1
                self.skipped.append(key)
            else:
                self._measure(section, key, measure)
        if skipped:
            print(f"\n{skipped} points skipped: the {self.budget_s:.0f} s budget was spent")
        print(f"\n({section.name}: {time.monotonic() - t0:.1f} s)", flush=True)

    def _measure(self, section: Section, key: str, measure: Callable[[], Any]) -> None:
        self.progress.write(key=key, state="started")
        try:
            row = measure()
            _sync()
        except Exception as e:
            message = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            print(f"| {key}: FAILED: {message} |", flush=True)
            self.failed.append(key)
            self.progress.write(key=key, state="failed", error=message)
            return
        self.progress.write(key=key, state="done", row=asdict(row))
        self._add(section, row)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    def _add(self, section: Section, row: Any) -> None:
        self.rows[section.name].append(row)
        print(row.cells(self.ceilings), flush=True)

    def retry_deferred(self) -> None:
        if not self.deferred:
            return
        print("\n### Points that were in flight when the earlier run died, retried")
        for section, key, measure in self.deferred:
            if self._over_budget():
                self.skipped.append(key)
                continue
            print(ROWS[section.name].HEADER, flush=True)
            self._measure(section, key, measure)


def _unjson(row: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if k == "tile" else v for k, v in row.items()}


def sections(grid: Grid, measure: Measure, wanted: Sequence[str]) -> list[Section]:
    """Every point of the run, in order: the peers' tables first. A point's key names its
    section and arguments (the progress file's key)."""
    product = itertools.product
    plans = {
        "decode": (
            "Decode: radixkv, SDPA on contiguous K/V, vLLM, SGLang",
            ("hd", "b", "ctx", "block"),
            measure.decode,
            product(grid.head_dims, grid.batches, grid.contexts, grid.block_sizes),
        ),
        "extend": (
            "Extend over a cached prefix (bottom-right causal)",
            ("hd", "b", "prefix", "new", "block"),
            measure.extend,
            (
                (hd, *c, bs)
                for hd, c, bs in product(grid.head_dims, grid.extend, grid.peer_block_sizes)
            ),
        ),
        "splits": (
            "Decode ms by split count (block 16; * the default's choice, w the wave-aware one)",
            ("hd", "b", "ctx", "table"),
            measure.splits,
            ((hd, *shape) for hd, shape in product(grid.head_dims, grid.splits)),
        ),
        "decode-tiles": (
            "Decode ms by tile (block 16, default splits; default first)",
            ("hd", "b", "ctx", "table", "tile"),
            measure.decode_tile,
            ((hd, *s, t) for hd, s, t in product(grid.head_dims, grid.decode_tiles, DECODE_SWEEP)),
        ),
        "extend-tiles": (
            "Extend TFLOP/s by tile (block 16; default first)",
            ("hd", "b", "prefix", "new", "tile"),
            measure.extend_tile,
            ((hd, *c, t) for hd, c, t in product(grid.head_dims, grid.extend_tiles, EXTEND_SWEEP)),
        ),
    }
    out = []
    for name, (title, labels, fn, points) in plans.items():
        if name not in wanted:
            continue
        section = Section(name, title)
        for args in points:
            values = [_tile_name(v) if isinstance(v, tuple) else v for v in args]
            key = " ".join([name, *(f"{k}={v}" for k, v in zip(labels, values, strict=True))])
            section.points.append((key, _bind(fn, *args)))
        out.append(section)
    return out


def _bind(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


SECTIONS = tuple(ROWS)


# ---------------------------------------------------------------------------------- the goals


@dataclass(frozen=True, slots=True)
class Goal:
    name: str
    target: str
    measured: float | None  # None: the run has no configuration for it
    met: bool


def _worst(values: list[float], higher_is_better: bool) -> float | None:
    if not values:
        return None
    return min(values) if higher_is_better else max(values)


def goals(
    decode: list[DecodeRow], extend: list[ExtendRow], ceilings: roofline.Ceilings
) -> list[Goal]:
    """The issue's kernel goals as measured ratios: the worst configuration of each."""
    rows: list[Goal] = []

    def add(name: str, target: str, value: float | None, ok: Callable[[float], bool]) -> None:
        rows.append(Goal(name, target, value, value is None or ok(value)))

    for hd in sorted({r.head_dim for r in decode}):
        mine = [r for r in decode if r.head_dim == hd]
        b1 = [r.ms / r.sdpa_ms for r in mine if (r.batch, r.context) == (1, 16384) and r.sdpa_ms]
        add(
            f"hd {hd}: decode b=1 ctx=16k, paged / SDPA time",
            "<= 1.30",
            _worst(b1, False),
            lambda v: v <= 1.3,
        )
        share = 0.85 if hd >= 128 else 0.8
        b16 = [r.gbps / ceilings.copy_gbps for r in mine if (r.batch, r.context) == (16, 4096)]
        add(
            f"hd {hd}: decode b=16 ctx=4k, share of copy bandwidth",
            f">= {share:.2f}",
            _worst(b16, True),
            lambda v, s=share: v >= s,
        )
        spreads = []
        for (batch, _), group in itertools.groupby(mine, key=lambda r: (r.batch, r.context)):
            rates = [r.gbps for r in group]
            if batch >= 16 and len(rates) > 1:
                spreads.append((max(rates) - min(rates)) / (sum(rates) / len(rates)))
        add(
            f"hd {hd}: decode b>=16, block-size spread of GB/s",
            "<= 0.05",
            _worst(spreads, False),
            lambda v: v <= 0.05,
        )
        vs_peer = [r.ms / p for r in mine if (p := _best(r.vllm_ms, r.sglang_ms)) is not None]
        add(
            f"hd {hd}: decode time / faster peer's (worst shape)",
            "<= 1.00",
            _worst(vs_peer, False),
            lambda v: v <= 1.0,
        )
    for hd in sorted({r.head_dim for r in extend}):
        mine = [r for r in extend if r.head_dim == hd]
        ext = [r.sdpa_ms / r.ms for r in mine if r.sdpa_ms]
        add(
            f"hd {hd}: extend, paged / SDPA TFLOP/s",
            ">= 0.85",
            _worst(ext, True),
            lambda v: v >= 0.85,
        )
        vs_peer = [p / r.ms for r in mine if (p := _best(r.vllm_ms, r.sglang_ms)) is not None]
        add(
            f"hd {hd}: extend TFLOP/s / faster peer's (worst shape)",
            ">= 1.00",
            _worst(vs_peer, True),
            lambda v: v >= 1.0,
        )
    return rows


def _print_goals(rows: list[Goal]) -> list[str]:
    """Print the goal table; returns the missed goals."""
    print("\n### Goals (worst configuration of each)\n")
    print("| goal | target | measured | status |")
    print("|---|---:|---:|---|")
    for g in rows:
        measured = "-" if g.measured is None else f"{g.measured:.2f}"
        status = "not in this run" if g.measured is None else ("met" if g.met else "MISSED")
        print(f"| {g.name} | {g.target} | {measured} | {status} |")
    return [g.name for g in rows if not g.met]


# ----------------------------------------------------------------------------------- the run


def run_check() -> int:
    """The GPU correctness suite (bf16/fp16/fp32 against the reference), compiled kernels."""
    pytest_bin = Path(sys.executable).with_name("pytest")
    # Never `python -m pytest` from the repo root: it would put the top-level kernels/ on sys.path.
    cmd = [str(pytest_bin)] if pytest_bin.exists() else [sys.executable, "-P", "-m", "pytest"]
    cmd += ["-m", "gpu", "-q", "-rs", "tests/kernels"]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    return subprocess.call(cmd, cwd=REPO, env=env)


def _use_tiny() -> None:
    """The CPU dry run: the interpreter (read when the kernel modules are first imported), fp16
    (the interpreter's bf16 tl.dot is wrong), few heads, one call timed from the host."""
    global DEVICE, DTYPE, TIMING, NUM_Q_HEADS, NUM_KV_HEADS
    os.environ["TRITON_INTERPRET"] = "1"
    DEVICE, DTYPE, TIMING = "cpu", torch.float16, "once"
    NUM_Q_HEADS, NUM_KV_HEADS = 4, 2  # the interpreter's time grows with the programs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the issue's shapes only")
    parser.add_argument("--tiny", action="store_true", help="the CPU, the interpreter, tiny shapes")
    parser.add_argument("--check", action="store_true", help="run the GPU correctness suite")
    parser.add_argument(
        "--timing",
        choices=("graph", "host"),
        default="graph",
        help="time CUDA-graph replays of each call (default) or host launches (L2 flushed)",
    )
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma-separated: " + ",".join(SECTIONS)
    )
    parser.add_argument("--progress", type=Path, help="record points here; resume from it")
    parser.add_argument("--budget-s", type=float, help="stop measuring after this many seconds")
    args = parser.parse_args(argv)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    if unknown := [s for s in wanted if s not in SECTIONS]:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    if args.check:
        return run_check()
    global TIMING
    TIMING = args.timing
    if args.tiny:
        _use_tiny()
    elif not torch.cuda.is_available():
        print("kernel_bench needs a CUDA device (or --tiny for the CPU)", file=sys.stderr)
        return 2
    import triton

    grid = TINY if args.tiny else QUICK if args.quick else FULL
    device = torch.device(DEVICE)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (interpreter)"
    print(f"## Kernels on {name}\n")
    print(f"torch {torch.__version__}, triton {triton.__version__}; timing: {TIMING}")
    ceilings = roofline.measure(device, DTYPE, tiny=args.tiny)
    print(ceilings.describe())
    peers = Peers.load()
    print(
        "peers: vLLM 0.32 and SGLang 0.5.23 Triton kernels"
        if peers.loaded
        else f"peers: not loaded ({peers.why_not})"
    )
    print(f"shapes: {NUM_Q_HEADS} q heads over {NUM_KV_HEADS} kv heads, {str(DTYPE)[6:]}")
    runner = Runner(ceilings, Progress(args.progress), args.budget_s)
    for section in sections(grid, Measure(grid, peers, runner.rows), wanted):
        runner.run(section)
    runner.retry_deferred()
    _print_goals(goals(runner.rows["decode"], runner.rows["extend"], ceilings))
    print(
        f"\n{sum(len(r) for r in runner.rows.values())} points measured or reprinted, "
        f"{len(runner.failed)} failed, {len(runner.skipped)} skipped for the budget, "
        f"in {time.monotonic() - runner.start:.0f} s"
    )
    return 1 if runner.failed else 0


if __name__ == "__main__":
    sys.exit(main())

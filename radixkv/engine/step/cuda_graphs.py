"""CUDA-graph decode: the model forward of a decode step, captured once per batch-size bucket.

An eager decode step of a small model is mostly Python: transformers' modules launch hundreds of
small kernels, each costing more host time than GPU time. A captured graph replays them all in one
launch. What makes that possible:

* static inputs: one device buffer laid out as a `StepLayout` of `bucket` one-token rows over
  `max_blocks` block-table columns (ids, positions, slot mapping, block tables, seq_lens,
  cu_seqlens_q); a replay packs the step into the pinned host buffer and copies it in one
  non-blocking copy, padding the rows past the step's up to the bucket (`step_inputs`: a pad row
  writes nowhere and reads block 0);
* fixed launch parameters: every kernel's grid and split-KV count is computed from tensor shapes
  only (the bucket and `max_blocks * block_size`, the longest context a row can have), never from
  per-step values, so the captured launches are right for every step of that bucket;
* one `AttentionMetadata` per bucket and KV cache group, built at capture over the static
  buffers (and a latent group's plan of it: every decode row attends in the absorbed form, so
  one plan serves every replay).

Prefill and mixed steps stay eager: their token counts vary too much to bucket.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixkv.engine.step.step_inputs import (
    InputStager,
    StepLayout,
    bucket_layout,
    pack_step,
    split_step,
)
from radixkv.kernels import CompileCounter
from radixkv.scheduler.output import ScheduledRequest

if TYPE_CHECKING:
    from radixkv.engine.step.kv_tensors import StepPlan

logger = logging.getLogger(__name__)


# forward(views of a split step buffer, each KV cache group's metadata, logits to keep) ->
# logits [1, T, vocab]
DecodeForward = Callable[..., torch.Tensor]
# Writes input tokens that are still on the device into a step's device `input_ids` (overlapped
# steps: `radixkv.engine.step.launch`).
TokenFeed = Callable[[torch.Tensor], None]


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, up to and including
    `max_num_seqs` (a step of n rows replays the smallest bucket >= n: at most 7 pad rows past
    8, where a row costs little next to the weights every row shares)."""
    assert max_num_seqs >= 1, f"EngineConfig checks max_num_seqs, got {max_num_seqs!r}"
    sizes = {b for b in (1, 2, 4, 8) if b <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def choose_bucket(num_rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `num_rows` rows; None when none does (the step runs eager)."""
    i = bisect.bisect_left(buckets, num_rows)
    return buckets[i] if i < len(buckets) else None


def graph_max_blocks(max_model_len: int, block_size: int, num_blocks: int) -> int:
    """Block-table columns of the static buffers: the blocks of the longest sequence, which also
    cannot hold more blocks than the pool has."""
    return min(-(-max_model_len // block_size), num_blocks)


def is_decode_step(rows: Sequence[ScheduledRequest]) -> bool:
    """Every row is one new token whose logits are sampled: the shape a decode graph captures."""
    return all(len(r.token_ids) == 1 and r.sample for r in rows)


def capture_graph(
    fn: Callable[[], torch.Tensor], device: torch.device, pool: object | None
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`fn` run once off the capture stream (it compiles the Triton kernels and runs lazy inits),
    then captured into a graph sharing the memory `pool`: (the graph, the output it writes)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class DecodeGraphs:
    """Decode forwards captured per bucket (`decode_buckets(max_num_seqs)`), over one static input
    buffer of `graph_max_blocks` block-table columns and one memory pool.

    `kv_shapes[g]`: one layer's KV shape of KV cache group g (the first group's pool bounds
    the block-table columns: every group's table is as wide); `plans[g]` its step plan, if any
    (`kv_tensors.GroupKV.step_plan`).

    Invariants: `static` holds the inputs of the last replay (or the pad rows of the capture);
    each bucket's graph reads the leading `bucket_layout(bucket, max_blocks).total` entries and
    writes its logits [1, bucket, vocab] into its own output, overwritten by each replay.
    """

    def __init__(
        self,
        forward: DecodeForward,
        stager: InputStager,
        kv_shapes: Sequence[tuple[int, ...]],
        max_num_seqs: int,
        max_model_len: int,
        compiles: CompileCounter | None = None,
        plans: Sequence[StepPlan | None] = (),
    ) -> None:
        self.buckets = decode_buckets(max_num_seqs)
        self.plans = tuple(plans)
        num_blocks, self.block_size = kv_shapes[0][:2]
        self.max_blocks = graph_max_blocks(max_model_len, self.block_size, num_blocks)
        self.stager = stager
        self.kv_shapes = tuple(kv_shapes)
        largest = self._layout(self.buckets[-1])
        self.static = torch.zeros(largest.total, dtype=torch.int32, device=stager.device)
        # bucket -> (its graph, the logits buffer the graph writes)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0  # decode steps computed by a graph (a statistic)
        self.capture_s = 0.0  # seconds the capture took, compiles included (a statistic)
        self.capture_compile_s = 0.0  # of which Triton JIT compiles (a statistic)
        compile_s = compiles.seconds if compiles is not None else 0.0
        self._capture_all(forward)
        if compiles is not None:
            self.capture_compile_s = compiles.seconds - compile_s

    def _layout(self, bucket: int) -> StepLayout:
        return bucket_layout(bucket, self.max_blocks, len(self.kv_shapes))

    def can_run(self, rows: Sequence[ScheduledRequest]) -> bool:
        """Whether a replay computes this step: decode rows only, a bucket for their number,
        block tables within `max_blocks`."""
        return (
            len(rows) <= self.buckets[-1]
            and is_decode_step(rows)
            and max(len(r.block_tables[0]) for r in rows) <= self.max_blocks
        )

    def run(self, rows: Sequence[ScheduledRequest], feed: TokenFeed | None = None) -> torch.Tensor:
        """Replay the bucket of `rows` (`can_run` must hold). Returns the logits of the real rows,
        [len(rows), vocab], a view valid until the next replay. `feed` writes device-side input
        tokens into the static `input_ids` before the replay."""
        bucket = choose_bucket(len(rows), self.buckets)
        assert bucket is not None, f"no bucket for {len(rows)} rows"
        graph, logits = self._graphs[bucket]
        layout = self._layout(bucket)
        self.stager.stage(rows, (), self.block_size, layout, out=self.static)
        if feed is not None:
            feed(self.static[:bucket])  # one token per row: the bucket's input_ids come first
        graph.replay()
        self.num_replays += 1
        return logits[0, : len(rows)]

    def _capture_all(self, forward: DecodeForward) -> None:
        device = self.static.device
        logger.info(
            "capturing CUDA graphs of the decode forward: batch sizes %s, %d block-table columns",
            self.buckets,
            self.max_blocks,
        )
        t0 = time.perf_counter()
        pool = None
        # Largest first: the smaller graphs then fit in the memory the largest one reserved.
        for bucket in reversed(self.buckets):
            layout = self._layout(bucket)
            host = torch.from_numpy(np.empty(layout.total, dtype=np.int32))
            pack_step((), (), self.block_size, layout, host.numpy())  # pad rows only
            self.static[: layout.total].copy_(host)
            views, metas = split_step(layout, host, self.static, self.kv_shapes, plans=self.plans)
            fn = partial(forward, views, metas, 0)
            graph, logits = capture_graph(fn, device, pool)
            pool = graph.pool()
            self._graphs[bucket] = (graph, logits)
            logger.debug("captured decode graph for batch %d", bucket)
        torch.cuda.synchronize(device)
        self.capture_s = time.perf_counter() - t0
        logger.info("captured %d decode graphs in %.2f s", len(self.buckets), self.capture_s)

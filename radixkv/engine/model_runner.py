"""Model runner: one packed forward per scheduler step over the paged KV cache.

Layers of the runner:

* `KVCacheSpec` / `plan_num_blocks`: the shape of one KV block of the model and how many fit the
  memory budget (CPU: `kv_cache_bytes`, default 512 MiB; CUDA: a fraction of free device memory).
* `ModelRunner`: sizes and owns the KV tensors, stacked over layers as
  `[num_layers, num_blocks, block_size, kv_heads, head_dim]` (K and V separately; a model with
  window layers has two pairs, its full layers' over `num_blocks` and its window layers' over
  `num_window_blocks`, the window group's pool: `radixkv.cache.hybrid`), switches the
  model to the ``"radixkv"`` attention (see `radixkv.engine.attention`), and runs `execute(step)`:

      copies (copy-on-write of partial blocks)  ->  metadata  ->  model forward  ->  logits

  Every row of the step is packed into one batch row of `num_tokens` tokens with explicit
  position ids, so prefill chunks and decode tokens of different requests share one forward.
  The step's integer inputs travel in one buffer, one host->device copy (`step_inputs`).
* On CUDA, unless `enforce_eager`, decode steps replay a CUDA graph captured at start-up per
  batch-size bucket (`cuda_graphs`, window layers' tables and slots included); prefill and mixed
  steps, and every step on the CPU, run eager.
* On Triton (CUDA), Llama models get fused RMSNorm and RoPE + K/V store modules (`fused_llama`);
  other models, and every model on the torch backend, keep transformers' modules and the generic
  attention hooks.
* `warm_up()` (the engine calls it once) runs a prefill, a mixed and a decode step so the Triton
  kernels compile every variant before the first request; a compile after that is logged as a
  warning with the step's shape (`radixkv.kernels.compile_counter`).

A step syncs with the device only when its logits are read back. The metadata's values are
re-checked per step only with `validate_steps` (default: the RADIXKV_VALIDATE_STEPS environment
variable); the scheduler builds them, and the public kernel API still checks what it is given.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from radixkv import kernels
from radixkv.cache.window import tier_margin, window_budget
from radixkv.engine.attention import PagedKVCache, register_attention
from radixkv.engine.attention_layout import probe_attention
from radixkv.engine.config import EngineConfig
from radixkv.engine.cuda_graphs import DecodeGraphs, TokenFeed
from radixkv.engine.fused_llama import fuse_llama_modules, unfuse_llama_modules
from radixkv.engine.step_inputs import InputStager, StepLayout, stage_step
from radixkv.kernels import AttentionMetadata
from radixkv.scheduler.output import BlockCopy, GroupPlan, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024**2
DEFAULT_GPU_MEMORY_FRACTION = 0.8  # of the free device memory after the weights are loaded


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of the paged KV cache of one model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K + V of one block over all layers."""
        elem = self.dtype.itemsize
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def plan_num_blocks(
    spec: KVCacheSpec,
    device: torch.device,
    *,
    num_blocks: int | None = None,
    kv_cache_bytes: int | None = None,
    reserved_bytes: int = 0,
) -> int:
    """Number of KV blocks: `num_blocks` if given, else what `kv_budget` holds less
    `reserved_bytes` (the window pool's). Raises ValueError when that holds no block (the sizes
    themselves were checked by `EngineConfig`). A spec of no layers (a model whose layers are
    all windowed: its full group is bookkeeping only) is sized as one layer's."""
    if num_blocks is not None:
        return num_blocks
    budget = kv_budget(device, kv_cache_bytes)
    bytes_per_block = spec.bytes_per_block or replace(spec, num_layers=1).bytes_per_block
    n = (budget - reserved_bytes) // bytes_per_block
    if n < 1:
        after = f" after the window pool's {reserved_bytes}" if reserved_bytes else ""
        raise ValueError(
            f"kv_cache_bytes={budget} holds no KV block{after} ({bytes_per_block} bytes each)"
        )
    return n


def kv_budget(device: torch.device, kv_cache_bytes: int | None) -> int:
    """The KV cache's bytes: `kv_cache_bytes`, else (CUDA) a fraction of free device memory or
    (CPU) DEFAULT_CPU_KV_CACHE_BYTES."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_GPU_MEMORY_FRACTION)
    return DEFAULT_CPU_KV_CACHE_BYTES


class ModelRunner:
    """Runs scheduler steps on a Hugging Face causal LM with a paged KV cache.

    Reads `config`'s block_size, num_blocks / kv_cache_bytes (`plan_num_blocks` sizes the pool:
    `num_blocks` is what it holds), enforce_eager, and for the decode graphs max_num_seqs (their
    batch sizes) and max_model_len (their block-table width; None: what the pool holds); a step
    past either runs eager.

    Invariants: `k_cache` / `v_cache` have shape [num_full_layers, num_blocks, block_size,
    kv_heads, head_dim] on the model's device in the model's dtype (every layer is full in a
    model without window layers), `window_k_cache` / `window_v_cache` [num_window_layers,
    num_window_blocks, ...] (None without window layers); `layer_kv[i]` is layer i's pair of
    views into them; the model's attention implementation is ``"radixkv"`` for as long as the
    runner lives; `decode_graphs` is None on the CPU and with `enforce_eager`.
    """

    def __init__(
        self, model: Any, config: EngineConfig, *, validate_steps: bool | None = None
    ) -> None:
        self.model = model
        param = next(model.parameters())
        self.device = param.device
        self.block_size = block_size = config.block_size
        # transformers renamed the forward's cache argument (`past_key_values` -> `cache`, the old
        # name goes in 5.40): pass the one this version declares.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        unfuse_llama_modules(model)  # fused by an earlier runner: the probe needs the originals
        self.layout = probe_attention(model, name, self._cache_arg)  # refuses what it cannot run
        self.window = self.layout.window
        windowed = [k.window is not None for k in self.layout.layers]  # in the window group
        heads, head_dim = self.layout.num_kv_heads, self.layout.head_dim
        spec = KVCacheSpec(windowed.count(False), heads, head_dim, block_size, param.dtype)
        window_spec = replace(spec, num_layers=windowed.count(True))
        # A budget in bytes, read once, when blocks are not counted out.
        budget = (
            None if config.num_blocks is not None else kv_budget(self.device, config.kv_cache_bytes)
        )
        self.num_window_blocks = num_window_blocks = plan_window_blocks(
            self.window, config, window_spec.bytes_per_block, budget
        )
        self.num_blocks = num_blocks = plan_num_blocks(
            spec,
            self.device,
            num_blocks=config.num_blocks,
            kv_cache_bytes=budget,
            reserved_bytes=num_window_blocks * window_spec.bytes_per_block,
        )
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        if validate_steps is None:
            validate_steps = os.environ.get("RADIXKV_VALIDATE_STEPS", "0") not in ("", "0")
        self.validate_steps = validate_steps
        self.k_cache, self.v_cache = self._kv_tensors(spec, num_blocks)
        self.kv_cache_shape = tuple(self.k_cache.shape[1:])  # one layer's, as the kernels take it
        self.window_k_cache = self.window_v_cache = self.window_kv_cache_shape = None
        full_kv = iter(zip(self.k_cache, self.v_cache, strict=True))
        window_kv = iter(())
        if self.window is not None:
            self.window_k_cache, self.window_v_cache = self._kv_tensors(
                window_spec, num_window_blocks
            )
            self.window_kv_cache_shape = tuple(self.window_k_cache.shape[1:])
            window_kv = iter(zip(self.window_k_cache, self.window_v_cache, strict=True))
        self.layer_kv = [next(window_kv if w else full_kv) for w in windowed]
        model.set_attn_implementation(register_attention())
        # The fused Llama modules run where their kernels are Triton; on the torch backend
        # transformers' own modules are the same computation, and cheaper to call.
        on_triton = kernels.backend_for(self.device) == "triton"
        self.fused_modules = on_triton and fuse_llama_modules(model)
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB) + %d window blocks (%.1f MiB) on %s; %s",
            num_blocks,
            block_size,
            num_blocks * spec.bytes_per_block / 2**20,
            num_window_blocks,
            num_window_blocks * window_spec.bytes_per_block / 2**20,
            self.device,
            self.layout.describe(),
        )
        self.stager = InputStager(self.device)
        # Triton's compile counter, when the kernels run on Triton (on the CPU nothing compiles,
        # and triton need not be imported at all).
        self._compiles = kernels.compile_counter() if on_triton else None
        self.decode_graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            # Without a max_model_len no sequence can outgrow the pool.
            max_len = config.max_model_len or num_blocks * block_size
            self.decode_graphs = self.capture_decode_graphs(config.max_num_seqs, max_len)
        self._compiles_seen = self._compiles.count if self._compiles is not None else 0

    def _kv_tensors(self, spec: KVCacheSpec, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed K and V of `spec`'s layers, not empty: slots past a request's length are masked,
        but NaN garbage could leak through a masked product in a reference kernel (and pad rows
        of a graph read block 0)."""
        shape = (spec.num_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        k = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        return k, torch.zeros_like(k)

    def capture_decode_graphs(self, max_num_seqs: int, max_len: int) -> DecodeGraphs | None:
        """The decode step's CUDA graphs, or None, with a warning, for a model whose forward
        cannot be captured (transformers' grouped MoE experts copy host tensors to the device
        as they run): its decode steps then run eager, as on a CPU."""
        try:
            with torch.inference_mode():
                return DecodeGraphs(
                    self._forward,
                    self.stager,
                    self.kv_cache_shape,
                    max_num_seqs,
                    max_len,
                    self._compiles,
                    self.window_kv_cache_shape,
                )
        except RuntimeError as exc:
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            logger.warning("CUDA graphs off: the decode step cannot be captured (%s)", why)
            return None

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run a prefill, a mixed (decode + prefill chunk + copy-on-write) and an eager decode
        step over scratch blocks, so every Triton kernel variant the engine's steps use is
        compiled now rather than inside the first requests. Writes garbage K/V into the pool's
        first blocks: call it before any request runs. Nothing to do on the torch backend."""
        if self._compiles is None:
            return
        t0, compiles = time.perf_counter(), self._compiles.count
        num_blocks = min(self.num_blocks, self.num_window_blocks or self.num_blocks)
        for step in warm_up_steps(num_blocks, self.block_size, window=self.window is not None):
            self._execute_eager(step)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._compiles_seen = self._compiles.count
        elapsed = time.perf_counter() - t0
        logger.info(
            "warm-up: %d Triton compiles in %.2f s", self._compiles_seen - compiles, elapsed
        )

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, feed: TokenFeed | None = None) -> torch.Tensor:
        """Run one step. Returns fp32 logits [num_sampled_rows, vocab] for the rows with
        `sample=True`, in row order. `feed`, when given, writes input tokens still on the device
        (an overlapped step's placeholders) into the step's device `input_ids` before the
        forward."""
        assert not step.is_empty, "execute() needs at least one scheduled row"
        logits = self._execute(step, feed)
        counter = self._compiles
        if counter is not None and counter.count > self._compiles_seen:
            names = counter.names_since(self._compiles_seen)
            logger.warning(
                "%d Triton JIT compile(s) after start-up, in a step of %d rows and %d tokens "
                "(a shape the warm-up missed): %s",
                counter.count - self._compiles_seen,
                len(step.rows),
                step.num_batched_tokens,
                ", ".join(names),
            )
            self._compiles_seen = counter.count
        return logits

    def _execute(self, step: SchedulerOutput, feed: TokenFeed | None = None) -> torch.Tensor:
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(step.rows):
            copies = step.plan(0).copies
            if copies:  # the copies alone, before the replay
                layout = StepLayout(0, 0, 0, num_copies=len(copies))
                _, dev = self.stager.stage((), copies, self.block_size, layout)
                self._copy_blocks(layout.split(dev))
            if step.plan(1).copies:
                self._copy_window_blocks(step.plan(1).copies)
            # A copy: the graph overwrites its output buffer on the next replay.
            return graphs.run(step.rows, feed).to(torch.float32, copy=True)
        return self._execute_eager(step, feed)

    def _execute_eager(self, step: SchedulerOutput, feed: TokenFeed | None = None) -> torch.Tensor:
        views, meta, window_meta = stage_step(
            step,
            self.stager,
            self.kv_cache_shape,
            self.window_kv_cache_shape,
            block_size=self.block_size,
            vocab_size=self.vocab_size,
            validate=self.validate_steps,
        )
        if feed is not None:
            feed(views["input_ids"])
        if step.plan(0).copies:
            self._copy_blocks(views)
        if step.plan(1).copies:
            self._copy_window_blocks(step.plan(1).copies)
        # An empty sample_idx (only non-final prefill chunks) still writes K/V and costs no lm_head.
        return self._forward(views, meta, views["sample_idx"], window_meta)[0].float()

    def _forward(
        self,
        views: dict[str, torch.Tensor],
        meta: AttentionMetadata,
        keep: torch.Tensor | int = 0,
        window_meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """The model over one packed step (`views`: its split buffer): logits [1, num_kept, vocab]
        of the tokens `keep` indexes (0: every token's)."""
        cache = PagedKVCache(self.layer_kv, meta, self.layout.layers, window_meta)
        out = self.model(
            input_ids=views["input_ids"][None],
            position_ids=views["positions"][None],
            **{self._cache_arg: cache},
            use_cache=True,
            logits_to_keep=keep,
            radixkv_cache=cache,
        )
        return out.logits

    def _copy_blocks(self, views: dict[str, torch.Tensor]) -> None:
        """The copy-on-write block copies of a split step buffer, in every layer's K and V."""
        kernels.copy_blocks(
            self.k_cache, self.v_cache, views["copy_src"], views["copy_dst"], views["copy_slots"]
        )

    def _copy_window_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Copy-on-write of window blocks (admissions with a partial hit: rare, unpacked)."""
        src, dst, slots = (
            torch.tensor([getattr(c, name) for c in copies], dtype=torch.int32, device=self.device)
            for name in ("src_block", "dst_block", "num_slots")
        )
        kernels.copy_blocks(self.window_k_cache, self.window_v_cache, src, dst, slots)


def plan_window_blocks(
    window: int | None, config: EngineConfig, bytes_per_block: int, budget: int | None
) -> int:
    """The window pool's blocks (0 without window layers): `config.num_window_blocks`, or room
    for `max_num_seqs` requests' windows and chunks, twice over (tails share them), at most
    half of a `budget` in bytes (None: the full pool's blocks are counted out instead) unless
    that holds not one request's. Raises ValueError for a pool that holds not one request's."""
    if window is None:
        return 0
    B, chunk = config.block_size, min(config.chunked_prefill_size, config.max_num_batched_tokens)
    need = window_budget(window, B, chunk, tier_margin(bool(config.host_cache_bytes)))
    if config.num_window_blocks is None:
        blocks = 2 * config.max_num_seqs * need
        return blocks if budget is None else max(need, min(blocks, budget // 2 // bytes_per_block))
    if config.num_window_blocks < need:
        raise ValueError(
            f"num_window_blocks={config.num_window_blocks} holds not one request's window "
            f"({need} blocks of {B} tokens for a window of {window} and chunks of {chunk})"
        )
    return config.num_window_blocks


def warm_up_steps(
    num_blocks: int, block_size: int, *, window: bool = False
) -> list[SchedulerOutput]:
    """The warm-up's steps over blocks [0, num_blocks): a prefill, a mixed step (a decode row, a
    prefill chunk and a copy-on-write) when the pool has two blocks, and a decode step of up to
    two rows (`window`: each row's window table is its full one). Their kernels cover every
    compiled variant: a step is decode-like (one token per row) or not, everything else a
    kernel specializes on is fixed per model (see `radixkv.kernels.triton_paged_attention`).
    The decode rows' block tables are wide (a context over 256 tokens), so on a GPU they split
    the context and the merge kernel compiles too."""
    B = block_size

    def row(name: str, num_tokens: int, first_block: int, width: int = 0) -> ScheduledRequest:
        """`num_tokens` tokens from position 0 in consecutive blocks from `first_block`, the
        table padded with block 0 to `width` columns."""
        blocks = tuple(range(first_block, first_block + -(-num_tokens // B)))
        table = blocks + (0,) * (width - len(blocks))
        tables = (table, table) if window else (table,)
        return ScheduledRequest(f"warm-up-{name}", (0,) * num_tokens, 0, tables, True)

    steps = [SchedulerOutput(rows=(row("prefill", min(16, num_blocks * B), 0),))]
    if num_blocks >= 2:
        mixed = (row("decode", 1, 0), row("chunk", min(8, (num_blocks - 1) * B), 1))
        steps.append(SchedulerOutput(rows=mixed, plans=(GroupPlan(copies=(BlockCopy(0, 1, 1),)),)))
    decode = tuple(row(f"decode-{i}", 1, i, width=-(-512 // B)) for i in range(min(2, num_blocks)))
    steps.append(SchedulerOutput(rows=decode))
    return steps

"""Model runner: one packed forward per scheduler step over the paged KV cache.

* `ModelRunner` sizes and owns the KV tensors, one pair (K, V) per KV cache group, stacked over
  the group's layers as `[num_layers, num_blocks, block_size, kv_heads, head_dim]` (`kv_tensors`:
  each group's pool sized by its kind; a model with window layers has two groups; a model with
  multi-head latent attention keeps one latent tensor in its tree group instead, read by the
  MLA modules the probe swapped in), binds every layer to its group's views, switches the model
  to the ``"radixkv"`` attention (see `radixkv.engine.step.attention`), and runs `execute(step)`:

      copies (copy-on-write of partial blocks)  ->  metadata  ->  model forward  ->  logits

  A hybrid model's recurrent layers keep no KV: their state group (the cache's last) is slots
  of one state of every recurrent layer (`recurrent.RecurrentStates`), a row's table its
  request's slot. A step first runs the group's slot copies in plan order (snapshots of earlier
  rows' states, then resumes from snapshots), then hands the packed layers the rows' slots
  (`RecurrentMetadata`: a row from position 0 starts from a zero state, any other from its
  slot). With compact snapshots (`snapshot_dtype` bf16 / int8) the slots past `max_num_seqs`
  are snapshots in that format (`recurrent.compact`), and a copy into or out of one converts.
  Its decode steps run eager (no CUDA graphs yet).

  Every row of the step is packed into one batch row of `num_tokens` tokens with explicit
  position ids, so prefill chunks and decode tokens of different requests share one forward.
  The step's integer inputs travel in one buffer, one host->device copy (`step_inputs`), with
  one block table, slot mapping and copy list per group.
* On CUDA, unless `enforce_eager`, decode steps replay a CUDA graph captured at start-up per
  batch-size bucket (`cuda_graphs`, every group's tables and slots included); prefill and mixed
  steps, and every step on the CPU, run eager.
* On Triton (CUDA), Llama models get fused RMSNorm and RoPE + K/V store modules (`fused_llama`);
  other models, and every model on the torch backend, keep transformers' modules and the generic
  attention hooks.
* `warm_up()` (the engine calls it once) runs a prefill, a mixed and a decode step (for latent
  layers also an extend over a context and a prefill of two expanded chunks) so the Triton
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
from typing import Any

import torch

from radixkv import kernels
from radixkv.engine.config import EngineConfig
from radixkv.engine.model.attention_layout import probe_attention
from radixkv.engine.step.attention import PagedKVCache, register_attention
from radixkv.engine.step.cpu_memory import keep_freed_memory
from radixkv.engine.step.cpu_weights import use_cpu_linears
from radixkv.engine.step.cuda_graphs import DecodeGraphs, TokenFeed
from radixkv.engine.step.fused_llama import fuse_llama_modules, unfuse_llama_modules
from radixkv.engine.step.kv_tensors import allocate_group_kv, plan_state_slots
from radixkv.engine.step.recurrent import RecurrentStates, RecurrentStep
from radixkv.engine.step.step_inputs import InputStager, StepLayout, region, stage_step
from radixkv.kernels import AttentionMetadata, RecurrentMetadata
from radixkv.kernels.latent_reference import expanded_chunk_size
from radixkv.scheduler.output import BlockCopy, GroupPlan, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs scheduler steps on a Hugging Face causal LM with a paged KV cache.

    Reads `config`'s block_size, the pool sizes (num_blocks / kv_cache_bytes, and each group
    kind's own: `kv_tensors`), enforce_eager, and for the decode graphs max_num_seqs (their
    batch sizes) and max_model_len (their block-table width; None: what the tree group's pool
    holds); a step past either runs eager.

    Invariants: `kv[g]` holds KV cache group g's K and V (or its latent), [len(kv[g].layers),
    num_blocks, block_size, heads, width], on the model's device in the model's dtype (`kv[0]`
    the tree's group: every layer, in a model without window layers); `layer_kv[i]` is layer
    i's views into its group's tensors (`GroupKV.layer_views`), `layer_groups[i]` that group;
    `step_plans[g]` what group g's layers read per step beside its metadata (None: nothing);
    the model's attention implementation is ``"radixkv"`` for as long as the runner lives;
    `decode_graphs` is None on the CPU, with `enforce_eager` and for a model with recurrent
    layers; `states` holds those layers' slots (None without any), cache group `state_group`
    (after the KV groups), whose spec and size close `group_specs` and `group_sizes`.
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
        state = self.layout.state_group(param.dtype, config.snapshot_dtype)
        self.states: RecurrentStates | None = None
        state_bytes = 0
        if state is not None:
            slots = plan_state_slots(state, config, self.device)
            compact = config.snapshot_dtype != "exact"
            self.states = RecurrentStates(
                self.layout.recurrent,
                slots,
                param.dtype,
                self.device,
                num_running=config.max_num_seqs if compact else None,
                snapshot_dtype=config.snapshot_dtype,
            )
            state_bytes = self.states.nbytes()
        self.kv = allocate_group_kv(
            self.layout.cache_groups(),
            config,
            num_kv_heads=self.layout.num_kv_heads,
            head_dim=self.layout.head_dim,
            dtype=param.dtype,
            device=self.device,
            reserved_bytes=state_bytes,
        )
        self.state_group = len(self.kv)  # its index in the cache's groups, when there is one
        kv_specs = tuple(kv.spec for kv in self.kv)
        self.group_specs = kv_specs if state is None else (*kv_specs, state.spec)
        kv_sizes = tuple(kv.num_blocks for kv in self.kv)
        self.group_sizes = kv_sizes if self.states is None else (*kv_sizes, slots)
        self.kv_shapes = tuple(kv.layer_shape for kv in self.kv)  # one layer's, per group
        # Each layer's group and its views into the group's tensors, by layer index.
        bound = {
            layer: (g, kv.layer_views(i))
            for g, kv in enumerate(self.kv)
            for i, layer in enumerate(kv.layers)
        }
        self.step_plans = tuple(kv.step_plan() for kv in self.kv)
        layers = range(len(self.layout.layers))
        # a recurrent layer reads its state through the step's `RecurrentStep`, no KV views
        self.layer_groups = [bound.get(i, (self.state_group,))[0] for i in layers]
        self.layer_kv = [bound.get(i, (None, ()))[1] for i in layers]
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        if validate_steps is None:
            validate_steps = os.environ.get("RADIXKV_VALIDATE_STEPS", "0") not in ("", "0")
        self.validate_steps = validate_steps
        model.set_attn_implementation(register_attention())
        # The fused Llama modules run where their kernels are Triton; on the torch backend
        # transformers' own modules are the same computation, and cheaper to call.
        on_triton = kernels.backend_for(self.device) == "triton"
        self.fused_modules = on_triton and fuse_llama_modules(model)
        if self.device.type == "cpu":
            use_cpu_linears(model)
            keep_freed_memory()
        pools = " + ".join(
            f"{kv.num_blocks} {kv.label} blocks ({kv.num_blocks * kv.bytes_per_block / 2**20:.1f}"
            " MiB)"
            for kv in self.kv
        )
        if self.states is not None:
            compact = self.states.snapshot_dtype
            pools += (
                f" + {self.states.num_slots} recurrent-state slots "
                f"({state_bytes / 2**20:.1f} MiB"
                + ("" if compact == "exact" else f", snapshots {compact}")
                + ")"
            )
        logger.info(
            "KV cache: %s of %d tokens on %s; %s",
            pools,
            block_size,
            self.device,
            self.layout.describe(),
        )
        self.stager = InputStager(self.device)
        # Triton's compile counter, when the kernels run on Triton (on the CPU nothing compiles,
        # and triton need not be imported at all).
        self._compiles = kernels.compile_counter() if on_triton else None
        self.decode_graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager and self.states is None:
            # Without a max_model_len no sequence can outgrow the pool.
            max_len = config.max_model_len or self.kv[0].num_blocks * block_size
            self.decode_graphs = self.capture_decode_graphs(config.max_num_seqs, max_len)
        self._compiles_seen = self._compiles.count if self._compiles is not None else 0

    def capture_decode_graphs(self, max_num_seqs: int, max_len: int) -> DecodeGraphs | None:
        """The decode step's CUDA graphs, or None, with a warning, for a model whose forward
        cannot be captured (transformers' grouped MoE experts copy host tensors to the device
        as they run): its decode steps then run eager, as on a CPU."""
        try:
            with torch.inference_mode():
                return DecodeGraphs(
                    self._forward,
                    self.stager,
                    self.kv_shapes,
                    max_num_seqs,
                    max_len,
                    self._compiles,
                    self.step_plans,
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
        first blocks: call it before any request runs. Nothing to do on the torch backend, nor
        (yet) for a model with recurrent layers: their steps' rows need state slots, and their
        first steps compile what a warm-up would."""
        if self._compiles is None or self.states is not None:
            return
        t0, compiles = time.perf_counter(), self._compiles.count
        num_blocks = min(kv.num_blocks for kv in self.kv)
        latent = [kv.latent for kv in self.kv if kv.latent is not None]
        long_prefill = 0
        if latent:  # a context the expanded form up-projects in two chunks
            dims = latent[0]
            width = dims.qk_nope_head_dim + dims.v_head_dim
            long_prefill = expanded_chunk_size(dims.num_heads, width, None) + 1
        steps = warm_up_steps(
            num_blocks, self.block_size, num_groups=len(self.kv), long_prefill=long_prefill
        )
        for step in steps:
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
            copies = [step.plan(g).copies for g in range(len(self.kv))]
            if any(copies):  # the copies alone, before the replay
                layout = StepLayout(0, 0, 0, num_copies=tuple(map(len, copies)))
                _, dev = self.stager.stage((), copies, self.block_size, layout)
                self._copy_blocks(step, layout.split(dev))
            # A copy: the graph overwrites its output buffer on the next replay.
            return graphs.run(step.rows, feed).to(torch.float32, copy=True)
        return self._execute_eager(step, feed)

    def _execute_eager(self, step: SchedulerOutput, feed: TokenFeed | None = None) -> torch.Tensor:
        views, metas = stage_step(
            step,
            self.stager,
            self.kv_shapes,
            block_size=self.block_size,
            vocab_size=self.vocab_size,
            validate=self.validate_steps,
            plans=self.step_plans,
        )
        if feed is not None:
            feed(views["input_ids"])
        self._copy_blocks(step, views)
        recurrent = self._recurrent_step(step)
        # An empty sample_idx (only non-final prefill chunks) still writes K/V and costs no lm_head.
        return self._forward(views, metas, views["sample_idx"], recurrent)[0].float()

    def run_copies_now(self, copies: tuple[list[tuple[int, int, int]], ...]) -> None:
        """The copies the cache planned for the next step (`GroupedCache.take_copies`: only the
        state group's snapshots have any), run now, outside a step: a save writes down the
        snapshots they fill (a compact one's leaving request's, above all)."""
        assert not any(c for g, c in enumerate(copies) if g != self.state_group), copies
        if self.states is not None and self.state_group < len(copies):
            for src, dst, _ in copies[self.state_group]:
                self.states.copy_slot(src, dst)

    def _recurrent_step(self, step: SchedulerOutput) -> RecurrentStep | None:
        """The state group's slot copies of `step`, run now in plan order, and the step's view
        of the slots for the recurrent layers (None without recurrent layers)."""
        states = self.states
        if states is None:
            return None
        g = self.state_group
        for c in step.plan(g).copies:
            states.copy_slot(c.src_block, c.dst_block)
        metadata = RecurrentMetadata.build(
            [len(r.token_ids) for r in step.rows],
            [r.block_tables[g][0] for r in step.rows],
            [r.start_position > 0 for r in step.rows],
            self.device,
            num_slots=states.num_running,
        )
        return RecurrentStep(states, metadata)

    def _forward(
        self,
        views: dict[str, torch.Tensor],
        metas: Sequence[AttentionMetadata],
        keep: torch.Tensor | int = 0,
        recurrent: RecurrentStep | None = None,
    ) -> torch.Tensor:
        """The model over one packed step (`views`: its split buffer; `metas`: each KV cache
        group's metadata; `recurrent`: the recurrent layers' slots, if any): logits
        [1, num_kept, vocab] of the tokens `keep` indexes (0: every token's)."""
        cache = PagedKVCache(self.layer_kv, metas, self.layout.layers, self.layer_groups, recurrent)
        out = self.model(
            input_ids=views["input_ids"][None],
            position_ids=views["positions"][None],
            **{self._cache_arg: cache},
            use_cache=True,
            logits_to_keep=keep,
            radixkv_cache=cache,
        )
        return out.logits

    def _copy_blocks(self, step: SchedulerOutput, views: dict[str, torch.Tensor]) -> None:
        """Each KV cache group's copy-on-write copies of `step` (in the split step buffer
        `views`), in every one of its layers' K and V (or latent)."""
        for g, kv in enumerate(self.kv):
            if step.plan(g).copies:
                src, dst, slots = (
                    views[region(n, g)] for n in ("copy_src", "copy_dst", "copy_slots")
                )
                kernels.copy_blocks(*kv.copy_pair, src, dst, slots)


def warm_up_steps(
    num_blocks: int, block_size: int, *, num_groups: int = 1, long_prefill: int = 0
) -> list[SchedulerOutput]:
    """The warm-up's steps over blocks [0, num_blocks) of every one of `num_groups` KV cache
    groups: a prefill, a mixed step (a decode row, a prefill chunk and a copy-on-write) when the
    pool has two blocks, and a decode step of up to two rows (each row's table the same in every
    group). Their kernels cover every
    compiled variant: a step is decode-like (one token per row) or not, everything else a
    kernel specializes on is fixed per model (see `radixkv.kernels.triton_paged_attention`).
    The decode rows' block tables are wide (a context over 256 tokens), so on a GPU they split
    the context and the merge kernel compiles too. With `long_prefill` (latent layers: a
    prefill the expanded form up-projects in two chunks) and room for it, a step of that
    prefill and a step of a short extend over a context, which both forms' rules absorb."""
    B = block_size

    def row(
        name: str, num_tokens: int, first_block: int, width: int = 0, start: int = 0
    ) -> ScheduledRequest:
        """`num_tokens` tokens from position `start` in consecutive blocks from `first_block`,
        the table padded with block 0 to `width` columns."""
        blocks = tuple(range(first_block, first_block + -(-(start + num_tokens) // B)))
        table = blocks + (0,) * (width - len(blocks))
        return ScheduledRequest(
            f"warm-up-{name}", (0,) * num_tokens, start, (table,) * num_groups, True
        )

    steps = [SchedulerOutput(rows=(row("prefill", min(16, num_blocks * B), 0),))]
    if num_blocks >= 2:
        mixed = (row("decode", 1, 0), row("chunk", min(8, (num_blocks - 1) * B), 1))
        steps.append(SchedulerOutput(rows=mixed, plans=(GroupPlan(copies=(BlockCopy(0, 1, 1),)),)))
    decode = tuple(row(f"decode-{i}", 1, i, width=-(-512 // B)) for i in range(min(2, num_blocks)))
    steps.append(SchedulerOutput(rows=decode))
    if long_prefill and num_blocks * B >= long_prefill:
        steps.append(SchedulerOutput(rows=(row("long-prefill", long_prefill, 0),)))
        steps.append(SchedulerOutput(rows=(row("extend", 2, 0, start=long_prefill - 2),)))
    return steps

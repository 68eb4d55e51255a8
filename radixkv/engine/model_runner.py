"""Model runner: one packed forward per scheduler step over the paged KV cache.

Layers of the runner:

* `KVCacheSpec` / `plan_num_blocks`: the shape of one KV block of the model and how many fit the
  memory budget (CPU: `kv_cache_bytes`, default 512 MiB; CUDA: a fraction of free device memory).
* `ModelRunner`: owns the KV tensors, stacked over layers as
  `[num_layers, num_blocks, block_size, kv_heads, head_dim]` (K and V separately), switches the
  model to the ``"radixkv"`` attention (see `radixkv.engine.attention`), and runs `execute(step)`:

      copies (copy-on-write of partial blocks)  ->  metadata  ->  model forward  ->  logits

  Every row of the step is packed into one batch row of `num_tokens` tokens with explicit
  position ids, so prefill chunks and decode tokens of different requests share one forward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixkv import kernels
from radixkv.cache import check_size
from radixkv.engine.attention import PagedKVCache, register_attention
from radixkv.kernels import AttentionMetadata
from radixkv.scheduler.output import BlockCopy, ScheduledRequest, SchedulerOutput

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
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @classmethod
    def from_model(cls, model: Any, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        cfg = model.config.get_text_config()
        layer_types = getattr(cfg, "layer_types", None) or ()
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"{type(model).__name__} has non-full attention layers "
                f"({sorted(set(layer_types))}); radixkv supports full causal attention only"
            )
        num_heads = cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        return cls(cfg.num_hidden_layers, num_kv_heads, head_dim, block_size, dtype)


def plan_num_blocks(
    spec: KVCacheSpec,
    device: torch.device,
    *,
    num_blocks: int | None = None,
    kv_cache_bytes: int | None = None,
    gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION,
) -> int:
    """Number of KV blocks: `num_blocks` if given, else what `kv_cache_bytes` holds, else (CUDA) a
    fraction of free device memory or (CPU) DEFAULT_CPU_KV_CACHE_BYTES. Raises TypeError for a
    size that is not an int, ValueError when the budget holds no block."""
    if num_blocks is not None:
        return check_size(num_blocks, "num_blocks", low=1)
    if kv_cache_bytes is None:
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            kv_cache_bytes = int(free * gpu_memory_fraction)
        else:
            kv_cache_bytes = DEFAULT_CPU_KV_CACHE_BYTES
    n = check_size(kv_cache_bytes, "kv_cache_bytes", low=0) // spec.bytes_per_block
    if n < 1:
        raise ValueError(
            f"kv_cache_bytes={kv_cache_bytes} holds no KV block ({spec.bytes_per_block} bytes each)"
        )
    return n


class ModelRunner:
    """Runs scheduler steps on a Hugging Face causal LM with a paged KV cache.

    Invariants: `k_cache` / `v_cache` have shape [num_layers, num_blocks, block_size, kv_heads,
    head_dim] on the model's device in the model's dtype; the model's attention implementation is
    ``"radixkv"`` for as long as the runner lives.
    """

    def __init__(self, model: Any, *, block_size: int, num_blocks: int) -> None:
        self.model = model
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.spec = KVCacheSpec.from_model(model, block_size, self.dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        shape = (self.spec.num_layers, num_blocks, block_size, self.spec.num_kv_heads)
        shape += (self.spec.head_dim,)
        # Zeroed, not empty: slots past a request's length are masked, but NaN garbage could leak
        # through a masked product in a reference kernel.
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        model.set_attn_implementation(register_attention())
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB) on %s",
            num_blocks,
            block_size,
            num_blocks * self.spec.bytes_per_block / 2**20,
            self.device,
        )

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor:
        """Run one step. Returns fp32 logits [num_sampled_rows, vocab] for the rows with
        `sample=True`, in row order."""
        assert not step.is_empty, "execute() needs at least one scheduled row"
        if step.copies:
            self._copy_blocks(step.copies)
        input_ids, position_ids, meta, sample_idx = self.build_inputs(step.rows)
        cache = PagedKVCache(self.k_cache, self.v_cache, meta)
        # An empty sample_idx (only non-final prefill chunks) still writes K/V and costs no lm_head.
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=sample_idx,
            radixkv_cache=cache,
        )
        return out.logits[0].float()  # out.logits: [1, num_sampled, vocab]

    def _copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        dev = self.device
        src = torch.tensor([c.src_block for c in copies], dtype=torch.int64, device=dev)
        dst = torch.tensor([c.dst_block for c in copies], dtype=torch.int64, device=dev)
        num_slots = torch.tensor([c.num_slots for c in copies], dtype=torch.int64, device=dev)
        kernels.copy_blocks(self.k_cache, self.v_cache, src, dst, num_slots)

    def build_inputs(
        self, rows: Sequence[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Pack the rows of a step (built once per step, on the host, then moved in one go).

        Returns input_ids [1, T], position_ids [1, T], the kernel metadata and the indices (into
        the packed T tokens) of the last token of every row with `sample=True`.

            row 0                     row 1        row 2 (decode)
            |--- q_len 0 ---|--------- q_len 1 ---|q|
            positions: start_0 .. start_0+q_len0-1 | start_1 .. | start_2
        """
        B = self.block_size
        num_tokens = sum(len(r.token_ids) for r in rows)
        max_blocks = max(len(r.block_table) for r in rows)
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slots = np.empty(num_tokens, dtype=np.int64)
        block_tables = np.zeros((len(rows), max_blocks), dtype=np.int32)
        seq_lens = np.empty(len(rows), dtype=np.int32)
        cu_seqlens_q = np.zeros(len(rows) + 1, dtype=np.int32)
        sample_idx: list[int] = []
        t = 0
        for i, row in enumerate(rows):
            q_len = len(row.token_ids)
            end = row.start_position + q_len
            assert q_len > 0, f"row {row.request_id} has no tokens"
            assert len(row.block_table) * B >= end, (
                f"row {row.request_id}: {len(row.block_table)} blocks cannot hold {end} tokens"
            )
            table = np.asarray(row.block_table, dtype=np.int64)
            pos = np.arange(row.start_position, end, dtype=np.int64)
            input_ids[t : t + q_len] = row.token_ids
            positions[t : t + q_len] = pos
            slots[t : t + q_len] = table[pos // B] * B + pos % B
            block_tables[i, : len(table)] = table
            seq_lens[i] = end
            t += q_len
            cu_seqlens_q[i + 1] = t
            if row.sample:
                sample_idx.append(t - 1)
        # Checked on the host: an out-of-range id would index out of the embedding on device.
        assert input_ids.min() >= 0 and input_ids.max() < self.vocab_size, "token id out of range"
        dev = self.device
        ids = torch.from_numpy(input_ids).to(dev).unsqueeze(0)
        # Validated here, once per step and on the host (no device sync); every layer's kernels
        # then check only their own tensors' shapes against it.
        meta = AttentionMetadata(
            block_tables=torch.from_numpy(block_tables),
            seq_lens=torch.from_numpy(seq_lens),
            cu_seqlens_q=torch.from_numpy(cu_seqlens_q),
            kv_cache_shape=tuple(self.k_cache.shape[1:]),
            slot_mapping=torch.from_numpy(slots),
            device=dev,
        )
        return (
            ids,
            torch.from_numpy(positions).to(dev).unsqueeze(0),
            meta,
            torch.tensor(sample_idx, dtype=torch.int64, device=dev),
        )

"""The paged KV tensors of a model: one pair (K, V) per KV cache group, sized by the group's kind.

A model's layers fall into cache groups (`attention_layout.LayerGroup`, read from the model); each
group's layers share a pool of blocks (`radixkv.cache.group`), so each group has its tensors:

    K, V    [len(group layers), num_blocks, block_size, kv_heads, head_dim]   (zeroed)

How many blocks a group's pool takes is its kind's rule (`GROUP_KINDS[kind].plan_blocks`: the
window group's is room for the running requests' windows), except the tree's group, which takes
what the budget leaves: `kv_cache_bytes` (CPU default 512 MiB) or a fraction of the free device
memory, or `num_blocks` counted out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from radixkv.cache.group import GroupSpec
from radixkv.cache.kinds import GROUP_KINDS

if TYPE_CHECKING:
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.model.attention_layout import LayerGroup

DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024**2
DEFAULT_GPU_MEMORY_FRACTION = 0.8  # of the free device memory after the weights are loaded


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of the paged KV cache of one group of layers."""

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


@dataclass(frozen=True, slots=True)
class GroupKV:
    """One KV cache group's tensors on the device: K and V of its `layers` (model layer indices,
    in tensor order), each [len(layers), num_blocks, block_size, kv_heads, head_dim]."""

    spec: GroupSpec
    layers: tuple[int, ...]
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @property
    def name(self) -> str:
        return self.spec.kind

    @property
    def num_blocks(self) -> int:
        return self.k_cache.shape[1]

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """One layer's K (or V) shape, as the kernels take it."""
        return tuple(self.k_cache.shape[1:])

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block over the group's layers."""
        return 2 * self.k_cache[:, 0].nbytes


def plan_num_blocks(
    spec: KVCacheSpec,
    device: torch.device,
    *,
    num_blocks: int | None = None,
    kv_cache_bytes: int | None = None,
    reserved_bytes: int = 0,
) -> int:
    """Number of KV blocks: `num_blocks` if given, else what `kv_budget` holds less
    `reserved_bytes` (the other groups' pools). Raises ValueError when that holds no block (the
    sizes themselves were checked by `EngineConfig`). A spec of no layers (a model whose layers
    are all windowed: the tree's group is bookkeeping only) is sized as one layer's."""
    if num_blocks is not None:
        return num_blocks
    budget = kv_budget(device, kv_cache_bytes)
    bytes_per_block = spec.bytes_per_block or replace(spec, num_layers=1).bytes_per_block
    n = (budget - reserved_bytes) // bytes_per_block
    if n < 1:
        after = f" after the other groups' pools' {reserved_bytes}" if reserved_bytes else ""
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


def allocate_group_kv(
    groups: Sequence[LayerGroup],
    config: EngineConfig,
    *,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[GroupKV, ...]:
    """Each group's tensors, its pool sized by its kind (the group whose kind leaves it to the
    budget takes what the others leave). ValueError for settings that hold not one request's
    blocks."""
    specs = [
        KVCacheSpec(len(g.layers), num_kv_heads, head_dim, config.block_size, dtype) for g in groups
    ]
    # A budget in bytes, read once, when blocks are not counted out.
    budget = None if config.num_blocks is not None else kv_budget(device, config.kv_cache_bytes)
    sizes = [
        GROUP_KINDS[g.spec.kind].plan_blocks(g.spec, config, s.bytes_per_block, budget)
        for g, s in zip(groups, specs, strict=True)
    ]
    reserved = sum(
        n * s.bytes_per_block for n, s in zip(sizes, specs, strict=True) if n is not None
    )
    kv = []
    for group, spec, n in zip(groups, specs, sizes, strict=True):
        if n is None:
            n = plan_num_blocks(spec, device, kv_cache_bytes=budget, reserved_bytes=reserved)
        # Zeroed, not empty: slots past a request's length are masked, but NaN garbage could
        # leak through a masked product in a reference kernel (and pad rows of a graph read
        # block 0).
        shape = (spec.num_layers, n, spec.block_size, num_kv_heads, head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        kv.append(GroupKV(group.spec, group.layers, k, torch.zeros_like(k)))
    return tuple(kv)

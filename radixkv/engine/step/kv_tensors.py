"""The paged KV tensors of a model: per KV cache group, K and V or one latent, sized by its kind.

A model's layers fall into cache groups (`attention_layout.LayerGroup`, read from the model); each
group's layers share a pool of blocks (`radixkv.cache.group`), so each group has its tensors, in
one of two layouts:

    K, V     [len(group layers), num_blocks, block_size, kv_heads, head_dim]   (zeroed)
    latent   [len(group layers), num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]:
             multi-head latent attention keeps one vector a token and layer, read by the kernels
             as one KV head of its width (`radixkv.kernels.latent_metadata`)

Everything that copies blocks (copy-on-write, the host and disk tiers) reads a group's `caches`,
whichever layout; what differs per step is what the layers read beside the step's metadata
(`GroupKV.step_plan`: a latent group's requests in runs of one attention form).

How many blocks a group's pool takes is its kind's rule (`GROUP_KINDS[kind].plan_blocks`: the
window group's is room for the running requests' windows), except the tree's group, which takes
what the budget leaves: `kv_cache_bytes` (CPU default 512 MiB) or a fraction of the free device
memory, or `num_blocks` counted out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from radixkv import kernels
from radixkv.cache.group import GroupSpec
from radixkv.cache.kinds import GROUP_KINDS
from radixkv.kernels import AttentionMetadata, LatentDims, LatentStep
from radixkv.kernels.latent_metadata import TORCH_MERGE_COST, TRITON_MERGE_COST

if TYPE_CHECKING:
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.model.attention_layout import LayerGroup

DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024**2
DEFAULT_GPU_MEMORY_FRACTION = 0.8  # of the free device memory after the weights are loaded


# What a group's layers read in a step beside its metadata, planned once per step from the
# metadata and the host copy of its block tables (`GroupKV.step_plan`).
StepPlan = Callable[[AttentionMetadata, torch.Tensor], Any]


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of the paged KV cache of one group of layers: `parts` tensors (K and V: 2; a
    latent: 1) of `num_kv_heads` x `head_dim` values a token and layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    parts: int = 2

    @property
    def bytes_per_block(self) -> int:
        """Every part of one block over all layers."""
        elem = self.dtype.itemsize
        per_layer = self.block_size * self.num_kv_heads * self.head_dim * elem
        return self.parts * self.num_layers * per_layer

    @classmethod
    def of(cls, group: LayerGroup, config: EngineConfig, kv_shape: tuple[int, int], dtype: Any):
        """The spec of `group`'s layers: a latent of its sizes, or K and V of `kv_shape`
        (kv_heads, head_dim)."""
        layers, block_size = len(group.layers), config.block_size
        if group.latent is not None:
            return cls(layers, 1, group.latent.latent_dim, block_size, dtype, parts=1)
        return cls(layers, *kv_shape, block_size, dtype)


@dataclass(frozen=True, slots=True)
class GroupKV:
    """One KV cache group's tensors on the device, for its `layers` (model layer indices, in
    tensor order): `caches` is (K, V), or (the latent,) when `latent` gives the layers' latent
    attention sizes; each [len(layers), num_blocks, block_size, heads, width]."""

    spec: GroupSpec
    layers: tuple[int, ...]
    caches: tuple[torch.Tensor, ...]
    latent: LatentDims | None = None

    @property
    def name(self) -> str:
        return self.spec.kind

    @property
    def layout(self) -> str:
        """What a block holds: "kv" or "latent"."""
        return "kv" if self.latent is None else "latent"

    @property
    def label(self) -> str:
        """The group as logs and stats name it: its kind, and "latent" for a latent layout."""
        return self.name if self.latent is None else f"{self.name} latent"

    @property
    def k_cache(self) -> torch.Tensor:
        """K of a K/V group (a latent group's one tensor)."""
        return self.caches[0]

    @property
    def v_cache(self) -> torch.Tensor:
        assert self.latent is None, "a latent group keeps one tensor, not V"
        return self.caches[1]

    @property
    def num_blocks(self) -> int:
        return self.caches[0].shape[1]

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """One layer's shape of each tensor: the kernels' kv_cache_shape (a latent is read as
        one KV head of its width)."""
        return tuple(self.caches[0].shape[1:])

    @property
    def bytes_per_block(self) -> int:
        """Every tensor of one block over the group's layers."""
        return sum(c[:, 0].nbytes for c in self.caches)

    @property
    def copy_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (K, V) pair `kernels.copy_blocks` copies blocks of. A latent is handed as both:
        its slots are copied twice, a few KiB a copy-on-write, rather than a kernel variant of
        its own."""
        return self.caches[0], self.caches[-1]

    def layer_views(self, i: int) -> tuple[torch.Tensor, ...]:
        """Layer i's (of the group's, in tensor order) views as its kernels take them: K and V
        [num_blocks, block_size, kv_heads, head_dim], or the latent [num_blocks, block_size,
        L + R]."""
        if self.latent is not None:
            return (self.caches[0][i, :, :, 0],)
        return tuple(c[i] for c in self.caches)

    def step_plan(self) -> StepPlan | None:
        """What the group's layers read in a step beside its metadata: a latent group's
        requests in runs of the attention form each prefers (`kernels.plan_latent_step`, by the
        cost of the backend its tensors run on); None for K and V."""
        if self.latent is None:
            return None
        triton = kernels.backend_for(self.caches[0].device) == "triton"
        merge_cost = TRITON_MERGE_COST if triton else TORCH_MERGE_COST
        return partial(_plan_latent, dims=self.latent, merge_cost=merge_cost)


def _plan_latent(
    metadata: AttentionMetadata,
    host_block_tables: torch.Tensor,
    *,
    dims: LatentDims,
    merge_cost: int,
) -> LatentStep:
    return kernels.plan_latent_step(
        metadata, dims, merge_cost=merge_cost, host_block_tables=host_block_tables
    )


def plan_num_blocks(
    spec: KVCacheSpec,
    device: torch.device,
    *,
    num_blocks: int | None = None,
    kv_cache_bytes: int | None = None,
    reserved_bytes: int = 0,
    token_blocks: int = 1,
) -> int:
    """Number of KV blocks: `num_blocks` if given, else what `kv_budget` holds less
    `reserved_bytes` (the other groups' pools). Raises ValueError when that holds no block (the
    sizes themselves were checked by `EngineConfig`). A spec of no layers (a model whose layers
    are all windowed: the tree's group is bookkeeping only) is sized as one layer's; a spec of no
    KV at all (a model of recurrent layers alone: its blocks hold token ids, no device bytes)
    takes `token_blocks`."""
    if num_blocks is not None:
        return num_blocks
    if spec.num_kv_heads == 0:
        return token_blocks
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
    reserved_bytes: int = 0,
) -> tuple[GroupKV, ...]:
    """Each group's tensors (K and V of `num_kv_heads` x `head_dim`, or a latent group's one),
    its pool sized by its kind (the group whose kind leaves it to the budget takes what the
    others leave, and `reserved_bytes` less: the recurrent states' slots). A model that keeps no
    KV (`num_kv_heads` 0: recurrent layers alone) has a tree group of token ids alone, of room
    for `max_num_seqs` contexts of `max_model_len` twice (the running requests' and as many for
    the paths of snapshots and the prefixes new prompts leave). ValueError for settings that
    hold not one request's blocks."""
    specs = [KVCacheSpec.of(g, config, (num_kv_heads, head_dim), dtype) for g in groups]
    # A budget in bytes, read once, when blocks are not counted out.
    budget = None if config.num_blocks is not None else kv_budget(device, config.kv_cache_bytes)
    sizes = [
        GROUP_KINDS[g.spec.kind].plan_blocks(g.spec, config, s.bytes_per_block, budget)
        for g, s in zip(groups, specs, strict=True)
    ]
    reserved = reserved_bytes + sum(
        n * s.bytes_per_block for n, s in zip(sizes, specs, strict=True) if n is not None
    )
    context_blocks = -(-(config.max_model_len or 1) // config.block_size)
    token_blocks = 2 * config.max_num_seqs * context_blocks
    kv = []
    for group, spec, n in zip(groups, specs, sizes, strict=True):
        if n is None:
            n = plan_num_blocks(
                spec,
                device,
                kv_cache_bytes=budget,
                reserved_bytes=reserved,
                token_blocks=token_blocks,
            )
        if spec.num_kv_heads == 0:  # no KV: no layer, one nominal head for the step's
            spec = replace(spec, num_kv_heads=1, head_dim=1)  # metadata, which nothing reads
        # Zeroed, not empty: slots past a request's length are masked, but NaN garbage could
        # leak through a masked product in a reference kernel (and pad rows of a graph read
        # block 0).
        shape = (spec.num_layers, n, spec.block_size, spec.num_kv_heads, spec.head_dim)
        caches = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.parts))
        kv.append(GroupKV(group.spec, group.layers, caches, group.latent))
    return tuple(kv)


def plan_state_slots(group: LayerGroup, config: EngineConfig, device: torch.device) -> int:
    """The state slots of the recurrent layers' group (its kind's rule, over the budget in bytes
    the KV pools share when blocks are not counted out)."""
    budget = None if config.num_blocks is not None else kv_budget(device, config.kv_cache_bytes)
    spec = group.spec
    n = GROUP_KINDS[spec.kind].plan_blocks(spec, config, spec.slot_bytes, budget)  # type: ignore[attr-defined]
    assert n is not None, "the state kind sizes its own pool"
    return n

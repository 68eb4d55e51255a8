"""How a Hugging Face model reads and writes the paged KV cache.

Two hooks, both inside `LlamaAttention.forward` (and every Llama-family attention of
transformers 5), for the models whose modules the runner does not replace (`fused_llama` replaces
Llama's attention with one that calls the kernels directly):

1. after RoPE, `past_key_values.update(key, value, layer_idx)` -> `PagedKVCache.update` writes the
   step's new K/V into their slots with `kernels.store_kv_step` and hands them back unchanged;
2. the attention function registered as ``"radixkv"`` (`paged_attention_forward`) ignores the dense
   key/value it is given and attends over the paged cache through the block tables with
   `kernels.paged_attention_step`; it does the causal masking itself (transformers passes no
   mask to an attention name it has no mask function for), with the layer's `AttentionKind`
   (sliding window, logit soft-cap, sinks) that `attention_layout` read from the model at load:
   fixed per layer, so a captured decode graph's launches stay right. The scale is the one
   transformers passes (Gemma's `query_pre_attn_scalar`), and RoPE (Gemma 3's local base
   included) is applied by transformers before either hook.

Each KV cache group keeps its layers' KV in tensors of its own (a model with window layers: the
window group's, over its smaller pool, `radixkv.cache.window`): a layer reads and writes its
group's tensors through its group's metadata (the group's own block tables and slots). Latent
(MLA) layers attend in radixkv's own modules (`latent_attention`), which ask the same object for
their latent cache and the step's plan (`PagedKVCache.latent_layer`), and a hybrid model's
packed recurrent layers (`radixkv.engine.step.recurrent`) for their state slots
(`PagedKVCache.recurrent_layer`).

transformers does not hand `past_key_values` to the attention function, so the runner passes the
same per-step cache object a second time as the `radixkv_cache` keyword of `model(...)`, which
transformers forwards to it; nothing is stored in module globals.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from radixkv import kernels
from radixkv.engine.step.recurrent import RecurrentStep
from radixkv.kernels import AttentionKind, AttentionMetadata, LatentStep, RecurrentMetadata

ATTENTION_NAME = "radixkv"


class PagedKVCache(Cache):
    """A transformers `Cache` whose storage is the engine's paged KV tensors.

    `layer_kv[i]` is layer i's (K, V) cache, each [num_blocks, B, kv_heads, head_dim] (a latent
    layer's: its latent cache alone, [num_blocks, B, L + R]): views of the runner's tensors of
    its KV cache group `layer_groups[i]`, whose step metadata is `metadata[layer_groups[i]]` (a
    latent group's: its `LatentStep`). One instance per step (it carries the step's kernel
    metadata, validated once when the runner built it, for every layer); it never grows or
    allocates. `kinds[i]` is layer i's attention; `recurrent` the step's recurrent-state slots
    (None: a model without recurrent layers).
    """

    def __init__(
        self,
        layer_kv: Sequence[tuple[torch.Tensor, ...]],
        metadata: Sequence[AttentionMetadata | LatentStep],
        kinds: Sequence[AttentionKind],
        layer_groups: Sequence[int],
        recurrent: RecurrentStep | None = None,
    ) -> None:
        # No per-layer objects: transformers' layer bookkeeping (lazy growth, offloading, cropping)
        # has no meaning for a cache whose blocks the scheduler manages.
        super().__init__(layers=[])
        self.layer_kv = layer_kv
        self.metadata = metadata
        self.kinds = kinds
        self.layer_groups = layer_groups
        self.recurrent = recurrent
        self.last_stored: int | None = None  # the layer whose K/V `update` stored last

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The K cache, V cache and metadata layer `layer_idx` writes and reads."""
        k_cache, v_cache = self.layer_kv[layer_idx]
        return k_cache, v_cache, self.metadata[self.layer_groups[layer_idx]]

    def latent_layer(self, layer_idx: int) -> tuple[torch.Tensor, LatentStep]:
        """The latent cache and the step's plan latent layer `layer_idx` writes and reads."""
        (cache,) = self.layer_kv[layer_idx]
        return cache, self.metadata[self.layer_groups[layer_idx]]

    def recurrent_layer(
        self, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, RecurrentMetadata]:
        """The conv and SSM state tensors and the step's slots recurrent layer `layer_idx`
        reads and writes."""
        assert self.recurrent is not None, "a recurrent layer in a step without state slots"
        return self.recurrent.recurrent_layer(layer_idx)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states / value_states: [1, kv_heads, num_tokens, head_dim] (after RoPE); the kernels
        # take any token and head strides, so the [num_tokens, kv_heads, head_dim] views are not
        # copied.
        key = key_states[0].transpose(0, 1)
        value = value_states[0].transpose(0, 1)
        kernels.store_kv_step(key, value, *self.layer(layer_idx))
        self.last_stored = layer_idx
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # position_ids are always passed explicitly; nothing should ask for this.
        return 0


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    radixkv_cache: PagedKVCache | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the paged cache. query: [1, heads, num_tokens, head_dim];
    returns ([1, num_tokens, heads, head_dim], None) as transformers expects."""
    if radixkv_cache is None:
        raise RuntimeError(
            "the radixkv attention only runs inside the radixkv model runner "
            "(model(..., past_key_values=cache, radixkv_cache=cache))"
        )
    layer = attended_layer(module, radixkv_cache.last_stored)
    assert layer is not None, "a shared attention module attended before any layer stored K/V"
    kind = radixkv_cache.kinds[layer]
    # What this call asks for is what the load-time probe read from the same call.
    assert kwargs.get("sliding_window") == kind.window, "the layer's window changed since load"
    q = query[0].transpose(0, 1)  # [num_tokens, heads, head_dim], a view (any strides will do)
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    out = kernels.paged_attention_step(q, *radixkv_cache.layer(layer), scaling, kind=kind)
    return out.unsqueeze(0), None


def attended_layer(module: torch.nn.Module, last_stored: int | None) -> int | None:
    """The layer an attention call attends for: its module's `layer_idx`, or for a module that
    several layers share (Zamba 2's: its `layer_idx` is -1, its forward is handed the layer)
    the layer whose K/V the cache stored last (`last_stored`), which is the call's own: every
    layer stores its K/V right before it attends."""
    layer = getattr(module, "layer_idx", None)
    if isinstance(layer, int) and layer < 0:
        return last_stored
    return layer


def register_attention() -> str:
    """Register `paged_attention_forward` under ATTENTION_NAME (idempotent); returns the name."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME

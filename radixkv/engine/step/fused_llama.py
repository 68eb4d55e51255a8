"""Llama layers with their elementwise work fused: the modules the runner swaps in for Llama models.

transformers' Llama layer launches about forty small kernels besides its matmuls: RMSNorm as eight
(twice per layer), RoPE as ten, and the attention hook's layout copies. In a captured decode graph
each still costs 2-3 µs of GPU time, as much in total as streaming the weights. For the model class
it was tested on (`LlamaForCausalLM`: SmolLM2, Llama 2 / 3, the tests' tiny Llamas) the runner
swaps the class of every `LlamaRMSNorm` and `LlamaAttention` for a subclass here:

    RMSNorm    ->  kernels.rms_norm                                    (one kernel)
    attention  ->  q/k/v projections, viewed [tokens, heads, head_dim] (no copies)
                   kernels.rope_store_kv_step: RoPE of q and k + K/V store  (one kernel)
                   kernels.paged_attention_step over the paged cache, then o_proj

Weights, parameter names and every other module stay transformers'. Any other model class keeps
transformers' modules and the generic hooks of `attention.py`, and so does every model on the
torch backend (the CPU): the kernels' torch references compute what transformers computes op for
op (the same bits, tested), only with a few more Python calls per layer (1.5 % of a CPU decode
step of SmolLM2).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaRMSNorm,
)

from radixkv import kernels

logger = logging.getLogger(__name__)


class FusedLlamaRMSNorm(LlamaRMSNorm):
    """`LlamaRMSNorm` as one kernel."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(hidden_states, self.weight, self.variance_epsilon)


class PagedLlamaAttention(LlamaAttention):
    """`LlamaAttention` over the paged KV cache with RoPE fused into the K/V store. Called by the
    decoder layer with the step's `radixkv_cache` among its keyword arguments (see
    `attention.py`); ignores transformers' own cache argument and mask."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        radixkv_cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if radixkv_cache is None or position_embeddings is None:
            raise RuntimeError(
                "PagedLlamaAttention runs only inside the radixkv model runner, with the step's "
                "cache and the rotary embeddings"
            )
        # hidden_states: [1, num_tokens, hidden] (the runner packs a step into one row)
        num_tokens = hidden_states.shape[1]
        shape = (num_tokens, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)  # [num_tokens, heads, head_dim]
        k = self.k_proj(hidden_states).view(shape)
        v = self.v_proj(hidden_states).view(shape)
        cos, sin = position_embeddings  # [1, num_tokens, head_dim] each
        k_cache, v_cache, meta = radixkv_cache.layer(self.layer_idx)
        q = kernels.rope_store_kv_step(q, k, v, cos[0], sin[0], k_cache, v_cache, meta)
        out = kernels.paged_attention_step(q, k_cache, v_cache, meta, self.scaling)
        return self.o_proj(out.view(1, num_tokens, -1)), None


# transformers' module class -> the fused one that replaces it
_FUSED = {LlamaRMSNorm: FusedLlamaRMSNorm, LlamaAttention: PagedLlamaAttention}


def unfuse_llama_modules(model: Any) -> None:
    """Undo `fuse_llama_modules` (in place; nothing to do for a model it never changed): a runner
    built over a model another runner fused probes transformers' own modules."""
    _swap_classes(model.modules(), {fused: plain for plain, fused in _FUSED.items()})


def fuse_llama_modules(model: Any) -> bool:
    """Swap the fused modules into a `LlamaForCausalLM` (in place; the class of each module
    changes, nothing else). Returns False, changing nothing, for any other model: a subclass or
    another architecture may compute differently."""
    if type(model) is not LlamaForCausalLM:
        return False
    modules = list(model.modules())
    known = (LlamaAttention, PagedLlamaAttention)  # a model swapped before may run again
    if any(isinstance(m, LlamaAttention) and type(m) not in known for m in modules):
        return False  # a customised attention: not the computation this was tested against
    _swap_classes(modules, _FUSED)
    logger.debug("fused RMSNorm and RoPE + K/V store kernels swapped into %s", type(model).__name__)
    return True


def _swap_classes(modules: Iterable[torch.nn.Module], classes: dict[type, type]) -> None:
    """Give each module of exactly a class in `classes` the class it maps to."""
    for module in modules:
        new = classes.get(type(module))
        if new is not None:
            module.__class__ = new

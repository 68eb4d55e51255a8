"""The linear layers' weights in the layout a CPU multiplies fastest: column-major.

`nn.Linear` keeps its weight [out, in] row-major and computes x @ W^T, which MKL's sgemm runs as
a transposed operand; at the few rows of a decode step that path is several times slower than
the same product over a column-major weight (W^T stored contiguous), and no faster for a long
prefill (`benchmarks/RESULTS.md`, CPU forward: a SmolLM2 decode step at batch 8 1.4x faster).
The values are the same; only their order in memory changes, in place, so the weights take no
more memory, with one exception: an output head that shares the input embedding's weight (tied
embeddings) gets a column-major copy of its own, since the embedding's row lookups want rows.
Linears whose weight other code reads as a row-major matrix instead of calling them (MLA's
kv_b_proj: its W_UK / W_UV views and the expanded latent kernel) keep their layout.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)


def use_column_major_linears(model: Any, keep: Iterable[torch.nn.Module] = ()) -> int:
    """Store every `nn.Linear` weight of `model` column-major (in place; idempotent), but those
    of the modules in `keep`; returns how many changed."""
    tied = model.get_input_embeddings().weight
    kept = {id(m) for m in keep}
    changed = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or module.weight.dim() != 2:
            continue
        if id(module) in kept:
            continue
        weight = module.weight
        if _is_column_major(weight):
            continue
        column_major = weight.detach().t().contiguous().t()
        if weight is tied:  # the embedding keeps its rows; the head gets its own copy
            module.weight = torch.nn.Parameter(column_major, requires_grad=False)
        else:
            weight.data = column_major
        changed += 1
    logger.debug("%d linear weights stored column-major", changed)
    return changed


def _is_column_major(weight: torch.Tensor) -> bool:
    return weight.stride(0) == 1 and weight.stride(1) == weight.shape[0]

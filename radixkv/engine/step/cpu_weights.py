"""The linear layers on a CPU: a decode step's few rows through the compiled kernel.

A decode step multiplies each weight by one row per running request. MKL's sgemm, which
`nn.Linear` calls, is tuned for many rows and reaches a fraction of the memory bandwidth such a
product is bound by; `kernels.cpu_linear` reads every weight row once against all the step's
rows, several times faster on the largest matrix (a 49k-word output head) and faster on most
others (`benchmarks/RESULTS.md`, CPU linears). Prefill chunks (many rows) still go to MKL.

The runner swaps the class of every plain `nn.Linear` for `CpuLinear`, whose forward is the only
change: weights, their layout (nn.Linear's own row-major, so a tied output head keeps sharing the
embedding's weight) and parameter names stay as they were. Subclasses of `nn.Linear` (quantized or
otherwise special linears) keep their own forward.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from radixkv.kernels import cpu_linear

logger = logging.getLogger(__name__)


class CpuLinear(torch.nn.Linear):
    """`nn.Linear` whose product over few rows runs `kernels.cpu_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(x, self.weight, self.bias)


def use_cpu_linears(model: Any) -> int:
    """Make every plain `nn.Linear` of `model` a `CpuLinear` (in place; idempotent); returns how
    many changed."""
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = CpuLinear
            changed += 1
    logger.debug("%d linears run the CPU linear kernel over few rows", changed)
    return changed

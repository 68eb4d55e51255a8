"""What one recurrent layer keeps per request: the shapes the state pool and the compact
snapshots are sized by (a module of its own: both `state` and `compact` read it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RecurrentLayerSpec:
    """What one recurrent layer keeps per request."""

    layer_idx: int
    conv_shape: tuple[int, int]  # (K - 1, channels): the last K - 1 inputs of the convolution
    ssm_shape: tuple[int, ...] | None  # (heads, k_dim, v_dim) or (heads, head_dim, state_dim)
    # The axis of ssm_shape an int8 snapshot's scale reduces over (`compact`): the value axis,
    # so there is one scale per head and key channel (Gated DeltaNet: v_dim; Mamba-2: head_dim,
    # its state_dim the key side; Mamba-1, whose heads are single channels: state_dim).
    quant_axis: int = 2

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of one request's state of this layer at `dtype`."""
        size = torch.empty((), dtype=dtype).element_size()
        numel = self.conv_shape[0] * self.conv_shape[1]
        if self.ssm_shape is not None:
            numel += math.prod(self.ssm_shape)
        return numel * size

    def scale_shape(self) -> tuple[int, ...]:
        """The shape of an int8 snapshot's scales: `ssm_shape` with `quant_axis` reduced."""
        assert self.ssm_shape is not None, "a short convolution keeps no SSM state"
        return tuple(1 if a == self.quant_axis else n for a, n in enumerate(self.ssm_shape))

    def snapshot_nbytes(self, dtype: torch.dtype, snapshot_dtype: str) -> int:
        """Bytes of one snapshot of this layer in `snapshot_dtype` (`compact.SNAPSHOT_DTYPES`)
        for a model of `dtype`: the conv window at `dtype` beside the SSM state as stored."""
        if snapshot_dtype == "exact":
            return self.nbytes(dtype)
        size = dtype.itemsize
        nbytes = self.conv_shape[0] * self.conv_shape[1] * size
        if self.ssm_shape is not None:
            numel = math.prod(self.ssm_shape)
            if snapshot_dtype == "int8":
                nbytes += numel + math.prod(self.scale_shape()) * size
            else:
                nbytes += numel * torch.bfloat16.itemsize
        return nbytes

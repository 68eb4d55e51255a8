"""LFM2's short convolution over a packed step (LFM2, LFM2-MoE, LFM3), with transformers' weights
as they are: in_proj -> B, C, x; y = C * conv(B * x), per request after its conv window; out_proj.
Its only state is the window of the last K - 1 inputs of the convolution."""

from __future__ import annotations

import torch
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeShortConv
from transformers.models.lfm3.modeling_lfm3 import Lfm3ShortConv

from radixkv import kernels
from radixkv.engine.step.recurrent.state import PackedRecurrentLayer, RecurrentLayerSpec
from radixkv.kernels import RecurrentMetadata

__all__ = ["PackedLfm2MoeShortConv", "PackedLfm2ShortConv", "PackedLfm3ShortConv"]


class _PackedShortConv(PackedRecurrentLayer):
    """The packed forward of the short convolutions (a mixin before transformers' class)."""

    conv: torch.nn.Conv1d
    in_proj: torch.nn.Linear
    out_proj: torch.nn.Linear
    conv_kernel_size: int

    def state_spec(self) -> RecurrentLayerSpec:
        return RecurrentLayerSpec(
            self.layer_idx, (self.conv_kernel_size - 1, self.conv.in_channels), None
        )

    def packed_forward(
        self,
        hidden_states: torch.Tensor,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor | None,
        metadata: RecurrentMetadata,
    ) -> torch.Tensor:
        B, C, x = self.in_proj(hidden_states[0]).chunk(3, dim=-1)
        y = kernels.causal_conv1d(
            B * x, self.conv.weight.squeeze(1), self.conv.bias, conv_states, metadata
        )
        return self.out_proj(C * y)[None]


class PackedLfm2ShortConv(_PackedShortConv, Lfm2ShortConv):
    """LFM2."""


class PackedLfm2MoeShortConv(_PackedShortConv, Lfm2MoeShortConv):
    """LFM2-MoE."""


class PackedLfm3ShortConv(_PackedShortConv, Lfm3ShortConv):
    """LFM3."""

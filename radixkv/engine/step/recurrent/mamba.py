"""Mamba-2 and Mamba-1 mixers over a packed step, with transformers' weights as they are.

Mamba-2 (Mamba 2, Bamba, Nemotron-H, Granite 4.0-H, Falcon-H1, Zamba2): transformers' mixers of
these families compute the same thing (Falcon-H1 adds muP multipliers and an optional norm), so
one packed forward serves them all:

    in_proj -> gate | x B C | dt
    kernels.causal_conv1d over x|B|C, per request after its conv window   (the layer's conv slot)
    kernels.ssm_scan: A = -exp(A_log) a scalar per head, dt = clamp(softplus(dt + dt_bias)),
        the D skip, per request from its state slot
    the gated RMSNorm (transformers' module; Falcon-H1 without one: y * silu(gate)), out_proj

Mamba-1 (Mamba, Jamba): x_proj makes dt, B, C per token (Jamba normalises each), dt_proj's weight
maps dt to the channels; the scan is `ssm_scan` with every channel a head of one dim and A per
(channel, state) entry; the output is gated by silu(gate) before out_proj.

NOTE: the step size is clamped to the model's `time_step_limit` on every token. transformers'
Mamba-2 decode path (one token with a cache) skips the clamp that its prefill applies; the two
differ only where softplus(dt + dt_bias) falls outside the limit (Nemotron-H and Zamba2 clamp
from below at `time_step_min`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.bamba.modeling_bamba import BambaMixer
from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridMambaLayer,
)
from transformers.models.jamba.modeling_jamba import JambaMambaMixer
from transformers.models.mamba.modeling_mamba import MambaMixer
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
from transformers.models.zamba2.modeling_zamba2 import Zamba2MambaMixer

from radixkv import kernels
from radixkv.engine.step.recurrent.state import PackedRecurrentLayer, RecurrentLayerSpec
from radixkv.kernels import RecurrentMetadata

__all__ = [
    "PackedBambaMixer",
    "PackedFalconH1Mixer",
    "PackedGraniteMoeHybridMambaLayer",
    "PackedJambaMambaMixer",
    "PackedMamba2Mixer",
    "PackedMambaMixer",
    "PackedNemotronHMamba2Mixer",
    "PackedZamba2MambaMixer",
]


class _PackedMamba2(PackedRecurrentLayer):
    """The packed forward of the Mamba-2 mixers (a mixin before transformers' class)."""

    # set by transformers' __init__ of every family
    in_proj: torch.nn.Linear
    norm: torch.nn.Module
    out_proj: torch.nn.Linear
    intermediate_size: int
    conv_dim: int
    num_heads: int
    head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel_size: int
    time_step_limit: tuple[float, float]
    A_log: torch.nn.Parameter
    D: torch.nn.Parameter
    dt_bias: torch.nn.Parameter

    def state_spec(self) -> RecurrentLayerSpec:
        return RecurrentLayerSpec(
            self.layer_idx,
            (self.conv_kernel_size - 1, self.conv_dim),
            (self.num_heads, self.head_dim, self.ssm_state_size),
            quant_axis=1,  # head_dim: B (state_dim) is the key side
        )

    def _project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[1, T, hidden] -> [T, gate | x B C | dt]."""
        return self.in_proj(hidden_states)[0]

    def _gate_and_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.norm(y, gate)

    def packed_forward(
        self,
        hidden_states: torch.Tensor,
        conv_states: torch.Tensor,
        states: torch.Tensor | None,
        metadata: RecurrentMetadata,
    ) -> torch.Tensor:
        assert states is not None, "a Mamba-2 layer has an SSM state"
        dtype = hidden_states.dtype
        tokens = hidden_states.shape[1]
        gate, xbc, dt = self._project(hidden_states).split(
            (self.intermediate_size, self.conv_dim, self.num_heads), dim=-1
        )
        xbc = self.packed_conv(xbc, conv_states, metadata)
        group_size = self.n_groups * self.ssm_state_size
        x, B, C = xbc.split((self.intermediate_size, group_size, group_size), dim=-1)
        y = kernels.ssm_scan(
            x.view(tokens, self.num_heads, self.head_dim),
            dt,
            -self.A_log.float().exp(),
            B.view(tokens, self.n_groups, self.ssm_state_size),
            C.view(tokens, self.n_groups, self.ssm_state_size),
            self.D,
            states,
            metadata,
            dt_bias=self.dt_bias,
            dt_softplus=True,
            dt_limit=tuple(self.time_step_limit),
        )
        y = self._gate_and_norm(y.view(tokens, self.intermediate_size), gate)
        return self.out_proj(y.to(dtype))[None]


class PackedMamba2Mixer(_PackedMamba2, Mamba2Mixer):
    """Mamba 2."""


class PackedBambaMixer(_PackedMamba2, BambaMixer):
    """Bamba."""


class PackedNemotronHMamba2Mixer(_PackedMamba2, NemotronHMamba2Mixer):
    """Nemotron-H's Mamba-2 layers."""


class PackedGraniteMoeHybridMambaLayer(_PackedMamba2, GraniteMoeHybridMambaLayer):
    """Granite 4.0-H's Mamba-2 layers."""


class PackedZamba2MambaMixer(_PackedMamba2, Zamba2MambaMixer):
    """Zamba2's Mamba-2 layers."""


class PackedFalconH1Mixer(_PackedMamba2, FalconH1Mixer):
    """Falcon-H1: muP multipliers around in_proj; the gated norm is optional (without it the
    output is gated by silu(gate))."""

    def _project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        projected = self.in_proj(hidden_states * self.ssm_in_multiplier)
        return (projected * self.mup_vector)[0]

    def _gate_and_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.mamba_rms_norm:
            return self.norm(y, gate)
        return y * F.silu(gate)


class _PackedMamba1(PackedRecurrentLayer):
    """The packed forward of the Mamba-1 mixers (a mixin before transformers' class)."""

    in_proj: torch.nn.Linear
    x_proj: torch.nn.Linear
    dt_proj: torch.nn.Linear
    out_proj: torch.nn.Linear
    intermediate_size: int
    ssm_state_size: int
    time_step_rank: int
    conv_kernel_size: int
    A_log: torch.nn.Parameter
    D: torch.nn.Parameter

    def state_spec(self) -> RecurrentLayerSpec:
        return RecurrentLayerSpec(
            self.layer_idx,
            (self.conv_kernel_size - 1, self.intermediate_size),
            (self.intermediate_size, 1, self.ssm_state_size),
        )

    def _normalize(
        self, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return dt, B, C

    def packed_forward(
        self,
        hidden_states: torch.Tensor,
        conv_states: torch.Tensor,
        states: torch.Tensor | None,
        metadata: RecurrentMetadata,
    ) -> torch.Tensor:
        assert states is not None, "a Mamba-1 layer has an SSM state"
        dtype = hidden_states.dtype
        tokens = hidden_states.shape[1]
        x, gate = self.in_proj(hidden_states)[0].chunk(2, dim=-1)
        x = self.packed_conv(x, conv_states, metadata)
        dt, B, C = self.x_proj(x).split(
            (self.time_step_rank, self.ssm_state_size, self.ssm_state_size), dim=-1
        )
        dt, B, C = self._normalize(dt, B, C)
        y = kernels.ssm_scan(
            x.view(tokens, self.intermediate_size, 1),
            dt @ self.dt_proj.weight.T,  # dt_proj's bias goes in with the softplus
            -self.A_log.float().exp(),
            B.view(tokens, 1, self.ssm_state_size),
            C.view(tokens, 1, self.ssm_state_size),
            self.D,
            states,
            metadata,
            dt_bias=self.dt_proj.bias,
            dt_softplus=True,
        )
        y = y.view(tokens, self.intermediate_size) * F.silu(gate)
        return self.out_proj(y.to(dtype))[None]


class PackedMambaMixer(_PackedMamba1, MambaMixer):
    """Mamba (1)."""


class PackedJambaMambaMixer(_PackedMamba1, JambaMambaMixer):
    """Jamba's Mamba layers: dt, B and C each RMS-normalised before use."""

    def _normalize(
        self, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)

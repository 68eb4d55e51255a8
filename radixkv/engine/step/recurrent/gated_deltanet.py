"""Gated DeltaNet over a packed step: the linear-attention layers of Qwen3.5 (dense and MoE),
Qwen3-Next and OLMo hybrid, with transformers' weights as they are.

transformers' layers take a padded [batch, time] input and keep their state in its own cache
classes; the runner packs a step into one row of several requests' tokens. Each class here is a
subclass of transformers' own whose `forward` reads the packed row:

    projections (the family's own: fused qkvz / separate q, k, v ...)   [1, T, ...]
    kernels.causal_conv1d over q|k|v, per request after its conv window  (the layer's conv slot)
    beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
    kernels.gated_delta_rule, q and k L2-normalised, per request from its state slot
    the gated RMSNorm (transformers' module) and the output projection

What differs between the families is only where q, k, v, z, a and b come from and which modules
normalise and project the output; each family class says that and nothing else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from radixkv import kernels
from radixkv.engine.step.recurrent.state import (
    PackedRecurrentLayer,
    RecurrentLayerSpec,
    split_heads,
)
from radixkv.kernels import RecurrentMetadata

__all__ = [
    "PackedOlmoHybridGatedDeltaNet",
    "PackedQwen3NextGatedDeltaNet",
    "PackedQwen3_5GatedDeltaNet",
    "PackedQwen3_5MoeGatedDeltaNet",
]


class _PackedGatedDeltaNet(PackedRecurrentLayer):
    """The packed forward shared by the families (a mixin before transformers' class)."""

    # set by transformers' __init__ of every family
    key_dim: int
    value_dim: int
    head_k_dim: int
    head_v_dim: int
    num_k_heads: int
    num_v_heads: int
    conv_kernel_size: int
    A_log: torch.nn.Parameter
    dt_bias: torch.nn.Parameter

    def _inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden [T, hidden] -> (q|k|v [T, conv_dim] before the convolution, z [T, value_dim],
        b [T, num_v_heads], a [T, num_v_heads])."""
        raise NotImplementedError

    def _output(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """core, z [T, num_v_heads, head_v_dim] -> [T, hidden]: the gated norm and projection."""
        raise NotImplementedError

    def _beta(self, b: torch.Tensor) -> torch.Tensor:
        return b.sigmoid()

    def state_spec(self) -> RecurrentLayerSpec:
        conv_dim = 2 * self.key_dim + self.value_dim
        return RecurrentLayerSpec(
            self.layer_idx,
            (self.conv_kernel_size - 1, conv_dim),
            (self.num_v_heads, self.head_k_dim, self.head_v_dim),
        )

    def packed_forward(
        self,
        hidden_states: torch.Tensor,
        conv_states: torch.Tensor,
        states: torch.Tensor | None,
        metadata: RecurrentMetadata,
    ) -> torch.Tensor:
        assert states is not None, "a Gated DeltaNet layer has a delta-rule state"
        hidden = hidden_states[0]
        tokens = hidden.shape[0]
        mixed, z, b, a = self._inputs(hidden)
        q, k, v = split_heads(
            self.packed_conv(mixed, conv_states, metadata),
            (self.num_k_heads, self.head_k_dim),
            (self.num_v_heads, self.head_v_dim),
        )
        # fp32: in fp16 the decay's exp(A_log) may overflow (transformers does the same)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = kernels.gated_delta_rule(
            q, k, v, g, self._beta(b), states, metadata, use_qk_l2norm=True
        )
        z = z.reshape(tokens, self.num_v_heads, self.head_v_dim)
        return self._output(core, z)[None]


class _QwenOutput:
    """Qwen's output: the gated RMSNorm `norm` per value head, then `out_proj`."""

    norm: torch.nn.Module
    out_proj: torch.nn.Linear

    def _output(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        head_v_dim = core.shape[-1]
        normed = self.norm(core.reshape(-1, head_v_dim), z.reshape(-1, head_v_dim))
        return self.out_proj(normed.reshape(core.shape[0], -1))


class PackedQwen3NextGatedDeltaNet(_QwenOutput, _PackedGatedDeltaNet, Qwen3NextGatedDeltaNet):
    """Qwen3-Next: q, k, v, z from one projection grouped by key head, b and a from another."""

    def _inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # transformers' own regrouping, on a batch of one packed row
        q, k, v, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(hidden[None]), self.in_proj_ba(hidden[None])
        )
        tokens = hidden.shape[0]
        mixed = torch.cat([t.reshape(tokens, -1) for t in (q[0], k[0], v[0])], dim=-1)
        return mixed, z[0], b[0], a[0]


class PackedQwen3_5GatedDeltaNet(_QwenOutput, _PackedGatedDeltaNet, Qwen3_5GatedDeltaNet):
    """Qwen3.5 (dense): q|k|v, z, b and a from separate projections."""

    def _inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            self.in_proj_qkv(hidden),
            self.in_proj_z(hidden),
            self.in_proj_b(hidden),
            (self.in_proj_a(hidden)),
        )


class PackedQwen3_5MoeGatedDeltaNet(_QwenOutput, _PackedGatedDeltaNet, Qwen3_5MoeGatedDeltaNet):
    """Qwen3.5 MoE: the dense model's linear attention (the experts are in its MLPs)."""

    _inputs = PackedQwen3_5GatedDeltaNet._inputs


class PackedOlmoHybridGatedDeltaNet(_PackedGatedDeltaNet, OlmoHybridGatedDeltaNet):
    """OLMo hybrid: separate q, k, v, a, b and gate projections; beta in [0, 2] when the model
    allows negative eigenvalues."""

    def _inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mixed = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], -1)
        return mixed, self.g_proj(hidden), self.b_proj(hidden), self.a_proj(hidden)

    def _beta(self, b: torch.Tensor) -> torch.Tensor:
        beta = b.sigmoid()
        return beta * 2.0 if self.allow_neg_eigval else beta

    def _output(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        head_v_dim = core.shape[-1]
        normed = self.o_norm(core.reshape(-1, head_v_dim), z.reshape(-1, head_v_dim))
        return self.o_proj(normed.reshape(core.shape[0], -1))

"""Kimi Delta Attention (KDA) over a packed step: the linear-attention layers of Kimi Linear, with
transformers' weights as they are.

KDA is Gated DeltaNet with a decay a key channel instead of one a head: each head's K x V state
decays row by row. transformers' layer takes a padded [batch, time] input and keeps its state in
its own cache; the subclass here reads the runner's packed row:

    q_proj, k_proj, v_proj                                       [1, T, H x K] each
    kernels.causal_conv1d over q|k|v, per request after its conv window  (the layer's conv slot)
    g = the layer's forget gate (transformers' module): -exp(A_log) softplus(f_b(f_a(x)) + dt_bias)
        per head and key channel; beta = sigmoid(b_proj)
    kernels.gated_delta_rule with g [T, H, K], q and k L2-normalised, per request from its slot
    the gated RMSNorm o_norm (gate g_b(g_a(x))) and o_proj

Kimi Linear's other layers are multi-head latent attention (`latent_attention`), on the paged
latent cache.
"""

from __future__ import annotations

import torch
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

from radixkv import kernels
from radixkv.engine.step.recurrent.state import (
    PackedRecurrentLayer,
    RecurrentLayerSpec,
    split_heads,
)
from radixkv.kernels import RecurrentMetadata

__all__ = ["PackedKimiLinearDeltaAttention"]


class PackedKimiLinearDeltaAttention(PackedRecurrentLayer, KimiLinearDeltaAttention):
    """Kimi Linear's KDA layer over the runner's packed row."""

    def state_spec(self) -> RecurrentLayerSpec:
        return RecurrentLayerSpec(
            self.layer_idx,
            (self.conv_kernel_size - 1, self.conv_dim),
            (self.num_heads, self.head_dim, self.head_dim),
        )

    def packed_forward(
        self,
        hidden_states: torch.Tensor,
        conv_states: torch.Tensor,
        states: torch.Tensor | None,
        metadata: RecurrentMetadata,
    ) -> torch.Tensor:
        assert states is not None, "a KDA layer has a delta-rule state"
        hidden = hidden_states[0]
        tokens = hidden.shape[0]
        heads = (self.num_heads, self.head_dim)
        mixed = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], -1)
        q, k, v = split_heads(self.packed_conv(mixed, conv_states, metadata), heads, heads)
        # fp32 [1, T, H, K], as transformers computes it (its softplus's threshold included)
        g = self.forget_gate(hidden_states)[0]
        beta = self.b_proj(hidden).sigmoid()
        core = kernels.gated_delta_rule(q, k, v, g, beta, states, metadata, use_qk_l2norm=True)
        gate = self.g_b_proj(self.g_a_proj(hidden)).view(tokens, *heads)
        return self.o_proj(self.o_norm(core, gate).reshape(tokens, -1))[None]

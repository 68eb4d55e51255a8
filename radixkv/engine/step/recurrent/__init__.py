"""Recurrent layers of hybrid models over the runner's packed steps, with per-request state.

`pack_recurrent_layers(model)` swaps radixkv's subclass into each Gated DeltaNet, Kimi Delta
Attention, Mamba-2, Mamba-1 and short-convolution layer of a transformers model (`gated_deltanet`,
`kimi_delta_attention`, `mamba`, `short_conv`) and returns the layers' `RecurrentLayerSpec`s;
`RecurrentStates` holds their per-request slots (and, `compact`, snapshots stored in bf16 or
int8), and a step hands the layers a `RecurrentStep` (the states plus the step's
`RecurrentMetadata`) in the `cache` argument transformers passes them.
"""

from radixkv.engine.step.recurrent.layers import pack_recurrent_layers, unpack_recurrent_layers
from radixkv.engine.step.recurrent.state import (
    RecurrentLayerSpec,
    RecurrentStates,
    RecurrentStateSource,
    RecurrentStep,
)

__all__ = [
    "RecurrentLayerSpec",
    "RecurrentStateSource",
    "RecurrentStates",
    "RecurrentStep",
    "pack_recurrent_layers",
    "unpack_recurrent_layers",
]

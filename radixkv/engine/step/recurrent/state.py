"""The per-request state of a model's recurrent layers, in slots, and the handle a step gives them.

A recurrent layer (Gated DeltaNet, KDA, Mamba-2, Mamba-1, a short convolution) carries two things
from one token to the next: the window of its last K - 1 convolution inputs and, except for a
short convolution, its SSM / delta-rule state. They do not grow with the sequence: a running request
holds one of each per layer, in a slot of that layer's tensors, whatever its length.

    RecurrentStates     the runner's storage: per layer, conv [num_slots, K - 1, channels] and
                        ssm [num_slots, *state_shape] (RecurrentLayerSpec says which)
    RecurrentStep       one step's view: the states plus the step's RecurrentMetadata (which slot
                        each packed request reads at its first token and writes after its last)

The packed layers (`layers.py`) find the handle in the `cache` argument transformers' decoder
layer hands them (the runner's per-step cache object will expose `recurrent_layer` beside its
attention views), or in the `radixkv_cache` keyword the runner passes to `model(...)`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from radixkv.kernels import RecurrentMetadata

__all__ = [
    "PackedRecurrentLayer",
    "RecurrentLayerSpec",
    "RecurrentStateSource",
    "RecurrentStates",
    "RecurrentStep",
    "state_source",
]


@dataclass(frozen=True, slots=True)
class RecurrentLayerSpec:
    """What one recurrent layer keeps per request."""

    layer_idx: int
    conv_shape: tuple[int, int]  # (K - 1, channels): the last K - 1 inputs of the convolution
    ssm_shape: tuple[int, ...] | None  # (heads, k_dim, v_dim) or (heads, head_dim, state_dim)

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of one request's state of this layer at `dtype`."""
        size = torch.empty((), dtype=dtype).element_size()
        numel = self.conv_shape[0] * self.conv_shape[1]
        if self.ssm_shape is not None:
            numel += math.prod(self.ssm_shape)
        return numel * size


class RecurrentStateSource(Protocol):
    """What a packed recurrent layer asks of the step: its state tensors and the step's slots."""

    def recurrent_layer(
        self, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, RecurrentMetadata]: ...


class RecurrentStates:
    """Slots of every recurrent layer's state: `num_slots` requests' worth, allocated once.

    Invariants: each layer of `specs` has a conv tensor [num_slots, *conv_shape] and, when its
    spec names one, an ssm tensor [num_slots, *ssm_shape], all of `dtype` on `device`. The
    contents of a slot mean something only while the request that owns it is running; a request
    that starts without a snapshot is marked as such in the step's metadata and never reads it.
    """

    def __init__(
        self,
        specs: Iterable[RecurrentLayerSpec],
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.specs = {spec.layer_idx: spec for spec in specs}
        self.num_slots = num_slots
        self.dtype = dtype
        self.conv = {
            i: torch.zeros((num_slots, *s.conv_shape), dtype=dtype, device=device)
            for i, s in self.specs.items()
        }
        self.ssm = {
            i: torch.zeros((num_slots, *s.ssm_shape), dtype=dtype, device=device)
            for i, s in self.specs.items()
            if s.ssm_shape is not None
        }

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer `layer_idx`'s conv and ssm tensors (ssm None for a short convolution)."""
        return self.conv[layer_idx], self.ssm.get(layer_idx)

    def slot_nbytes(self) -> int:
        """Bytes of one request's state across all layers (a snapshot's size)."""
        return sum(spec.nbytes(self.dtype) for spec in self.specs.values())

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy every layer's state of slot `src` into slot `dst` (a fork, or a snapshot taken)."""
        for tensors in (self.conv, self.ssm):
            for t in tensors.values():
                t[dst].copy_(t[src])

    def check_integrity(self) -> None:
        for i, spec in self.specs.items():
            conv = self.conv[i]
            assert conv.shape == (self.num_slots, *spec.conv_shape), f"layer {i}: conv shape"
            assert conv.dtype == self.dtype, f"layer {i}: conv dtype"
            ssm = self.ssm.get(i)
            assert (ssm is None) == (spec.ssm_shape is None), f"layer {i}: ssm presence"
            if ssm is not None:
                assert spec.ssm_shape is not None
                assert ssm.shape == (self.num_slots, *spec.ssm_shape), f"layer {i}: ssm shape"
        assert set(self.conv) == set(self.specs), "a conv tensor per layer"


class RecurrentStep:
    """One step's handle for the packed layers: the states and the step's metadata."""

    def __init__(self, states: RecurrentStates, metadata: RecurrentMetadata) -> None:
        assert all(s < states.num_slots for s in metadata.slots), "slot out of range"
        self.states = states
        self.metadata = metadata

    def recurrent_layer(
        self, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, RecurrentMetadata]:
        conv, ssm = self.states.layer(layer_idx)
        return conv, ssm, self.metadata


class PackedRecurrentLayer:
    """A packed recurrent layer's entry point (a mixin before transformers' module class): the
    decoder layer calls it as transformers' module, with the step's handle as `cache`."""

    layer_idx: int

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        # hidden_states: [1, T, hidden], the step's packed row: no padding, so no mask to apply
        conv_states, ssm_states, metadata = state_source(cache, kwargs).recurrent_layer(
            self.layer_idx
        )
        return self.packed_forward(hidden_states, conv_states, ssm_states, metadata)

    def packed_forward(
        self,
        hidden_states: torch.Tensor,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor | None,
        metadata: RecurrentMetadata,
    ) -> torch.Tensor:
        """[1, T, hidden] -> [1, T, hidden], each request from and back to its slots."""
        raise NotImplementedError

    def state_spec(self) -> RecurrentLayerSpec:
        """The shapes of the per-request state this layer keeps."""
        raise NotImplementedError


def state_source(cache: object, kwargs: Mapping[str, Any]) -> RecurrentStateSource:
    """The step's state handle: the `cache` transformers passed, else the runner's keyword."""
    for candidate in (cache, kwargs.get("radixkv_cache")):
        if candidate is not None and hasattr(candidate, "recurrent_layer"):
            return candidate  # type: ignore[return-value]
    raise RuntimeError(
        "radixkv's packed recurrent layers run only inside the radixkv model runner, with the "
        "step's recurrent states (a cache object with `recurrent_layer`)"
    )

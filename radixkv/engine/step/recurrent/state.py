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
from typing import Any, Protocol

import torch

from radixkv import kernels
from radixkv.engine.step.recurrent.compact import CompactSnapshots
from radixkv.engine.step.recurrent.layer_spec import RecurrentLayerSpec
from radixkv.kernels import RecurrentMetadata

__all__ = [
    "PackedRecurrentLayer",
    "RecurrentLayerSpec",
    "RecurrentStateSource",
    "RecurrentStates",
    "RecurrentStep",
    "state_source",
]


class RecurrentStateSource(Protocol):
    """What a packed recurrent layer asks of the step: its state tensors and the step's slots."""

    def recurrent_layer(
        self, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, RecurrentMetadata]: ...


class RecurrentStates:
    """Slots of every recurrent layer's state: `num_slots` requests' worth, allocated once.

    Invariants: each layer of `specs` has a conv tensor [num_running, *conv_shape] and, when
    its spec names one, an ssm tensor [num_running, *ssm_shape], all of `dtype` on `device`
    (`num_running` is `num_slots` unless snapshots are compact). The contents of a slot mean
    something only while the request that owns it is running, or the cache lists a snapshot in
    it; a request that starts without a snapshot is marked as such in the step's metadata and
    never reads it.

    Compact snapshots (`snapshot_dtype` "bf16" / "int8", `compact`): slots [0, num_running)
    are the running requests', exact, in the tensors above; slots [num_running, num_slots) are
    snapshots, in `snapshots`, and a copy between the two kinds converts.
    """

    def __init__(
        self,
        specs: Iterable[RecurrentLayerSpec],
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        num_running: int | None = None,
        snapshot_dtype: str = "exact",
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        assert (num_running is None) == (snapshot_dtype == "exact"), (num_running, snapshot_dtype)
        self.specs = {spec.layer_idx: spec for spec in specs}
        self.num_slots = num_slots
        self.num_running = running = num_slots if num_running is None else num_running
        assert 1 <= running <= num_slots, (running, num_slots)
        self.dtype = dtype
        self.snapshot_dtype = snapshot_dtype
        self.conv = {
            i: torch.zeros((running, *s.conv_shape), dtype=dtype, device=device)
            for i, s in self.specs.items()
        }
        self.ssm = {
            i: torch.zeros((running, *s.ssm_shape), dtype=dtype, device=device)
            for i, s in self.specs.items()
            if s.ssm_shape is not None
        }
        self.snapshots: CompactSnapshots | None = None
        if num_slots > running:
            specs_ = self.specs.values()
            self.snapshots = CompactSnapshots(
                specs_, num_slots - running, snapshot_dtype, dtype, device
            )

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer `layer_idx`'s conv and ssm tensors (ssm None for a short convolution)."""
        return self.conv[layer_idx], self.ssm.get(layer_idx)

    def slot_nbytes(self) -> int:
        """Bytes of one request's state across all layers (a running slot's, and a snapshot's
        unless they are compact)."""
        return sum(spec.nbytes(self.dtype) for spec in self.specs.values())

    def snapshot_nbytes(self) -> int:
        """Bytes of one snapshot across all layers, in `snapshot_dtype`."""
        return sum(s.snapshot_nbytes(self.dtype, self.snapshot_dtype) for s in self.specs.values())

    def nbytes(self) -> int:
        """Bytes of every slot: the running ones and the compact snapshots'."""
        compact = self.num_slots - self.num_running
        return self.num_running * self.slot_nbytes() + compact * self.snapshot_nbytes()

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy every layer's state of slot `src` into slot `dst` (a snapshot taken, or a resume
        from one), converting between a running slot and a compact snapshot's."""
        running = self.num_running
        if src < running and dst < running:
            for tensors in (self.conv, self.ssm):
                for t in tensors.values():
                    t[dst].copy_(t[src])
            return
        snapshots = self.snapshots
        assert snapshots is not None, (src, dst)
        if dst >= running > src:
            snapshots.store(dst - running, *self.running_views(src))
        elif src >= running > dst:
            snapshots.load(src - running, *self.running_views(dst))
        else:
            snapshots.copy(src - running, dst - running)

    def running_views(self, slot: int) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Running slot `slot`'s conv windows and SSM states, by layer (views)."""
        conv = {i: t[slot] for i, t in self.conv.items()}
        return conv, {i: t[slot] for i, t in self.ssm.items()}

    def check_integrity(self) -> None:
        running = self.num_running
        for i, spec in self.specs.items():
            conv = self.conv[i]
            assert conv.shape == (running, *spec.conv_shape), f"layer {i}: conv shape"
            assert conv.dtype == self.dtype, f"layer {i}: conv dtype"
            ssm = self.ssm.get(i)
            assert (ssm is None) == (spec.ssm_shape is None), f"layer {i}: ssm presence"
            if ssm is not None:
                assert spec.ssm_shape is not None
                assert ssm.shape == (running, *spec.ssm_shape), f"layer {i}: ssm shape"
        assert set(self.conv) == set(self.specs), "a conv tensor per layer"
        assert (self.snapshots is None) == (running == self.num_slots), "snapshot slots"
        if self.snapshots is not None:
            assert self.snapshots.num_slots == self.num_slots - running
            self.snapshots.check_integrity()


class RecurrentStep:
    """One step's handle for the packed layers: the states and the step's metadata."""

    def __init__(self, states: RecurrentStates, metadata: RecurrentMetadata) -> None:
        assert all(s < states.num_running for s in metadata.slots), "a row in no running slot"
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
    # transformers' depthwise causal convolution and its activation (every layer with a conv1d)
    conv1d: torch.nn.Conv1d
    activation: str

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

    def packed_conv(
        self, x: torch.Tensor, conv_states: torch.Tensor, metadata: RecurrentMetadata
    ) -> torch.Tensor:
        """`conv1d` and `activation` over the packed row's inputs `x` [T, channels], each
        request's after its conv window (which it leaves holding its last K - 1 inputs)."""
        weight = self.conv1d.weight.squeeze(1)
        return kernels.causal_conv1d(
            x, weight, self.conv1d.bias, conv_states, metadata, self.activation
        )


def split_heads(
    mixed: torch.Tensor, key_heads: tuple[int, int], value_heads: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A delta-rule layer's q|k|v [T, 2 x heads x dim + heads x dim], convolved, as q and k [T,
    *key_heads] and v [T, *value_heads] ((heads, dim) each)."""
    tokens = mixed.shape[0]
    key_dim, value_dim = math.prod(key_heads), math.prod(value_heads)
    q, k, v = mixed.split((key_dim, key_dim, value_dim), dim=-1)
    return q.view(tokens, *key_heads), k.view(tokens, *key_heads), v.view(tokens, *value_heads)


def state_source(cache: object, kwargs: Mapping[str, Any]) -> RecurrentStateSource:
    """The step's state handle: the `cache` transformers passed, else the runner's keyword."""
    for candidate in (cache, kwargs.get("radixkv_cache")):
        if candidate is not None and hasattr(candidate, "recurrent_layer"):
            return candidate  # type: ignore[return-value]
    raise RuntimeError(
        "radixkv's packed recurrent layers run only inside the radixkv model runner, with the "
        "step's recurrent states (a cache object with `recurrent_layer`)"
    )

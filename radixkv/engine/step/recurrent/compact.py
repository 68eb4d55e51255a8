"""Compact snapshots: kept recurrent states stored smaller than a running request's.

A running request's state stays at the model's dtype, exact; a snapshot is read once, when a hit
resumes from it (its copy into the request's running slot), so it may be stored smaller at the
cost of one rounding of the state it resumes with (`snapshot_dtype`):

    "exact"   the running state's format (the default: greedy output equals a cold run's)
    "bf16"    the SSM / delta-rule state in bfloat16
    "int8"    the SSM / delta-rule state in int8, symmetric, one scale (at the model's dtype)
              per head and key channel: the scale reduces over the state's value axis
              (`RecurrentLayerSpec.quant_axis`), so each key channel, which the layer's decay
              and readout weigh as a unit, keeps its own range (SGLang's checkpoint format)

The conv window stays at the model's dtype in every format: K - 1 inputs, small beside the
state. `CompactSnapshots` holds the snapshot slots of every recurrent layer in one format and
converts on the way in (`store`, from a running slot) and out (`load`, into one).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from radixkv.engine.config import SNAPSHOT_DTYPES

if TYPE_CHECKING:
    from radixkv.engine.step.recurrent.layer_spec import RecurrentLayerSpec

__all__ = ["SNAPSHOT_DTYPES", "CompactSnapshots", "dequantize_int8", "quantize_int8"]

INT8_MAX = 127


def quantize_int8(state: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`state` in int8 with one scale per index of every axis but `axis` (which the scale
    reduces over): (q, scale), scale at `state`'s dtype with `axis` kept as size 1. The scale
    is rounded to that dtype before dividing by it, so `dequantize_int8` undoes exactly the
    same scale; the rounding error of an entry is at most half its scale."""
    x = state.to(torch.float32)
    amax = x.abs().amax(dim=axis, keepdim=True)
    # an all-zero row (a fresh state) gets scale 1, not 0: nothing to divide by zero
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax)).to(state.dtype)
    q = torch.round(x / scale.to(torch.float32)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


class CompactSnapshots:
    """`num_slots` snapshots of every layer of `specs` in `snapshot_dtype` ("bf16" or "int8"):
    per layer conv [num_slots, *conv_shape] at `dtype`, and for a layer with an SSM state, its
    `ssm` [num_slots, *ssm_shape] (bfloat16 or int8) and for int8 its `scale` (`dtype`, the
    quantized axis of size 1).

    Invariants (`check_integrity`): those shapes and dtypes; a slot means something only while
    the cache lists a snapshot in it.
    """

    def __init__(
        self,
        specs: Iterable[RecurrentLayerSpec],
        num_slots: int,
        snapshot_dtype: str,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        assert snapshot_dtype in SNAPSHOT_DTYPES and snapshot_dtype != "exact", snapshot_dtype
        self.specs = {spec.layer_idx: spec for spec in specs}
        self.num_slots = num_slots
        self.snapshot_dtype = snapshot_dtype
        self.dtype = dtype
        store = torch.int8 if snapshot_dtype == "int8" else torch.bfloat16
        self.conv = {
            i: torch.zeros((num_slots, *s.conv_shape), dtype=dtype, device=device)
            for i, s in self.specs.items()
        }
        ssm = {i: s for i, s in self.specs.items() if s.ssm_shape is not None}
        self.ssm = {
            i: torch.zeros((num_slots, *s.ssm_shape), dtype=store, device=device)  # type: ignore[misc]
            for i, s in ssm.items()
        }
        self.scale: dict[int, torch.Tensor] = {}
        if snapshot_dtype == "int8":
            self.scale = {
                i: torch.ones((num_slots, *s.scale_shape()), dtype=dtype, device=device)
                for i, s in ssm.items()
            }

    def store(self, slot: int, conv: dict[int, torch.Tensor], ssm: dict[int, torch.Tensor]) -> None:
        """Snapshot slot `slot` := one running slot's state (`conv[i]`, `ssm[i]`: layer i's)."""
        for i, window in conv.items():
            self.conv[i][slot].copy_(window)
        for i, state in ssm.items():
            if self.snapshot_dtype == "int8":
                q, scale = quantize_int8(state, self.specs[i].quant_axis)
                self.ssm[i][slot].copy_(q)
                self.scale[i][slot].copy_(scale)
            else:
                self.ssm[i][slot].copy_(state)  # rounded to bfloat16

    def load(self, slot: int, conv: dict[int, torch.Tensor], ssm: dict[int, torch.Tensor]) -> None:
        """One running slot's state (`conv[i]`, `ssm[i]`, written in place) := snapshot `slot`
        at the running state's dtype."""
        for i, window in conv.items():
            window.copy_(self.conv[i][slot])
        for i, state in ssm.items():
            if self.snapshot_dtype == "int8":
                state.copy_(dequantize_int8(self.ssm[i][slot], self.scale[i][slot], state.dtype))
            else:
                state.copy_(self.ssm[i][slot])

    def copy(self, src: int, dst: int) -> None:
        """Snapshot slot `dst` := snapshot slot `src`, as stored."""
        for tensors in (self.conv, self.ssm, self.scale):
            for t in tensors.values():
                t[dst].copy_(t[src])

    def slot_nbytes(self) -> int:
        """Bytes of one snapshot across all layers."""
        return sum(t[0].nbytes for d in (self.conv, self.ssm, self.scale) for t in d.values())

    def check_integrity(self) -> None:
        for i, spec in self.specs.items():
            assert self.conv[i].shape == (self.num_slots, *spec.conv_shape), f"layer {i}: conv"
            assert self.conv[i].dtype == self.dtype, f"layer {i}: conv dtype"
            assert (i in self.ssm) == (spec.ssm_shape is not None), f"layer {i}: ssm presence"
            if spec.ssm_shape is not None:
                assert self.ssm[i].shape == (self.num_slots, *spec.ssm_shape), f"layer {i}: ssm"
                if self.snapshot_dtype == "int8":
                    scale = self.scale[i]
                    assert scale.shape == (self.num_slots, *spec.scale_shape()), f"layer {i}"
        assert set(self.scale) == (set(self.ssm) if self.snapshot_dtype == "int8" else set())

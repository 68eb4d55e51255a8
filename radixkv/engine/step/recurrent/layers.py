"""Which transformers module each packed recurrent layer replaces, and the swap itself.

As `fused_llama` does for Llama's attention, the runner changes the class of each recurrent
module of a loaded model to radixkv's subclass (weights, parameter names and every other module
stay transformers'); `pack_recurrent_layers` returns the layers' state specs, from which the
runner sizes its state slots.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

import torch

from radixkv.engine.step.recurrent.state import RecurrentLayerSpec

logger = logging.getLogger(__name__)

__all__ = ["pack_recurrent_layers", "unpack_recurrent_layers"]

# The activations the convolution kernel applies (transformers' names).
_CONV_ACTIVATIONS = (None, "silu")


@functools.cache
def packed_classes() -> dict[type, type]:
    """transformers' recurrent module class -> the packed subclass that replaces it."""
    from radixkv.engine.step.recurrent import (
        gated_deltanet,
        kimi_delta_attention,
        mamba,
        short_conv,
    )

    packed = [
        *(getattr(gated_deltanet, n) for n in gated_deltanet.__all__),
        *(getattr(kimi_delta_attention, n) for n in kimi_delta_attention.__all__),
        *(getattr(mamba, n) for n in mamba.__all__),
        *(getattr(short_conv, n) for n in short_conv.__all__),
    ]
    # each packed class lists its transformers class last among its bases
    return {cls.__bases__[-1]: cls for cls in packed}


def pack_recurrent_layers(model: torch.nn.Module) -> tuple[RecurrentLayerSpec, ...]:
    """Swap the packed class into every recurrent layer of `model`, in place (a module packed
    before stays as it is), and return the layers' state specs in layer order. Raises ValueError,
    changing nothing, if a layer's convolution uses an activation the kernel does not apply."""
    classes = packed_classes()
    packed_types = set(classes.values())
    found = [m for m in model.modules() if type(m) in classes or type(m) in packed_types]
    for module in found:
        activation = getattr(module, "activation", None)
        if activation not in _CONV_ACTIVATIONS:
            raise ValueError(
                f"layer {module.layer_idx} ({type(module).__name__}) convolves with the "
                f"{activation!r} activation, which radixkv's conv kernel does not apply"
            )
    for module in found:
        module.__class__ = classes.get(type(module), type(module))
    specs = sorted((m.state_spec() for m in found), key=lambda s: s.layer_idx)
    layers = [s.layer_idx for s in specs]
    assert len(set(layers)) == len(layers), f"two recurrent modules claim one layer: {layers}"
    logger.debug("packed %d recurrent layers of %s", len(specs), type(model).__name__)
    return tuple(specs)


def unpack_recurrent_layers(model: torch.nn.Module) -> None:
    """Give every packed layer of `model` its transformers class back (in place)."""
    plain = {packed: original for original, packed in packed_classes().items()}
    _swap(model.modules(), plain)


def _swap(modules: Iterable[torch.nn.Module], classes: dict[type, type]) -> None:
    for module in modules:
        new = classes.get(type(module))
        if new is not None:
            module.__class__ = new

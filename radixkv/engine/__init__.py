"""The engine: `LLM` runs a Hugging Face causal LM over the prefix cache (torch + transformers).

Names are imported on first use: `EngineConfig` and `SamplingParams` load no torch, so the command
line's help and `from radixkv import SamplingParams` stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.heap import freeze_startup_heap, release_heap
    from radixkv.engine.llm import LLM
    from radixkv.engine.model_loader import ModelLoadError, ModelNotFoundError
    from radixkv.engine.outputs import RequestOutput, RequestStats, StreamDelta
    from radixkv.engine.records import RequestUpdate
    from radixkv.engine.sampling_params import SamplingParams

_MODULES = {  # name -> the module that defines it
    "EngineConfig": "config",
    "LLM": "llm",
    "ModelLoadError": "model_loader",
    "ModelNotFoundError": "model_loader",
    "RequestOutput": "outputs",
    "RequestStats": "outputs",
    "RequestUpdate": "records",
    "SamplingParams": "sampling_params",
    "StreamDelta": "outputs",
    "freeze_startup_heap": "heap",
    "release_heap": "heap",
}
__all__ = [
    "LLM",
    "EngineConfig",
    "ModelLoadError",
    "ModelNotFoundError",
    "RequestOutput",
    "RequestStats",
    "RequestUpdate",
    "SamplingParams",
    "StreamDelta",
    "freeze_startup_heap",
    "release_heap",
]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(f"radixkv.engine.{_MODULES[name]}"), name)
    raise AttributeError(f"module 'radixkv.engine' has no attribute {name!r}")

"""The engine: `LLM` runs a Hugging Face causal LM over the prefix cache (torch + transformers).

llm.py              `LLM`, the door: checks what users pass, keeps a record of each request
records.py          the request records, their stats and the updates each step hands out
outputs.py          what the doors hand back (`RequestOutput`, `StreamDelta`, ...)
config.py           `EngineConfig`: every setting, one set of defaults, checked once
sampling_params.py  `SamplingParams`: a request's settings
assembly.py         the runner, tier movers, grouped cache and scheduler built from the model
interrupts.py       Ctrl-C waits for the end of a step;  heap.py: the server's start-up heap
step/               one step on the device: launch and finish, the model runner, its inputs
sampling/           from logits to tokens: the sampler, penalties, logprobs, grammars
tiers/              the host and disk tiers' movers and storage
model/              loading the model and tokenizer, its layers' layout, prompts and text

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
    from radixkv.engine.model.model_loader import ModelLoadError, ModelNotFoundError
    from radixkv.engine.outputs import RequestOutput, RequestStats, StreamDelta
    from radixkv.engine.records import RequestUpdate
    from radixkv.engine.sampling_params import SamplingParams

_MODULES = {  # name -> the module that defines it
    "EngineConfig": "config",
    "LLM": "llm",
    "ModelLoadError": "model.model_loader",
    "ModelNotFoundError": "model.model_loader",
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

"""The engine: `LLM` runs a Hugging Face causal LM over the prefix cache (torch + transformers)."""

from radixkv.engine.llm import LLM, RequestUpdate
from radixkv.engine.model_loader import ModelNotFoundError
from radixkv.engine.outputs import RequestOutput, RequestStats, StreamDelta

__all__ = [
    "LLM",
    "ModelNotFoundError",
    "RequestOutput",
    "RequestStats",
    "RequestUpdate",
    "StreamDelta",
]

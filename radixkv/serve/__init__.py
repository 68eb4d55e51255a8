"""`radixkv serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one `LLM`."""

from radixkv.serve.app import OpenAIServer, ServeConfig, create_app
from radixkv.serve.engine_loop import EngineLoop, EngineSnapshot, RequestStream

__all__ = [
    "EngineLoop",
    "EngineSnapshot",
    "OpenAIServer",
    "RequestStream",
    "ServeConfig",
    "create_app",
]

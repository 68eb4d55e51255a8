"""Ctrl-C in tests: child processes that receive it as one started from an interactive shell
does, and a real SIGINT sent from inside a chosen call of this process.

A test suite started in the background of a non-interactive shell (`make test &`, nohup, a CI
runner) inherits SIGINT ignored, its children inherit that too, and Python then leaves it ignored
(as a program started that way should). A test that sends a child SIGINT gives it SIGINT's
default disposition first, so that Python installs its own handler there.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any

import pytest


def sigint_restored() -> None:
    """`preexec_fn` for `subprocess.Popen`: SIGINT back to its default in the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class CtrlCInside:
    """What `ctrl_c_inside` saw: calls made, and whether the interrupted call ran to its end."""

    calls: int = 0
    started: bool = False
    finished: bool = False


def ctrl_c_inside(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, at: int = 1
) -> CtrlCInside:
    """Patch `owner.name` to send this process a real SIGINT at the start of its `at`-th call,
    then run the call: `finished` stays False if a KeyboardInterrupt cut the call short."""
    real = getattr(owner, name)
    seen = CtrlCInside()

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        seen.calls += 1
        if seen.calls != at:
            return real(*args, **kwargs)
        seen.started = True
        os.kill(os.getpid(), signal.SIGINT)
        result = real(*args, **kwargs)
        seen.finished = True
        return result

    monkeypatch.setattr(owner, name, interrupted)
    return seen

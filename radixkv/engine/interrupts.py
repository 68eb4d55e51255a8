"""Ctrl-C never lands in the middle of an engine operation.

A KeyboardInterrupt raised at an arbitrary bytecode could cut a cache update in half (a split
node without its blocks, a lock taken and never released), and no `except` clause can repair
that. So the operations that change the engine's state (a step, an abort, a save) hold SIGINT
while they run and raise the KeyboardInterrupt just after, where the state is whole again: a
Ctrl-C during `generate` stops it between two steps, and its requests are aborted as for any
other exception.

Only where Python's own handler is installed and on the main thread, the one that receives
signals: a program that installed its own SIGINT handler keeps it, and a server's engine thread
never sees signals at all.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class _Held:
    depth = 0  # nesting of sigint_deferred on the main thread
    pending = False  # a Ctrl-C arrived while held


def _hold(signum: int, frame: object) -> None:
    _Held.pending = True


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Run the block with Ctrl-C held; one that arrived meanwhile raises KeyboardInterrupt at its
    end (at the end of the outermost block, when nested)."""
    if threading.current_thread() is not threading.main_thread() or (
        _Held.depth == 0 and signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    if _Held.depth == 0:
        signal.signal(signal.SIGINT, _hold)
    _Held.depth += 1
    try:
        yield
    finally:
        _Held.depth -= 1
        if _Held.depth == 0:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if _Held.pending:
                _Held.pending = False
                raise KeyboardInterrupt

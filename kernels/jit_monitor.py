"""Counting Triton JIT compiles: the engine warns about any that happen after its warm-up.

A kernel is compiled once per specialization of its arguments (dtypes, constexprs, and which ints
are 1 or multiples of 16, which pointers are 16-byte aligned). A compile costs 0.5-2 s on a cold
cache and tens of ms even when Triton finds the binary in its disk cache, so one inside a timed
step is a latency spike. Triton calls `knobs.runtime.jit_cache_hook` before each compile of a new
specialization in this process (and `jit_post_compile_hook` after it); the counter chains itself in
front of whatever hooks were installed before it (Triton >= 3.4; older releases call the class
attributes `JITFunction.cache_hook` / `compiled_hook`, which it uses instead). The interpreter
(TRITON_INTERPRET=1) compiles nothing and calls neither.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from typing import Any

__all__ = ["CompileCounter", "compile_counter"]


class CompileCounter:
    """Triton JIT compiles of this process, every kernel's (a process-wide fact: Triton's hooks
    are global). `count` and `seconds` only grow; `recent` names the last compiled kernels."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.recent: deque[str] = deque(maxlen=32)
        self._started: dict[Any, float] = {}
        self._lock = threading.Lock()

    def before_compile(self, **kwargs: Any) -> None:
        """Triton's pre-compile hook (its keyword arguments: key, repr, fn, compile, ...)."""
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
        with self._lock:
            self.count += 1
            self.recent.append(name)
            self._started[kwargs.get("key")] = time.perf_counter()

    def after_compile(self, **kwargs: Any) -> None:
        """Triton's post-compile hook: adds the compile's duration to `seconds`."""
        with self._lock:
            t0 = self._started.pop(kwargs.get("key"), None)
            if t0 is not None:
                self.seconds += time.perf_counter() - t0

    def names_since(self, count: int) -> list[str]:
        """The kernels compiled after the counter read `count` (the last 32 at most)."""
        n = min(self.count - count, len(self.recent))
        return list(self.recent)[len(self.recent) - n :] if n > 0 else []


def _chain(first: Any, then: Any) -> Any:
    """A hook that calls `first` (the counter's, which returns None) then `then` (a hook installed
    before the counter, or None) and returns `then`'s result: a cache hook returning True tells
    Triton to skip the compile, and that decision stays with the earlier hook."""

    def hook(**kwargs: Any) -> Any:
        first(**kwargs)
        return then(**kwargs) if then is not None else None

    return hook


@functools.cache
def compile_counter() -> CompileCounter | None:
    """The process's counter, its hooks installed on first call; None without Triton."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    counter = CompileCounter()
    try:
        from triton import knobs

        target: Any = knobs.runtime
        names = ("jit_cache_hook", "jit_post_compile_hook")
    except ImportError:  # Triton < 3.4
        from triton.runtime.jit import JITFunction

        target = JITFunction
        names = ("cache_hook", "compiled_hook")
    before, after = names
    setattr(target, before, _chain(counter.before_compile, getattr(target, before, None)))
    setattr(target, after, _chain(counter.after_compile, getattr(target, after, None)))
    return counter

"""`Checked`: a proxy that runs `check_integrity()` after every public call of the object it wraps.

The project's stateful classes check their own invariants; tests call the check after every
operation by wrapping the object under test (a cache, a disk store) in one of these.
"""

from __future__ import annotations

from typing import Any


class Checked:
    """Proxy of `inner` that runs `inner.check_integrity()` after every public method call (also
    when the call raises)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                self.inner.check_integrity()

        return checked

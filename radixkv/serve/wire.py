"""The messages between the server's front end and its engine process, as bytes.

Both ends are this program and the sockets live in a folder only this user can open, so the
messages are pickles (the project's own dataclasses, exceptions and module-level functions go
as they are). Reading one still never imports or calls anything outside the project: `loads`
resolves only the project's classes and functions, torch's dtypes and a short list of harmless
builtins, so a message that names `os.system` (or reaches it through a project module's
attribute) is refused before anything runs. The tokenizer therefore never travels: the front
end loads its own.
"""

from __future__ import annotations

import builtins
import io
import pickle
from typing import Any

PROJECT = "radixkv"
SAFE_BUILTINS = frozenset({"set", "frozenset", "slice", "range", "complex", "bytearray"})
SAFE_GLOBALS = frozenset({("functools", "partial"), ("collections", "OrderedDict")})


class WireError(pickle.UnpicklingError):
    """A message that names something outside the project."""


def dumps(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return _ProjectUnpickler(io.BytesIO(data)).load()


def travels(value: Any) -> bool:
    """Whether `value` survives `dumps` and then `loads` (an exception from a library outside
    the project does not: the engine sends such an error in words)."""
    try:
        loads(dumps(value))
    except Exception:
        return False
    return True


class _ProjectUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and "." not in name:  # a dtype among the settings
            import torch

            found = getattr(torch, name, None)
            if isinstance(found, torch.dtype):
                return found
        elif module == "builtins" and "." not in name:
            found = getattr(builtins, name, None)
            if name in SAFE_BUILTINS or _is_exception(found):
                return found
        elif module.split(".")[0] == PROJECT:
            found = super().find_class(module, name)
            # A dotted name walks attributes: what it reaches must be the project's own class
            # or function, never a module or a library's function a project module imported.
            owner = getattr(found, "__module__", None) or ""
            if isinstance(found, type | _FUNCTION) and owner.split(".")[0] == PROJECT:
                return found
        raise WireError(f"a message names {module}.{name}, which is not the project's")


_FUNCTION = type(dumps)


def _is_exception(found: Any) -> bool:
    return isinstance(found, type) and issubclass(found, BaseException)

"""`BlockHashIndex`, a router's reference consumer of KV events, from `examples/kv_event_router.py`
(the examples are not installed: loaded from their file)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "examples" / "kv_event_router.py"
_SPEC = importlib.util.spec_from_file_location("kv_event_router", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
_MODULE = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_MODULE)

BlockHashIndex = _MODULE.BlockHashIndex

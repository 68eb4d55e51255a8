"""The garbage collector after start-up.

Loading a model leaves millions of long-lived Python objects (modules, parameters, tokenizer
tables) in the collector's generations; a full collection then walks all of them, 100-250 ms
that lands inside whichever request happens to trigger it. As vLLM does, a front door collects
once after start-up and freezes what survived: later collections walk only what requests create.
Frozen objects are never collected, so a process that builds and drops engines (a benchmark)
unfreezes before dropping one.
"""

from __future__ import annotations

import atexit
import gc


def freeze_startup_heap() -> int:
    """Collect, then move every surviving object out of the collector's reach. Returns how many
    objects are frozen."""
    gc.collect()
    gc.freeze()
    # Released again at exit, so that finalisation collects it: extension modules (Triton's)
    # report what is still alive then as leaks.
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()


def release_heap() -> None:
    """Undo `freeze_startup_heap` and collect: before dropping an engine built after it."""
    gc.unfreeze()
    gc.collect()

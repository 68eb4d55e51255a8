"""Freed memory kept for the next step on a CPU: glibc's malloc told not to hand large blocks back.

A CPU forward allocates and frees the same large activations every layer of every step (a
prefill chunk's MLP input alone is megabytes). By default glibc serves each such block with its
own `mmap` and returns it with `munmap` when freed, so the next layer's block of the same size
arrives as fresh pages: a page fault and a zeroed page for every 4 KiB, about 500,000 faults for
a 4,000-token prefill of SmolLM2 (`benchmarks/RESULTS.md`). Raising the mmap threshold to its
ceiling (32 MiB) serves those blocks from the heap instead, and a high trim threshold keeps the
heap's freed top for reuse: the same prefill then faults 0 times. The cost is that up to the
step's peak of activations stays mapped between steps, which a serving engine reaches anyway.
vLLM's CPU backend gets the same effect by preloading tcmalloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling on 64-bit machines
TRIM_THRESHOLD = 1 * 2**30


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep large freed blocks for reuse (process-wide, idempotent);
    False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX))
    done = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and done
    logger.debug("malloc keeps freed blocks below %d bytes: %s", MMAP_THRESHOLD_MAX, done)
    return done

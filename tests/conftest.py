"""Shared test set-up.

TRITON_INTERPRET is read when `@triton.jit` decorates a function, so it must be set before any
kernel module is imported: here, at the top of the first conftest pytest loads.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

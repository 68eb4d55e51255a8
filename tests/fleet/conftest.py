"""The fleet tests run the real routers (installed by scripts/setup_routers.sh) in front of
`radixkv serve` replicas of the tiny test model, on 127.0.0.1. The launcher is the recipes' own
(examples/fleet/fleet.py) and the workload the benchmark's (benchmarks/fleet_bench.py)."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
for path in (_ROOT, _ROOT / "examples" / "fleet"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

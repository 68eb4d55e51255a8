"""Every tile kernel_bench sweeps compiles for sm_90 on this CPU without spilling registers
(benchmarks/sm90_compile.py, with this environment's Triton and its ptxas), and the compiled
loops show what the sweeps test: the block-table lookup leaves the loop single-buffered below 5
pipeline stages (one K/V buffer, nothing in flight at its wait) and 5 stages double-buffer it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_swept_tiles_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-P", str(ROOT / "benchmarks" / "sm90_compile.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and cells[0] in ("paged_attention", "merge_splits"):
            rows[(cells[0], int(cells[1]), cells[2])] = cells
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernel_bench

    for head_dim in (64, 128):
        for tile in (*kernel_bench.DECODE_SWEEP, *kernel_bench.EXTEND_SWEEP):
            cells = rows[("paged_attention", head_dim, kernel_bench._tile_name(tile))]
            assert cells[4] == "0 / 0", cells  # no spill stores or loads
            assert int(cells[9]) >= 1  # an SM holds one at least
            buffers, in_flight = cells[7], cells[8]
            if tile[3] >= 5:
                assert int(buffers) >= 2 and int(in_flight) > 0, cells
            elif tile[0] == 16:  # decode, fewer stages: one K/V tile, loads not overlapped
                assert (buffers, in_flight) == ("1", "0"), cells
        assert ("merge_splits", head_dim, "64 splits") in rows
    assert re.search(r"Triton \d+\.\d+", result.stdout)

"""Does an open live page cost the server anything, and does the page stay smooth under load?

    python -m benchmarks.page_bench                        # default model, 64 clients x 2 turns
    python -m benchmarks.page_bench --clients 16 --rounds 3
    python -m benchmarks.page_bench --tiny --model DIR     # seconds: 2 clients x 2 turns

Each round runs `serve_bench`'s workload (concurrent multi-turn chat clients, greedy, streamed)
against a fresh `radixkv serve` twice: with no page open, then with the page open in headless
Debian chromium (Selenium, the system's chromedriver). Reported per run: output tokens/s and
TTFT p50 (as serve_bench reports them); with the page, the longest task the browser's Long Tasks
API saw (tasks over 50 ms; 0 when none) and the longest gap between two animation frames. The
goals: output tok/s with the page >= 0.97x without it, no frame over 100 ms. Run it on an
otherwise idle machine: on a loaded one the two runs time their neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from benchmarks.serve_bench import run_clients, running_server, summarize, workload_parser
from benchmarks.serve_servers import parse_server

# Installed in the page before the load: every long task and the longest frame gap.
WATCH_FRAMES = """
window.__long = [];
new PerformanceObserver((list) => {
  for (const e of list.getEntries()) window.__long.push(e.duration);
}).observe({type: "longtask", buffered: true});
window.__gap = 0;
let last = performance.now();
const frame = (t) => { window.__gap = Math.max(window.__gap, t - last); last = t;
                       requestAnimationFrame(frame); };
requestAnimationFrame(frame);
"""


def headless_chromium(scratch: str) -> Any:
    """Debian's chromium through its chromedriver, named (Selenium Manager never downloads).
    Both take `scratch` as their temp folder: Chromium leaves an `org.chromium.Chromium.*`
    folder there when the driver quits it, so the caller removes `scratch` afterwards."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    service = Service("/usr/bin/chromedriver", env=dict(os.environ, TMPDIR=scratch))
    return webdriver.Chrome(options=options, service=service)


def open_page(driver: Any, base_url: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(base_url + "/")
    live = lambda d: d.find_element("id", "status").text == "live"  # noqa: E731
    WebDriverWait(driver, 120, poll_frequency=0.1).until(live)
    driver.execute_script(WATCH_FRAMES)


def run_once(args: argparse.Namespace, model_path: str, with_page: bool) -> dict:
    driver = None
    scratch = tempfile.mkdtemp(prefix="radixkv-page-bench-")
    spec = parse_server("radixkv", args.threads)
    try:
        with running_server(spec, args, model_path, lambda _: None, ["--ui"]) as server:
            if with_page:
                driver = headless_chromium(scratch)
                open_page(driver, server.base_url)
            turns, wall = asyncio.run(run_clients(server.base_url, server.model, args))
            row = summarize("radixkv", turns, wall, {})
            if driver is not None:
                long_tasks = driver.execute_script("return window.__long")
                row["longest_task_ms"] = max(long_tasks, default=0.0)
                row["num_long_tasks"] = len(long_tasks)
                row["longest_frame_ms"] = driver.execute_script("return window.__gap")
    finally:
        if driver is not None:
            driver.quit()
        shutil.rmtree(scratch, ignore_errors=True)
    return {"page": with_page, **row}


def report(rows: list[dict]) -> str:
    lines = ["| round | page | requests | output tok/s | TTFT p50 | longest task | longest frame |"]
    lines.append("|---|---|---|---|---|---|---|")
    for r in rows:
        task = f"{r['longest_task_ms']:.0f} ms ({r['num_long_tasks']})" if r["page"] else "-"
        frame = f"{r['longest_frame_ms']:.0f} ms" if r["page"] else "-"
        lines.append(
            f"| {r['round']} | {'open' if r['page'] else 'none'} | {r['requests']} | "
            f"{r['output_tok_s']:.1f} | {r['ttft_p50_s'] * 1e3:.0f} ms | {task} | {frame} |"
        )
    ratios = [
        page["output_tok_s"] / alone["output_tok_s"]
        for alone, page in zip(rows[::2], rows[1::2], strict=True)
        if alone["output_tok_s"] > 0
    ]
    if ratios:
        lines.append(
            f"output tok/s with the page / without: median x{statistics.median(ratios):.3f} "
            f"(rounds: {', '.join(f'x{r:.3f}' for r in ratios)}; goal >= x0.97)"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = workload_parser(__doc__.split("\n\n")[0], clients=64, turns=2)
    p.add_argument("--tiny", action="store_true", help="2 clients x 2 turns x 4 tokens")
    args = p.parse_args(argv)
    if args.tiny:
        args.clients, args.turns, args.max_tokens = 2, 2, 4
    if args.max_num_seqs is None:
        args.max_num_seqs = args.clients
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model_path = args.model
    if model_path is None:
        from radixkv.bundled_model import ensure_converted

        model_path = str(ensure_converted())
    workload = f"{args.clients} clients x {args.turns} turns, max {args.max_tokens} tokens"
    runs = [(n, page) for n in range(1, args.rounds + 1) for page in (False, True)]
    rows = []
    for number, with_page in runs:  # without, then with: each pair sees the same machine
        print(f"[page_bench] round {number}, page {with_page}", file=sys.stderr, flush=True)
        rows.append({"round": number, **run_once(args, model_path, with_page)})
    print(f"model {model_path}; {workload} per reply, greedy\n{report(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The live page of the cache (`/`), in a real browser: headless Debian chromium driven by
Selenium, against a real server on 127.0.0.1 over a tiny model whose tokenizer spells text
character by character; and, for a model with window layers (a tiny random Gemma 3), the
window group's figures in the snapshots and on the page."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from page_helpers import char_model_dir, send_from_page, start_browser, text_of, wait_for
from processes import sigint_restored
from serve_helpers import metric, read_metrics, wait_until
from tiny_archs import WINDOW, WINDOW_TIER_DEVICE, WINDOW_TIER_PROMPTS, build_arch

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return char_model_dir(tmp_path_factory.mktemp("char-model"))


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    driver = start_browser(tmp_path_factory.mktemp("browser-tmp"))
    yield driver
    driver.quit()


@pytest.fixture
def page_server(model_dir: Path, make_server: Callable[..., Any]) -> Callable[..., Any]:
    """(engine settings) -> a live server of the character model with the page on."""

    def make(**engine: Any) -> Any:
        return make_server({"block_size": 4, **engine}, model=model_dir, ui=True)

    return make


def open_page(browser: Any, server: Any) -> None:
    browser.get(server.base_url + "/")
    wait_for(browser, lambda d: text_of(d, "status") == "live", "the page's stream")


def reply_growth(browser: Any) -> None:
    """Record each length the next reply's text takes, as the browser renders it."""
    browser.execute_script(
        """
        window.__lengths = [];
        new MutationObserver(() => {
          const r = document.querySelectorAll('#chat-log .msg.assistant .body');
          if (r.length) window.__lengths.push(r[r.length - 1].textContent.length);
        }).observe(document.getElementById('chat-log'),
                   {subtree: true, childList: true, characterData: true});
        """
    )


def node_count(browser: Any) -> int:
    return int(text_of(browser, "node-count"))


def check_view(server: Any) -> None:
    server.app.state.cache_view.check_integrity()
    server.on_engine(lambda llm: llm.cache.check_integrity())


def test_chat_streams_the_tree_grows_and_a_second_turn_lights_its_cached_path(
    browser: Any, page_server: Callable[..., Any]
) -> None:
    server = page_server()
    open_page(browser, server)
    assert node_count(browser) == 0 and text_of(browser, "hit-tokens") == "0"
    browser.find_element("id", "temperature").send_keys("0")  # greedy: the same reply each run

    reply_growth(browser)
    first = send_from_page(browser, "Name three rivers.")
    lengths = browser.execute_script("return window.__lengths")
    assert len(set(n for n in lengths if n > 0)) >= 2, f"the reply came in one piece: {lengths}"
    stats = first.find_element("css selector", ".reply-stats").text
    prompt_ids = server.llm.encode_chat([{"role": "user", "content": "Name three rivers."}])
    assert stats.startswith(f"prompt {len(prompt_ids)} tok · cached 0 · computed {len(prompt_ids)}")
    assert "ttft" in stats
    wait_for(browser, lambda d: node_count(d) >= 1, "the tree to gain a node")
    computed = "#tree .node.computed"
    wait_for(browser, lambda d: d.find_elements("css selector", computed), "its computed path")
    assert not browser.find_elements("css selector", "#tree .node.hit")  # nothing was cached
    check_view(server)

    second = send_from_page(browser, "And three mountains?")
    cached = int(second.find_element("css selector", ".reply-stats .cached").text.split()[1])
    assert cached >= len(prompt_ids)  # the first turn and its reply came from the cache

    def page_matches_metrics(d: Any) -> bool:
        samples = read_metrics(server.base_url)
        want = metric(samples, "radixkv_cached_tokens_total")
        return text_of(d, "hit-tokens") == str(int(want)) and want == cached

    wait_for(browser, page_matches_metrics, "the page's hit count to equal /metrics")
    wait_for(browser, lambda d: d.find_elements("css selector", "#tree .node.hit"), "a hit path")
    hit_ends = [
        int(e.get_attribute("data-end"))
        for e in browser.find_elements("css selector", "#tree .node.hit")
    ]
    assert max(hit_ends) >= cached  # the highlighted path covers the hit
    check_view(server)


def test_markup_in_a_prompt_stays_text(browser: Any, page_server: Callable[..., Any]) -> None:
    server = page_server()
    open_page(browser, server)
    attack = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'
    send_from_page(browser, attack)
    wait_for(
        browser,
        lambda d: any("<script>" in e.text for e in d.find_elements("css selector", "#tree .text")),
        "the prompt's text in the tree",
    )
    assert browser.execute_script("return window.__xss") is None
    assert not browser.find_elements("css selector", "#chat-log img, #tree img, #tree script")
    user = browser.find_elements("css selector", "#chat-log .msg.user .body")[-1]
    assert user.text == attack
    check_view(server)


def test_a_salted_tenant_never_reaches_the_page(
    browser: Any, page_server: Callable[..., Any]
) -> None:
    server = page_server()
    open_page(browser, server)
    send_from_page(browser, "shared words")
    metrics = server.server_state.metrics
    before = snapshot_after(server, metrics.num_prompt_tokens)
    wait_for(browser, lambda d: node_count(d) >= 1, "the shared request's nodes")
    nodes, last = node_count(browser), text_of(browser, "last-request")
    secret = "tenant secret zebra quartz"
    client = server.client()
    for _ in range(2):  # twice: the second is a hit in the tenant's own namespace
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": secret}],
            max_tokens=4,
            extra_body={"cache_salt": "tenant-a"},
        )
    after = snapshot_after(server, metrics.num_prompt_tokens)
    assert "zebra" not in after and "tenant" not in after
    # The tree, its recency and the last request are as they were: nothing tells of the tenant.
    assert json.loads(after)["tree"] == json.loads(before)["tree"]
    assert json.loads(after)["last_request"] == json.loads(before)["last_request"]
    total = str(metrics.num_prompt_tokens)
    wait_for(browser, lambda d: text_of(d, "prompt-tokens") == total, "the page's totals")
    assert node_count(browser) == nodes and text_of(browser, "last-request") == last
    assert "zebra" not in browser.page_source
    check_view(server)


def snapshot_after(server: Any, num_prompt_tokens: int, last_seq: int | None = 1) -> str:
    """The first snapshot of /ui/events that counts `num_prompt_tokens` prompt tokens and shows
    the shared request `last_seq` as the last one (None: no request yet; a request's prompt
    tokens are counted before it finishes, and it is recorded when it finishes)."""
    with urllib.request.urlopen(server.base_url + "/ui/events", timeout=60) as response:
        for raw in response:
            line = raw.decode()
            if line.startswith("data: "):
                text = line[6:]
                snapshot = json.loads(text)
                last = snapshot["last_request"] or {}
                if (
                    snapshot["gauges"]["prompt_tokens"] == num_prompt_tokens
                    and last.get("seq") == last_seq
                ):
                    return text
    raise AssertionError("the stream ended without that snapshot")


def test_host_and_disk_occupancy_move(
    browser: Any, page_server: Callable[..., Any], tmp_path: Path
) -> None:
    server = page_server(
        num_blocks=24, max_num_seqs=2, host_cache_bytes=6 * 3072, kv_cache_dir=tmp_path
    )
    open_page(browser, server)
    assert browser.find_element("id", "g-host").get_attribute("data-value") == "0"
    browser.execute_script(
        """
        window.__gone = [];
        new MutationObserver((changes) => {
          for (const c of changes) for (const n of c.addedNodes)
            if (n.classList && n.classList.contains('gone')) window.__gone.push(n.textContent);
        }).observe(document.getElementById('tree'), {subtree: true, childList: true});
        """
    )
    client = server.client()
    metrics = server.server_state.metrics
    for i in range(6):  # distinct prompts overflow the device pool, then the host tier
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"prompt {i} " + "abcdefghij"[i] * 24}],
            max_tokens=4,
            temperature=0,
        )
        total = str(metrics.num_prompt_tokens)  # the page has seen this request's nodes
        wait_for(browser, lambda d, t=total: text_of(d, "prompt-tokens") == t, "the request")
    for gauge in ("g-host", "g-disk", "g-evicted"):
        wait_for(
            browser,
            lambda d, g=gauge: float(d.find_element("id", g).get_attribute("data-value")) > 0,
            f"{gauge} to move",
        )
    # Nodes the page had drawn left the device for the host, and faded out saying so.
    gone = browser.execute_script("return window.__gone")
    assert any("→ host" in text for text in gone), gone
    # A full-attention model: no window layers' panel, the gauges unlabelled as before.
    assert not browser.find_elements("css selector", "#window-panel, #full-label")
    check_view(server)
    # Its snapshots carry exactly the keys they always had, tiers on or off.
    snapshot = json.loads(snapshot_after(server, metrics.num_prompt_tokens, last_seq=6))
    assert set(snapshot) == {"model", "tree", "last_request", "gauges", "limits"}
    assert set(snapshot["gauges"]) == FULL_GAUGES


FULL_GAUGES = {  # the snapshot's gauges before the window layers had figures of their own
    "time", "prompt_tokens", "cached_tokens", "generated_tokens", "hit_rate", "blocks",
    "block_size", "device_used", "device_evictable", "host_blocks", "host_used", "disk_bytes",
    "disk_budget", "evicted_blocks", "offloaded_blocks", "queue", "running", "tokens_per_s",
}  # fmt: skip


def test_the_page_is_off_unless_enabled(make_server: Callable[..., Any]) -> None:
    server = make_server()  # ServeConfig's default: no page
    for path in ("/", "/ui/events", "/ui/page.js"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(server.base_url + path, timeout=10)
        assert refused.value.code == 404


@pytest.mark.parametrize(
    ("argv", "ui"),
    [
        ([], True),
        (["--host", "127.0.0.2"], True),
        (["--host", "::1"], True),
        (["--host", "localhost"], True),
        (["--host", "0.0.0.0"], False),
        (["--host", "myhost.example"], False),
        (["--host", "0.0.0.0", "--ui"], True),
        (["--no-ui"], False),
    ],
)
def test_the_page_is_on_by_default_only_on_loopback(argv: list[str], ui: bool) -> None:
    from radixkv.serve.cli import build_parser, serve_config

    assert serve_config(build_parser().parse_args(argv), "m").ui is ui


def test_page_files_forbid_inline_script(page_server: Callable[..., Any]) -> None:
    server = page_server()
    with urllib.request.urlopen(server.base_url + "/", timeout=10) as response:
        policy = response.headers["Content-Security-Policy"]
        html = response.read().decode()
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy
    assert "<script>" not in html and "http" not in html.replace('"/ui/', "")  # no CDN
    with urllib.request.urlopen(server.base_url + "/ui/page.js", timeout=10) as response:
        script = response.read().decode()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script  # text reaches the DOM as text only
    assert "textContent" in script
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(server.base_url + "/ui/..%2Fapp.py", timeout=10)
    assert refused.value.code == 404


def test_chat_web_serves_the_page_and_opens_it(model_dir: Path, tmp_path: Path) -> None:
    """`radixkv chat --web`: the server starts on loopback with the page, and the browser
    (here a stand-in named by $BROWSER that records the address) is sent to it."""
    opened = tmp_path / "opened.txt"
    browser_cmd = tmp_path / "browser.sh"
    browser_cmd.write_text(f'#!/bin/sh\necho "$1" > {opened}\n')
    browser_cmd.chmod(0o755)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["chat", "--web", "--model", str(model_dir), "--num-blocks", "64", "--port", str(port)]
    env = dict(os.environ, BROWSER=f"{browser_cmd} %s")
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=sigint_restored,
    )
    try:
        deadline = time.monotonic() + 120
        while not (opened.exists() and opened.read_text().strip()):
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the page was never opened"
            time.sleep(0.1)
        url = opened.read_text().strip()
        assert url == f"http://127.0.0.1:{port}/"
        with urllib.request.urlopen(url, timeout=30) as response:
            assert b"/ui/page.js" in response.read()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def test_a_page_past_the_limit_ends_the_longest_open_stream_and_a_page_gone_is_let_go(
    page_server: Callable[..., Any],
) -> None:
    """Issue 43, item 7: a process that holds every stream no longer keeps the owner's page
    out (it got 503 for as long as they were held). Each page past the limit is served and
    ends the longest-open stream, two rounds over; the others go on."""
    from radixkv.serve.cache_view import MAX_SUBSCRIBERS

    server = page_server()
    view = server.app.state.cache_view
    streams = [
        urllib.request.urlopen(server.base_url + "/ui/events", timeout=30)
        for _ in range(MAX_SUBSCRIBERS)
    ]
    try:
        for stream in streams:
            assert stream.readline() == b"retry: 2000\n"
        assert view.num_subscribers == MAX_SUBSCRIBERS
        for round_ in range(2):
            newest = urllib.request.urlopen(server.base_url + "/ui/events", timeout=30)
            assert newest.status == 200 and newest.readline() == b"retry: 2000\n"
            displaced = streams.pop(0)
            assert _read_to_end(displaced) is not None, "the longest-open stream was not ended"
            streams.append(newest)
            assert view.num_subscribers == MAX_SUBSCRIBERS
            assert view.num_displaced == round_ + 1
        # The requests of the others go on meanwhile.
        reply = server.client().completions.create(model="tiny", prompt="hello", max_tokens=3)
        assert reply.usage.completion_tokens == 3
        view.check_integrity()
    finally:
        for stream in streams:
            stream.close()
    wait_until(lambda: view.num_subscribers == 0, what="the closed pages to be let go")
    with urllib.request.urlopen(server.base_url + "/ui/events", timeout=30) as again:
        assert again.readline() == b"retry: 2000\n"
    view.check_integrity()


def _read_to_end(stream: Any) -> bytes | None:
    """What is left of `stream` once the server ends it; None if it is still open after 30 s
    (a read timeout)."""
    try:
        return stream.read()
    except TimeoutError:
        return None
    finally:
        stream.close()


def test_snapshots_come_at_most_four_a_second_under_load(
    page_server: Callable[..., Any],
) -> None:
    from radixkv.serve.cache_view import MAX_UPDATES_PER_S

    server = page_server()
    client = server.client()
    enough = threading.Event()

    def load() -> None:  # requests until the reader has its snapshots (50 at the most)
        for i in range(50):
            if enough.is_set():
                return
            client.completions.create(model="tiny", prompt=f"load {i} " * 8, max_tokens=16)

    worker = threading.Thread(target=load)
    times = []
    with urllib.request.urlopen(server.base_url + "/ui/events", timeout=60) as stream:
        worker.start()
        for raw in stream:
            if raw.startswith(b"data: "):
                times.append(json.loads(raw[6:])["gauges"]["time"])
                if len(times) == 6:
                    break
            elif raw.startswith(b":") and not worker.is_alive():
                break  # a heartbeat after the load ended: no more snapshots will come
    enough.set()
    worker.join(60)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) == 5 and min(gaps) >= 1 / MAX_UPDATES_PER_S - 1e-3, gaps


def test_shutting_down_ends_the_page_stream(
    model_dir: Path, make_server: Callable[..., Any]
) -> None:
    """A page left open never holds a shutdown for its whole timeout: its stream ends."""
    server = make_server({"block_size": 4}, model=model_dir, ui=True, shutdown_timeout_s=600)
    stream = urllib.request.urlopen(server.base_url + "/ui/events", timeout=60)
    assert stream.readline() == b"retry: 2000\n"
    closer = threading.Thread(target=server.close)
    closer.start()
    rest = stream.read()  # to the end of the stream: a read past 60 s raises
    closer.join(60)
    assert not closer.is_alive()
    assert rest.count(b"event: snapshot") <= 1


# A tiny Gemma 3 (three window layers of WINDOW tokens, one full layer) with both groups' tiers
# on: the traffic of the window tier tests, twice, with host room for 8 blocks of each group (a
# pair of blocks is 4 KiB in this model), the rest to disk.
WINDOW_ENGINE = dict(WINDOW_TIER_DEVICE, host_cache_bytes=8 * 4096)
WINDOW_ROUNDS = 2


@pytest.fixture(scope="module")
def window_server(tmp_path_factory: pytest.TempPathFactory, make_server: Callable[..., Any]) -> Any:
    """A live server of the tiny Gemma 3 with the page on, after the traffic above."""
    model = build_arch("gemma3", tmp_path_factory.mktemp("gemma3"))
    disk = tmp_path_factory.mktemp("gemma3-kv")
    server = make_server({**WINDOW_ENGINE, "kv_cache_dir": disk}, model=model, ui=True)
    client = server.client()
    for _ in range(WINDOW_ROUNDS):
        for prompt in WINDOW_TIER_PROMPTS:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    return server


def window_counters(llm: Any) -> dict[str, Any]:
    """Engine thread: the window group's own counters, read where they are kept."""
    group, io = llm.cache.groups[1], llm.tier_ios[1]
    moves = {kind: {"bytes": t.nbytes, "seconds": t.seconds} for kind, t in io.totals.items()}
    counts = group.tiers.counts
    return {
        "window": group.window,
        "device": {
            "blocks": group.pool.num_blocks,
            "in_use": group.pool.num_blocks - group.pool.num_free - group.num_evictable_blocks(),
            "tails": group.num_evictable_blocks(),
            "free": group.pool.num_free,
            "num_tails": group.num_tails,
            "evicted_tails": group.num_evicted_tails,
        },
        "host": {
            "blocks": io.host.num_blocks,
            "held": len(group.tiers.entries),
            "loaded_blocks": counts["num_loaded_blocks"],
            "offloaded_blocks": counts["num_offloaded_blocks"],
            "moves": {kind: moves[kind] for kind in ("load", "offload")},
        },
        "disk": {
            "files": io.disk.num_files,
            "bytes": io.disk.num_bytes,
            "budget": io.disk.budget_bytes,
            "read_blocks": counts["num_disk_reads"],
            "written_blocks": counts["num_disk_writes"],
            "moves": {kind: moves[kind] for kind in ("disk_read", "disk_write")},
        },
    }


def window_snapshot(server: Any) -> dict[str, Any]:
    num_requests = WINDOW_ROUNDS * len(WINDOW_TIER_PROMPTS)
    metrics = server.server_state.metrics
    return json.loads(snapshot_after(server, metrics.num_prompt_tokens, last_seq=num_requests))


def test_window_layers_figures_in_the_snapshot_are_the_engines(window_server: Any) -> None:
    snapshot = window_snapshot(window_server)
    want = window_server.on_engine(window_counters)
    assert snapshot["window_layers"] == want
    # The traffic really reached every tier of the window group, and served hits from them.
    host, disk, device = want["host"], want["disk"], want["device"]
    assert host["held"] > 0 and host["loaded_blocks"] > 0 and host["moves"]["load"]["bytes"] > 0
    assert disk["files"] > 0 and disk["written_blocks"] > 0 and disk["read_blocks"] > 0
    assert device["tails"] > 0 and device["in_use"] == 0  # idle: only tails hold blocks
    # The gauges beside it stay the full layers' group's.
    full = window_server.on_engine(lambda llm: (llm.tier_ios[0].host.num_blocks, llm.cache.stats()))
    gauges = snapshot["gauges"]
    assert gauges["host_blocks"] == full[0] and gauges["blocks"] == full[1].num_blocks
    assert gauges["host_used"] == full[1].num_host_cached_blocks
    assert set(gauges) == FULL_GAUGES
    window_server.app.state.cache_view.check_integrity()
    window_server.on_engine(lambda llm: llm.check_integrity())


def test_the_page_shows_the_window_layers(browser: Any, window_server: Any) -> None:
    open_page(browser, window_server)
    wait_for(browser, lambda d: d.find_elements("id", "window-panel"), "the window panel")
    want = window_snapshot(window_server)["window_layers"]
    panel = text_of(browser, "window-panel")
    assert panel.startswith(f"window layers ({WINDOW} tokens)")
    assert text_of(browser, "full-label") == "full layers"
    for row in ("device", "host", "disk"):
        element = browser.find_element("id", f"w-{row}")
        numbers = {k: v for k, v in want[row].items() if not isinstance(v, dict)}
        attributes = {k: int(element.get_attribute(f"data-{k}")) for k in numbers}
        assert attributes == numbers
    device, host, disk = want["device"], want["host"], want["disk"]

    def shown(row: str) -> str:
        return browser.find_element("css selector", f"#w-{row} .value").text

    assert shown("device") == (
        f"{device['in_use']} in use · {device['tails']} in tails ·"
        f" {device['free']} free of {device['blocks']} blk"
    )
    assert shown("host").startswith(
        f"{host['held']}/{host['blocks']} blk · loaded {host['loaded_blocks']} ·"
        f" offloaded {host['offloaded_blocks']} · moved"
    )
    assert shown("disk").startswith(f"{disk['files']} files, ")
    assert f"read {disk['read_blocks']} · written {disk['written_blocks']}" in shown("disk")


# A tiny Qwen3.5 (Gated DeltaNet beside full attention) with the snapshots' host and disk tiers
# on: three chats sharing a system prompt, one running request and one snapshot slot beside it,
# so snapshots are evicted to the host; then the first chat again, which resumes from one.
HYBRID_ENGINE = dict(
    block_size=4,
    snapshot_min_gap_tokens=4,
    max_num_seqs=1,
    num_snapshots=1,
    host_cache_bytes=2**20,
)
HYBRID_CHATS = [0, 1, 2, 0]


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory: pytest.TempPathFactory, make_server: Callable[..., Any]) -> Any:
    """A live server of the tiny Qwen3.5 with the page on, after the chats above."""
    from serve_helpers import user_message

    model = build_arch("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))
    disk = tmp_path_factory.mktemp("qwen3_5-kv")
    server = make_server({**HYBRID_ENGINE, "kv_cache_dir": disk}, model=model, ui=True)
    client = server.client()
    system = {"role": "system", "content": user_message(7, 30)}
    for i in HYBRID_CHATS:
        messages = [system, {"role": "user", "content": user_message(600 + i)}]
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    return server


def state_counters(llm: Any) -> dict[str, Any]:
    """Engine thread: the state group's own counters, read where they are kept, and the
    snapshots ending in the shared tree's nodes."""
    group, io = llm.cache.groups[-1], llm.tier_ios[-1]
    moves = {kind: {"bytes": t.nbytes, "seconds": t.seconds} for kind, t in io.totals.items()}
    counts, ledger = group.tiers.counts, group.ledger.stats()
    return {
        "device": {
            "slots": group.num_blocks,
            "slot_bytes": group.slot_bytes,
            "running": group.num_open_tables,
            "snapshots": group.num_snapshots,
            "bytes": group.num_snapshots * group.slot_bytes,
            "free": group.pool.num_free,
            "evicted": ledger.num_evicted,
        },
        "hits": {
            "hits": ledger.num_hits + group.num_lower_hits,
            "tokens": group.num_hit_tokens,
            "lower": group.num_lower_hits,
        },
        "host": {
            "snapshots": io.host.num_blocks,
            "held": len(group.tiers.entries),
            "loaded": counts["num_loaded_blocks"],
            "offloaded": counts["num_offloaded_blocks"],
            "moves": {kind: moves[kind] for kind in ("load", "offload")},
        },
        "disk": {
            "files": io.disk.num_files,
            "bytes": io.disk.num_bytes,
            "budget": io.disk.budget_bytes,
            "read": counts["num_disk_reads"],
            "written": counts["num_disk_writes"],
            "moves": {kind: moves[kind] for kind in ("disk_read", "disk_write")},
        },
        "marked": sum(llm.cache.snapshot_nodes().values()),
    }


def hybrid_snapshot(server: Any) -> dict[str, Any]:
    metrics = server.server_state.metrics
    return json.loads(snapshot_after(server, metrics.num_prompt_tokens, len(HYBRID_CHATS)))


def test_snapshots_in_the_page_snapshot_are_the_engines(hybrid_server: Any) -> None:
    snapshot = hybrid_snapshot(hybrid_server)
    want = hybrid_server.on_engine(state_counters)
    marked = want.pop("marked")
    assert snapshot["state_layers"] == want
    device, hits, host = want["device"], want["hits"], want["host"]
    assert device["snapshots"] > 0 and device["bytes"] == device["snapshots"] * device["slot_bytes"]
    assert hits["hits"] > 0 and hits["tokens"] > 0  # the repeated chat resumed from one
    assert host["held"] > 0 and host["offloaded"] > 0  # evicted snapshots went to the host
    # the tree's nodes say where the device's snapshots end, each counted once
    nodes = snapshot["tree"]["nodes"]
    assert sum(n["snapshots"] for n in nodes) == marked > 0
    assert "window_layers" not in snapshot and set(snapshot["gauges"]) == FULL_GAUGES
    hybrid_server.app.state.cache_view.check_integrity()
    hybrid_server.on_engine(lambda llm: llm.check_integrity())


def test_the_page_shows_snapshots_and_marks_the_nodes_that_own_one(
    browser: Any, hybrid_server: Any
) -> None:
    open_page(browser, hybrid_server)
    wait_for(browser, lambda d: d.find_elements("id", "state-panel"), "the state panel")
    snapshot = hybrid_snapshot(hybrid_server)
    want = snapshot["state_layers"]
    assert text_of(browser, "state-panel").startswith("recurrent state snapshots")
    for row in ("device", "hits", "host", "disk"):
        element = browser.find_element("id", f"s-{row}")
        numbers = {k: v for k, v in want[row].items() if not isinstance(v, dict)}
        attributes = {k: int(element.get_attribute(f"data-{k}")) for k in numbers}
        assert attributes == numbers
    device, hits = want["device"], want["hits"]

    def shown(row: str) -> str:
        return browser.find_element("css selector", f"#s-{row} .value").text

    assert shown("device").startswith(
        f"{device['running']} running · {device['snapshots']} snapshots ("
    )
    assert shown("hits").startswith(f"{hits['hits']} resumed from a snapshot ({hits['tokens']}")
    assert f"{hits['lower']} from host or disk" in shown("hits")
    marked = {n["id"]: n["snapshots"] for n in snapshot["tree"]["nodes"] if n["snapshots"]}
    wait_for(browser, lambda d: d.find_elements("css selector", "li.node.snapshot"), "a mark")
    on_page = {
        int(li.get_attribute("data-id")): li.find_element("css selector", ".meta").text
        for li in browser.find_elements("css selector", "li.node.snapshot")
    }
    assert set(on_page) == set(marked)
    for node_id, n in marked.items():
        assert f"· {n} snapshot" in on_page[node_id]


# ---------------------------------------------------------------------- issue 43: first minute


def test_a_reply_cut_at_the_token_limit_says_so(
    browser: Any, page_server: Callable[..., Any]
) -> None:
    """Item 11: before, nothing told a reply cut at the page's token limit from one that
    ended."""
    server = page_server()
    open_page(browser, server)
    browser.find_element("id", "temperature").send_keys("0")
    limit = browser.find_element("id", "max-tokens")
    limit.clear()
    limit.send_keys("3")
    reply = send_from_page(browser, "Name three rivers.")
    assert "cut" in reply.get_attribute("class").split()
    assert "cut at the token limit" in reply.find_element("css selector", ".reply-stats").text
    limit.clear()
    limit.send_keys("4000")
    browser.find_element("id", "new-chat").click()
    ended = send_from_page(browser, "Hi")  # the tiny model ends it long before 4,000
    assert "cut" not in ended.get_attribute("class").split()


def _node(node_id: int, parent: int | None, start: int, end: int) -> dict[str, Any]:
    return {
        "id": node_id,
        "parent": parent,
        "start": start,
        "end": end,
        "blocks": 1,
        "shared_head": False,
        "locks": 0,
        "recency": 0,
        "host": 0,
        "text": "x",
    }


@pytest.mark.parametrize(
    ("children_of_hit_end", "branch"),
    [([(2, 10, 20)], False), ([(2, 10, 20), (3, 10, 15)], True)],
)
def test_branch_marks_only_a_hit_that_ends_at_a_fork(
    browser: Any, page_server: Callable[..., Any], children_of_hit_end, branch
) -> None:
    """Item 11: a linear chat's hit ends where its one child begins (before, marked
    `branch` with no sibling); only a node with another child than the path's is a fork.
    Snapshots of both shapes, handed to the page's own renderer."""
    server = page_server()
    open_page(browser, server)
    snapshot = json.loads(snapshot_after(server, 0, last_seq=None))
    nodes = [_node(0, None, 0, 0), _node(1, 0, 0, 10)]
    nodes += [_node(i, 1, start, end) for i, start, end in children_of_hit_end]
    snapshot["tree"] = {
        "nodes": nodes,
        "folded": [],
        "num_nodes": len(nodes) - 1,
        "num_tokens": 20,
        "path": [1, 2],
        "path_tokens": 20,
    }
    snapshot["last_request"] = {
        "seq": 1,
        "prompt_tokens": 21,
        "cached_tokens": 10,
        "matched_tokens": 10,
        "cut_reason": None,
    }
    browser.execute_script("onSnapshot(arguments[0])", snapshot)
    marked = browser.find_elements("css selector", "#tree .node.branch")
    assert [int(e.get_attribute("data-id")) for e in marked] == ([1] if branch else [])


def test_generated_tokens_are_counted_as_each_step_brings_them(page_server) -> None:
    """Item 9: before, they were added when a request finished, so a reply streaming read
    0 tok/s and a dashboard's rate() saw bursts. Mid-reply, /metrics (both names) counts at
    least the tokens the client has, and the page's snapshot has a rate above 0."""
    server = page_server()
    client = server.client()
    stream = client.completions.create(
        model="tiny",
        prompt="hello",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    rate = 0.0
    with urllib.request.urlopen(server.base_url + "/ui/events", timeout=60) as events:
        for chunk in stream:
            received += len(chunk.choices[0].text) > 0
            if received == 40:
                samples = read_metrics(server.base_url)
                assert metric(samples, "radixkv_generated_tokens_total") >= 40
                vllm = metric(
                    samples, "vllm:generation_tokens_total", model_name="tiny", engine="0"
                )
                assert vllm >= 40
                assert server.server_state.engine.snapshot.num_running == 1  # still streaming
                for raw in events:
                    line = raw.decode()
                    if line.startswith("data: "):
                        rate = json.loads(line[6:])["gauges"]["tokens_per_s"]
                        if rate > 0:
                            break
                break
    stream.close()
    assert rate > 0


def test_the_token_rate_is_measured_over_its_window() -> None:
    from radixkv.serve.cache_view import TokenRate

    rate = TokenRate(window_s=2.0)
    assert rate(0.0, 0) == 0.0
    assert rate(1.0, 10) == 10.0
    assert rate(2.0, 20) == 10.0
    assert rate(3.0, 30) == 10.0  # the window holds 1.0 .. 3.0
    assert rate(4.0, 30) == 5.0  # 2.0 .. 4.0: 10 tokens in 2 s
    assert rate(6.5, 30) == 0.0  # no token in the window
    rate.check_integrity()


def test_a_window_models_cut_hit_is_explained_on_the_page(
    browser: Any, tmp_path: Path, make_server: Callable[..., Any]
) -> None:
    """Item 10: a prompt sharing 30 tokens with the last one reports fewer cached and, before,
    no reason: its window layers' KV was kept only where a later hit can resume. The
    snapshot's last request and the page's line say how many matched and why."""
    model = build_arch("gemma3", tmp_path / "gemma3")
    engine = dict(block_size=4, num_blocks=64, num_window_blocks=40, chunked_prefill_size=16)
    server = make_server(engine, model=model, ui=True)
    client = server.client()
    first = list(range(10, 50))
    second = first[:30] + list(range(100, 110))
    for prompt in (first, second):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    snapshot = json.loads(snapshot_after(server, len(first) + len(second), last_seq=2))
    last = snapshot["last_request"]
    assert last["matched_tokens"] == 30 and last["cached_tokens"] < 30, last
    assert "matched 30 tokens" in last["cut_reason"] and "sliding-window" in last["cut_reason"]
    open_page(browser, server)
    wait_for(browser, lambda d: "sliding-window" in text_of(d, "last-request"), "the reason")

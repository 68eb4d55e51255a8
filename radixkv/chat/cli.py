"""The `radixkv` command line: an interactive multi-turn chat over the prefix cache.

    radixkv chat                      chat with the embedded default model (SmolLM2-135M-Instruct)
    radixkv chat --model PATH_OR_ID   any Llama-family Hugging Face model
    radixkv chat --script FILE        one user message per line (or messages piped on stdin)

After each reply one status line shows how much of the prompt the cache served. In-chat
commands: /tree draws the radix tree, /stats prints cache counters, /reset starts a new
conversation (the cache keeps the old one until it is evicted), /quit leaves.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

HELP_COMMANDS = "/tree  /stats  /reset  /quit"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixkv", description="Prefix-cached LLM inference over a radix tree of KV blocks."
    )
    sub = parser.add_subparsers(dest="command")
    chat = sub.add_parser("chat", help="multi-turn chat (the default command)")
    chat.add_argument(
        "--model",
        default=None,
        help="local path or Hugging Face id (default: embedded SmolLM2-135M-Instruct)",
    )
    chat.add_argument("--system", default="You are a helpful assistant.", help="system prompt")
    chat.add_argument(
        "--script", default=None, metavar="FILE", help="read user messages from FILE, one per line"
    )
    chat.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    size = chat.add_mutually_exclusive_group()
    size.add_argument("--cache-mb", type=int, default=None, help="KV cache size in MiB")
    size.add_argument("--num-blocks", type=int, default=None, help="KV cache size in blocks")
    chat.add_argument("--no-prefix-cache", action="store_true", help="recompute every prompt")
    chat.add_argument(
        "--max-tokens", type=int, default=256, help="reply length limit (default 256)"
    )
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--top-k", type=int, default=0)
    chat.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "chat")  # `radixkv` alone starts the chat
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return run_chat(args)


def run_chat(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the chat loop; returns the process exit code (0 ok, 2 bad input or model)."""
    out = out or sys.stdout
    err = sys.stderr
    # Imported here so `radixkv --help` answers instantly and a broken install fails with one line.
    from radixkv.chat.session import ChatSession
    from radixkv.engine import LLM, ModelNotFoundError
    from radixkv.scheduler.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        messages = _message_source(args.script)
    except (ValueError, TypeError, OSError) as exc:
        print(f"radixkv: {exc}", file=err)
        return 2

    # Our own progress lines cover the one-time conversion; transformers' per-load weight bars
    # would only add noise to every start.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        with _Progress(err) as progress:
            llm = LLM(
                args.model,
                block_size=args.block_size,
                num_blocks=args.num_blocks,
                kv_cache_bytes=None if args.cache_mb is None else args.cache_mb * 2**20,
                enable_prefix_cache=not args.no_prefix_cache,
                seed=args.seed,
                progress=progress,
            )
    except ModelNotFoundError as exc:
        print(f"radixkv: {exc}", file=err)
        return 2
    except (ValueError, TypeError) as exc:
        print(f"radixkv: {exc}", file=err)
        return 2

    interactive = messages is None
    if interactive:
        print(f"radixkv chat · {llm.model_name} · commands: {HELP_COMMANDS}", file=out)
    session = ChatSession(llm, system=args.system, params=params)
    for message in messages if messages is not None else _prompt_lines():
        message = message.strip()
        if not message:
            continue
        if not interactive:
            print(f"you> {message}", file=out)
        if message.startswith("/"):
            if _command(message, llm, session, out):
                break
            continue
        print("assistant> ", end="", file=out, flush=True)
        try:
            for delta in session.stream(message):
                print(delta, end="", file=out, flush=True)
        except (ValueError, TypeError) as exc:
            print(f"\nradixkv: {exc}", file=err)
            continue
        print(file=out)
        print(status_line(session.last_reply.stats), file=out, flush=True)
    return 0


def status_line(stats: object) -> str:
    """One line per reply: prompt and cached tokens, hit %, time to first token, decode speed."""
    prompt = stats.num_prompt_tokens  # type: ignore[attr-defined]
    cached = stats.num_cached_tokens  # type: ignore[attr-defined]
    hit = 100.0 * cached / prompt if prompt else 0.0
    ttft_ms = 1000.0 * stats.ttft_s  # type: ignore[attr-defined]
    speed = stats.decode_tokens_per_s  # type: ignore[attr-defined]
    reply = stats.num_output_tokens  # type: ignore[attr-defined]
    return (
        f"  [prompt {prompt} tok · cached {cached} ({hit:.1f}%) · ttft {ttft_ms:.0f} ms"
        f" · reply {reply} tok · decode {speed:.1f} tok/s]"
    )


def stats_text(llm: object) -> str:
    s = llm.cache.stats()  # type: ignore[attr-defined]
    return "\n".join(
        [
            f"hit rate      {100.0 * s.hit_rate:.1f}%  ({s.num_hit_tokens} of"
            f" {s.num_query_tokens} prompt tokens from cache, {s.num_computed_tokens} computed,"
            f" {s.num_queries} requests)",
            f"blocks        {s.num_blocks} x {s.block_size} tokens: {s.num_free_blocks} free,"
            f" {s.num_evictable_blocks} cached, {s.num_in_use_blocks} in use",
            f"tree          {s.num_nodes} nodes",
            f"evictions     {s.num_evicted_blocks} blocks, {s.num_evicted_tokens} tokens",
        ]
    )


def _command(line: str, llm: object, session: object, out: TextIO) -> bool:
    """Run one /command; returns True when the chat should end."""
    from radixkv.chat.tree_view import render_tree

    name = line.split()[0].lower()
    if name in ("/quit", "/exit", "/q"):
        return True
    if name == "/tree":
        tok = llm.tokenizer  # type: ignore[attr-defined]
        print(render_tree(llm.cache.nodes(), decode=tok.decode), file=out)  # type: ignore[attr-defined]
    elif name == "/stats":
        print(stats_text(llm), file=out)
    elif name == "/reset":
        session.reset()  # type: ignore[attr-defined]
        print("(new conversation; the old one stays cached until evicted)", file=out)
    else:
        print(f"unknown command {name}; commands: {HELP_COMMANDS}", file=out)
    out.flush()
    return False


def _message_source(script: str | None) -> list[str] | None:
    """Messages from --script FILE or piped stdin; None means interactive."""
    if script is not None:
        with open(script, encoding="utf-8") as f:
            return f.read().splitlines()
    if not sys.stdin.isatty():
        return sys.stdin.read().splitlines()
    return None


def _prompt_lines() -> Iterator[str]:
    while True:
        try:
            yield input("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return


class _Progress:
    """Shows the one-time model conversion: each stage on its own line, with elapsed seconds
    ticking on a terminal so a half-minute wait never looks like a hang."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._stage: str | None = None
        self._t0 = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, stage: str) -> None:
        self._finish_line()
        self._stage, self._t0 = stage, time.monotonic()
        if self._tty:
            if self._thread is None:
                self._thread = threading.Thread(target=self._tick, daemon=True)
                self._thread.start()
        else:
            print(f"radixkv: {stage}", file=self._stream, flush=True)

    def _tick(self) -> None:
        while not self._stop.wait(0.25):
            if self._stage is not None:
                elapsed = time.monotonic() - self._t0
                print(
                    f"\rradixkv: {self._stage} ... {elapsed:4.0f} s",
                    end="",
                    file=self._stream,
                    flush=True,
                )

    def _finish_line(self) -> None:
        if self._stage is not None and self._tty:
            elapsed = time.monotonic() - self._t0
            print(
                f"\rradixkv: {self._stage} ... done ({elapsed:.0f} s)",
                file=self._stream,
                flush=True,
            )
        self._stage = None

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc[0] is None:
            self._finish_line()
        self._stage = None

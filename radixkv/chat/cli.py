"""The `radixkv` command line: an interactive multi-turn chat over the prefix cache.

    radixkv chat                      chat with the embedded default model (SmolLM2-135M-Instruct)
    radixkv chat --model PATH_OR_ID   any Llama-family Hugging Face model
    radixkv chat --script FILE        one user message per line (or messages piped on stdin)

After each reply one status line shows how much of the prompt the cache served. In-chat
commands: /tree draws the radix tree, /stats prints cache counters, /reset starts a new
conversation (the cache keeps the old one until it is evicted), /quit leaves.

Ctrl-C during a reply stops it and returns to the prompt: the interrupted turn (message and
partial reply) is not kept, the conversation before it is. The engine step in flight runs to its
end first (`_ctrl_c_held`): an interrupt raised at an arbitrary point could cut a cache update in
half. Ctrl-C anywhere else (at the prompt, while loading or converting the model) ends the program
with one line. Sampling defaults to the model's generation config (SmolLM2: temperature 0.2,
top-p 0.9), greedy when it has none; its repetition penalty applies either way.
Runs offline (HF_HUB_OFFLINE=1) unless HF_HUB_OFFLINE=0 is set.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TextIO

from radixkv.options import add_engine_options, check_engine_options, engine_settings, name_flags

if TYPE_CHECKING:
    from radixkv.chat.session import ChatSession
    from radixkv.engine.outputs import RequestStats
    from radixkv.engine.sampling_params import SamplingParams

HELP_COMMANDS = "/tree  /stats  /reset  /quit"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixkv", description="Prefix-cached LLM inference over a radix tree of KV blocks."
    )
    sub = parser.add_subparsers(dest="command")
    chat = sub.add_parser("chat", help="multi-turn chat (the default command)")
    # Listed for `radixkv --help` only: `radixkv serve` is dispatched before this parser runs.
    sub.add_parser("serve", help="OpenAI-compatible HTTP server (see radixkv serve --help)")
    add_engine_options(chat)
    chat.add_argument("--system", default="You are a helpful assistant.", help="system prompt")
    chat.add_argument(
        "--script", default=None, metavar="FILE", help="read user messages from FILE, one per line"
    )
    chat.add_argument(
        "--max-tokens", type=int, default=256, help="reply length limit (default 256)"
    )
    model_default = "default: the model's generation config, greedy without one"
    chat.add_argument(
        "--temperature", type=float, default=None, help=f"0 = greedy ({model_default})"
    )
    chat.add_argument("--top-p", type=float, default=None, help=f"nucleus mass ({model_default})")
    chat.add_argument("--top-k", type=int, default=None, help=f"0 = off ({model_default})")
    chat.add_argument(
        "--min-p", type=float, default=None, help=f"in [0, 1], 0 = off ({model_default})"
    )
    chat.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="> 0, 1 = off (default: the model's generation config, sampling or greedy)",
    )
    # Run by `radixkv.__main__` before this parser: the chat then lives in the browser.
    chat.add_argument(
        "--web",
        action="store_true",
        help="chat in the browser instead, beside the live page of the cache: this is "
        "`radixkv serve --ui --open` on 127.0.0.1 (takes the engine options and serve's "
        "--port, not --system/--script/sampling)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `radixkv` command; returns the exit code (130 after Ctrl-C outside a
    reply)."""
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
            argv.insert(0, "chat")  # `radixkv` alone starts the chat
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command != "chat":  # `radixkv serve` never gets here (see radixkv.__main__)
            parser.error("this entry point runs the chat only; the server is `radixkv serve`")
        if args.web:  # `radixkv chat --web` never gets here either
            parser.error("--web is run by the `radixkv` command: radixkv chat --web")
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        # Library deprecation notices are for developers; in a chat they split a reply.
        warnings.filterwarnings("ignore", category=FutureWarning)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        _tolerate_undecodable_bytes()
        return run_chat(args)
    except KeyboardInterrupt:
        lead = "\n" if sys.stderr.isatty() else ""  # end the line the ^C or a progress line is on
        print(f"{lead}radixkv: interrupted", file=sys.stderr, flush=True)
        return 130


def _tolerate_undecodable_bytes() -> None:
    """Input bytes that are not UTF-8 reach the chat as lone surrogates (which it rejects with
    one line) instead of raising inside input(); output shows them escaped."""
    for stream, errors in (
        (sys.stdin, "surrogateescape"),
        (sys.stdout, "backslashreplace"),
        (sys.stderr, "backslashreplace"),
    ):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors=errors)


def run_chat(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the chat loop; returns the process exit code (0 ok, 2 bad input or model)."""
    out = out or sys.stdout
    err = sys.stderr
    try:
        chat_sampling(args, None)  # bad values fail before the model loads
        check_engine_options(args)
        messages = _message_source(args.script)
    except (ValueError, TypeError, OSError) as exc:
        print(f"radixkv: {name_flags(str(exc))}", file=err)
        return 2
    # Imported here, after the checks, so `radixkv --help` and a bad option answer at once (torch
    # and transformers take seconds to import) and a broken install fails with one line.
    from transformers.utils import logging as hf_logging

    from radixkv.chat.session import ChatSession
    from radixkv.engine import LLM, ModelLoadError, freeze_startup_heap

    # Our own progress lines cover the one-time conversion; transformers' per-load weight bars
    # and load reports would only add noise (a broken model is reported in one line below).
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        with _Progress(err) as progress:
            llm = LLM(args.model, progress=progress, **engine_settings(args))
        params = chat_sampling(args, llm.model.generation_config)
        session = ChatSession(llm, system=args.system, params=params)
    except (ModelLoadError, ValueError, TypeError) as exc:
        print(f"radixkv: {exc}", file=err)
        return 2
    freeze_startup_heap()

    print(
        f"radixkv chat · {llm.model_name} · {sampling_text(params)} · commands: {HELP_COMMANDS}",
        file=out,
    )
    interactive = messages is None
    try:
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
            _reply(session, message, out, err)
    finally:
        llm.save_kv_cache()  # with --kv-cache-dir: a restarted chat finds its prefixes
    return 0


def chat_sampling(args: argparse.Namespace, generation_config: object | None) -> SamplingParams:
    """The chat's SamplingParams: each option given on the command line, else the model's
    generation config when it samples (`do_sample`), else greedy; its repetition penalty
    applies to greedy decoding too (as in transformers' `generate`). Raises ValueError /
    TypeError for out-of-range values."""
    from radixkv.engine.sampling_params import SamplingParams

    def pick(given: object, key: str, unset: float) -> object:
        if given is not None:
            return given
        if getattr(generation_config, "do_sample", False):
            value = getattr(generation_config, key, None)
            return unset if value is None else value
        return 0.0 if key == "temperature" else unset

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=pick(args.temperature, "temperature", 1.0),  # type: ignore[arg-type]
        top_p=pick(args.top_p, "top_p", 1.0),  # type: ignore[arg-type]
        top_k=int(pick(args.top_k, "top_k", 0)),  # type: ignore[call-overload]
        min_p=pick(args.min_p, "min_p", 0.0),  # type: ignore[arg-type]
        repetition_penalty=(
            args.repetition_penalty
            if args.repetition_penalty is not None
            else getattr(generation_config, "repetition_penalty", None) or 1.0
        ),
    )


def sampling_text(params: SamplingParams) -> str:
    penalty = params.repetition_penalty
    repetition = f", repetition penalty {penalty:g}" if penalty != 1.0 else ""
    if params.greedy:
        return "greedy" + repetition
    top_k = f", top-k {params.top_k}" if params.top_k else ""
    min_p = f", min-p {params.min_p:g}" if params.min_p else ""
    return f"temperature {params.temperature:g}, top-p {params.top_p:g}{top_k}{min_p}{repetition}"


def _reply(session: ChatSession, message: str, out: TextIO, err: TextIO) -> None:
    """Stream one reply. Ctrl-C stops it (the turn is not kept); a failed step is one line."""
    try:
        pieces = session.stream(message)
    except (ValueError, TypeError) as exc:
        print(f"radixkv: {exc}", file=err, flush=True)
        return
    print("assistant> ", end="", file=out, flush=True)
    with _ctrl_c_held() as held:  # also over the abort, which returns the reply's blocks
        try:
            for piece in pieces:
                if held:  # raised here, between engine steps
                    raise KeyboardInterrupt
                print(piece, end="", file=out, flush=True)
        except KeyboardInterrupt:
            pieces.close()
            print(
                "\n(reply interrupted; this turn is not kept. Ctrl-C at the prompt quits)", file=out
            )
            return
        except Exception as exc:
            pieces.close()
            failure = f"{type(exc).__name__}: {exc}"
            print(f"\nradixkv: the reply failed ({failure})", file=err, flush=True)
            return
    print(file=out)
    print(status_line(session.last_reply.stats), file=out, flush=True)  # type: ignore[union-attr]
    if session.dropped_turns:
        print(
            f"  (context full: dropped the oldest {session.dropped_turns} turn(s);"
            " the system prompt stays)",
            file=out,
            flush=True,
        )


@contextmanager
def _ctrl_c_held() -> Iterator[list[int]]:
    """Hold the Ctrl-Cs (SIGINT) that arrive inside the block in the returned list, for the caller
    to act on between engine steps. Only on the main thread (the one that receives signals) and
    while Python's own handler is installed; elsewhere a Ctrl-C is raised where it lands."""
    held: list[int] = []
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield held
        return
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def status_line(stats: RequestStats) -> str:
    """One line per reply: prompt and cached tokens, hit %, time to first token, decode speed."""
    prompt, cached = stats.num_prompt_tokens, stats.num_cached_tokens
    hit = 100.0 * stats.cache_hit_rate
    ttft_ms = 1000.0 * stats.ttft_s
    speed = stats.decode_tokens_per_s
    reply = stats.num_output_tokens
    line = (
        f"  [prompt {prompt} tok · cached {cached} ({hit:.1f}%) · ttft {ttft_ms:.0f} ms"
        f" · reply {reply} tok · decode {speed:.1f} tok/s]"
    )
    reason = stats.hit_cut_reason
    return line if reason is None else f"{line}\n  [{reason}]"


def stats_text(llm: object) -> str:
    s = llm.cache.stats()  # type: ignore[attr-defined]
    return "\n".join(
        [
            f"hit rate      {100.0 * s.hit_rate:.1f}%  ({s.num_hit_tokens} of"
            f" {s.num_query_tokens} prompt tokens from cache, {s.num_computed_tokens} computed,"
            f" {s.num_queries} requests)",
            f"blocks        {s.num_blocks} x {s.block_size} tokens: {s.num_free_blocks} free,"
            f" {s.num_evictable_blocks} cached, {s.num_in_use_blocks} in use",
            *kv_lines(llm.runner.kv),  # type: ignore[attr-defined]
            *state_lines(llm.cache.group_stats()),  # type: ignore[attr-defined]
            f"tree          {s.num_nodes} nodes",
            f"evictions     {s.num_evicted_blocks} blocks, {s.num_evicted_tokens} tokens",
            *cut_lines(llm.cache.num_cut_hit_tokens),  # type: ignore[attr-defined]
            *tier_lines(llm),
        ]
    )


def kv_lines(kvs: Any) -> list[str]:
    """/stats' line on what each KV cache group's blocks hold (a latent group's say so)."""
    return [
        f"KV blocks     {kv.label}: {kv.num_blocks} blocks of {kv.bytes_per_block / 1024:.1f} KiB"
        f" ({len(kv.layers)} layers)"
        for kv in kvs
    ]


def state_lines(group_stats: Sequence[Any]) -> list[str]:
    """/stats' line on a hybrid model's recurrent-state slots (none without recurrent layers)."""
    from radixkv.cache.state import StateStats

    return [
        f"state slots   {s.num_slots} of {s.slot_bytes / 1024:.1f} KiB: {s.num_running_slots}"
        f" running, {s.num_snapshots} snapshots ({s.num_snapshot_bytes / 2**20:.2f} MiB),"
        f" {s.num_hits} hits resumed {s.num_hit_tokens} tokens from one"
        + (f" ({s.num_lower_hits} from the host or disk tier)" if s.num_host_blocks else "")
        for s in group_stats
        if isinstance(s, StateStats)
    ]


def cut_lines(num_cut_hit_tokens: int) -> list[str]:
    """/stats' line on hits cut back (none when no hit was: a model whose layers all keep every
    token's KV never cuts one)."""
    if not num_cut_hit_tokens:
        return []
    return [
        f"cut hits      {num_cut_hit_tokens} matched tokens not served: the sliding-window or"
        " recurrent layers keep what a hit resumes from only at some points, and a hit resumes"
        " only where they did"
    ]


def tier_lines(llm: object) -> list[str]:
    """The host and disk tiers' lines of /stats (none without them), one pair per KV cache group
    (a model with window layers has a second, its window group's, named by it; hits are counted
    once, by the tree's group)."""
    tier_ios = llm.tier_ios  # type: ignore[attr-defined]
    if tier_ios[0] is None:
        return []
    s = llm.cache.stats()  # type: ignore[attr-defined]
    hits = (f", {s.num_host_hit_tokens} hit tokens", f", {s.num_disk_hit_tokens} hit tokens")
    lines = _group_tier_lines("", tier_ios[0], s.num_host_cached_blocks, hits)
    cache = llm.cache  # type: ignore[attr-defined]
    others = zip(cache.groups, cache.group_stats(), tier_ios, strict=True)
    from radixkv.cache.state import StateStats

    for group, stats, tiers in list(others)[1:]:
        unit = "snapshots" if isinstance(stats, StateStats) else "blocks"
        held = stats.num_host_cached_blocks
        lines += _group_tier_lines(f"{group.name} ", tiers, held, ("", ""), unit)
    return lines


def _group_tier_lines(
    group: str, tiers: Any, num_held: int, hits: tuple[str, str], unit: str = "blocks"
) -> list[str]:
    """One group's host line, and its disk line when it has a disk tier."""
    moved = {k: f"{t.nbytes / 2**20:.2f} MiB in {t.seconds:.3f} s" for k, t in tiers.totals.items()}
    lines = [
        f"{group + 'host tier':<13} {num_held} of {tiers.host.num_blocks} {unit} used{hits[0]};"
        f" offloaded {moved['offload']}, loaded {moved['load']}"
    ]
    if tiers.disk is not None:
        d = tiers.disk.stats()
        lines.append(
            f"{group + 'disk tier':<13} {d.num_files} files, {d.num_bytes / 2**20:.1f} of"
            f" {d.budget_bytes / 2**20:.0f} MiB{hits[1]}; read {moved['disk_read']},"
            f" written {moved['disk_write']} ({d.directory})"
        )
    return lines


def _command(line: str, llm: object, session: object, out: TextIO) -> bool:
    """Run one /command; returns True when the chat should end."""
    from radixkv.chat.tree_view import render_tree

    name = line.split()[0].lower()
    if name in ("/quit", "/exit", "/q"):
        return True
    if name == "/tree":
        tok = llm.tokenizer  # type: ignore[attr-defined]
        cache = llm.cache  # type: ignore[attr-defined]
        snapshots = cache.snapshot_nodes()
        print(render_tree(cache.nodes(), decode=tok.decode, snapshots=snapshots), file=out)
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
        path = os.path.expanduser(script)
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
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

"""One grammar-compile worker process of `radixkv.serve.grammar_pool`: it compiles, its parent
times it, and kills it when the time is up (a thread cannot be stopped; a process can).

    parent ──stdin──►  set-up (JSON), TokenizerInfo (xgrammar's JSON), then requests {kind, text}
    parent ◄─stdout──  READY once xgrammar is imported; per request OK + the compiled grammar's
                       `serialize_json()`, or ERROR + a message for the client

Every message is a frame: an 8-byte big-endian length, then that many bytes. The worker keeps no
cache (the parent's is the one, within its byte budget) and refuses a compiled grammar over the
set-up's `max_bytes` before sending it. It ends when its stdin closes or its parent dies.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import time
from typing import Any, BinaryIO

READY, OK, ERROR = b"r", b"o", b"e"
_LENGTH = struct.Struct(">Q")
_PARENT_POLL_S = 1.0


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(_LENGTH.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame's payload; None at the end of the stream."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(head)
    payload = stream.read(size)
    return payload if len(payload) == size else None


def frame_length(head: bytes) -> int:
    (size,) = _LENGTH.unpack(head)
    return int(size)


FRAME_HEAD_BYTES = _LENGTH.size


def main() -> None:
    """The worker's loop (the parent starts it with `grammar_pool.WORKER_BOOT`)."""
    _exit_with_parent()
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a library's stray print goes to the server's stderr, never into a frame
    requests = sys.stdin.buffer
    setup_frame, info_frame = read_frame(requests), read_frame(requests)
    if setup_frame is None or info_frame is None:
        return
    setup = json.loads(setup_frame)
    from radixkv.engine.sampling.grammar import import_xgrammar

    xgr = import_xgrammar()
    info = xgr.TokenizerInfo.deserialize_json(info_frame.decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write_frame(replies, READY)
    while (frame := read_frame(requests)) is not None:
        request = json.loads(frame)
        spec = (request["kind"], request["text"])
        write_frame(replies, _compiled(compiler, spec, setup["vocab_size"], setup["max_bytes"]))


def _compiled(compiler: Any, spec: tuple[str, str], vocab_size: int, max_bytes: int) -> bytes:
    from radixkv.engine.sampling.grammar import GrammarError, compile_spec

    try:
        compiled = compile_spec(compiler, spec, vocab_size)
    except GrammarError as exc:
        return ERROR + str(exc).encode()
    except Exception as exc:  # what xgrammar raises beyond its documented errors
        return ERROR + f"{spec[0]} cannot be compiled ({type(exc).__name__})".encode()
    size = compiled.memory_size_bytes
    if size > max_bytes:
        return (
            ERROR
            + (
                f"{spec[0]} compiles to {size / 2**20:.1f} MiB; at most {max_bytes / 2**20:.1f} "
                "MiB are allowed (a quarter of the server's grammar cache): simplify it"
            ).encode()
        )
    return OK + compiled.serialize_json().encode()


def _exit_with_parent() -> None:
    """End this process when its parent dies (a killed server): a compile runs with the GIL
    released, so this thread notices mid-compile."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="radixkv-grammar-parent", daemon=True).start()

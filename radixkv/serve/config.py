"""`ServeConfig`: the server's settings and limits, each answered as the README's table says."""

from __future__ import annotations

import math
from dataclasses import dataclass

from radixkv.engine.sampling_params import DEFAULT_GRAMMAR_CACHE_BYTES


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Server settings. `model_name` is the id clients pass as `model` (and /v1/models lists).

    The limits keep one client from costing the others: what they answer is in the README
    ("Limits"); `radixkv serve --help` names the flag of each.
    """

    model_name: str
    max_queued_requests: int = 256  # waiting for admission; more are answered 503
    retry_after_s: int = 1  # the Retry-After header of a 503
    max_body_bytes: int = 2 * 2**20  # a larger request body: 413, before it is read
    max_stops: int = 64  # entries of `stop` (and of `stop_token_ids`); more: 400
    max_stop_chars: int = 512  # characters of one stop string; more: 400
    # A request's head and body must be in within this many seconds of its first line
    # (a body: 408; a head: the connection is closed).
    read_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0  # an idle connection is closed after this
    # SIGTERM / SIGINT: replies in flight may finish for this long; then each ends with an error
    # (a stream: an error event and [DONE]). A second signal ends them at once.
    shutdown_timeout_s: float = 20.0
    # A structured-output grammar (schema, regex, EBNF, tools) that takes longer to compile is
    # answered 400 (its compile is killed); at most this many compile at once, each in a worker
    # process of its own (`grammar_pool.py`).
    grammar_compile_timeout_s: float = 10.0
    max_grammar_compiles: int = 2
    # Compiled grammars are cached within this many bytes; one over a quarter of it: 400.
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    max_n: int = 16  # choices of one request (`n`); more: 400
    # /health_generate answers 503 when no token came within this long (SGLang's 20 s).
    health_check_timeout_s: float = 20.0
    # The key of the admin routes (/flush_cache), sent as `Authorization: Bearer KEY`; None:
    # those routes are off (they act on every tenant's cache).
    admin_key: str | None = None
    # The live page of the cache at `/` and its event stream (`ui_routes.py`); off unless asked
    # (`radixkv serve` turns it on by default only on a loopback address).
    ui: bool = False
    # Host names the page answers besides IP addresses and localhost (`ui_routes.host_allowed`):
    # the name the server listens on, `--allowed-host`.
    ui_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        for name in (
            "max_queued_requests",
            "retry_after_s",
            "max_body_bytes",
            "max_stops",
            "max_stop_chars",
            "max_grammar_compiles",
            "grammar_cache_bytes",
            "max_n",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.ui_hosts, tuple) or not all(
            isinstance(h, str) and h.strip() for h in self.ui_hosts
        ):
            raise ValueError(f"ui_hosts must be a tuple of host names, got {self.ui_hosts!r}")
        key = self.admin_key
        # Printable ASCII: an HTTP header carries it as is.
        if key is not None and not (
            isinstance(key, str) and key.strip() and key.isascii() and key.isprintable()
        ):
            raise ValueError("admin_key must be a non-empty string of printable ASCII")
        for name in (
            "read_timeout_s",
            "keep_alive_timeout_s",
            "shutdown_timeout_s",
            "grammar_compile_timeout_s",
            "health_check_timeout_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number of seconds, got {value!r}")
            # 0 s of shutdown: streams end at once; a zero read timeout would refuse everything.
            if not (value >= 0 if name == "shutdown_timeout_s" else value > 0) or value == math.inf:
                raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")

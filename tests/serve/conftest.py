"""A live `radixkv serve` app on 127.0.0.1 (ephemeral port) over the tiny GQA test model."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

torch.set_num_threads(1)  # see the PLATFORM notes on OpenMP spin-waiting


class LiveServer:
    """`radixkv serve`'s server (`build_server`) in a thread; `close()` shuts it down as a
    signal would (the deadline of its config, then the lifespan shutdown)."""

    def __init__(self, llm: Any, on_shutdown: Any = (), **config: Any) -> None:
        from radixkv.serve.app import create_app
        from radixkv.serve.config import ServeConfig
        from radixkv.serve.http_server import build_server

        self.llm = llm
        self.config = ServeConfig(model_name="tiny", **config)
        self.app = create_app(llm, self.config, on_shutdown=on_shutdown)
        self.server_state = self.app.state.server
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._server = build_server(self.app, self.config, log_level="warning")
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def client(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="none", **kwargs)

    def async_client(self, **kwargs: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="none", **kwargs)

    def on_engine(self, fn: Callable[[Any], Any], timeout: float = 30) -> Any:
        """fn(llm) run on the engine thread between steps."""
        return self.server_state.engine.call(fn).result(timeout)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(30 + self.config.shutdown_timeout_s)


@pytest.fixture(scope="session")
def make_server(tiny_model_dir: Callable[[str], Path]) -> Iterator[Callable[..., LiveServer]]:
    """(engine kwargs, server kwargs) -> a started LiveServer on a fresh tiny-model LLM.

    Server kwargs: `model` (a model folder, or a loaded model, instead of the tiny GQA one),
    `on_shutdown` for `create_app`, the rest for `ServeConfig`. Engine kwargs: LLM's own (such
    as `tokenizer`)."""
    from radixkv.engine import LLM

    servers: list[LiveServer] = []

    def make(engine: dict[str, Any] | None = None, model: Any = None, **config: Any) -> LiveServer:
        source = tiny_model_dir("gqa") if model is None else model
        source = str(source) if isinstance(source, Path) else source
        llm = LLM(source, **{"num_blocks": 256, **(engine or {})})
        server = LiveServer(llm, **config)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def server(make_server: Callable[..., LiveServer]) -> LiveServer:
    return make_server()


@pytest.fixture(scope="session")
def reference_llm(tiny_model_dir: Callable[[str], Path]) -> Any:
    """The same model without a server or prefix cache, for 'the same request run alone'."""
    from radixkv.engine import LLM

    return LLM(str(tiny_model_dir("gqa")), enable_prefix_cache=False, num_blocks=256)

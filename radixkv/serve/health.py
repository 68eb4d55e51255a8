"""/health_generate: proof that the engine steps, at the cost of at most one tiny request.

SGLang's rule: any token the engine delivers after a check began shows that it steps. Here:

- a token delivered within the last `RECENT_TOKEN_S` answers at once (a busy replica is
  never made to wait for a probe of its own);
- otherwise one probe (a one-token request under a salt of its own, so that it never enters the
  shared cache) is started, and every check that arrives meanwhile waits on that same probe;
- the probe is a request like any other against the queue limit: with the waiting queue full it
  submits nothing and only watches for a token;
- it answers 200 as soon as any token comes (its own or another request's), 503 when none came
  within the timeout, whether the engine never took the probe in or never stepped it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from radixkv.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixkv.serve.engine_loop import EngineLoop, RequestStream

logger = logging.getLogger(__name__)

RECENT_TOKEN_S = 1.0
HEALTH_CACHE_SALT = "radixkv-health-check"  # its one-token prompt never enters the shared cache
_POLL_S = 0.02


class GenerateProbe:
    """The checks of one engine loop; `check()` returns None when the engine steps, else why
    not. `max_queued` is the server's waiting-queue limit, `timeout_s` the most a check waits."""

    def __init__(self, engine: EngineLoop, *, max_queued: int, timeout_s: float) -> None:
        self.engine = engine
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self._probe: asyncio.Future[str | None] | None = None
        self.num_probes = 0  # probes submitted to the engine since start

    async def check(self) -> str | None:
        if not self.engine.is_alive:
            return "engine stopped"
        if _since(self.engine.t_last_token) < RECENT_TOKEN_S:
            return None
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._run())
        # Shielded: a check whose client went away does not cancel the others' probe.
        return await asyncio.shield(self._probe)

    async def _run(self) -> str | None:
        started = time.perf_counter()
        deadline = started + self.timeout_s
        stream = None
        try:
            if self.engine.num_queued < self.max_queued:
                stream = await asyncio.wait_for(self._submit(), self.timeout_s)
            while time.perf_counter() < deadline:
                if self.engine.t_last_token is not None and self.engine.t_last_token > started:
                    return None
                if stream is not None and _failed(stream):
                    return "the engine failed the probe"
                await asyncio.sleep(_POLL_S)
        except asyncio.TimeoutError:
            pass  # the engine did not take the probe in
        finally:
            if stream is not None:
                self.engine.release(stream)
        logger.error("health_generate: no token within %.0f s", self.timeout_s)
        return f"no token from the engine within {self.timeout_s:g} s"

    async def _submit(self) -> RequestStream:
        self.num_probes += 1
        params = SamplingParams(max_tokens=1)
        return await self.engine.submit([0], params, cache_salt=HEALTH_CACHE_SALT)


def _since(t: float | None) -> float:
    return float("inf") if t is None else time.perf_counter() - t


def _failed(stream: RequestStream) -> bool:
    """Whether the probe's stream holds a failure (a token would have shown in t_last_token)."""
    if stream.updates.empty():
        return False
    update = stream.updates.get_nowait()
    return isinstance(update, BaseException) or update.error is not None

"""The engine: `LLM` ties model runner, scheduler, prefix cache and sampler together.

    LLM.generate / LLM.stream
        │  validate + tokenize (nothing is admitted unless every request of the call is valid)
        ▼
    Scheduler.add_request ──► loop: schedule() ─► ModelRunner.execute() ─► sample() ─►
                                    Scheduler.update_from_output()  (stop rules, cache inserts)

The engine is synchronous and single-threaded: every public call drives the step loop until its
own requests finish (requests of other calls, e.g. a paused stream, advance with it). A lock
serialises callers from several threads.
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixkv.cache.prefix_cache import PrefixCache
from radixkv.cache.validation import check_size
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.model_loader import Progress, load_model
from radixkv.engine.model_runner import KVCacheSpec, ModelRunner, plan_num_blocks
from radixkv.engine.outputs import RequestOutput, RequestStats, StreamDelta
from radixkv.engine.sampler import make_generator, sample
from radixkv.scheduler import Request, Scheduler, SchedulerConfig
from radixkv.scheduler.output import SchedulerOutput
from radixkv.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptInput = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]


@dataclass(slots=True)
class _Tracked:
    """Engine-side bookkeeping of one request, kept until its caller collects the output."""

    request: Any  # radixkv.scheduler.Request
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    t_submit: float
    num_cached_tokens: int | None = None  # start position of its first scheduled row
    t_first_token: float | None = None
    t_last_token: float | None = None
    t_finish: float | None = None
    num_streamed_tokens: int = 0
    finished: bool = False


class LLM:
    """A prefix-caching inference engine over a Hugging Face Llama-family causal LM.

    `model`: None (the embedded SmolLM2-135M-Instruct, converted once into the user cache dir),
    a local folder, a Hugging Face id, or a loaded `PreTrainedModel` (its attention implementation
    is switched to the paged one). `block_size` tokens per KV block; the KV pool holds `num_blocks`
    blocks, or what `kv_cache_bytes` holds, or (CPU) 512 MiB / (CUDA) 80 % of free device memory.
    `num_threads` (CPU only): torch threads; None = half the cores (1 on a 2-core machine), because
    OpenMP spin-waiting collapses when a co-tenant keeps the other cores busy.
    `enforce_eager`: no CUDA graphs for decode steps (the CPU always runs eager).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | Any | None = None,
        *,
        tokenizer: Any | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        enable_prefix_cache: bool = True,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 1024,
        chunked_prefill_size: int = 512,
        policy: str = "lpm",
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 0,
        num_threads: int | None = None,
        progress: Progress | None = None,
        enforce_eager: bool = False,
    ) -> None:
        check_size(block_size, "block_size", low=1)
        check_size(seed, "seed", low=0)
        if num_threads is not None:
            check_size(num_threads, "num_threads", low=1)
        # Validate the scheduler bounds before the (slow) model load.
        config_args: dict[str, Any] = dict(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            chunked_prefill_size=chunked_prefill_size,
            policy=policy,
            enable_prefix_cache=enable_prefix_cache,
        )
        SchedulerConfig(**config_args)
        loaded = load_model(
            model, tokenizer=tokenizer, device=device, dtype=dtype, progress=progress
        )
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        param = next(self.model.parameters())
        if param.device.type == "cpu":
            _set_cpu_threads(num_threads)
        spec = KVCacheSpec.from_model(self.model, block_size, param.dtype)
        n_blocks = plan_num_blocks(
            spec, param.device, num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes
        )
        self.max_model_len = _max_model_len(self.model.config.get_text_config())
        self.runner = ModelRunner(
            self.model,
            block_size=block_size,
            num_blocks=n_blocks,
            enforce_eager=enforce_eager,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
        )
        self.cache = PrefixCache(n_blocks, block_size)
        self.scheduler_config = SchedulerConfig(**config_args, max_model_len=self.max_model_len)
        self.scheduler = Scheduler(self.cache, self.scheduler_config)
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self.seed = seed
        self._num_submitted = 0
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompts: PromptInput,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one or many prompts (strings or token-id lists), in input order.

        Raises ValueError / TypeError, with nothing admitted, for an empty prompt, token ids outside
        the vocabulary, a prompt that can never fit, or params of the wrong type or count.
        """
        prompt_ids = self._normalize_prompts(prompts)
        params_list = _normalize_params(params, len(prompt_ids))
        with self._lock:
            ids = self._submit(prompt_ids, params_list)
            try:
                while not all(self._tracked[i].finished for i in ids):
                    self._step()
            except BaseException:
                self._abort(ids)
                raise
            return [self._collect(i) for i in ids]

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> Iterator[StreamDelta]:
        """Generate for one prompt, yielding text deltas as tokens arrive; the last delta carries
        the finished RequestOutput (`delta.output`). Closing the iterator early aborts the request.

        Validation errors are raised by this call, before iteration starts."""
        prompt_ids = self._normalize_prompts(prompt)
        if len(prompt_ids) != 1:
            raise ValueError("stream() takes one prompt; use generate() for several")
        params_list = _normalize_params(params, 1)
        with self._lock:
            (rid,) = self._submit(prompt_ids, params_list)
        return self._stream_iter(rid)

    def encode(self, text: str) -> list[int]:
        """Tokenize like generate() does for a string prompt."""
        if self.tokenizer is None:
            raise ValueError(
                f"model {self.model_name!r} has no tokenizer: pass prompts as token-id lists"
            )
        return list(self.tokenizer.encode(text))

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    # ------------------------------------------------------------------ step loop

    def _submit(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[str]:
        """Add every request or none (a rejected one rolls back those added before it)."""
        for i, ids in enumerate(prompt_ids):
            if len(ids) >= self.max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; the model's context is {self.max_model_len}"
                )
        added: list[str] = []
        now = time.perf_counter()
        try:
            for ids, p in zip(prompt_ids, params, strict=True):
                # Ids are never reused, not even those of a rolled-back call: the scheduler may
                # still report an aborted id as finished in a later step.
                index = self._num_submitted
                self._num_submitted += 1
                rid = f"req-{index}"
                eos = () if p.ignore_eos else self.eos_token_ids
                request = Request(rid, tuple(ids), p, eos_token_ids=eos)
                self.scheduler.add_request(request)
                added.append(rid)
                gen = None
                if not p.greedy:
                    seed = p.seed if p.seed is not None else _derive_seed(self.seed, index)
                    gen = make_generator(seed, self.runner.device)
                self._tracked[rid] = _Tracked(
                    request, gen, IncrementalDetokenizer(self.tokenizer), t_submit=now
                )
        except BaseException:
            self._abort(added)
            raise
        return added

    def _step(self) -> None:
        out: SchedulerOutput = self.scheduler.schedule()
        for rid in out.finished_ids:  # aborted / rejected by the scheduler itself
            t = self._tracked.get(rid)
            if t is not None and t.request.finish_reason is not None:
                self._mark_finished(rid)
        if out.is_empty:
            if out.finished_ids:
                return
            unfinished = [r for r, t in self._tracked.items() if not t.finished]
            raise RuntimeError(
                f"scheduler scheduled nothing with requests pending ({unfinished[:5]}...)"
            )
        for row in out.rows:
            tracked = self._tracked.get(row.request_id)
            if tracked is not None and tracked.num_cached_tokens is None:
                tracked.num_cached_tokens = row.start_position
        logits = self.runner.execute(out)
        sample_rows = [r for r in out.rows if r.sample]
        tracked_rows = [self._tracked[r.request_id] for r in sample_rows]
        tokens = sample(
            logits,
            [t.request.params for t in tracked_rows],
            [t.generator for t in tracked_rows],
        )
        now = time.perf_counter()
        for t in tracked_rows:
            if t.t_first_token is None:
                t.t_first_token = now
            t.t_last_token = now
        sampled = {r.request_id: tok for r, tok in zip(sample_rows, tokens, strict=True)}
        for request in self.scheduler.update_from_output(out, sampled):
            if request.request_id in self._tracked:
                self._mark_finished(request.request_id)

    def _mark_finished(self, rid: str) -> None:
        t = self._tracked[rid]
        t.finished = True
        t.t_finish = time.perf_counter()

    def _abort(self, ids: Sequence[str]) -> None:
        for rid in ids:
            t = self._tracked.pop(rid, None)
            if t is not None and t.finished:
                continue
            try:
                self.scheduler.abort(rid)
            except (KeyError, ValueError):
                logger.debug("abort of %s: not in the scheduler", rid)

    def _collect(self, rid: str) -> RequestOutput:
        t = self._tracked.pop(rid)
        req = t.request
        out_ids = tuple(req.output_token_ids)
        t_first = t.t_first_token if t.t_first_token is not None else t.t_finish
        t_last = t.t_last_token if t.t_last_token is not None else t.t_finish
        assert t_first is not None and t_last is not None and t.t_finish is not None
        decode_s = t_last - t_first
        stats = RequestStats(
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=t.num_cached_tokens or 0,
            num_output_tokens=len(out_ids),
            ttft_s=t_first - t.t_submit,
            decode_tokens_per_s=(len(out_ids) - 1) / decode_s if decode_s > 0 else 0.0,
            total_s=t.t_finish - t.t_submit,
        )
        return RequestOutput(
            request_id=rid,
            prompt_token_ids=tuple(req.prompt_token_ids),
            token_ids=out_ids,
            text=self.decode(out_ids),
            finish_reason=str(req.finish_reason or "abort"),
            stats=stats,
        )

    def _stream_iter(self, rid: str) -> Iterator[StreamDelta]:
        try:
            while True:
                output = None
                with self._lock:
                    t = self._tracked[rid]
                    if not t.finished and len(t.request.output_token_ids) <= t.num_streamed_tokens:
                        self._step()
                    new = tuple(t.request.output_token_ids[t.num_streamed_tokens :])
                    t.num_streamed_tokens += len(new)
                    text = t.detok.push(new)
                    if t.finished:
                        text += t.detok.finish()
                        output = self._collect(rid)
                # Yield outside the lock: the consumer may call the engine between deltas.
                if output is not None:
                    yield StreamDelta(text, new, output)
                    return
                if new or text:
                    yield StreamDelta(text, new)
        finally:
            with self._lock:
                if rid in self._tracked:
                    self._abort([rid])

    # ------------------------------------------------------------------ validation

    def _normalize_prompts(self, prompts: PromptInput) -> list[list[int]]:
        if isinstance(prompts, str):
            items: list[Any] = [prompts]
        elif isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
            if len(prompts) == 0:
                raise ValueError("prompts must not be empty")
            first = prompts[0]
            # A flat list of ints is one prompt given as token ids.
            items = [prompts] if _is_int(first) else list(prompts)
        else:
            raise TypeError(
                "prompts must be a string, a list of strings, a list of token ids or a list of "
                f"token-id lists, got {type(prompts).__name__}"
            )
        result = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                if not item:
                    raise ValueError(f"prompt {i} is an empty string")
                ids = self.encode(item)
            elif isinstance(item, Sequence) and not isinstance(item, (bytes, bytearray)):
                if not all(_is_int(t) for t in item):
                    raise TypeError(f"prompt {i}: token ids must be ints")
                ids = [int(t) for t in item]
            else:
                raise TypeError(
                    f"prompt {i} must be a string or a list of token ids, got {type(item).__name__}"
                )
            if not ids:
                raise ValueError(f"prompt {i} is empty (no tokens)")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {i}: token ids {bad[:5]} are outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
            result.append(ids)
        return result


def _normalize_params(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}] must be SamplingParams, got {type(p).__name__}")
        return list(params)
    raise TypeError(f"params must be SamplingParams or a list of them, got {type(params).__name__}")


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _derive_seed(engine_seed: int, index: int) -> int:
    """Seed of an unseeded sampled request: a fixed mix of the engine seed and submit order."""
    return (engine_seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (2**63)


def _eos_token_ids(model: Any, tokenizer: Any | None) -> tuple[int, ...]:
    ids: list[int] = []
    gen_cfg = getattr(model, "generation_config", None)
    for source in (
        getattr(gen_cfg, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if source is None:
            continue
        for t in [source] if _is_int(source) else list(source):
            if int(t) not in ids:
                ids.append(int(t))
    return tuple(ids)


def _max_model_len(cfg: Any) -> int:
    n = int(getattr(cfg, "max_position_embeddings", None) or 8192)
    window = getattr(cfg, "sliding_window", None)
    if (
        window
        and getattr(cfg, "use_sliding_window", True)
        and not getattr(cfg, "layer_types", None)
    ):
        # The paged attention is full causal attention: it equals a sliding-window model's
        # attention only while the whole context fits in the window (Mistral-style configs).
        n = min(n, int(window))
    return n


def _set_cpu_threads(num_threads: int | None) -> None:
    if num_threads is None:
        num_threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) // 2))
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)

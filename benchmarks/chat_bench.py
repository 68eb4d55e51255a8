"""End-to-end multi-turn chat benchmark (issue #5): radixkv against plain transformers.

Several conversations share one system prompt and run turn by turn: turn k of every conversation is
submitted together as one batch to each system, and every reply is exactly `--reply-tokens` greedy
tokens (EOS ignored), so all systems do the same work. Four systems, measured in one run:

    (a) radixkv, prefix cache on         `LLM(enable_prefix_cache=True).generate(...)`
    (b) radixkv, prefix cache off        `LLM(enable_prefix_cache=False).generate(...)`
    (c) plain transformers `generate`    full chat history each turn, the batch left-padded
    (d) transformers continuous batching `generate_batch`'s engine (paged cache, hash-chained full
                                         pages shared), kept running across turns so its page cache
                                         carries over from one turn to the next (`--cb-api
                                         generate_batch`: one generate_batch call per turn)

The history is shared: the first system run (normally (a)) generates the replies; turn k+1's prompt
is turn k's prompt tokens + the reply tokens + the chat template's tokens for "end of assistant
message, next user message, assistant header". The other systems replay exactly those prompt token
lists and generate their own replies (which are checked against the first system's). A prompt is
built from token ids, never re-tokenised from text, so a reply's tokens are the same in the next
turn's history as when they were generated - as in a chat server that keeps its token history.

The systems run interleaved, turn by turn (turn 1 of a, b, c, d, then turn 2 ...), so a
co-tenant's load on a shared machine falls on all of them alike; each is warmed up once first.
Caches are sized to hold every conversation twice over (nothing is evicted). Measured per turn:
prefill tokens computed (tokens run through the model minus the decode tokens; for (c) this
includes left padding), mean time to first token from the moment the turn's batch is submitted,
wall time of the turn, and in total the process CPU time too (robust to waiting for a core).
`--profile` adds where each system's time goes. Run as a script, never with the repository root
on sys.path (transformers would import the top-level `kernels/` folder):

    .venv/bin/python benchmarks/chat_bench.py --quick
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

SYSTEM_PROMPT = (
    "You are Sage, a patient and precise tutor who helps adults learn practical skills. Follow "
    "these rules in every answer. First, be concrete: prefer a worked example, a number or a "
    "named tool over a general statement. Second, be brief: answer in at most four short "
    "sentences unless the learner asks for more detail. Third, be honest: if something is "
    "uncertain or depends on the situation, say so plainly and explain what it depends on. "
    "Fourth, be encouraging but never flattering; point out one mistake or risk the learner "
    "should watch for. Fifth, remember the conversation: refer back to what the learner told you "
    "earlier when it matters, and do not repeat advice you already gave. Sixth, use plain words; "
    "when a technical term is needed, define it in the same sentence. Seventh, finish with one "
    "small, specific next step the learner can take today."
)

TOPICS = (
    "sourdough baking",
    "amateur astronomy",
    "vegetable gardening",
    "the history of ancient Rome",
    "Python programming",
    "travelling in Japan",
    "music theory for guitar",
    "personal budgeting",
)

USER_TEMPLATES = (
    "I want to get started with {topic}. Where should a complete beginner begin?",
    "What are the three most common mistakes people make with {topic}?",
    "Can you explain the single most important idea in {topic} with a simple example?",
    "Which tools or resources would you recommend for {topic}, and why?",
    "How much time per week should I spend on {topic} to make real progress?",
    "What is a small project I could finish this weekend related to {topic}?",
    "Please summarise what we have discussed so far in two sentences.",
    "What is a surprising fact about {topic} that most people do not know?",
    "How would you explain {topic} to a ten-year-old?",
    "What should I learn next once I know the basics of {topic}?",
    "Give me a short checklist for my first month of {topic}.",
    "Thanks! Last question: how do experts in {topic} keep improving?",
)

# A plain-text prompt sharing no prefix with the conversations (not chat-templated), for warm-up.
WARMUP_PROMPT = "Warm-up. The quick brown fox jumps over the lazy dog, then counts: one, two,"

SYSTEM_NAMES = {
    "a": "(a) radixkv cache",
    "b": "(b) radixkv no cache",
    "c": "(c) HF generate",
    "d": "(d) HF cont. batching",
}


# --------------------------------------------------------------------------------------------------
# Conversations


def user_message(conversation: int, turn: int) -> str:
    """The scripted user message of `turn` (0-based) in `conversation`."""
    topic = TOPICS[conversation % len(TOPICS)]
    text = USER_TEMPLATES[turn % len(USER_TEMPLATES)].format(topic=topic)
    if conversation >= len(TOPICS) or turn >= len(USER_TEMPLATES):
        text += f" (conversation {conversation + 1}, turn {turn + 1})"
    return text


class ChatHistories:
    """Token histories of `num_conversations` conversations that share a system prompt.

    `next_prompts()` adds the next user message to each conversation and returns the prompt token
    ids of that turn; `add_replies` appends the assistant replies to it. Turn k+1's prompt extends
    turn k's prompt + reply by the chat template's tokens between them, so prompts only ever grow
    (a radix cache can serve the whole previous turn).
    """

    def __init__(self, tokenizer: Any, num_conversations: int) -> None:
        self._tok = tokenizer
        self._messages: list[list[dict[str, str]]] = [
            [{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(num_conversations)
        ]
        self._token_ids: list[list[int]] = [[] for _ in range(num_conversations)]
        self._turn = 0  # turns whose prompts were built
        self._replied = True  # the replies of the last built turn were added

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def next_prompts(self) -> list[list[int]]:
        """Append the next user message to every conversation and return the prompts (token ids)."""
        assert self._replied, "add_replies() must follow every next_prompts()"
        for conv, (messages, ids) in enumerate(zip(self._messages, self._token_ids, strict=True)):
            # `before` is the text the tokens so far stand for: the last prompt + the last reply.
            before = self._render(messages[:-1]) + messages[-1]["content"] if ids else ""
            messages.append({"role": "user", "content": user_message(conv, self._turn)})
            after = self._render(messages)
            if not after.startswith(before):
                raise RuntimeError("the chat template does not extend the history as a prefix")
            # NOTE: only the template's new text is tokenised; earlier tokens are kept as they are.
            ids.extend(self._tok.encode(after[len(before) :], add_special_tokens=False))
        self._turn += 1
        self._replied = False
        return [list(ids) for ids in self._token_ids]

    def add_replies(self, replies: Sequence[Sequence[int]]) -> None:
        assert not self._replied and len(replies) == len(self._token_ids)
        for messages, ids, reply in zip(self._messages, self._token_ids, replies, strict=True):
            ids.extend(reply)
            text = self._tok.decode(list(reply), skip_special_tokens=False)
            messages.append({"role": "assistant", "content": text})
        self._replied = True


# --------------------------------------------------------------------------------------------------
# Measurement


@dataclass(frozen=True, slots=True)
class TurnRun:
    """What one system did for one turn (all conversations of the turn in one batch)."""

    replies: list[list[int]]  # generated token ids per conversation
    ttft_s: list[float]  # per conversation, from the batch's submission to its first token
    wall_s: float  # submission of the batch to the last reply
    cpu_s: float  # CPU time of the process meanwhile (all threads): robust to a busy machine
    num_prefill_tokens: int  # prompt tokens run through the model (computed, not served by a cache)


@dataclass(slots=True)
class SystemResult:
    key: str  # "a", "b", "c", "d"
    turns: list[TurnRun] = field(default_factory=list)
    note: str = ""
    profile: dict[str, float] = field(default_factory=dict)  # seconds per part, with --profile

    @property
    def total_prefill(self) -> int:
        return sum(t.num_prefill_tokens for t in self.turns)

    @property
    def total_wall_s(self) -> float:
        return sum(t.wall_s for t in self.turns)

    @property
    def total_cpu_s(self) -> float:
        return sum(t.cpu_s for t in self.turns)


class ForwardCounter:
    """Counts tokens run through a Hugging Face model, and the time spent in its forward (hooks on
    the top module)."""

    def __init__(self, model: Any) -> None:
        self.num_tokens = 0
        self.seconds = 0.0
        self._t0 = 0.0
        self._handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post),
        ]

    def _pre(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"][..., 0]
        self.num_tokens += int(ids.numel())
        self._t0 = time.perf_counter()

    def _post(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        self.seconds += time.perf_counter() - self._t0

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class Profile:
    """Cumulative wall time of chosen functions, wrapped in place (`close()` restores them).

    Time goes to the `current` bucket: the system whose turn is running (module-level functions
    such as the kernels are shared by both radixkv instances).
    """

    def __init__(self) -> None:
        self.current: dict[str, float] | None = None
        self._undo: list[tuple[Any, str, Any, bool]] = []
        self._wrapped: set[tuple[int, str]] = set()

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        if (id(owner), attr) in self._wrapped:
            return
        self._wrapped.add((id(owner), attr))
        fn = getattr(owner, attr)
        own = attr in getattr(owner, "__dict__", {})

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.current is not None:
                    self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn, own))

    def close(self) -> None:
        for owner, attr, fn, own in reversed(self._undo):
            if own:
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr)
        self._undo.clear()
        self._wrapped.clear()


class System:
    """One system under test: `warmup()` once, then `run_turn()` per turn, then `close()`."""

    key: str
    counter: ForwardCounter

    def profile_parts(self, prof: Profile) -> list[str]:
        """Wrap the system's parts in `prof`'s timers; returns their names (besides the model
        forward, which every system reports)."""
        return []

    def warmup(self, num_tokens: int) -> None:
        raise NotImplementedError

    def run_turn(self, prompts: list[list[int]], num_tokens: int) -> TurnRun:
        raise NotImplementedError

    def close(self) -> None:
        pass


class RadixkvSystem(System):
    """(a) / (b): radixkv's `LLM.generate`, the whole turn as one call."""

    def __init__(
        self,
        key: str,
        *,
        enable_prefix_cache: bool,
        block_size: int,
        num_blocks: int,
        max_batch_tokens: int,
        max_requests: int,
        num_threads: int,
    ) -> None:
        from radixkv import LLM

        self.key = key
        self.llm = LLM(
            enable_prefix_cache=enable_prefix_cache,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_batched_tokens=max_batch_tokens,
            max_num_seqs=max_requests,
            num_threads=num_threads,
            seed=0,
        )
        # Cross-check of the engine's own accounting (prompt - cached tokens) against the tokens
        # that actually went through the model.
        self.counter = ForwardCounter(self.llm.model)
        self.mismatches: list[str] = []

    def profile_parts(self, prof: Profile) -> list[str]:
        import radixkv.engine.model_runner
        import radixkv.engine.step
        import radixkv.kernels

        prof.wrap(self.llm.scheduler, "schedule", "scheduler")
        prof.wrap(self.llm.scheduler, "record_launched", "scheduler")
        prof.wrap(self.llm.scheduler, "fill", "scheduler")
        prof.wrap(radixkv.engine.model_runner, "stage_step", "runner: build step inputs")
        prof.wrap(radixkv.engine.step, "draw", "sampling")  # the name the step calls
        prof.wrap(self.llm._steps, "finish", "sampling: read the tokens")
        # Inside the model forward (attention.py and fused_llama.py call them through the module
        # at call time). The engine calls the per-step variants (metadata validated once per
        # step); a Llama on Triton stores K/V inside the fused RoPE kernel instead.
        prof.wrap(radixkv.kernels, "paged_attention_step", "  kernels.paged_attention")
        prof.wrap(radixkv.kernels, "store_kv_step", "  kernels.store_kv")
        prof.wrap(radixkv.kernels, "rope_store_kv_step", "  kernels.rope + store_kv")
        prof.wrap(radixkv.kernels, "rms_norm", "  kernels.rms_norm")
        return [
            "  kernels.paged_attention",
            "  kernels.store_kv",
            "  kernels.rope + store_kv",
            "  kernels.rms_norm",
            "scheduler",
            "runner: build step inputs",
            "sampling",
        ]

    def _params(self, num_tokens: int) -> Any:
        from radixkv import SamplingParams

        return SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)

    def warmup(self, num_tokens: int) -> None:
        ids = self.llm.tokenizer.encode(WARMUP_PROMPT, add_special_tokens=False)
        self.llm.generate([ids], self._params(num_tokens))

    def run_turn(self, prompts: list[list[int]], num_tokens: int) -> TurnRun:
        before = self.counter.num_tokens
        c0 = time.process_time()
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, self._params(num_tokens))
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        computed = sum(o.stats.num_prompt_tokens - o.stats.num_cached_tokens for o in outs)
        forwarded = self.counter.num_tokens - before - len(prompts) * (num_tokens - 1)
        if forwarded != computed:
            self.mismatches.append(f"{computed} by stats vs {forwarded} through the model")
        return TurnRun(
            replies=[list(o.token_ids) for o in outs],
            ttft_s=[o.stats.ttft_s for o in outs],
            wall_s=wall,
            cpu_s=cpu,
            num_prefill_tokens=computed,
        )

    def close(self) -> None:
        self.counter.close()


class PlainGenerateSystem(System):
    """(c): `model.generate` over each conversation's full history, the turn batched with left
    padding (padding positions are computed too, and counted). TTFT = when the first new token of
    the batch reaches the streamer."""

    key = "c"

    def __init__(self, model: Any, pad_token_id: int) -> None:
        import torch
        from transformers import GenerationConfig

        self._torch = torch
        self.model = model
        self.pad_token_id = pad_token_id
        # NOTE: eos_token_id=None alone is not enough: generate() fills it in from the model's own
        # generation config, so that is cleared too (the model instance belongs to this benchmark).
        self.model.generation_config.eos_token_id = None
        self._config_cls = GenerationConfig
        self.counter = ForwardCounter(model)

    def _generate(self, prompts: list[list[int]], num_tokens: int) -> tuple[Any, list[float]]:
        torch = self._torch
        from transformers.generation.streamers import BaseStreamer

        stamps: list[float] = []

        class _Clock(BaseStreamer):
            def put(self, value: Any) -> None:
                stamps.append(time.perf_counter())

            def end(self) -> None:
                pass

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=self._config_cls(
                    max_new_tokens=num_tokens,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=self.pad_token_id,
                ),
                streamer=_Clock(),
            )
        return out[:, width:], stamps

    def warmup(self, num_tokens: int) -> None:
        self._generate([[1, 2, 3, 4, 5, 6, 7, 8]], num_tokens)

    def run_turn(self, prompts: list[list[int]], num_tokens: int) -> TurnRun:
        before = self.counter.num_tokens
        c0 = time.process_time()
        t0 = time.perf_counter()
        new_ids, stamps = self._generate(prompts, num_tokens)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        # stamps[0] is the prompt handed to the streamer, stamps[1] the first generated token.
        ttft = stamps[1] - t0
        forwarded = self.counter.num_tokens - before
        return TurnRun(
            replies=[row.tolist() for row in new_ids],
            ttft_s=[ttft] * len(prompts),
            wall_s=wall,
            cpu_s=cpu,
            num_prefill_tokens=forwarded - len(prompts) * (num_tokens - 1),
        )

    def close(self) -> None:
        self.counter.close()


def run_on_manager(manager: Any, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    """Requests on a running transformers continuous batching manager, each recording its
    tokens' timestamps: request id -> finished output, in prompt order."""
    ids = manager.add_requests(inputs=prompts, max_new_tokens=max_new, record_timestamps=True)
    results: dict[str, Any] = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            results[result.request_id] = result
        elif result is None and not manager.is_running():
            raise RuntimeError("transformers' continuous batching loop stopped")
    return {rid: results[rid] for rid in ids}


class ContinuousBatchingSystem(System):
    """(d): transformers' continuous batching, the engine behind `model.generate_batch`.

    Configured like radixkv: page size = radixkv's block size, the same cache capacity, token
    budget and request bound. Block sharing (prefix caching of full pages by hash chain) is on.
    With `api="manager"` (default) one manager stays running across turns and each turn is
    `add_requests` + collecting the results, so no turn pays thread start/stop. With
    `api="generate_batch"` each turn is one `generate_batch(..., persistent_manager=True)` call
    (the page cache also survives between calls, but each call restarts the loop thread).
    TTFT is the first token's recorded timestamp minus the batch's submission time.
    """

    key = "d"

    def __init__(
        self,
        model: Any,
        *,
        page_size: int,
        num_blocks: int,
        max_batch_tokens: int,
        max_requests: int,
        api: str,
    ) -> None:
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        # The manager's warnings (persistent manager, flash attention missing) are expected here.
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
        self.model = model
        self.api = api
        # eos_token_id=-1: no stop token, every reply has exactly max_new_tokens tokens.
        self._gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
        self._cb_config = ContinuousBatchingConfig(
            page_size=page_size,
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_requests,
            allow_block_sharing=True,
            seed=0,
        )
        self.counter = ForwardCounter(model)
        self._cm: AbstractContextManager[Any] | None = None
        self._manager: Any = None
        if api == "manager":
            self._cm = model.continuous_batching_context_manager(
                generation_config=self._gen_config,
                continuous_batching_config=self._cb_config,
                block=True,
                timeout=10,
            )
            self._manager = self._cm.__enter__()

    def _generate(self, prompts: list[list[int]], num_tokens: int) -> dict[str, Any]:
        if self._manager is None:
            return self.model.generate_batch(
                prompts,
                generation_config=self._gen_config,
                continuous_batching_config=self._cb_config,
                record_timestamps=True,
                persistent_manager=True,
                max_new_tokens=num_tokens,
            )
        return run_on_manager(self._manager, prompts, num_tokens)

    def warmup(self, num_tokens: int) -> None:
        self._generate([[1, 2, 3, 4, 5, 6, 7, 8]], num_tokens)

    def run_turn(self, prompts: list[list[int]], num_tokens: int) -> TurnRun:
        before = self.counter.num_tokens
        c0 = time.process_time()
        t0 = time.perf_counter()
        results = list(self._generate(prompts, num_tokens).values())
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        for r in results:
            if r.error is not None:
                raise RuntimeError(f"continuous batching request failed: {r.error}")
        forwarded = self.counter.num_tokens - before
        return TurnRun(
            replies=[list(r.generated_tokens) for r in results],
            ttft_s=[r.timestamps[0] - t0 for r in results],
            wall_s=wall,
            cpu_s=cpu,
            num_prefill_tokens=forwarded - len(prompts) * (num_tokens - 1),
        )

    def close(self) -> None:
        if self._cm is not None:
            self._cm.__exit__(None, None, None)
        else:
            self.model.destroy_cached_continuous_batching_manager()
        self.counter.close()


# --------------------------------------------------------------------------------------------------
# Report


@dataclass(frozen=True, slots=True)
class Goal:
    text: str
    value: str
    met: bool


def evaluate_goals(results: dict[str, SystemResult]) -> list[Goal]:
    goals: list[Goal] = []
    a, b, c, d = (results.get(k) for k in "abcd")
    if a is not None and b is not None:
        ratio = a.total_prefill / max(b.total_prefill, 1)
        goals.append(
            Goal("prefill tokens computed (a) <= 15 % of (b)", f"{ratio:.1%}", ratio <= 0.15)
        )
    if a is not None and len(a.turns) >= 2:
        last = min(8, len(a.turns))
        ratio = _mean_ttft(a.turns[last - 1]) / _mean_ttft(a.turns[0])
        goals.append(
            Goal(f"turn-{last} TTFT <= 1.3x turn-1 TTFT for (a)", f"{ratio:.2f}x", ratio <= 1.3)
        )
    for other, limit in ((d, 0.5), (c, 0.25)):
        if a is not None and other is not None:
            ratio = a.total_wall_s / other.total_wall_s
            cpu = a.total_cpu_s / other.total_cpu_s
            value = f"{ratio:.2f}x (CPU time {cpu:.2f}x)"
            goals.append(Goal(f"total time (a) <= {limit}x ({other.key})", value, ratio <= limit))
    return goals


def _profile_table(results: dict[str, SystemResult], keys: list[str]) -> list[str]:
    parts: list[str] = []
    for k in keys:
        parts += [p for p in results[k].profile if p not in parts]
    header = ["part", *[SYSTEM_NAMES[k] for k in keys]]
    rows = []
    for part in [*parts, "other (engine Python, threads)"]:
        row = [part]
        for k in keys:
            prof, wall = results[k].profile, results[k].total_wall_s
            if part in prof:
                sec = prof[part]
            elif part.startswith("other") and prof:
                # Nested parts (indented) are inside "model forward"; do not count them twice.
                sec = wall - sum(v for p, v in prof.items() if not p.startswith(" "))
            else:
                row.append("-")
                continue
            row.append(f"{sec:.2f} ({sec / wall:.0%})")
        rows.append(row)
    return _table(header, rows)


def _mean_ttft(turn: TurnRun) -> float:
    return statistics.fmean(turn.ttft_s)


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(
        c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [_row(header, widths), _row(["-" * w for w in widths], widths)]
    lines += [_row(r, widths) for r in rows]
    return lines


def format_report(
    results: dict[str, SystemResult], prompt_tokens: list[int], reference: str
) -> str:
    keys = [k for k in "abcd" if k in results]
    names = [SYSTEM_NAMES[k] for k in keys]
    turns = range(len(prompt_tokens))
    out: list[str] = []

    def ratio(x: float, y: float, fmt: str) -> str:
        return format(x / y, fmt) if y else "-"

    # Prefill tokens computed.
    header = ["turn", "prompt tokens", *names]
    extra = "a" in results and "b" in results
    if extra:
        header.append("a/b")
    rows = []
    for t in turns:
        row = [str(t + 1), str(prompt_tokens[t])]
        row += [str(results[k].turns[t].num_prefill_tokens) for k in keys]
        if extra:
            a, b = results["a"].turns[t], results["b"].turns[t]
            row.append(ratio(a.num_prefill_tokens, b.num_prefill_tokens, ".1%"))
        rows.append(row)
    total = ["total", str(sum(prompt_tokens)), *[str(results[k].total_prefill) for k in keys]]
    if extra:
        total.append(ratio(results["a"].total_prefill, results["b"].total_prefill, ".1%"))
    rows.append(total)
    out.append("Prefill tokens computed (all conversations of the turn; (c) counts its padding)")
    out += _table(header, rows)

    # TTFT.
    header = ["turn", *names]
    if "a" in results:
        header.append("a/a[turn 1]")
    rows = []
    for t in turns:
        row = [str(t + 1)] + [f"{_mean_ttft(results[k].turns[t]) * 1e3:.0f}" for k in keys]
        if "a" in results:
            a = results["a"].turns
            row.append(ratio(_mean_ttft(a[t]), _mean_ttft(a[0]), ".2f"))
        rows.append(row)
    out += ["", "Time to first token, ms (mean over the turn's conversations, from submission)"]
    out += _table(header, rows)

    # Wall time.
    header = ["turn", *names]
    cmp = [k for k in "dc" if k in results and "a" in results]
    header += [f"a/{k}" for k in cmp]
    rows = []
    for t in turns:
        row = [str(t + 1)] + [f"{results[k].turns[t].wall_s:.2f}" for k in keys]
        a_wall = results["a"].turns[t].wall_s if cmp else 0.0
        row += [ratio(a_wall, results[k].turns[t].wall_s, ".2f") for k in cmp]
        rows.append(row)
    total = ["total"] + [f"{results[k].total_wall_s:.2f}" for k in keys]
    total += [ratio(results["a"].total_wall_s, results[k].total_wall_s, ".2f") for k in cmp]
    rows.append(total)
    cpu = ["CPU s"] + [f"{results[k].total_cpu_s:.2f}" for k in keys]
    cpu += [ratio(results["a"].total_cpu_s, results[k].total_cpu_s, ".2f") for k in cmp]
    rows.append(cpu)
    out += ["", "Wall time per turn, s (the whole batch); last row: the process's CPU time in all"]
    out += _table(header, rows)

    # Agreement of replies with the system that generated the history.
    ref = results[reference]
    parts = []
    for k in keys:
        same = sum(
            r == s
            for tr, ts in zip(results[k].turns, ref.turns, strict=True)
            for r, s in zip(tr.replies, ts.replies, strict=True)
        )
        num = sum(len(t.replies) for t in ref.turns)
        parts.append(f"{k} {same}/{num}")
    out += ["", f"Replies identical to ({reference})'s (greedy): " + ", ".join(parts)]

    goals = evaluate_goals(results)
    if goals:
        out += ["", "Goals"]
        out += [f"  [{'met' if g.met else 'MISSED'}] {g.text}: {g.value}" for g in goals]
    if any(results[k].profile for k in keys):
        out += [
            "",
            "Where the time goes (--profile; s over all turns, % of the system's wall time)",
        ]
        out += _profile_table(results, keys)
    notes = [f"  ({k}) {results[k].note}" for k in keys if results[k].note]
    if notes:
        out += ["", "Notes", *notes]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------
# Driver


def _load_hf_model() -> tuple[Any, Any]:
    """The embedded default model and tokenizer, loaded as plain transformers objects (a separate
    instance from radixkv's, which switches its model's attention implementation)."""
    from radixkv.engine.model_loader import load_model

    loaded = load_model(None)
    return loaded.model, loaded.tokenizer


def _cache_blocks(prompt_lengths: Sequence[int], reply_tokens: int, block_size: int) -> int:
    """Blocks to hold every conversation's whole history at once, twice over (nothing is evicted
    in any system, so eviction policy is not what is measured)."""
    per_conv = [-(-(n + reply_tokens) // block_size) for n in prompt_lengths]
    return 2 * sum(per_conv) + 64


def run(args: argparse.Namespace, say: Callable[[str], None]) -> str:
    import torch

    torch.set_num_threads(args.threads)
    keys = list(dict.fromkeys(args.systems))
    tokenizer = _load_hf_model()[1]

    # Final prompt lengths do not depend on reply contents: size every cache from a dry run.
    dry = ChatHistories(tokenizer, args.conversations)
    final: list[int] = []
    for _ in range(args.turns):
        final = [len(p) for p in dry.next_prompts()]
        dry.add_replies([[0] * args.reply_tokens for _ in final])
    num_blocks = _cache_blocks(final, args.reply_tokens, args.block_size)

    def make(key: str) -> System:
        if key in "ab":
            return RadixkvSystem(
                key,
                enable_prefix_cache=key == "a",
                block_size=args.block_size,
                num_blocks=num_blocks,
                max_batch_tokens=args.max_batch_tokens,
                max_requests=args.max_num_seqs,
                num_threads=args.threads,
            )
        # (c) and (d) get a model instance each: (d)'s manager may switch its attention.
        model = _load_hf_model()[0]
        if key == "c":
            return PlainGenerateSystem(model, pad_token_id=tokenizer.pad_token_id)
        return ContinuousBatchingSystem(
            model,
            page_size=args.block_size,
            num_blocks=num_blocks,
            max_batch_tokens=args.max_batch_tokens,
            max_requests=args.max_num_seqs,
            api=args.cb_api,
        )

    systems: dict[str, System] = {}
    prof = Profile() if args.profile else None
    results = {key: SystemResult(key) for key in keys}
    try:
        for key in keys:
            systems[key] = make(key)
            say(f"{SYSTEM_NAMES[key]}: warm-up")
            systems[key].warmup(args.reply_tokens)
        if prof is not None:
            for key, system in systems.items():
                parts = ["model forward", *system.profile_parts(prof)]
                results[key].profile = dict.fromkeys(parts, 0.0)

        # Turn by turn, every system in turn: a co-tenant's load spreads over all systems alike.
        # The first system's replies become the shared history the others replay.
        histories = ChatHistories(tokenizer, args.conversations)
        prompts_per_turn: list[list[list[int]]] = []
        for turn in range(args.turns):
            prompts_per_turn.append(histories.next_prompts())
            for key, system in systems.items():
                forward_s = system.counter.seconds
                if prof is not None:
                    prof.current = results[key].profile
                run_ = system.run_turn(prompts_per_turn[turn], args.reply_tokens)
                if prof is not None:
                    prof.current = None
                    results[key].profile["model forward"] += system.counter.seconds - forward_s
                results[key].turns.append(run_)
                if key == keys[0]:
                    histories.add_replies(run_.replies)
                say(
                    f"turn {turn + 1} {SYSTEM_NAMES[key]}: {run_.wall_s:.2f} s, "
                    f"{run_.num_prefill_tokens} prefill tokens"
                )
        for key, system in systems.items():
            if isinstance(system, RadixkvSystem):
                stats = system.llm.cache.stats()
                note = f"cache hit rate {stats.hit_rate:.1%}, {stats.num_nodes} tree nodes"
                if system.mismatches:
                    note += "; prefill tokens per turn " + ", ".join(system.mismatches)
                results[key].note = note
    finally:
        if prof is not None:
            prof.close()
        for system in systems.values():
            system.close()

    prompt_tokens = [sum(len(p) for p in turn) for turn in prompts_per_turn]
    return format_report(results, prompt_tokens, reference=keys[0])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="smoke test: 2 conversations x 3 turns")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--systems",
        default="abcd",
        help="which systems, in run order; the first generates the history (default abcd)",
    )
    p.add_argument(
        "--profile", action="store_true", help="time the parts of each system (model, kernels...)"
    )
    p.add_argument(
        "--block-size", type=int, default=16, help="radixkv block size = (d) page size (default 16)"
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=1024,
        help="tokens per step, radixkv and (d) (default 1024)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=16,
        help="requests per step, radixkv and (d) (default 16)",
    )
    p.add_argument(
        "--cb-api",
        choices=("manager", "generate_batch"),
        default="manager",
        help="(d): one manager running across turns, or one generate_batch call per turn",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.reply_tokens = 2, 3, 8
    if not set(args.systems) <= set("abcd") or not args.systems:
        p.error("--systems takes letters among a, b, c, d")
    for name in ("conversations", "turns", "reply_tokens", "threads", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    report = run(args, say)
    print(
        f"chat_bench: {args.conversations} conversations x {args.turns} turns, "
        f"{args.reply_tokens} reply tokens (greedy, EOS ignored), torch threads {args.threads}"
    )
    print(report)
    say(f"benchmark took {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

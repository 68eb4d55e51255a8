"""The client side of `serve_bench`: three workloads, sent with the official openai client.

- `chat`: N concurrent clients, each one conversation of T turns over one shared system prompt
  (the whole history in every request, as OpenAI clients send it), streamed chat completions.
- `shared-prefix`: SGLang's `bench_serving --dataset-name generated-shared-prefix` traffic,
  generated the same way: G groups of P prompts, each a group's random-token system prompt, two
  newlines and a random-token question; shuffled; sent at once with at most C in flight as
  streamed text completions with `ignore_eos`.
- `no-sharing`: the control: distinct random-token prompts, nothing shared, the same way.

Every request is greedy, so the replies of two servers on the same model can be compared text for
text: each reply carries a key naming its request (client and turn, or prompt index).
Random prompts draw from the vocabulary minus the special tokens with a seeded generator: the same
arguments give the same prompts on every server and every round.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

QUESTIONS = [
    "What is the capital of France?",
    "Name a river that flows through it.",
    "Give one fun fact about that river.",
    "How long is it, roughly?",
    "Which sea does it flow into?",
    "Name a famous bridge over it.",
    "Who built that bridge?",
    "Summarise our conversation in one sentence.",
]
TOPICS = ["France", "Italy", "Japan", "Egypt", "Peru", "Canada", "India", "Kenya"]
SHORT_SYSTEM = "You are a helpful assistant. Answer briefly."
# The long system prompt is built from these until it reaches the asked length: an assistant's
# house rules, each numbered, so that no two lines are the same text.
_RULE_SUBJECTS = ["geography", "history", "travel", "food", "rivers", "bridges", "cities", "maps"]
_RULE_ACTIONS = [
    "answer in one or two sentences and never invent sources",
    "name the country first, then the fact the user asked for",
    "prefer well-known facts over obscure ones and say when unsure",
    "give numbers with their units and round them sensibly",
    "keep a friendly tone and do not repeat the question",
    "mention at most one example unless the user asks for more",
]


@dataclass(frozen=True, slots=True)
class Reply:
    """One request's outcome as the client saw it."""

    key: str  # which request: the same on every server ("c3.t1", "g2.p5", "p7")
    text: str
    ttft_s: float  # request sent -> first content chunk
    num_prompt_tokens: int
    num_cached_tokens: int | None  # None: the server does not report it
    num_output_tokens: int


@dataclass(frozen=True, slots=True)
class Chat:
    """Concurrent multi-turn conversations over one shared system prompt."""

    clients: int
    turns: int
    max_tokens: int
    system: str
    name: str = "chat"

    def describe(self) -> str:
        return f"{self.clients} clients x {self.turns} turns, max {self.max_tokens} tokens a reply"

    async def run(self, client: Any, model: str, schema: dict | None = None) -> list[Reply]:
        convs = await asyncio.gather(
            *(self._conversation(client, model, i, schema) for i in range(self.clients))
        )
        return [reply for conv in convs for reply in conv]

    async def _conversation(
        self, client: Any, model: str, index: int, schema: dict | None
    ) -> list[Reply]:
        messages = [{"role": "system", "content": self.system}]
        replies = []
        for turn in range(self.turns):
            messages.append({"role": "user", "content": user_message(index, turn)})
            extra = {} if schema is None else {"response_format": schema}
            reply = await stream_chat(
                client, model, f"c{index}.t{turn}", messages, self.max_tokens, extra
            )
            messages.append({"role": "assistant", "content": reply.text})
            replies.append(reply)
        return replies


@dataclass(frozen=True, slots=True)
class Completions:
    """Independent text completions, all sent at once with at most `concurrency` in flight."""

    name: str
    prompts: tuple[tuple[str, str], ...]  # (key, prompt text), in sending order
    max_tokens: int
    concurrency: int
    summary: str

    def describe(self) -> str:
        return f"{self.summary}, {self.max_tokens} tokens out, {self.concurrency} in flight"

    async def run(self, client: Any, model: str, schema: dict | None = None) -> list[Reply]:
        del schema  # text completions: the schema mode is the chat's
        slots = asyncio.Semaphore(self.concurrency)

        async def one(key: str, prompt: str) -> Reply:
            async with slots:
                return await stream_completion(client, model, key, prompt, self.max_tokens)

        return list(await asyncio.gather(*(one(key, text) for key, text in self.prompts)))


def user_message(client: int, turn: int) -> str:
    question = QUESTIONS[turn % len(QUESTIONS)]
    topic = TOPICS[client % len(TOPICS)]
    return question.replace("France", topic) + f" (client {client})"


def long_system_prompt(tokenizer: Any, num_tokens: int) -> str:
    """House rules, numbered, until the text is at least `num_tokens` tokens long."""
    lines = ["You are a helpful assistant for a travel and geography service. House rules:"]
    i = 0
    while len(tokenizer.encode("\n".join(lines))) < num_tokens:
        subject = _RULE_SUBJECTS[i % len(_RULE_SUBJECTS)]
        action = _RULE_ACTIONS[(i // len(_RULE_SUBJECTS)) % len(_RULE_ACTIONS)]
        lines.append(f"{i + 1}. For questions about {subject}, {action}.")
        i += 1
    return "\n".join(lines)


def random_text(tokenizer: Any, num_tokens: int, rng: random.Random) -> str:
    """SGLang's `gen_prompt`: the text of `num_tokens` token ids drawn from the vocabulary (its
    special tokens left out, so that no server reads a drawn `<|im_end|>` as one)."""
    return tokenizer.decode(rng.choices(_plain_token_ids(tokenizer), k=num_tokens))


def _plain_token_ids(tokenizer: Any) -> list[int]:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return sorted(i for i in tokenizer.get_vocab().values() if i not in special)


def shared_prefix(
    tokenizer: Any,
    *,
    groups: int,
    prompts_per_group: int,
    system_tokens: int,
    question_tokens: int,
    max_tokens: int,
    concurrency: int,
    seed: int,
) -> Completions:
    """SGLang's generated-shared-prefix traffic (`bench_serving`, range ratio 1, one turn)."""
    rng = random.Random(seed)
    systems = [random_text(tokenizer, system_tokens, rng) for _ in range(groups)]
    prompts = [
        (f"g{g}.p{p}", f"{systems[g]}\n\n{random_text(tokenizer, question_tokens, rng)}")
        for g in range(groups)
        for p in range(prompts_per_group)
    ]
    rng.shuffle(prompts)
    summary = (
        f"{groups} groups x {prompts_per_group} prompts, {system_tokens}-token system prompt + "
        f"{question_tokens}-token question"
    )
    return Completions("shared-prefix", tuple(prompts), max_tokens, concurrency, summary)


def no_sharing(
    tokenizer: Any,
    *,
    prompts: int,
    prompt_tokens: int,
    max_tokens: int,
    concurrency: int,
    seed: int,
) -> Completions:
    """Distinct random-token prompts: no prefix a cache could serve."""
    rng = random.Random(seed)
    texts = tuple((f"p{i}", random_text(tokenizer, prompt_tokens, rng)) for i in range(prompts))
    summary = f"{prompts} distinct {prompt_tokens}-token prompts"
    return Completions("no-sharing", texts, max_tokens, concurrency, summary)


async def stream_chat(
    client: Any, model: str, key: str, messages: Sequence[dict], max_tokens: int, extra: dict
) -> Reply:
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model,
        messages=list(messages),
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    return await _collect(stream, key, t0, lambda choice: choice.delta.content)


async def stream_completion(
    client: Any, model: str, key: str, prompt: str, max_tokens: int
) -> Reply:
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    return await _collect(stream, key, t0, lambda choice: choice.text)


async def _collect(stream: Any, key: str, t0: float, text_of: Any) -> Reply:
    parts: list[str] = []
    ttft = None
    usage = None
    async for chunk in stream:
        text = text_of(chunk.choices[0]) if chunk.choices else None
        if text:
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(text)
        usage = chunk.usage or usage
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return Reply(
        key=key,
        text="".join(parts),
        ttft_s=ttft if ttft is not None else time.perf_counter() - t0,
        num_prompt_tokens=usage.prompt_tokens if usage else 0,
        num_cached_tokens=getattr(details, "cached_tokens", None) if details else None,
        num_output_tokens=usage.completion_tokens if usage else len(parts),
    )

"""`n` > 1 through a live server and the real `openai` client: choices with their index, whole
and streamed; the prompt counted once in the usage; choice i as a request seeded with seed + i;
the prompt cached after; too many choices, or too many tokens for the cache, get
a 400 naming `n`."""

from __future__ import annotations

import pytest
from serve_helpers import user_message

openai = pytest.importorskip("openai")  # a test extra: absent on the GPU machine

# Long enough for in-batch prefix caching (over the engine's defer_shared_prefix_tokens).
MESSAGES = [{"role": "user", "content": user_message(7, n=60)}]
SEED = 41


def chat(client, **kwargs):
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 1.0} | kwargs
    return client.chat.completions.create(seed=SEED, extra_body={"ignore_eos": True}, **kwargs)


def test_choices_follow_their_seeds_and_count_the_prompt_once(server):
    client = server.client()
    reply = chat(client, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    singles = [
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=6,
            temperature=1.0,
            seed=SEED + i,
            extra_body={"ignore_eos": True},
        )
        for i in range(3)
    ]
    assert [c.message.content for c in reply.choices] == [
        s.choices[0].message.content for s in singles
    ]
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == 3 * 6
    assert len({c.message.content for c in reply.choices}) > 1


def test_streamed_choices_carry_their_index(server):
    client = server.client()
    whole = chat(client, n=2)
    texts = ["", ""]
    finished = [None, None]
    chunks = list(chat(client, n=2, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finished[c.index] = c.finish_reason or finished[c.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finished == ["length", "length"]
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 12


def test_completions_choices_come_with_their_index_and_leave_the_prompt_cached(server):
    client = server.client()
    prompt = user_message(8, n=60)
    done = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, n=4, temperature=1.0, seed=3
    )
    assert sorted(c.index for c in done.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in done.choices)
    num_prompt = done.usage.prompt_tokens
    assert server.on_engine(lambda llm: llm.cache.stats()).num_in_use_blocks == 0
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == num_prompt - 1


@pytest.mark.parametrize(("n", "max_tokens"), [(17, 4), (16, 900)])
def test_too_many_choices_or_tokens_get_400_naming_n(server, n, max_tokens):
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, n=n, max_tokens=max_tokens)
    assert info.value.body["param"] == "n"

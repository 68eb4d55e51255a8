"""Continuous batching across HTTP requests: many concurrent multi-turn clients, nothing lost,
every greedy reply equal to the same request run alone."""

from __future__ import annotations

import asyncio

from serve_helpers import metric, read_metrics, render_chat, run_alone, user_message

NUM_CLIENTS = 32
NUM_TURNS = 4
MAX_TOKENS = 4


async def conversation(client, index: int) -> list[tuple[list[dict[str, str]], object]]:
    """One client's turns: (messages sent, reply) per turn."""
    messages = [{"role": "system", "content": user_message(index, n=3)}]
    turns = []
    for turn in range(NUM_TURNS):
        messages.append({"role": "user", "content": user_message(1000 + index * 10 + turn, n=4)})
        stream = turn % 2 == 1  # half the turns stream
        kwargs = dict(model="tiny", messages=messages, temperature=0, max_tokens=MAX_TOKENS)
        if stream:
            chunks = await client.chat.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}
            )
            parts, finish, usage = [], None, None
            async for chunk in chunks:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
                usage = chunk.usage or usage
            reply = ("".join(parts), finish, usage)
        else:
            r = await client.chat.completions.create(**kwargs)
            reply = (r.choices[0].message.content, r.choices[0].finish_reason, r.usage)
        turns.append((list(messages), reply))
        messages.append({"role": "assistant", "content": reply[0]})
    return turns


def test_concurrent_multi_turn_clients_lose_nothing_and_match_runs_alone(
    make_server, reference_llm
) -> None:
    server = make_server({"max_num_seqs": 16})

    async def run_all():
        client = server.async_client(max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(conversation(client, i) for i in range(NUM_CLIENTS)))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    assert len(results) == NUM_CLIENTS
    assert all(len(turns) == NUM_TURNS for turns in results)
    cached_later_turns = 0
    for turns in results:
        for turn, (messages, (text, finish, usage)) in enumerate(turns):
            prompt = render_chat(reference_llm.tokenizer, messages)
            alone = run_alone(reference_llm, prompt, MAX_TOKENS)
            assert (text, finish) == (alone.text, alone.finish_reason), (messages, text)
            assert usage.prompt_tokens == len(prompt)
            if turn > 0:
                cached_later_turns += usage.prompt_tokens_details.cached_tokens
    assert cached_later_turns > 0
    samples = read_metrics(server.base_url)
    finished = sum(metric(samples, "radixkv_requests_total", outcome=o) for o in ("stop", "length"))
    assert finished == NUM_CLIENTS * NUM_TURNS
    assert metric(samples, "radixkv_requests_total", outcome="error") == 0
    assert metric(samples, "radixkv_blocks", state="in_use") == 0
    server.on_engine(lambda llm: llm.cache.check_integrity())

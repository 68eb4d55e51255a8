"""A three-turn chat through the Python API: each turn's prompt extends the previous prompt and
reply, so the status line shows the cache serving almost all of it.

Runs on CPU with the embedded default model (the first use converts it once, about 20 s;
later starts take seconds). Run it as `.venv/bin/python examples/chat_example.py`.
"""

from __future__ import annotations

from radixkv import LLM, ChatSession, SamplingParams


def main() -> None:
    llm = LLM()  # embedded SmolLM2-135M-Instruct
    chat = ChatSession(
        llm, system="You are a concise assistant.", params=SamplingParams(max_tokens=40)
    )
    for message in (
        "What is the capital of France?",
        "And of Italy?",
        "Which of the two cities is older?",
    ):
        reply = chat.send(message)
        s = reply.stats
        print(f"you> {message}\nassistant> {reply.text}")
        print(
            f"  [prompt {s.num_prompt_tokens} tok, cached {s.num_cached_tokens},"
            f" ttft {1000 * s.ttft_s:.0f} ms, {s.decode_tokens_per_s:.1f} tok/s]"
        )
    print(f"cache hit rate over the session: {llm.cache.stats().hit_rate:.0%}")


if __name__ == "__main__":
    main()

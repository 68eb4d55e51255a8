"""ChatSession mechanics on a tiny model (the real-model check is in test_smollm2_e2e.py)."""

from __future__ import annotations

import pytest

from radixkv import LLM, ChatReply, ChatSession, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("gqa")), block_size=4, num_blocks=256)


def test_turns_extend_the_previous_prompt_and_hit_the_cache(llm):
    chat = ChatSession(llm, system="w10 w11", params=SamplingParams(max_tokens=8))
    previous: list[int] = []  # last turn's prompt + reply tokens
    for turn, message in enumerate(["w20 w21 w22", "w30", "w31 w32"]):
        prompt = chat.prompt_token_ids(message)
        # The template re-renders the previous prompt + reply token for token ...
        assert prompt[: len(previous)] == previous
        reply = chat.send(message)
        assert isinstance(reply, ChatReply) and reply.token_ids
        assert reply.stats.num_prompt_tokens == len(prompt)
        if turn > 0:
            # ... so everything but the previous reply's last token (no KV yet) is a cache hit.
            assert chat.num_reused_tokens == len(previous)
            assert reply.stats.num_cached_tokens == len(previous) - 1
        previous = [*prompt, *reply.token_ids]
    roles = [m["role"] for m in chat.history]
    assert roles == ["system"] + ["user", "assistant"] * 3
    assert chat.history[-1]["content"] == reply.text
    assert chat.last_reply is reply


def test_stream_then_last_reply(llm):
    chat = ChatSession(llm, params=SamplingParams(max_tokens=6))
    pieces = list(chat.stream("w40 w41"))
    assert "".join(pieces) == chat.last_reply.text
    assert chat.history[-1] == {"role": "assistant", "content": chat.last_reply.text}
    chat.reset()
    assert chat.history == [] and chat.last_reply is None


def test_bad_messages_leave_the_history_unchanged(llm):
    chat = ChatSession(llm, params=SamplingParams(max_tokens=3))
    chat.send("w50")
    before = chat.history
    with pytest.raises(ValueError, match="empty"):
        chat.send("   ")
    with pytest.raises(TypeError, match="str"):
        chat.send(["w50"])
    assert chat.history == before
    chat.send("w51")
    assert len(chat.history) == len(before) + 2

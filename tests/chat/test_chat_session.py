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


def test_context_limit_drops_the_oldest_turns_and_keeps_the_system_prompt(tmp_path):
    from tiny_llama import build_model, build_tokenizer

    folder = tmp_path / "short-context"
    build_model("gqa", max_position_embeddings=64).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    llm = LLM(str(folder), block_size=4, num_blocks=128)
    chat = ChatSession(llm, system="w10 w11", params=SamplingParams(max_tokens=8))
    dropped = []
    for turn in range(12):
        message = f"w{20 + turn} w{40 + turn} w{60 + turn}"
        before = chat.history
        reply = chat.send(message)  # never fails, however long the conversation
        assert reply.stats.num_prompt_tokens + 8 <= 64
        dropped.append(chat.dropped_turns)
        history = chat.history
        assert history[0] == {"role": "system", "content": "w10 w11"}
        assert [m["role"] for m in history[1:]] == ["user", "assistant"] * ((len(history) - 1) // 2)
        # The oldest turns went, the newest stayed in order, and this turn was added.
        kept = before[1 + 2 * chat.dropped_turns :]
        assert history[1:-2] == kept and history[-2]["content"] == message
    assert dropped[0] == 0 and sum(dropped) > 0
    llm.cache.check_integrity()


def test_interrupted_reply_keeps_the_conversation_and_the_engine(llm, monkeypatch):
    chat = ChatSession(llm, system="w10", params=SamplingParams(max_tokens=12))
    chat.send("w20 w21")
    before = chat.history
    real_execute = llm.runner.execute
    calls = 0

    def ctrl_c_on_third_step(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(llm.runner, "execute", ctrl_c_on_third_step)
    pieces = []
    with pytest.raises(KeyboardInterrupt):
        for piece in chat.stream("w30 w31"):
            pieces.append(piece)
    assert pieces  # the reply had started
    assert chat.history == before  # the interrupted turn is not kept
    assert llm.cache.stats().num_in_use_blocks == 0
    llm.cache.check_integrity()
    reply = chat.send("w30 w31")  # and the next turn works
    assert reply.token_ids and chat.history[-2:] == [
        {"role": "user", "content": "w30 w31"},
        {"role": "assistant", "content": reply.text},
    ]


def test_undecodable_input_is_rejected_with_a_clear_message(llm):
    chat = ChatSession(llm, params=SamplingParams(max_tokens=3))
    line = b"w10 \xff w11".decode("utf-8", errors="surrogateescape")
    with pytest.raises(ValueError, match="not valid UTF-8 text"):
        chat.send(line)
    assert chat.history == []
    assert chat.send("w10 w11").token_ids

"""End to end on the real default model (SmolLM2-135M-Instruct, embedded GGUF converted once into
the user cache dir): a 3-turn chat whose greedy replies equal plain transformers generation on the
same full histories, and whose turns 2 and 3 are served from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from radixkv import LLM, ChatSession, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 40
SYSTEM = "You are a concise assistant. Answer in one or two sentences."
TURNS = [
    "What is the capital of France?",
    "And what river flows through it?",
    "Name one famous museum there.",
]


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(block_size=16)


@pytest.fixture(scope="module")
def reference_model(llm):
    """An independent copy of the same weights with transformers' own attention."""
    from transformers import AutoModelForCausalLM

    from radixkv.bundled_model import converted_dir

    return AutoModelForCausalLM.from_pretrained(
        converted_dir(), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


def test_three_turn_chat_matches_transformers_and_hits_the_cache(llm, reference_model):
    tok = llm.tokenizer
    chat = ChatSession(llm, system=SYSTEM, params=SamplingParams(max_tokens=MAX_TOKENS))
    previous: list[int] = []  # last turn's prompt + reply tokens
    for turn, message in enumerate(TURNS):
        messages = [*chat.history, {"role": "user", "content": message}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            expected = reference_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )[0, len(prompt) :].tolist()

        reply = chat.send(message)

        assert list(reply.token_ids) == expected, f"turn {turn + 1}: {reply.text!r}"
        assert reply.stats.num_prompt_tokens == len(prompt)
        assert reply.text.strip()
        if turn == 0:
            assert "Paris" in reply.text
        else:
            # The new prompt extends the previous prompt + reply ...
            assert prompt[: len(previous)] == previous
            # ... and all of it but the reply's last token (sampled, never run) is cached.
            assert reply.stats.num_cached_tokens >= len(previous) - 1
        previous = [*prompt, *reply.token_ids]
    llm.cache.check_integrity()


def test_streamed_text_equals_the_final_text(llm):
    prompt = "Write the word café and one emoji."
    deltas = list(llm.stream(prompt, SamplingParams(max_tokens=24)))
    out = deltas[-1].output
    assert out is not None
    assert "".join(d.text for d in deltas) == out.text
    assert all("\ufffd" not in d.text for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == list(out.token_ids)


def test_a_json_schema_reply_of_the_real_model_validates(llm):
    """xgrammar's TokenizerInfo from the real byte-level BPE tokenizer (49,152 ids)."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "river": {"type": "string"}},
        "required": ["city", "river"],
        "additionalProperties": False,
    }
    prompt = llm.encode_chat(
        [{"role": "user", "content": "Name the capital of France and its river."}]
    )
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=60, json_schema=schema))
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)
    llm.check_integrity()

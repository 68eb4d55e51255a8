"""`SamplingParams(n=...)`: a prompt's n choices come one after another, share its prefill
through the tree (the others hit all but its last token), choice i of a seeded request samples
as a request seeded with seed + i, and every block comes back."""

from __future__ import annotations

import pytest
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams

PROMPTS = random_prompts(9, 2, min_len=40, max_len=60)  # over defer_shared_prefix_tokens


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir("gqa")), block_size=8, num_blocks=128)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_choices_share_the_prefill_and_follow_their_seeds(tiny_model_dir, async_scheduling):
    llm = LLM(
        str(tiny_model_dir("gqa")), block_size=8, num_blocks=128, async_scheduling=async_scheduling
    )
    params = SamplingParams(n=4, temperature=1.0, seed=2**64 - 2, max_tokens=6, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    llm.check_integrity()
    assert llm.cache.stats().num_in_use_blocks == 0
    assert len(outs) == 8
    for p, prompt in enumerate(PROMPTS):
        choices = outs[4 * p : 4 * p + 4]
        assert all(list(c.prompt_token_ids) == prompt for c in choices)
        # The first computes the prompt; the others hit all of it but its last token.
        assert [c.stats.num_cached_tokens for c in choices] == [0] + [len(prompt) - 1] * 3
        for i, c in enumerate(choices):
            seed = (params.seed + i) % 2**64
            alone = SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True)
            (expected,) = llm.generate([prompt], alone)
            assert c.token_ids == expected.token_ids
        assert len({c.token_ids for c in choices}) > 1  # distinct streams


def test_greedy_choices_are_all_the_greedy_reply(llm):
    (one,) = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=5, ignore_eos=True))
    three = llm.generate(PROMPTS[:1], SamplingParams(n=3, max_tokens=5, ignore_eos=True))
    assert [o.token_ids for o in three] == [one.token_ids] * 3


def test_n_is_checked_at_the_door(llm):
    for bad, error in ((0, ValueError), (129, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error):
            SamplingParams(n=bad)
    with pytest.raises(ValueError, match="n > 1"):
        llm.add_request(PROMPTS[0], SamplingParams(n=2))
    assert not llm.has_unfinished_requests()

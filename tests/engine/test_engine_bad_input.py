"""Bad input is refused up front with a clear error, and the engine stays usable afterwards."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import VOCAB_SIZE, random_prompts

from radixkv import LLM, ModelNotFoundError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("gqa")), block_size=4, num_blocks=64)


@pytest.fixture(scope="module")
def good_prompt():
    return random_prompts(21, 1, max_len=10)[0]


def assert_still_usable(llm: LLM, prompt: list[int]) -> None:
    assert not llm.scheduler.has_unfinished()
    assert not llm._tracked
    llm.check_integrity()
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4
    llm.check_integrity()


@pytest.mark.parametrize(
    ("prompts", "error", "match"),
    [
        ("", ValueError, "empty"),
        ([], ValueError, "empty"),
        ([[]], ValueError, "empty"),
        (["w7 w8", ""], ValueError, "prompt 1"),
        ([5, VOCAB_SIZE], ValueError, "outside the vocabulary"),
        ([[5, 6], [7, -1]], ValueError, "prompt 1.*outside the vocabulary"),
        ([[5, 6], [7, 10**9]], ValueError, "outside the vocabulary"),
        ([5, True], TypeError, "ints"),
        ([[5, 6.0]], TypeError, "ints"),
        (42, TypeError, "prompts must be"),
        ([None], TypeError, "prompt 0"),
        ([1] * 1024, ValueError, "context"),
        (b"\x05\x06", TypeError, "prompt 0"),
        ([b"ab"], TypeError, "prompt 0"),
        ({5, 6}, TypeError, "prompts must be"),
        ([5, {6: 7}], TypeError, "prompt 0"),
        ([{5, 6}], TypeError, "prompt 0"),
    ],
    ids=[
        "empty string",
        "empty list",
        "empty token list",
        "one empty of two",
        "id == vocab",
        "negative id",
        "huge id",
        "bool id",
        "float id",
        "int prompt",
        "None prompt",
        "longer than the model",
        "bytes",
        "bytes prompt",
        "set",
        "dict id",
        "set prompt",
    ],
)
def test_bad_prompts(llm, good_prompt, prompts, error, match):
    with pytest.raises(error, match=match):
        llm.generate(prompts, SamplingParams(max_tokens=4))
    assert_still_usable(llm, good_prompt)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(max_tokens=0), ValueError, "max_tokens"),
        (dict(max_tokens=-3), ValueError, "max_tokens"),
        (dict(max_tokens=2.5), TypeError, "max_tokens"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_p=-0.1), ValueError, "top_p"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=float("inf")), ValueError, r"temperature must be in \[0, inf\)"),
        (dict(temperature=float("nan")), ValueError, r"temperature must be in \[0, inf\)"),
        (dict(temperature=True), TypeError, "temperature must be a number"),
        (dict(top_p=float("inf")), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p=float("nan")), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), ValueError, "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("params", "error", "match"),
    [
        ({"max_tokens": 4}, TypeError, "SamplingParams"),
        ("greedy", TypeError, "SamplingParams"),
        ([SamplingParams()], ValueError, "1 SamplingParams for 2 prompts"),
        ([SamplingParams(), "greedy"], TypeError, r"params\[1\]"),
    ],
)
def test_bad_params_argument(llm, good_prompt, params, error, match):
    with pytest.raises(error, match=match):
        llm.generate([good_prompt, good_prompt], params)
    assert_still_usable(llm, good_prompt)


def test_a_prompt_larger_than_the_cache_admits_nothing(llm, good_prompt):
    too_big = random_prompts(22, 1, min_len=300, max_len=300)[0]  # 64 blocks x 4 = 256 slots
    with pytest.raises(ValueError):
        llm.generate([good_prompt, too_big], SamplingParams(max_tokens=4))
    assert_still_usable(llm, good_prompt)


def test_stream_validates_before_iterating(llm, good_prompt):
    with pytest.raises(ValueError, match="empty"):
        llm.stream([], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="one prompt"):
        llm.stream([[5, 6], [7, 8]])
    assert_still_usable(llm, good_prompt)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="cannot load model"):
        LLM(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelNotFoundError, match="no loadable"):
        LLM(str(tmp_path))  # exists, but holds no model
    assert issubclass(ModelNotFoundError, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size="16"), TypeError, "block_size"),
        (dict(policy="random"), ValueError, "policy"),
        (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
        (dict(num_blocks=0), ValueError, "num_blocks"),
        (dict(kv_cache_bytes=10), ValueError, "holds no KV block"),
        (dict(device="gpu0"), ValueError, "device must be a torch device"),
        (dict(device=1.5), TypeError, "device must be a torch device"),
        (dict(device=f"cuda:{torch.cuda.device_count()}"), ValueError, "CUDA devices"),
    ],
)
def test_bad_engine_arguments(tiny_model_dir, kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM(str(tiny_model_dir("gqa")), **kwargs)


def test_seed_range_is_named(tiny_model_dir):
    SamplingParams(temperature=1.0, seed=2**64 - 1)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
        SamplingParams(temperature=1.0, seed=2**64)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
        LLM(str(tiny_model_dir("gqa")), seed=2**64)
    llm = LLM(str(tiny_model_dir("gqa")), block_size=4, num_blocks=16, seed=2**64 - 1)
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=2**64 - 1, ignore_eos=True)
    (out,) = llm.generate([[5, 6, 7]], params)  # the largest seeds sample
    assert len(out.token_ids) == 3


SIZES = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "seed")


@pytest.mark.parametrize("name", [*SIZES, "chunked_prefill_size", "kv_cache_bytes"])
def test_size_arguments_are_checked_alike(tiny_model_dir, name):
    with pytest.raises(TypeError, match=f"{name} must be an int, got str"):
        LLM(str(tiny_model_dir("gqa")), **{name: "8"})


def test_numpy_ints_are_sizes_everywhere(tiny_model_dir):
    import numpy as np

    sizes = dict(block_size=4, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64, seed=3)
    llm = LLM(str(tiny_model_dir("gqa")), **{k: np.int64(v) for k, v in sizes.items()})
    assert llm.cache.num_blocks == 64 and type(llm.cache.num_blocks) is int
    assert llm.cache.block_size == 4 and llm.config.max_num_seqs == 2
    assert type(llm.cache.block_size) is int and type(llm.config.seed) is int
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out.token_ids) == 2

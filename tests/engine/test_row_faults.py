"""A fault that belongs to one row of a step fails that request alone (issue 20, F6): the step's
other rows go on and finish exactly as they would have without it, every block and lock comes
back, and the engine keeps serving.

Faults of one row: NaN logits of one request on a decode step (its draw fails), a fault in the
sampler's shared work that only one request's params trigger (found by sampling each row alone),
a fault in one request's detokenizer.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tiny_llama import random_prompts

import radixkv.engine.sampling.sampler as sampler_module
from radixkv import LLM, SamplingParams
from radixkv.engine.model.detokenizer import IncrementalDetokenizer

ENGINE_ARGS = dict(block_size=4, num_blocks=128, max_num_seqs=8)
PROMPTS = random_prompts(77, 6, shared_prefix=6, max_len=16)
GUILTY = 2
PARAMS = [
    SamplingParams(max_tokens=10, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=1.0, seed=666, ignore_eos=True),  # the guilty one
    SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=6, ignore_eos=True),
    SamplingParams(max_tokens=10, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=1.2, seed=7, ignore_eos=True),
]
INNOCENT = [i for i in range(len(PROMPTS)) if i != GUILTY]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("gqa"))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlapped"])
def llm(model_dir, request):
    """Both step modes: overlapped, a row's fault is known one step late, and the outcome must
    be the same."""
    return LLM(model_dir, async_scheduling=request.param, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def expected(model_dir):
    outs = LLM(model_dir, **ENGINE_ARGS).generate(PROMPTS, PARAMS)
    return [o.token_ids for o in outs]


def run_all(llm: LLM, added: Callable[[list[str]], object] = lambda ids: None):
    """Every prompt through the step API, `added(ids)`, then steps to the end; (ids, final
    update by id)."""
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS, strict=True)]
    added(ids)
    finals = {}
    while llm.has_unfinished_requests():
        for update in llm.step():
            if update.output is not None:
                finals[update.request_id] = update
        llm.check_integrity()
    return ids, finals


def assert_only_the_guilty_failed(llm: LLM, expected, ids, finals, exc_type) -> None:
    guilty = finals[ids[GUILTY]]
    assert guilty.output.finish_reason == "error" and isinstance(guilty.error, exc_type)
    for i in INNOCENT:
        final = finals[ids[i]]
        assert final.error is None, (i, final.error)
        assert final.output.token_ids == expected[i], i
    llm.check_integrity()
    assert llm.cache.stats().num_in_use_blocks == 0
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected  # still serving


def test_nan_logits_of_one_request_on_a_decode_step_fail_it_alone(llm, expected) -> None:
    real_execute = llm.runner.execute
    guilty: list[str] = []
    poisoned: list[set[str]] = []  # the sampled rows of each step whose logits were poisoned

    def execute(out, feed=None):
        logits = real_execute(out, feed).clone()
        sampled = [row.request_id for row in out.rows if row.sample]
        for j, rid in enumerate(sampled):
            output = llm.scheduler.get_request(rid).output_token_ids  # placeholders included
            if rid in guilty and len(output) == 3:
                logits[j] = float("nan")  # its 4th token
                poisoned.append(set(sampled))
        return logits

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm.runner, "execute", execute)
        ids, finals = run_all(llm, lambda ids: guilty.append(ids[GUILTY]))
    assert poisoned == [set(ids)]  # all six were in that decode step
    assert len(finals[ids[GUILTY]].output.token_ids) == 3
    assert_only_the_guilty_failed(llm, expected, ids, finals, RuntimeError)


def test_a_fault_in_the_shared_sampling_work_is_narrowed_to_its_row(llm, expected) -> None:
    real = sampler_module._filtered_probs
    calls = []

    def filtered_probs(logits: torch.Tensor, params):
        calls.append(len(params))
        if any(p.seed == 666 for p in params) and len(calls) > 3:
            raise ValueError("injected: seed 666 breaks the sampler")
        return real(logits, params)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler_module, "_filtered_probs", filtered_probs)
        ids, finals = run_all(llm)
    assert 4 in calls  # the four sampled rows shared a call before the one that failed
    assert_only_the_guilty_failed(llm, expected, ids, finals, ValueError)


def test_a_fault_in_one_requests_detokenizer_fails_it_alone(llm, expected) -> None:
    real_push = IncrementalDetokenizer.push
    guilty: list[IncrementalDetokenizer] = []
    pushes = [0]

    def push(self, new_ids):
        if self in guilty:
            pushes[0] += 1
            if pushes[0] == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_push(self, new_ids)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(IncrementalDetokenizer, "push", push)
        ids, finals = run_all(llm, lambda ids: guilty.append(llm._tracked[ids[GUILTY]].detok))
    assert len(finals[ids[GUILTY]].output.token_ids) == 3  # the update has its token
    assert_only_the_guilty_failed(llm, expected, ids, finals, UnicodeDecodeError)

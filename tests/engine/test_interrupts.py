"""A real Ctrl-C (SIGINT) while the engine works lands after the operation in flight, never inside
it: the cache update runs to its end, the KeyboardInterrupt comes just after, every block and lock
comes back, and the engine's next outputs equal a fresh engine's."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from processes import ctrl_c_inside
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams
from radixkv.cache import PrefixCache
from radixkv.engine.interrupts import sigint_deferred

ENGINE_ARGS = dict(block_size=4, num_blocks=64, max_num_seqs=2, chunked_prefill_size=8)
PROMPTS = random_prompts(61, 3, shared_prefix=6, max_len=20)
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("gqa"))


@pytest.fixture(params=[False, True], ids=["sync", "overlapped"])
def engine_args(request):
    return {**ENGINE_ARGS, "async_scheduling": request.param}


@pytest.fixture(scope="module")
def expected(model_dir):
    return [o.token_ids for o in LLM(model_dir, **ENGINE_ARGS).generate(PROMPTS, PARAMS)]


def assert_idle_and_whole(llm: LLM) -> None:
    llm.check_integrity()
    assert llm.cache.stats().num_in_use_blocks == 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_in_generate_lands_after_the_step(
    engine_args, model_dir, expected, monkeypatch, python_sigint
):
    llm = LLM(model_dir, **engine_args)
    commit = ctrl_c_inside(monkeypatch, PrefixCache, "commit", at=3)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS)
    assert commit.started and commit.finished  # the commit ran to its end
    assert not llm.has_unfinished_requests()  # generate aborted its requests
    assert_idle_and_whole(llm)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    assert_idle_and_whole(llm)


def test_a_second_ctrl_c_while_generate_aborts_its_requests_aborts_them_all(
    engine_args, model_dir, expected, monkeypatch, python_sigint
):
    """generate's clean-up aborts each of its requests; a Ctrl-C during the first abort must not
    leave the others running with nobody to read them."""
    from radixkv.scheduler import Scheduler

    llm = LLM(model_dir, **engine_args)
    ctrl_c_inside(monkeypatch, PrefixCache, "commit", at=2)
    aborts = ctrl_c_inside(monkeypatch, Scheduler, "abort")
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS)
    assert aborts.calls == len(PROMPTS)
    assert not llm.has_unfinished_requests()
    monkeypatch.undo()
    assert_idle_and_whole(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected


def test_ctrl_c_in_step_keeps_the_step_and_its_updates(
    engine_args, model_dir, expected, monkeypatch, python_sigint
):
    """The step the Ctrl-C arrived in completes; step() raises after it, and its updates come
    with the next call: the requests finish exactly as without the interrupt."""
    llm = LLM(model_dir, **engine_args)
    ids = [llm.add_request(p, PARAMS) for p in PROMPTS]
    commit = ctrl_c_inside(monkeypatch, PrefixCache, "commit", at=4)
    outputs, interrupts = {}, 0
    while llm.has_unfinished_requests():
        try:
            updates = llm.step()
        except KeyboardInterrupt:
            interrupts += 1
            llm.check_integrity()
            continue
        outputs.update((u.request_id, u.output.token_ids) for u in updates if u.output)
        llm.check_integrity()
    assert interrupts == 1 and commit.started and commit.finished
    assert [outputs[rid] for rid in ids] == expected
    assert_idle_and_whole(llm)


def test_ctrl_c_while_streaming_aborts_the_stream(
    engine_args, model_dir, expected, monkeypatch, python_sigint
):
    llm = LLM(model_dir, **engine_args)
    commit = ctrl_c_inside(monkeypatch, PrefixCache, "commit", at=2)
    stream = llm.stream(PROMPTS[0], PARAMS)
    with pytest.raises(KeyboardInterrupt):
        for _ in stream:
            pass
    assert commit.started and commit.finished
    assert not llm.has_unfinished_requests()
    monkeypatch.undo()
    assert_idle_and_whole(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected


def test_ctrl_c_while_a_stream_is_closed_lands_after_the_abort(
    engine_args, model_dir, expected, monkeypatch, python_sigint
):
    """Closing a stream aborts its request, which returns its blocks: a Ctrl-C inside that
    release waits for its end too."""
    llm = LLM(model_dir, **engine_args)
    stream = llm.stream(PROMPTS[0], PARAMS)
    next(stream)
    release = ctrl_c_inside(monkeypatch, PrefixCache, "close")
    with pytest.raises(KeyboardInterrupt):
        stream.close()
    assert release.finished
    monkeypatch.undo()
    assert_idle_and_whole(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected


def test_a_program_s_own_sigint_handler_is_kept(engine_args, model_dir, expected, monkeypatch):
    """A program that installed its own handler decides what a Ctrl-C does: the engine neither
    replaces it nor raises."""
    calls: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        llm = LLM(model_dir, **engine_args)
        ctrl_c_inside(monkeypatch, PrefixCache, "commit", at=2)
        outs = llm.generate(PROMPTS, PARAMS)
        assert calls == [signal.SIGINT]
        assert [o.token_ids for o in outs] == expected
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_engine_runs_off_the_main_thread(engine_args, model_dir, expected, python_sigint):
    """Only the main thread may set signal handlers (elsewhere signal.signal raises): an engine
    driven by another thread, as the server's is, leaves SIGINT alone."""
    llm = LLM(model_dir, **engine_args)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(llm.generate(PROMPTS, PARAMS)))
    worker.start()
    worker.join(timeout=120)
    assert [o.token_ids for o in result[0]] == expected
    assert_idle_and_whole(llm)


def test_nested_holds_raise_once_at_the_outermost_end(python_sigint):
    reached: list[str] = []
    with pytest.raises(KeyboardInterrupt), sigint_deferred():
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            reached.append("inner")
        reached.append("outer")  # the inner block's end does not raise
    assert reached == ["inner", "outer"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with sigint_deferred():  # nothing held over from before
        pass

"""The engine process's messages: the project's objects go both ways, nothing else is read."""

from __future__ import annotations

import functools
import os
import pickle
from dataclasses import dataclass

import pytest
import torch

from radixkv.engine.sampling_params import SamplingParams
from radixkv.serve import engine_process, wire
from radixkv.serve.engine_snapshot import EngineSnapshot


def test_the_projects_records_errors_and_functions_travel() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.5, stop_token_ids=[5])
    snapshot = EngineSnapshot(num_running=2, tier_moves={"load": (10, 0.5)})
    message = ("call", 3, functools.partial(engine_process.close_services), (params, snapshot))
    kind, call_id, fn, (params_back, snapshot_back) = wire.loads(wire.dumps(message))
    assert (kind, call_id, fn.func) == ("call", 3, engine_process.close_services)
    assert params_back == params and snapshot_back == snapshot
    error = wire.loads(wire.dumps(ValueError("max_tokens must be positive")))
    assert isinstance(error, ValueError) and str(error) == "max_tokens must be positive"
    assert wire.loads(wire.dumps({1, 2})) == {1, 2}
    settings = {"dtype": torch.bfloat16, "max_num_seqs": 8}  # what `radixkv serve --dtype` sends
    assert wire.loads(wire.dumps(settings)) == settings


class _RunsCommand:
    def __reduce__(self):  # what a hostile message would carry
        return (os.system, ("true",))


@dataclass
class _TestsOwnRecord:  # a class outside the project (this test module's)
    x: int


def test_a_message_that_names_anything_outside_the_project_is_refused() -> None:
    with pytest.raises(wire.WireError, match=r"(posix|os)\.system"):
        wire.loads(pickle.dumps(_RunsCommand()))
    with pytest.raises(wire.WireError, match="_TestsOwnRecord"):
        wire.loads(wire.dumps(_TestsOwnRecord(1)))
    # A project module imports os: a dotted name that walks through it reaches os.system.
    assert engine_process.os is os
    walk = (
        pickle.PROTO
        + bytes([4])
        + pickle.SHORT_BINUNICODE
        + bytes([28])
        + b"radixkv.serve.engine_process"
        + pickle.SHORT_BINUNICODE
        + bytes([9])
        + b"os.system"
        + pickle.STACK_GLOBAL
        + pickle.SHORT_BINUNICODE
        + bytes([4])
        + b"true"
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )
    with pytest.raises(wire.WireError, match=r"os\.system"):
        wire.loads(walk)
    with pytest.raises(wire.WireError, match=r"builtins\.eval"):
        wire.loads(pickle.dumps(eval))
    with pytest.raises(wire.WireError, match=r"torch\.serialization\.load"):
        wire.loads(pickle.dumps(torch.load))


def test_an_error_from_outside_the_project_is_sent_in_words() -> None:
    class LibraryError(Exception):
        pass

    assert not wire.travels(LibraryError("boom"))
    sent = engine_process._sendable_error(LibraryError("boom"))
    assert type(sent) is RuntimeError and "LibraryError: boom" in str(sent)
    assert engine_process._sendable_error(KeyError("k")).args == ("k",)

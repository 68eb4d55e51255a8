"""Walk meter: which project files a reader passes through to follow one step and one admission.

    python scripts/walks.py

Runs the engine on the tests' tiny random Llama (`tests/tiny_llama.py`, CPU, synchronous steps)
and traces three walks:

* step:      one `LLM.step()` whose rows are decodes of running requests (schedule, launch,
             runner, finish, fill, delivery);
* runner:    the part of that step inside `ModelRunner.execute` (the runner and its inputs);
* admission: the `Scheduler.schedule()` that admits a request whose prompt prefix is cached,
             nothing else running (the request entering the scheduler and the cache).

A walk is the sequence of project files (under `radixkv/`, `scheduler/`, `kernels/`) whose lines
run, in order, collapsed into stays: a stay is consecutive time in one file. Code outside the
project (the standard library, torch and numpy calls) is transparent. Printed per walk: the stays
(with the functions that ran in each), and the counts

    stays     the number of stays;
    files     the number of distinct files;
    returns   the stays in a file the walk had already been in and left.

and its callbacks: each project function entered while a frame of its own file lies lower on the
stack with another project file's frame between (`llm.py -> step.py -> llm.py`), with the files
between. Unlike the stays, callbacks count every project frame, followed or not.

What a reader does not follow is not counted; lines run inside such a call add no stay:

* trivial accessors: functions and properties whose body (past a docstring) is one `return` of
  an expression that calls nothing but builtins (`return self._x`, `return len(self._waiting)`);
* methods that `dataclasses` generates (their code is in no project file; a `__post_init__` they
  call is followed);
* input guards: functions named `check_*`, `_check_*`, `_require*` (they return nothing or raise;
  the reader reads the call as an assertion);
* the model's forward: everything below an `nn.Module` call (transformers calling the attention
  hook once per layer) is one opaque call, as the reader of a step sees `self.model(...)`.
"""

from __future__ import annotations

import ast
import builtins
import functools
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROJECT_DIRS = ("radixkv", "scheduler", "kernels")
GUARDS = ("check_", "_check_", "_require")  # input checks: they return nothing or raise
SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(ROOT / "tests"))


@functools.cache  # asked for every frame of every call on the stack
def _project_path(filename: str) -> str | None:
    """The file's path relative to the repository when it is project code, else None."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return rel.as_posix() if rel.parts[0] in PROJECT_DIRS else None


def _inside_model(frame: types.FrameType) -> bool:
    """Whether the frame runs below an `nn.Module` call (the model's forward calling the
    attention hook once per layer)."""
    caller = frame.f_back
    while caller is not None:
        if caller.f_code.co_name == "_call_impl" and "torch" in caller.f_code.co_filename:
            return True
        caller = caller.f_back
    return False


def _files_between(frame: types.FrameType, path: str) -> tuple[str, ...]:
    """The project files of the frames between `frame` and the nearest older frame of `path`
    (its own file), nearest first; () when no older frame of `path` is on the stack."""
    between: list[str] = []
    caller = frame.f_back
    while caller is not None:
        caller_path = _project_path(caller.f_code.co_filename)
        if caller_path == path:
            return tuple(between)
        if caller_path is not None and caller_path not in between:
            between.append(caller_path)
        caller = caller.f_back
    return ()


class _Trivia:
    """Which functions of a file are trivial accessors (see the module docstring), by the line
    a code object starts on."""

    def __init__(self) -> None:
        self._by_file: dict[str, set[int]] = {}

    def is_trivial(self, code: types.CodeType) -> bool:
        lines = self._by_file.get(code.co_filename)
        if lines is None:
            lines = self._by_file[code.co_filename] = _trivial_lines(code.co_filename)
        return code.co_firstlineno in lines


def _trivial_lines(filename: str) -> set[int]:
    """The first lines (decorator or `def`) of the trivial functions of a file."""
    tree = ast.parse(Path(filename).read_text(encoding="utf-8"))
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_trivial(node):
            lines.add(node.lineno)
            lines.update(d.lineno for d in node.decorator_list)
    return lines


def _is_trivial(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if len(body) != 1 or not isinstance(body[0], ast.Return):
        return False
    calls = [n for n in ast.walk(body[0]) if isinstance(n, ast.Call)]
    return all(isinstance(c.func, ast.Name) and hasattr(builtins, c.func.id) for c in calls)


class Walk:
    """Records the project files whose lines run while tracing is on."""

    def __init__(self) -> None:
        self.stays: list[str] = []
        self.functions: list[list[str]] = []  # per stay, the functions whose lines ran in it
        # (stays before it, file, function, the files between): see the module docstring
        self.callbacks: list[tuple[int, str, str, tuple[str, ...]]] = []
        self._trivia = _Trivia()

    def _on_call(self, frame: types.FrameType, event: str, arg: Any) -> Callable | None:
        code = frame.f_code
        path = _project_path(code.co_filename)
        if path is None:
            return None
        between = _files_between(frame, path)
        if between:
            self.callbacks.append((len(self.stays), path, code.co_qualname, between))
        if self._trivia.is_trivial(code) or code.co_name.startswith(GUARDS):
            return None
        if _inside_model(frame):
            return None  # inside the model's forward: see the module docstring
        name = code.co_qualname
        self._enter(path, name)

        def on_line(frame: types.FrameType, event: str, arg: Any) -> Callable | None:
            if event == "line":
                self._enter(path, name)
            return on_line

        return on_line

    def _enter(self, path: str, function: str) -> None:
        if not self.stays or self.stays[-1] != path:
            self.stays.append(path)
            self.functions.append([])
        if function not in self.functions[-1]:
            self.functions[-1].append(function)

    def run(self, fn: Callable[[], Any]) -> Any:
        previous = sys.gettrace()  # a test run's coverage tracer, say: it resumes after
        sys.settrace(self._on_call)
        try:
            return fn()
        finally:
            sys.settrace(previous)

    def counts(self) -> tuple[int, int, int]:
        seen: set[str] = set()
        returns = 0
        for path in self.stays:
            returns += path in seen
            seen.add(path)
        return len(self.stays), len(seen), returns

    def part(self, span: list[int]) -> Walk:
        """The stays between the two marks of `span` (see `_spanned`)."""
        start, end = span
        part = Walk()
        part.stays, part.functions = self.stays[start:end], self.functions[start:end]
        part.callbacks = [c for c in self.callbacks if start <= c[0] <= end]
        return part


@contextmanager
def _spanned(walk: Walk, owner: type, name: str) -> Iterator[list[int]]:
    """Marks where `walk` stands when the method `owner.name` is entered and when it is left
    (once each: a span)."""
    method = getattr(owner, name)
    span: list[int] = []

    def spanned(self: Any, *args: Any, **kwargs: Any) -> Any:
        span.append(len(walk.stays))  # its caller's file is the last stay: a new one follows
        try:
            return method(self, *args, **kwargs)
        finally:
            span.append(len(walk.stays))

    setattr(owner, name, spanned)
    try:
        yield span
    finally:
        setattr(owner, name, method)
    assert len(span) == 2, f"{owner.__name__}.{name} ran {len(span) // 2} times"


def measure() -> dict[str, Walk]:
    import torch
    from tiny_llama import build_model, build_tokenizer, random_prompts

    from radixkv import LLM, SamplingParams
    from radixkv.engine.step.model_runner import ModelRunner
    from radixkv.scheduler import Scheduler

    torch.set_num_threads(1)
    settings = dict(block_size=4, num_blocks=128, max_num_seqs=4, async_scheduling=False)
    llm = LLM(build_model("gqa"), tokenizer=build_tokenizer(), **settings)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt_a, prompt_b = random_prompts(7, 2, shared_prefix=12, max_len=20)

    # A request runs to completion: its prompt's blocks are cached.
    llm.generate([prompt_a], greedy)

    # Admission: a request sharing that prefix enters an idle engine; its step's schedule().
    llm.add_request(prompt_b, greedy)
    admitting = Walk()
    with _spanned(admitting, Scheduler, "schedule") as span:
        admitting.run(llm.step)
    (running,) = llm.scheduler.running_requests
    assert running.num_cached_tokens > 0, "the admitted request found no cached prefix"
    admission = admitting.part(span)

    # A decode step: the second prompt's prefill runs first, beside the first one's decode.
    llm.add_request(prompt_a, greedy)
    llm.step()
    running = llm.scheduler.running_requests
    assert len(running) == 2 and all(r.num_tokens_to_compute == 1 for r in running), running
    step = Walk()
    with _spanned(step, ModelRunner, "execute") as span:
        step.run(llm.step)
    return {"step": step, "runner": step.part(span), "admission": admission}


def main() -> int:
    for name, walk in measure().items():
        stays, files, returns = walk.counts()
        print(f"{name}: {stays} stays, {files} files, {returns} returns")
        for path, functions in zip(walk.stays, walk.functions, strict=True):
            print(f"    {path:<34} {', '.join(functions)}")
        for path, function, between in dict.fromkeys(c[1:] for c in walk.callbacks):
            print(f"    callback: {path} {function}, below {', '.join(between)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

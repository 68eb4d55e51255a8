"""A request's n choices (`n` > 1): each is its own engine request with its own stream; here
their replies are merged into one, choice by choice (OpenAI's `index`), and their usage into
one that counts the prompt once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(choice index, item) of every stream, in arrival order. The first error ends it; leaving
    early closes every stream (aborting its request)."""
    queue: asyncio.Queue[tuple[int, T | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None))
            await queue.put((index, None, None))
        except Exception as exc:
            await queue.put((index, None, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def merged_usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One usage for all choices: the prompt (and its cached tokens) once, every completion."""
    first = usages[0]
    completion = sum(u["completion_tokens"] for u in usages)
    return {
        **first,
        "completion_tokens": completion,
        "total_tokens": first["prompt_tokens"] + completion,
    }

"""The engine's door: prompts validated and packed once, sampling params matched to prompts.

What comes out is trusted downstream: the scheduler and the cache take the `PackedTokens` as they
are, without a second check.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from radixkv.cache import PackedTokens
from radixkv.engine.sampling_params import SamplingParams

PromptInput = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]


def pack_prompts(
    prompts: PromptInput, encode: Callable[[str], list[int]], vocab_size: int, max_model_len: int
) -> list[PackedTokens]:
    """Each prompt as PackedTokens: a string (tokenized by `encode`) or a list of token ids in
    [0, vocab_size), shorter than `max_model_len`. A string or a flat list of ints is one prompt.
    TypeError / ValueError naming the prompt at fault; mutates nothing."""
    if isinstance(prompts, str):
        prompts = [prompts]
    elif not isinstance(prompts, Sequence):
        raise TypeError(
            "prompts must be a string, a list of strings, a list of token ids or a list of "
            f"token-id lists, got {type(prompts).__name__}"
        )
    elif not prompts:
        raise ValueError("prompts must not be empty")
    elif isinstance(prompts[0], numbers.Integral) and not isinstance(prompts[0], bool):
        prompts = [prompts]
    return [_pack(i, p, encode, vocab_size, max_model_len) for i, p in enumerate(prompts)]


def _pack(
    i: int, prompt: Any, encode: Callable[[str], list[int]], vocab_size: int, max_model_len: int
) -> PackedTokens:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"prompt {i} is an empty string")
        prompt = encode(prompt)
    kinds = f"prompt {i} must be a string or a list of ints (token ids)"
    # Sets and dicts have no token order; PackedTokens would take bools as ints.
    if not isinstance(prompt, Sequence) or bool in map(type, prompt):
        raise TypeError(f"{kinds}, got {type(prompt).__name__} {prompt!r:.40}")
    vocab = f"the vocabulary [0, {vocab_size})"
    try:
        tokens = PackedTokens(prompt)
    except TypeError as e:
        raise TypeError(f"{kinds}: {e}") from None
    except ValueError as e:
        raise ValueError(f"prompt {i}: token ids outside {vocab}: {e}") from None
    if not tokens:
        raise ValueError(f"prompt {i} is empty (no tokens)")
    if max(tokens) >= vocab_size:
        raise ValueError(f"prompt {i}: token id {max(tokens)} is outside {vocab}")
    if len(tokens) >= max_model_len:
        raise ValueError(
            f"prompt {i} has {len(tokens)} tokens; the model's context is {max_model_len}"
        )
    return tokens


def check_chat_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` as a list of dicts whose "role" and "content" are strings (other keys kept):
    a missing or None role or content is a ValueError, any other type a TypeError, naming the
    message. Chat templates would otherwise fail on them with errors of their own kind."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            value = message.get(key)
            if value is None:
                raise ValueError(f"messages[{i}] has no {key!r} (a string is needed)")
            if not isinstance(value, str):
                raise TypeError(
                    f"messages[{i}][{key!r}] must be a string, got {type(value).__name__}"
                )
        checked.append(dict(message))
    return checked


def params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    """SamplingParams for each of `n` prompts: None (greedy defaults) or one for all, or a list of
    `n`. TypeError / ValueError otherwise."""
    if params is None or isinstance(params, SamplingParams):
        return [SamplingParams() if params is None else params] * n
    if not isinstance(params, Sequence) or isinstance(params, (str, bytes)):
        raise TypeError(
            f"params must be SamplingParams or a list of them, got {type(params).__name__}"
        )
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"params[{i}] must be SamplingParams, got {type(p).__name__}")
    return list(params)


def expand_choices(
    prompts: list[PackedTokens], params: list[SamplingParams]
) -> tuple[list[PackedTokens], list[SamplingParams]]:
    """One request per choice: a prompt whose params have `n` > 1 repeated n times, in place,
    with each choice's params (`SamplingParams.choices`)."""
    out_prompts: list[PackedTokens] = []
    out_params: list[SamplingParams] = []
    for prompt, p in zip(prompts, params, strict=True):
        for choice in p.choices():
            out_prompts.append(prompt)
            out_params.append(choice)
    return out_prompts, out_params

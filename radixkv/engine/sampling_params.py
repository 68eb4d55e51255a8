"""Per-request sampling settings: the user's half of a request, validated on construction.

Torch-free, like `radixkv.engine.config`: `from radixkv import SamplingParams` loads no model code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from radixkv.cache import check_size


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    `temperature == 0` is greedy (top-k / top-p / min-p are then ignored; the penalties and
    `min_tokens` are not). `seed` makes a sampled request reproducible on its own, whatever else
    is in the batch. Raises ValueError / TypeError on construction for out-of-range values.
    """

    max_tokens: int = 64  # new tokens to generate, >= 1
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = disabled, else keep the k most likely tokens
    top_p: float = 1.0  # nucleus mass in (0, 1]
    # vLLM's and SGLang's: keep the tokens whose probability (after temperature) is at least
    # min_p times the most likely token's, in [0, 1]; 0 = disabled
    min_p: float = 0.0
    # per-request RNG seed in [0, 2**64); distinct seeds give distinct streams (`make_generator`);
    # None = derived from the engine seed and request
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS
    ignore_eos: bool = False  # keep going past EOS (benchmarks with fixed reply lengths)
    # OpenAI's logit adjustments (`penalties.py`): penalties in [-2, 2], biases in [-100, 100]
    # by token id (a mapping or (id, bias) pairs; kept as pairs sorted by id)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's and SGLang's (the CTRL paper's, as in transformers), > 0, 1 = disabled: the logit of
    # every token that occurs in the prompt or the reply so far is divided by it when positive
    # and multiplied by it when negative (> 1 discourages repeats, < 1 encourages them)
    repetition_penalty: float = 1.0
    # vLLM's: EOS and the stop tokens cannot be sampled before the reply has this many tokens
    # (at most max_tokens; a grammar that can only end still ends)
    min_tokens: int = 0
    # None: no logprobs; k: the sampled token's logprob and the k most likely, k <= 20
    logprobs: int | None = None
    # Structured output (`radixkv.engine.sampling.grammar`), at most one: a JSON schema (a dict, or
    # its JSON text; kept as text), any JSON object, a regex, one of a few strings, an EBNF grammar
    # (xgrammar's dialect, GBNF-like), or an xgrammar structural tag (JSON text).
    json_schema: str | Mapping[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    # Jump-forward (`radixkv.engine.sampling.jump_forward`): text the grammar forces is appended at
    # once and computed as one extend step. None: the engine's `jump_forward` setting. Never with
    # logprobs: a jumped token was not sampled, so it has no sampling distribution to report (True
    # with logprobs is refused; None with logprobs decodes token by token).
    jump_forward: bool | None = None
    # choices per prompt, each its own request: the first's prefill is cached, and the others'
    # prompts hit it (in-batch prefix caching, for prompts longer than the engine's
    # `defer_shared_prefix_tokens`). Choice i of a seeded request samples with
    # seed + i (mod 2**64): `choices()`.
    n: int = 1

    def __post_init__(self) -> None:
        check_size(self.max_tokens, "max_tokens", low=1)
        check_size(self.top_k, "top_k", low=0)
        if self.seed is not None:
            check_seed(self.seed)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        # Written so that NaN fails the comparisons too.
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be in [0, inf), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for t in self.stop_token_ids:
            check_size(t, "stop_token_ids[i]", low=0)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(getattr(self, name), name, MAX_PENALTY)
        _check_vllm_extensions(self)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.logprobs is not None and check_size(self.logprobs, "logprobs", low=0) > 20:
            raise ValueError(f"logprobs must be at most 20, got {self.logprobs}")
        _check_structured(self)
        if self.jump_forward is not None and not isinstance(self.jump_forward, bool):
            raise TypeError(f"jump_forward must be a bool or None, got {self.jump_forward!r}")
        if self.jump_forward and self.logprobs is not None:
            raise ValueError("jump_forward and logprobs conflict: jumped tokens are not sampled")
        if check_size(self.n, "n", low=1) > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a bias or penalty changes this request's logits before sampling (at every
        step; `min_tokens` only at the first: `adjusts_logits_at`)."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    def adjusts_logits_at(self, num_generated: int) -> bool:
        """Whether this request's logits are changed before sampling its next token, when its
        reply has `num_generated` tokens so far."""
        return self.adjusts_logits or num_generated < self.min_tokens

    def choices(self) -> list[SamplingParams]:
        """The params of each of the n choices: n = 1 each, choice i seeded with seed + i."""
        if self.n == 1:
            return [self]
        return [
            replace(self, n=1, seed=None if self.seed is None else (self.seed + i) % 2**64)
            for i in range(self.n)
        ]

    @property
    def grammar_spec(self) -> tuple[str, str] | None:
        """(kind, text) of the request's structured-output constraint, None without one: the
        key its compiled grammar is cached under."""
        for kind in GRAMMAR_KINDS:
            value = getattr(self, kind)
            if kind == "json_object" and value:
                return kind, ""
            if kind == "choice" and value is not None:
                return kind, json.dumps(list(value))
            if kind != "json_object" and value is not None:
                return kind, value
        return None

    def stop_tokens(self, eos_token_ids: Iterable[int]) -> tuple[int, ...]:
        """Every token that ends a request: its own stop tokens, and the model's EOS ids unless
        `ignore_eos` (which never ignores an explicit stop token)."""
        return self.stop_token_ids if self.ignore_eos else (*self.stop_token_ids, *eos_token_ids)


def check_seed(seed: object) -> int:
    """`seed` as an int in [0, 2**64), what torch's generators take; TypeError / ValueError."""
    value = check_size(seed, "seed", low=0)
    if value >= 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {value}")
    return value


MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty
MAX_BIAS = 100.0  # and on a logit_bias value


def _check_number(value: object, name: str, bound: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not -bound <= value <= bound:  # NaN fails too
        raise ValueError(f"{name} must be in [-{bound:g}, {bound:g}], got {value}")
    return float(value)


def _check_vllm_extensions(params: SamplingParams) -> None:
    """min_p in [0, 1], repetition_penalty > 0 and finite, 0 <= min_tokens <= max_tokens
    (both numbers' types are checked already)."""
    if not 0.0 <= params.min_p <= 1.0:  # NaN fails too
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    if not 0.0 < params.repetition_penalty < float("inf"):
        raise ValueError(
            f"repetition_penalty must be a finite number > 0, got {params.repetition_penalty}"
        )
    if check_size(params.min_tokens, "min_tokens", low=0) > params.max_tokens:
        raise ValueError(
            f"min_tokens must be at most max_tokens ({params.max_tokens}), got {params.min_tokens}"
        )


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """`logit_bias` (a mapping or (id, bias) pairs) as pairs sorted by token id."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise TypeError(f"logit_bias must be a mapping of token ids to numbers, got {bias!r}")
    pairs = {}
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise TypeError(f"logit_bias must be a mapping of token ids to numbers, got {item!r}")
        token = check_size(item[0], "logit_bias's token id", low=0)
        pairs[token] = _check_number(item[1], f"logit_bias[{token}]", MAX_BIAS)
    return tuple(sorted(pairs.items()))


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_GRAMMAR_CHARS = 65536  # of a schema, regex, grammar or all choices: bounds compile work
# The memory compiled grammars are cached in (vLLM's default for xgrammar's own cache): one
# compiled grammar can hold tens of MiB (a long regex of dots over a large vocabulary).
DEFAULT_GRAMMAR_CACHE_BYTES = 512 * 2**20
MAX_CHOICES = 1024
MAX_N = 128  # choices of one request (the server has its own, smaller, limit)


def _check_structured(params: SamplingParams) -> None:
    """At most one constraint, of the right type, within the size bounds; a schema as text."""
    if not isinstance(params.json_object, bool):
        raise TypeError(f"json_object must be a bool, got {type(params.json_object).__name__}")
    given = [k for k in GRAMMAR_KINDS if getattr(params, k) not in (None, False)]
    if len(given) > 1:
        raise ValueError(f"{given[0]} and {given[1]} conflict: give one structured-output field")
    schema = params.json_schema
    if isinstance(schema, Mapping):
        try:
            schema = json.dumps(schema, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"json_schema is not JSON-serialisable: {exc}") from None
        object.__setattr__(params, "json_schema", schema)
    for kind in ("json_schema", "regex", "grammar", "structural_tag"):
        value = getattr(params, kind)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{kind} must be a str, got {type(value).__name__}")
        if value is not None and not value:
            raise ValueError(f"{kind} must not be empty")
    if params.choice is not None:
        _check_choice(params)
    spec = params.grammar_spec
    if spec is not None and len(spec[1]) > MAX_GRAMMAR_CHARS:
        raise ValueError(
            f"{spec[0]} has {len(spec[1])} characters; at most {MAX_GRAMMAR_CHARS} are allowed"
        )


def _check_choice(params: SamplingParams) -> None:
    choice = params.choice
    if isinstance(choice, (str, bytes)) or not isinstance(choice, Iterable):
        raise TypeError(f"choice must be a sequence of strings, got {type(choice).__name__}")
    choice = tuple(choice)
    if not choice or len(choice) > MAX_CHOICES:
        raise ValueError(f"choice must have 1 to {MAX_CHOICES} strings, got {len(choice)}")
    for c in choice:
        if not isinstance(c, str) or not c:
            raise TypeError(f"choice must hold non-empty strings, got {c!r:.40}")
    object.__setattr__(params, "choice", choice)

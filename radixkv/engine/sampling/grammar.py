"""Constrained decoding through xgrammar: each request with a grammar gets a matcher, and every
step masks its rows' logits to the tokens the grammar allows next.

    SamplingParams.grammar_spec ──► compile_spec ──► CompiledGrammar (GrammarCache: by text,
                                   within a byte budget; the Python API compiles in its caller's
                                   thread, the server in worker processes: never the engine)
    per request: RequestGrammar (an xgrammar matcher fed the request's tokens as they are known)
    per step:    mask_rows(logits, grammars, outputs) before penalties, temperature and top-p

A request's matcher ends on the request's own stop tokens: once the grammar is complete only
those are allowed, so a request whose grammar terminates finishes with reason "stop" through
the scheduler's ordinary stop-token check, in either step mode.

Matchers catch up lazily: a row's mask is built from the request's output tokens known at that
point, so a preempted, recomputed request keeps its matcher and the overlapped step only has to
hand over the one token still in flight. Jump-forward (`radixkv.engine.sampling.jump_forward`) reads
the text a matcher forces (`jump_string`) and rewinds it past a token its re-tokenization replaced.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixkv.engine.sampling_params import DEFAULT_GRAMMAR_CACHE_BYTES


class GrammarError(ValueError):
    """A grammar that cannot be compiled, or a token it does not allow."""


class GrammarCache:
    """Compiled grammars by spec ((kind, text), from `SamplingParams.grammar_spec`), most
    recently used last, within a byte budget: each entry counts its `memory_size_bytes`, and
    the least recently used go first. Thread-safe.

    Invariant: `num_bytes` is the sum of the entries' sizes, at most `budget_bytes`."""

    def __init__(self, budget_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES) -> None:
        assert budget_bytes >= 0, budget_bytes
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()

    def get(self, spec: tuple[str, str]) -> Any | None:
        """The cached grammar of `spec` (now the most recent), None when there is none."""
        with self._lock:
            entry = self._entries.get(spec)
            if entry is None:
                return None
            self._entries.move_to_end(spec)
            return entry[0]

    def put(self, spec: tuple[str, str], compiled: Any) -> bool:
        """Keep `compiled`, evicting the least recently used until it fits; False (nothing
        changed) when it alone is over the budget."""
        size = int(compiled.memory_size_bytes)
        if size > self.budget_bytes:
            return False
        with self._lock:
            old = self._entries.pop(spec, None)
            if old is not None:
                self._num_bytes -= old[1]
            while self._num_bytes + size > self.budget_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._num_bytes -= evicted
            self._entries[spec] = (compiled, size)
            self._num_bytes += size
        return True

    def __contains__(self, spec: object) -> bool:
        with self._lock:
            return spec in self._entries

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    def check_integrity(self, vocab_size: int | None = None) -> None:
        with self._lock:
            sizes = [size for _, size in self._entries.values()]
            assert self._num_bytes == sum(sizes), (self._num_bytes, sum(sizes))
            assert self._num_bytes <= self.budget_bytes, (self._num_bytes, self.budget_bytes)
            for spec, (compiled, size) in self._entries.items():
                assert size == compiled.memory_size_bytes, spec
                if vocab_size is not None:
                    assert _vocab_size(compiled) == vocab_size, spec


@dataclass(frozen=True, slots=True, eq=False)
class SerializedGrammar:
    """A compiled grammar as xgrammar's JSON (`CompiledGrammar.serialize_json`), for a vocabulary
    of `vocab_size`: what the server's front end keeps and sends to an engine in another
    process, which loads it once (`GrammarLoader`). Its size is its text's."""

    json_text: str
    vocab_size: int

    @property
    def memory_size_bytes(self) -> int:
        return len(self.json_text)


class GrammarLoader:
    """Serialized grammars loaded for one tokenizer and vocabulary (an engine process's), in a
    `GrammarCache` by spec: a spec sent again is not loaded again."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    ) -> None:
        xgr = import_xgrammar()
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self.cache = GrammarCache(cache_bytes)

    def load(self, spec: tuple[str, str], grammar: SerializedGrammar) -> Any:
        """The CompiledGrammar of `spec`, loaded from `grammar` unless cached."""
        assert grammar.vocab_size == self.vocab_size, (grammar.vocab_size, self.vocab_size)
        compiled = self.cache.get(spec)
        if compiled is None:
            xgr = import_xgrammar()
            compiled = xgr.CompiledGrammar.deserialize_json(grammar.json_text, self._info)
            self.cache.put(spec, compiled)
        return compiled


def _vocab_size(grammar: Any) -> int:
    if isinstance(grammar, SerializedGrammar):
        return grammar.vocab_size
    return grammar.tokenizer_info.vocab_size


class GrammarCompiler:
    """Compiles structured-output constraints for one tokenizer and vocabulary, in the
    caller's thread (the Python API's; the server compiles in worker processes of its own,
    `radixkv.serve.grammar_pool`), and keeps them in a `GrammarCache`."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    ) -> None:
        xgr = import_xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # xgrammar's own cache is off: this one is bounded in bytes and shared by all kinds.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.cache = GrammarCache(cache_bytes)

    def compile(self, spec: tuple[str, str]) -> Any:
        """The CompiledGrammar of `spec` (from `SamplingParams.grammar_spec`); GrammarError
        naming the kind for one xgrammar refuses."""
        compiled = self.cache.get(spec)
        if compiled is None:
            compiled = compile_spec(self._compiler, spec, self.vocab_size)
            self.cache.put(spec, compiled)
        return compiled

    def check_integrity(self) -> None:
        self.cache.check_integrity(self.vocab_size)

    def is_cached(self, spec: tuple[str, str]) -> bool:
        return spec in self.cache

    @property
    def num_cached(self) -> int:
        return self.cache.num_cached


def import_xgrammar() -> Any:
    """The xgrammar module; GrammarError when it is not installed."""
    try:
        import xgrammar as xgr
    except ImportError as exc:
        raise GrammarError(f"structured output needs the xgrammar package ({exc})") from None
    return xgr


def compile_spec(compiler: Any, spec: tuple[str, str], vocab_size: int) -> Any:
    """`spec` compiled by `compiler` (an xgrammar GrammarCompiler); GrammarError naming the
    kind for one xgrammar refuses, or one no token of the vocabulary can begin."""
    kind, text = spec
    try:
        compiled = _compile_kind(compiler, kind, text)
    except (RuntimeError, ValueError, TypeError) as exc:  # RecursionError among them
        raise GrammarError(f"{kind} cannot be compiled: {exc}") from None
    _check_spellable(kind, compiled, vocab_size)
    return compiled


def _check_spellable(kind: str, compiled: Any, vocab_size: int) -> None:
    """GrammarError when no token of the vocabulary can begin the grammar (a tokenizer
    without its characters): such a request could never make progress."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()):
        raise GrammarError(f"{kind}: no token of this model's vocabulary can begin it")


def _compile_kind(c: Any, kind: str, text: str) -> Any:
    # NOTE: JSON comes compact (one space after ":" and ","), with no free whitespace:
    # small models otherwise loop on whitespace until max_tokens (vLLM's reason for its
    # disable-any-whitespace option).
    if kind == "json_schema":
        return c.compile_json_schema(json_schema_for_xgrammar(text), any_whitespace=False)
    if kind == "json_object":
        any_object = '{"type": "object"}'
        return c.compile_json_schema(any_object, any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return c.compile_regex(text)
    if kind == "choice":
        # JSON string literals are valid EBNF string literals.
        alternatives = " | ".join(json.dumps(c_) for c_ in json.loads(text))
        return c.compile_grammar(f"root ::= {alternatives}")
    if kind == "grammar":
        return c.compile_grammar(text)
    assert kind == "structural_tag", kind
    return c.compile_structural_tag(text)


def json_schema_for_xgrammar(text: str) -> str:
    """The schema as xgrammar is given it: short string lengths become a pattern, since
    xgrammar's minLength / maxLength grammar admits raw control characters, which JSON forbids.
    (A pattern's compile time grows with its bound squared, so longer bounds stay as they are.)
    Raises GrammarError for text that is not a JSON object."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise GrammarError("json_schema must be a JSON object")
    return json.dumps(_lengths_as_patterns(schema))


_NOT_SCHEMAS = frozenset(("enum", "const", "default", "examples"))  # values, not subschemas
MAX_LENGTH_AS_PATTERN = 64


def _lengths_as_patterns(node: Any) -> Any:
    if isinstance(node, list):
        return [_lengths_as_patterns(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _NOT_SCHEMAS else _lengths_as_patterns(v) for k, v in node.items()}
    low, high = out.get("minLength", 0), out.get("maxLength")
    plain = out.get("type") == "string" and "pattern" not in out and "format" not in out
    short = type(low) is int and type(high) is int and 0 <= low <= high <= MAX_LENGTH_AS_PATTERN
    if plain and short:
        del out["maxLength"]
        out.pop("minLength", None)
        out["pattern"] = f"^.{{{low},{high}}}$"  # `.`: one unescaped non-control character
    return out


class RequestGrammar:
    """One request's matcher.

    Invariant: the matcher has accepted exactly `accepted`, a prefix of the request's output
    tokens; after a stop token it is terminated and accepts nothing more."""

    def __init__(self, compiled: Any, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        assert stop_token_ids, "a grammar needs a stop token to end on"
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        self.accepted: list[int] = []
        self._forced: tuple[int, str] | None = None  # (outputs, the jump string after them)

    def catch_up(self, output_token_ids: Sequence[int]) -> None:
        """Accept the tokens of `output_token_ids` (the request's outputs so far) not yet seen.
        GrammarError if the grammar refuses one (it was sampled without this grammar's mask)."""
        n = len(self.accepted)
        assert not n or output_token_ids[n - 1] == self.accepted[-1], "outputs rewritten"
        for token in output_token_ids[n:]:
            if self._matcher.is_terminated():
                return  # tokens after the stop token: an overlapped step's, dropped later
            if not self._matcher.accept_token(int(token)):
                raise GrammarError(f"the grammar does not allow token {token}")
            self.accepted.append(int(token))

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def jump_string(self, output_token_ids: Sequence[int]) -> str:
        """The text the grammar forces after `output_token_ids` (caught up first): what every
        continuation it allows begins with; "" when there is none or it has terminated. The
        last answer is remembered: asking again for the same outputs costs nothing."""
        n = len(output_token_ids)
        if self._forced is not None and self._forced[0] == n:
            return self._forced[1]
        assert n >= len(self.accepted), (n, len(self.accepted))
        self.catch_up(output_token_ids)
        forced = "" if self.is_terminated else self._matcher.find_jump_forward_string()
        self._forced = (n, forced)
        return forced

    def rewind(self, num_tokens: int) -> None:
        """Undo the accepted tokens after the first `num_tokens` (their outputs were replaced)."""
        assert 0 <= num_tokens <= len(self.accepted), (num_tokens, len(self.accepted))
        if num_tokens < len(self.accepted):
            self._matcher.rollback(len(self.accepted) - num_tokens)
            del self.accepted[num_tokens:]
        self._forced = None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`; GrammarError if there is none."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if not bool(bitmask[row].any()):
            raise GrammarError("the grammar allows no token of this vocabulary next")

    def check_integrity(self, output_token_ids: Sequence[int]) -> None:
        n = len(self.accepted)
        assert list(output_token_ids[:n]) == self.accepted, "matcher ahead of the outputs"


def mask_rows(
    logits: torch.Tensor,
    grammars: Sequence[RequestGrammar | None],
    outputs: Sequence[Sequence[int] | None],
) -> tuple[torch.Tensor, dict[int, Exception]]:
    """`logits` ([num_rows, vocab]) with each grammar row's disallowed tokens at -inf (a copy;
    the same tensor when no row has a grammar), and the rows that failed: a token the grammar
    refused, or no token allowed. `outputs[i]`: row i's output tokens known so far (None for a
    row without a grammar). A terminated matcher's row is left alone: it is a row an overlapped
    step computed past the stop token, whose token is dropped."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    faults: dict[int, Exception] = {}
    if not rows:
        return logits, faults
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(grammars), logits.shape[1])
    masked: list[int] = []
    for i in rows:
        grammar, known = grammars[i], outputs[i]
        assert grammar is not None and known is not None
        try:
            grammar.catch_up(known)
            if not grammar.is_terminated:
                grammar.fill(bitmask, i)
                masked.append(i)
        except GrammarError as exc:
            faults[i] = exc
    if not masked:
        return logits, faults
    logits = logits.clone()  # the model's own logits stay as they are (logprobs read them)
    xgr.apply_token_bitmask_inplace(logits, _to(bitmask, logits), indices=masked)
    return logits, faults


def _to(bitmask: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The host bitmask on the logits' device, without a synchronization on CUDA."""
    if logits.device.type != "cuda":
        return bitmask
    return bitmask.pin_memory().to(logits.device, non_blocking=True)

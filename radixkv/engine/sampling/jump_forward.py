"""Jump-forward decoding: when a request's grammar allows exactly one continuation string
(xgrammar's `find_jump_forward_string`, e.g. `"customer_name": "` after `{`), its tokens are
appended at once and computed as one extend row, instead of one decode step each.

Re-tokenized at the boundary, as SGLang does, so that the ids stay the tokenizer's own: the
last few output tokens are decoded, the forced text appended, and the whole encoded again; the
request keeps the common prefix of the old and new ids and takes the rest. Here only the last
sampled token may be replaced (it has no KV yet), so the prefix cache never holds a rewritten
token: where the new ids differ earlier (digits sampled one by one that the tokenizer would
merge), the last token alone is encoded with the forced text. A jump is not taken where the
text does not round-trip (half a UTF-8 character, a tokenizer whose decode is not the inverse
of encode) or where the new ids hold a stop token; the mask then goes on token by token.

So the ids from the last sampled token through the forced text are the tokenizer's own
encoding of their text (with the few tokens before, where that encoding keeps them). What
stays non-canonical: the sampled tokens before (the model may spell a value in pieces, as
token-by-token decoding does), and the boundary after the forced text, which the next sampled
token cannot merge into.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from radixkv.cache.tokens import common_prefix_len
from radixkv.engine.model.detokenizer import decode
from radixkv.engine.sampling.grammar import RequestGrammar
from radixkv.scheduler import Request, Scheduler

# Output tokens decoded again with the forced text: enough for a merge across the boundary.
RETOKENIZE_WINDOW = 4
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True, slots=True)
class Jump:
    """What a request's outputs become: the first `num_kept` stay, `token_ids` follow."""

    num_kept: int
    token_ids: tuple[int, ...]


def plan_jump(
    tokenizer: Any,
    grammar: RequestGrammar,
    output_token_ids: Sequence[int],
    stop_token_ids: Collection[int],
) -> Jump | None:
    """The jump after a request's outputs (all known, the last one without KV), None when the
    grammar forces nothing or the re-tokenized ids cannot be spliced in (see the module
    docstring). Reads the grammar (catches it up); changes nothing else."""
    forced = grammar.jump_string(output_token_ids)
    if not forced:
        return None
    for window in (RETOKENIZE_WINDOW, 1):
        jump = _splice(tokenizer, output_token_ids, forced, window)
        if jump is not None:
            break
    if jump is None or any(t in stop_token_ids for t in jump.token_ids):
        return None  # nothing to splice, or a stop token spelled by the forced text
    return jump


def _splice(
    tokenizer: Any, output_token_ids: Sequence[int], forced: str, window: int
) -> Jump | None:
    """The last `window` outputs and the forced text encoded together, spliced in where they
    first differ from the outputs; None if that would rewrite a token with KV (any but the last
    output) or the text does not round-trip."""
    start = max(0, len(output_token_ids) - window)
    old = list(output_token_ids[start:])
    text = decode(tokenizer, old)
    if _REPLACEMENT in text:
        return None  # half a character: its bytes would not come back
    text += forced
    new = list(tokenizer.encode(text, add_special_tokens=False))
    if decode(tokenizer, new) != text:
        return None  # a decode that is not encode's inverse
    kept = common_prefix_len(old, new)
    if kept < len(old) - 1 or kept == len(new):
        return None  # it would rewrite a token with KV (or add nothing)
    return Jump(start + kept, tuple(new[kept:]))


def jump_after_token(
    request: Request, grammar: RequestGrammar, tokenizer: Any, scheduler: Scheduler
) -> tuple[int, ...] | None:
    """Jump-forward after a request's sampled token, if the text before that token was forced:
    the rest of the forced text is appended, re-tokenized with that token, and its next row
    computes it as one extend (`Scheduler.jump`). Returns its new tokens from the sampled one's
    place on (that token, or what replaced it, first), None without a jump.

    NOTE: both step modes jump at the same tokens, so that their outputs agree. Overlapped, a
    request's next step is launched before its token is read, so whenever text is forced after
    its known tokens it is held (`Scheduler.hold`): its next token is then read before anything
    later is computed, and the jump after it can be taken."""
    out = request.output_token_ids
    new = None
    if not request.num_pending and grammar.jump_string(out[:-1]):
        new = _take_jump(request, grammar, tokenizer, scheduler)
    known = len(out) - request.num_pending
    if not request.is_finished and grammar.jump_string(out[:known]):
        scheduler.hold(request.request_id)
    return new


def _take_jump(
    request: Request, grammar: RequestGrammar, tokenizer: Any, scheduler: Scheduler
) -> tuple[int, ...] | None:
    """Splice the jump after a request's last token (all its tokens known) into the request and
    its matcher; its new tokens from that token's place on, or None."""
    jump = plan_jump(tokenizer, grammar, request.output_token_ids, request.stop_token_ids)
    if jump is None:
        return None
    sampled_at = len(request.output_token_ids) - 1
    scheduler.jump(request.request_id, jump.num_kept, jump.token_ids)
    grammar.rewind(jump.num_kept)
    grammar.catch_up(request.output_token_ids)  # the forced text's tokens: allowed
    return tuple(request.output_token_ids[sampled_at:])

"""The cache's door: token ids as the cache stores them (native uint32 bytes, validated once)
and the one check of every size or count argument.

`PackedTokens` is the public form; `pack_tokens` validates any sequence of ints into those bytes;
`common_prefix_len` is the one longest-common-prefix helper (token lists, tuples, PackedTokens or
uint32 memoryviews of packed bytes), `shares_prefix` its yes-or-no form for two PackedTokens;
`check_size` gives every size argument one wording (the
scheduler and the engine use it too).
"""

from __future__ import annotations

import operator
import sys
from array import array
from collections.abc import Iterator, Mapping, Sequence, Set
from typing import overload

import numpy as np

TOKEN_BYTES = 4
MAX_TOKEN_ID = 2**32 - 1
_TOKEN_DTYPE = np.dtype("=u4")
_INT32_DTYPE = np.dtype("=i4")
_SIGN_BYTE = TOKEN_BYTES - 1 if sys.byteorder == "little" else 0  # the byte holding bit 31
assert array("I").itemsize == TOKEN_BYTES, "radixkv needs a 4-byte C unsigned int"
_NO_TOKENS: tuple[int, ...] = ()


def pack_tokens(tokens: Sequence[int], name: str = "tokens") -> bytes:
    """Validate and pack token ids into native uint32 bytes (one C pass over the sequence).

    Accepts any sequence of ints (bool counts as an int; numpy integer arrays take a vectorised
    path; a `PackedTokens` is valid already and read as is). Raises TypeError for a non-sequence
    (a set or a dict included: their order is undefined) or a non-int element, and ValueError for
    an id outside [0, 2**32 - 1], naming the first offending position. Mutates nothing.
    """
    if type(tokens) is PackedTokens:
        return tokens.tobytes()
    if isinstance(tokens, np.ndarray):
        return _pack_ndarray(tokens, name)
    return _pack_sequence(tokens, name)


def unpack_tokens(packed: bytes) -> list[int]:
    return memoryview(packed).cast("I").tolist()


class PackedTokens(Sequence[int]):
    """Token ids validated once and packed the way the cache stores them (native uint32).

    Immutable. Every `PrefixCache` call that takes tokens reads one as is: no validation, no copy,
    so a caller that hands the same tokens to several calls (`admit` the prompt, then `commit`
    prompt + reply; a chat, turn after turn) pays validation once per token. `+` appends
    (validating the other operand only), a slice with step 1 is a PackedTokens, `tobytes()` gives
    the packed bytes. Raises like `match` for ids that are not ints in [0, 2**32).
    """

    __slots__ = ("_packed",)

    def __init__(self, tokens: Sequence[int] = _NO_TOKENS) -> None:
        # The default has nothing to check: `frombytes` and `+` build on it.
        self._packed: bytes = b"" if tokens is _NO_TOKENS else pack_tokens(tokens)

    @classmethod
    def frombytes(cls, packed: bytes) -> PackedTokens:
        """Wrap packed native uint32 bytes (every uint32 is a token id, so only the length is
        checked). ValueError if the length is not a multiple of 4."""
        if len(packed) % TOKEN_BYTES:
            raise ValueError(f"packed tokens need a multiple of 4 bytes, got {len(packed)}")
        tokens = cls()
        tokens._packed = bytes(packed)
        return tokens

    def __len__(self) -> int:
        return len(self._packed) // TOKEN_BYTES

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> PackedTokens: ...
    def __getitem__(self, index: int | slice) -> int | PackedTokens:
        view = memoryview(self._packed).cast("I")
        if isinstance(index, slice):
            return PackedTokens.frombytes(view[index].tobytes())
        try:
            return view[index]
        except IndexError:
            raise IndexError("PackedTokens index out of range") from None

    def __iter__(self) -> Iterator[int]:
        return iter(memoryview(self._packed).cast("I"))

    def __add__(self, other: Sequence[int]) -> PackedTokens:
        return PackedTokens.frombytes(self._packed + pack_tokens(other, "other"))

    def __radd__(self, other: Sequence[int]) -> PackedTokens:
        return PackedTokens.frombytes(pack_tokens(other, "other") + self._packed)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedTokens):
            return self._packed == other._packed
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._packed)

    def __repr__(self) -> str:
        n = len(self)
        head = ", ".join(map(str, self[:8]))
        return f"PackedTokens([{head}{', ...' if n > 8 else ''}], len={n})"

    def tobytes(self) -> bytes:
        return self._packed

    def tolist(self) -> list[int]:
        return memoryview(self._packed).cast("I").tolist()


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of `a[:limit]` and `b[:limit]` (no limit: the whole).

    `a` and `b` must be of one kind whose slices compare in C (two lists, two PackedTokens, two
    uint32 memoryviews; a list slice never equals a tuple). Gallops over doubling runs while they
    agree, then bisects the run that differs: O(result) C work and O(log result) Python steps, so
    a long shared prompt costs no per-token Python loop.
    """
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    lo, step = 0, 16  # a[:lo] == b[:lo]
    while lo < n:
        hi = min(lo + step, n)
        if a[lo:hi] == b[lo:hi]:
            lo, step = hi, 2 * step
            continue
        while hi - lo > 16:  # the first mismatch lies in [lo, hi)
            mid = (lo + hi) >> 1
            if a[lo:mid] == b[lo:mid]:
                lo = mid
            else:
                hi = mid
        while a[lo] == b[lo]:
            lo += 1
        return lo
    return lo


def shares_prefix(a: PackedTokens, b: PackedTokens, n: int) -> bool:
    """Whether `a` and `b` both hold at least `n` tokens and agree on the first `n`: one compare
    of their bytes in C, where `common_prefix_len` would take O(log n) Python steps."""
    size = n * TOKEN_BYTES
    x, y = a.tobytes(), b.tobytes()
    return len(x) >= size and len(y) >= size and x[:size] == y[:size]


def check_size(value: object, name: str, *, low: int) -> int:
    """`value` as an int >= low; TypeError for a non-int (bool included), ValueError below `low`."""
    if type(value) is int and value >= low:  # the common case, on every request: one check
        return value
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        number = operator.index(value)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if number < low:
        raise ValueError(f"{name} must be >= {low}, got {number}")
    return number


def _pack_sequence(values: Sequence[int], name: str) -> bytes:
    """`values` as native uint32 bytes: C unsigned ints accept exactly the ints in [0, 2**32), so
    type, sign and range are checked in one C pass. TypeError/ValueError naming the culprit."""
    if type(values) not in (list, tuple) and (
        isinstance(values, (str, bytes, bytearray, memoryview, Set, Mapping))
        or not hasattr(values, "__len__")
        or not hasattr(values, "__getitem__")
    ):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    try:
        return array("I", values).tobytes()
    except (TypeError, OverflowError):
        pass
    for i, v in enumerate(values):  # slow path, only to name the culprit
        if not hasattr(v, "__index__"):
            raise TypeError(f"{name}[{i}] = {v!r} is not an int ({type(v).__name__})") from None
        if not 0 <= int(v) <= MAX_TOKEN_ID:
            raise ValueError(f"{name}[{i}] = {int(v)} is not a token id in [0, {MAX_TOKEN_ID}]")
    raise TypeError(f"{name} could not be read as ints")  # pragma: no cover


def _pack_ndarray(tokens: np.ndarray, name: str) -> bytes:
    if tokens.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tokens.shape}")
    if tokens.dtype == _TOKEN_DTYPE:
        return tokens.tobytes()  # every uint32 is a token id
    if tokens.dtype == _INT32_DTYPE:  # what tokenizers hand out: only the signs to check
        packed = tokens.tobytes()
        # Speed: the sign bytes all below 0x80 (ASCII) means no negative id; see RESULTS.md.
        if packed[_SIGN_BYTE::TOKEN_BYTES].isascii():
            return packed
    if tokens.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold ints, got dtype {tokens.dtype}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > MAX_TOKEN_ID):
        bad = int(np.flatnonzero((tokens < 0) | (tokens > MAX_TOKEN_ID))[0])
        raise ValueError(
            f"{name}[{bad}] = {int(tokens[bad])} is not a token id in [0, {MAX_TOKEN_ID}]"
        )
    return tokens.astype(_TOKEN_DTYPE, copy=False).tobytes()

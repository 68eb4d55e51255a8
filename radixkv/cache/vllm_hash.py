"""vLLM's `sha256_cbor` block hash, for consumers that compute block keys themselves (the chain
is built by `radixkv.cache.keys.chain_keys`, as every chain).

radixkv's own chain is xxh64 (`radixkv.cache.keys`). A router that hashes request tokens the
way vLLM does (llm-d's KV-cache manager, configured with vLLM's hash seed) can only match a
replica's events if they carry vLLM's hashes. vLLM computes them so
(`vllm/v1/core/kv_cache_utils.py`: `init_none_hash`, `hash_block_tokens`,
`generate_block_hash_extra_keys`; `vllm/utils/hashing.py`: `sha256_cbor`):

    sha256_cbor(x) = sha256(canonical CBOR of x)           (cbor2.dumps(x, canonical=True))
    NONE_HASH      = sha256_cbor(seed)                      the seed as a text string:
                                                            PYTHONHASHSEED, else "vllm-none-hash"
                                                            (vLLM 0.33, for sha256 and sha256_cbor)
    h_i            = sha256_cbor((h_{i-1} or NONE_HASH, tuple(block i's token ids), extra_i))
    extra_0        = (("cache_salt", cache_salt),) for a salted request, else None;
                     extra_i = None for i > 0 (vLLM 0.33 tags each extra key with its source;
                     its KV events carry them untagged, `(cache_salt,)`, in `extra_keys`)
    event hash     = int.from_bytes(h_i, "big") & (2**64 - 1)
                     (vLLM's int form of block hashes, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)

The chain links the full 32-byte digests; only the wire carries the low 64 bits. Only byte
strings, text, unsigned ints, arrays and null occur, so canonical CBOR is just the shortest head
for each (RFC 8949, 4.2.1), written out here rather than adding a CBOR dependency.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed for sha256_cbor without PYTHONHASHSEED
_MASK64 = (1 << 64) - 1
_NULL = b"\xf6"


def _head(major: int, n: int) -> bytes:
    """The shortest CBOR head of major type `major` with argument `n` (>= 0)."""
    if n < 24:
        return bytes([major << 5 | n])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | info]) + n.to_bytes(size, "big")
    raise ValueError(f"{n} does not fit a CBOR head")


def cbor(value: object) -> bytes:
    """Canonical CBOR of bytes, str, an int >= 0, a list/tuple of these, or None."""
    if value is None:
        return _NULL
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _head(3, len(data)) + data
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return _head(0, value)
    if isinstance(value, (list, tuple)):
        return _head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"no canonical CBOR here for {type(value).__name__} {value!r:.40}")


def sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor(value)).digest()


def none_hash(seed: str) -> bytes:
    """vLLM's NONE_HASH for PYTHONHASHSEED=`seed`: the parent of every first block."""
    return sha256_cbor(seed)


def wire_hash(digest: bytes) -> int:
    """The block hash an event carries: the digest's low 64 bits."""
    return int.from_bytes(digest, "big") & _MASK64


def salt_keys(cache_salt: str | None) -> tuple | None:
    """Block 0's extra keys for a request with `cache_salt` (None or "": unsalted, as in vLLM)."""
    return (("cache_salt", cache_salt),) if cache_salt else None


@dataclass(frozen=True, slots=True)
class _FirstBlock:
    """The parent handed to a namespace's first block: vLLM puts the salt in its extra keys."""

    cache_salt: str | None


class Sha256CborHasher:
    """The `BlockHasher` (`radixkv.cache.keys`) of vLLM's chain: nodes hold the 32-byte
    digests, events their low 64 bits. A namespace is vLLM's cache salt."""

    def __init__(self, seed: str = DEFAULT_SEED) -> None:
        self.none_hash = none_hash(seed)

    def first_parent(self, namespace: str | None) -> _FirstBlock:
        return _FirstBlock(namespace)

    def block(self, parent: bytes | _FirstBlock, tokens_le: bytes) -> bytes:
        block = tuple(np.frombuffer(tokens_le, "<u4").tolist())
        if isinstance(parent, _FirstBlock):
            return sha256_cbor((self.none_hash, block, salt_keys(parent.cache_salt)))
        return sha256_cbor((parent, block, None))

    @staticmethod
    def wire(digest: bytes) -> int:
        return wire_hash(digest)

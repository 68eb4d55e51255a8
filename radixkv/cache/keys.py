"""Block keys: the one name of a full block, read by KV events and the lower tiers alike.

A full block is named by a chain over every block from the start of its path, seeded by its
namespace, so a key names the whole prefix ending at its block and a tenant's block is never
found under another's key:

    link_0 = hasher.block(hasher.first_parent(namespace), tokens of block 0)
    link_i = hasher.block(link_{i-1}, tokens of block i)          (tokens as little-endian uint32)

The hasher is the cache's choice (`make_block_hasher`): `XXH64`, radixkv's own (xxh64 over the
parent as 8 little-endian bytes ++ the tokens; `namespace_seed(name)` is a namespace's h_{-1}),
or vLLM's sha256_cbor chain (`radixkv.cache.vllm_hash`), for routers that hash tokens as vLLM
does. A `BlockKey` carries the link (the hasher's own value, which the next block chains from),
its 64-bit wire form (what events carry, what names a block file), its parent's wire form, the
block's tokens and a blake2b digest over the namespace and every token of the prefix, which a
64-bit hash collision cannot fake (a tier loads nothing on a hash alone).

A tree node keeps `block_keys`, the keys of the full blocks ENDING in it (block i by the node with
start < (i+1)*B <= end), computed once and chained from the last key kept above (B = 16):

    positions   0 ......... 16 ......... 32 ... 36 ......... 48 ......... 60
    node a      [0 ............................ 36)                            keys of blocks 0, 1
    node b                                      [36 ........................ 60)  key of block 2
    b's keys = chain_keys(after=a's last key, tokens [32, 48))

A node's keys depend only on its path's tokens, which change only where the tree cuts a node: a
split cuts its list in two (`split_keys`), a trim drops the list's tail (`trim_keys`); block ids
never enter a key. `KeyChain.check` recomputes every kept list from the path's start.

A lookup names a prompt's blocks with `PromptKeys`: the keys the tree's path keeps, then the
prompt's blocks past it, hashed once for every reader of that lookup (both groups' lower tiers).
"""

from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import xxhash

from radixkv.cache.node import TreeNode
from radixkv.cache.tokens import TOKEN_BYTES

_xxh64 = xxhash.xxh64_intdigest
_NATIVE_LITTLE = sys.byteorder == "little"
_DIGEST_BYTES = 32
HashFn = Callable[[Any, bytes], Any]  # (parent link, block tokens LE) -> link


@dataclass(frozen=True, slots=True)
class BlockKey:
    """What names one full block in events and tiers, and what loading it checks."""

    block_hash: int  # the link's wire form (uint64): events carry it, a block file is named by it
    parent_hash: int | None  # the previous block's; None for a namespace's first block
    tokens: bytes  # the block's token ids, little-endian uint32
    prefix_digest: bytes  # blake2b-256 over the namespace and every token up to this block's end
    link: Any  # the hasher's own value, which the next block chains from


# ---------------------------------------------------------------------------------- hashing
def token_bytes_le(packed: bytes) -> bytes:
    """Native uint32 token bytes (how the tree stores tokens) as little-endian ones, the hash
    input on every machine."""
    return packed if _NATIVE_LITTLE else np.frombuffer(packed, "=u4").astype("<u4").tobytes()


def hash_block(parent_hash: int | None, tokens_le: bytes) -> int:
    """Chained hash of one block: xxh64(parent hash as 8 little-endian bytes, if any ++ tokens)."""
    if parent_hash is None:
        return _xxh64(tokens_le)
    return _xxh64(parent_hash.to_bytes(8, "little") + tokens_le)


def namespace_seed(namespace: str) -> int:
    """The h_{-1} of a namespace's xxh64 chains: keeps equal prefixes of two namespaces apart."""
    return _xxh64(b"radixkv-namespace:" + namespace.encode("utf-8"))


def namespace_digest(namespace: str | None) -> bytes:
    """The digest chain's start for `namespace` (None: the shared one; "" is another)."""
    tag = b"\x00" if namespace is None else b"\x01" + namespace.encode("utf-8")
    return hashlib.blake2b(b"radixkv-prefix:" + tag, digest_size=_DIGEST_BYTES).digest()


def chain_hashes(
    parent: Any, tokens_le: bytes, block_size: int, hash_fn: HashFn = hash_block
) -> list[Any]:
    """The links of the consecutive full blocks in `tokens_le` (little-endian uint32 ids, a whole
    number of blocks), chained from `parent`. Mutates nothing."""
    nbytes = TOKEN_BYTES * block_size
    assert len(tokens_le) % nbytes == 0, "chain_hashes takes whole blocks"
    links = []
    for start in range(0, len(tokens_le), nbytes):
        parent = hash_fn(parent, tokens_le[start : start + nbytes])
        links.append(parent)
    return links


class BlockHasher(Protocol):
    """A block-hash chain: `block(parent, tokens_le)` hashes one block from its parent's link,
    `first_parent(namespace)` is the parent of a namespace's block 0, `wire(link)` the uint64
    an event carries."""

    def first_parent(self, namespace: str | None) -> Any: ...

    def block(self, parent: Any, tokens_le: bytes) -> Any: ...

    def wire(self, link: Any) -> int: ...


class Xxh64Hasher:
    """radixkv's own chain (`hash_block`, `namespace_seed`): links are their wire form."""

    block = staticmethod(hash_block)

    @staticmethod
    def first_parent(namespace: str | None) -> int | None:
        return None if namespace is None else namespace_seed(namespace)

    @staticmethod
    def wire(link: int) -> int:
        return link


XXH64 = Xxh64Hasher()
BLOCK_HASHES = ("xxh64", "sha256_cbor")


def make_block_hasher(name: str = "xxh64", seed: str | None = None) -> BlockHasher:
    """The chain called `name` (one of BLOCK_HASHES); `seed` is sha256_cbor's (vLLM's
    PYTHONHASHSEED; None: vLLM's default) and must be None for xxh64. Raises ValueError."""
    if name == "xxh64":
        if seed is not None:
            raise ValueError("block_hash_seed applies to block_hash='sha256_cbor' only")
        return XXH64
    if name == "sha256_cbor":
        from radixkv.cache.vllm_hash import DEFAULT_SEED, Sha256CborHasher

        return Sha256CborHasher(DEFAULT_SEED if seed is None else seed)
    raise ValueError(f"block_hash must be one of {BLOCK_HASHES}, got {name!r}")


def chain_keys(
    namespace: str | None,
    tokens_le: bytes,
    block_size: int,
    *,
    after: BlockKey | None = None,
    hasher: BlockHasher = XXH64,
) -> list[BlockKey]:
    """Keys of the consecutive full blocks in `tokens_le` (little-endian uint32 ids, a whole number
    of blocks), the first one following `after` (None: the first block of a sequence in
    `namespace`; `namespace` is not read then). Mutates nothing."""
    if after is None:
        start, parent = hasher.first_parent(namespace), None
        digest = namespace_digest(namespace)
    else:
        start, parent, digest = after.link, after.block_hash, after.prefix_digest
    nbytes = TOKEN_BYTES * block_size
    keys = []
    for i, link in enumerate(chain_hashes(start, tokens_le, block_size, hasher.block)):
        tokens = tokens_le[i * nbytes : (i + 1) * nbytes]
        digest = hashlib.blake2b(digest + tokens, digest_size=_DIGEST_BYTES).digest()
        h = hasher.wire(link)
        keys.append(BlockKey(h, parent, tokens, digest, link))
        parent = h
    return keys


# ------------------------------------------------------------------------------ tree paths
def namespace_of(node: TreeNode) -> str | None:
    """The namespace of the root above `node` (or of `node`, a root)."""
    while node.parent is not None:
        node = node.parent
    return node.namespace


def path_bytes(node: TreeNode, lo: int, hi: int) -> bytes:
    """Packed tokens of path positions [lo, hi) (hi <= node.end; hi may lie above the node, in
    an ancestor), read up the ancestors."""
    parts = []
    cursor: TreeNode | None = node
    end = hi
    while lo < end:
        assert cursor is not None and cursor.parent is not None
        a = max(lo, cursor.start)
        if a < end:  # else the range ends above this node
            parts.append(cursor.tokens[4 * (a - cursor.start) : 4 * (end - cursor.start)])
            end = a
        cursor = cursor.parent
    return b"".join(reversed(parts))


def split_keys(prefix: TreeNode, suffix: TreeNode, p: int, block_size: int) -> None:
    """`suffix` [s, e) is being split at p into `prefix` [s, p) and itself [p, e): the blocks
    ending at or before p now end in the prefix. Call before `suffix.start` changes."""
    keys = suffix.block_keys
    if keys is not None:
        k = p // block_size - suffix.start // block_size
        prefix.block_keys, suffix.block_keys = keys[:k], keys[k:]


def trim_keys(leaf: TreeNode, keep: int) -> None:
    """`leaf` keeps only its first `keep` blocks (a trim back to a block boundary)."""
    if leaf.block_keys is not None:
        del leaf.block_keys[keep:]


class KeyChain:
    """The keys of a tree's paths, by one hasher, kept on the nodes (see the module docstring),
    and of the prompts looked up past them, kept for the prompts looked up last.

    A longest-prefix-first scheduler looks every waiting prompt up at every step; with lower
    tiers each lookup names the prompt's blocks past the tree, so those are hashed once per
    prompt and read back after (at most `MEMO_KEYS` keys, least recently looked up prompts
    forgotten first). A key depends on nothing but the prompt, its namespace and the hasher."""

    MEMO_KEYS = 1 << 16

    def __init__(self, block_size: int, hasher: BlockHasher = XXH64) -> None:
        self.block_size = block_size
        self.hasher = hasher
        # (namespace, packed prompt) -> (first block index, keys of blocks from it to the end)
        self._memo: OrderedDict[tuple[str | None, bytes], tuple[int, list[BlockKey]]] = (
            OrderedDict()
        )
        self._num_memo_keys = 0

    def chain(
        self, namespace: str | None, tokens_le: bytes, after: BlockKey | None = None
    ) -> list[BlockKey]:
        return chain_keys(namespace, tokens_le, self.block_size, after=after, hasher=self.hasher)

    def node_keys(self, node: TreeNode) -> list[BlockKey]:
        """Keys of the full blocks ending in the non-root `node` (block indices start // B ..
        end // B - 1), kept on it. Chained from the last key kept on the path above (or from the
        namespace's start), keeping the keys of every node on the way too. Do not change the
        list."""
        B = self.block_size
        if node.block_keys is not None:
            return node.block_keys
        on_the_way = []
        anchor = node
        while anchor.parent is not None and not anchor.block_keys:  # not kept, or no full block
            on_the_way.append(anchor)
            anchor = anchor.parent
        after = anchor.block_keys[-1] if anchor.block_keys else None
        lo = anchor.end // B  # a root's end is 0: its chain starts at the namespace's seed
        tokens = path_bytes(node, lo * B, node.end // B * B)
        keys = self.chain(anchor.namespace, token_bytes_le(tokens), after)
        for n in on_the_way:
            n.block_keys = keys[n.start // B - lo : n.end // B - lo]
        return node.block_keys  # type: ignore[return-value]

    def last_key(self, node: TreeNode) -> BlockKey | None:
        """The key of the last full block of `node`'s path ending at or before `node.end` (None: a
        root, or a path shorter than a block)."""
        while node.parent is not None:
            keys = self.node_keys(node)
            if keys:
                return keys[-1]
            node = node.parent
        return None

    def prompt_keys(
        self, qb: bytes, num_full: int, m: int, node: TreeNode | None, namespace: str | None
    ) -> list[BlockKey]:
        """Keys of the full blocks [m // B, num_full) of the packed prompt `qb`, whose first m
        tokens a walk matched, ending at `node` (None: `namespace` has no root, and m is 0). Only
        those blocks are hashed: the chain goes on from the key of block m // B - 1, which the
        path keeps."""
        B = self.block_size
        i0 = m // B
        prompt = (namespace, qb)
        known = self._memo.get(prompt)
        if known is not None and known[0] <= i0:  # it runs to the prompt's last full block
            self._memo.move_to_end(prompt)
            return known[1][i0 - known[0] :]
        after = None
        if node is not None and node.parent is not None and i0 > node.start // B:
            after = self.node_keys(node)[i0 - 1 - node.start // B]  # block i0 - 1 ends in node
        elif node is not None and i0:
            after = self.last_key(node.parent)  # type: ignore[arg-type]
        block_bytes = TOKEN_BYTES * B
        tokens = qb[i0 * block_bytes : num_full * block_bytes]
        keys = self.chain(namespace, token_bytes_le(tokens), after)
        self._remember(prompt, i0, keys)
        return keys[:]

    def _remember(self, prompt: tuple[str | None, bytes], first: int, keys: list[BlockKey]) -> None:
        old = self._memo.pop(prompt, None)
        if old is not None:
            self._num_memo_keys -= len(old[1])
        if len(keys) > self.MEMO_KEYS:
            return
        self._memo[prompt] = (first, keys)
        self._num_memo_keys += len(keys)
        while self._num_memo_keys > self.MEMO_KEYS:
            _, (_, gone) = self._memo.popitem(last=False)
            self._num_memo_keys -= len(gone)

    def check(self, nodes: Iterable[TreeNode]) -> None:
        """Every kept list of keys equals the keys the chain gives over its path from position 0.
        Raises AssertionError naming the node's segment."""
        B = self.block_size
        for node in nodes:
            if node.block_keys is None:
                continue
            tokens = token_bytes_le(path_bytes(node, 0, node.end // B * B))
            if node.block_keys != self.chain(namespace_of(node), tokens)[node.start // B :]:
                raise AssertionError(f"[{node.start},{node.end}) keeps stale block keys")
        remembered = sum(len(keys) for _, keys in self._memo.values())
        assert remembered == self._num_memo_keys <= self.MEMO_KEYS, "prompt keys miscounted"


class PromptKeys:
    """The keys of one prompt's full blocks in one namespace, each hashed at most once however
    many lookups read them: a full group's lower tiers, then a window group's beside it (the
    same chain names both groups' blocks). Made by a `PrefixCache` lookup whose walk matched
    `m` tokens ending at `node`: the keys of blocks [0, m // B) are read from the path's nodes
    (which keep them), the rest are hashed on the first read and kept here.

    Valid while the tree's path to `node` is unchanged: read it before the cache next changes
    (an admission reads it before it locks or evicts anything)."""

    __slots__ = ("_chain", "_m", "_node", "_past", "_path", "_qb", "namespace", "num_full")

    def __init__(
        self, chain: KeyChain, qb: bytes, namespace: str | None, m: int, node: TreeNode | None
    ) -> None:
        self._chain, self._qb, self.namespace = chain, qb, namespace
        self._m, self._node = m, node
        self.num_full = len(qb) // (TOKEN_BYTES * chain.block_size)  # full blocks of the prompt
        self._path: list[BlockKey] | None = None  # blocks [0, m // B), once read
        self._past: list[BlockKey] | None = None  # blocks [m // B, num_full), once hashed

    def span(self, lo: int, hi: int) -> list[BlockKey]:
        """The keys of the prompt's blocks [lo, hi), 0 <= lo <= hi <= `num_full`."""
        assert 0 <= lo <= hi <= self.num_full, (lo, hi, self.num_full)
        tree = self._m // self._chain.block_size
        keys = self._path_keys()[lo:hi] if lo < tree else []
        if hi > tree:
            keys += self._past_keys()[max(lo, tree) - tree : hi - tree]
        return keys

    def is_of(self, qb: bytes, namespace: str | None) -> bool:
        """Whether these are the keys of the packed prompt `qb` in `namespace`."""
        return namespace == self.namespace and (qb is self._qb or qb == self._qb)

    def _path_keys(self) -> list[BlockKey]:
        if self._path is None:
            parts = []
            node = self._node
            while node is not None and node.parent is not None:
                parts.append(self._chain.node_keys(node))  # the first call keys the whole path
                node = node.parent
            tree = self._m // self._chain.block_size
            self._path = [key for part in reversed(parts) for key in part][:tree]
        return self._path

    def _past_keys(self) -> list[BlockKey]:
        if self._past is None:
            chain, m, node = self._chain, self._m, self._node
            self._past = chain.prompt_keys(self._qb, self.num_full, m, node, self.namespace)
        return self._past

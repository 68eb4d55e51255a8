"""The disk tier: full KV blocks as content-addressed files that outlive the process.

The engine's side of it, beside the tier mover (`tier_io.py`) that reads and writes through it;
the cache plans with it as a `DiskIndex` (`radixkv.cache.tiers`: probe, pin) and touches no file.

A store directory (`root`) holds one folder per KV layout:

    root/<layout>/                  first 32 hex digits of the fingerprint's digest: files of
                                    another model, dtype or shape never share a folder
    root/<layout>/fingerprint.json  the fingerprint, for people (every file carries its digest)
    root/<layout>/<hh>/<hash>.kv    one full block; <hash> is its chained block hash (16 hex
                                    digits), <hh> the first two of them

A block is named by the wire form of its key (`radixkv.cache.keys`), the KV events' hash:
namespace-salted and covering the whole prefix, so a lookup past what the tree holds goes on by
hashing the next full blocks of a prompt and probing for their files (`probe`), as LMCache and
vLLM look up theirs.
A file's bytes, little-endian, no pickle anywhere (a KV directory may be shared, and loading a
pickle runs code):

    header    HEADER.size bytes   magic + format version, fingerprint digest, block hash, parent
                                  hash, token count, payload size, prefix digest
    tokens    4 x block_size      the block's token ids (uint32); a key of fewer tokens (a
                                  recurrent-state snapshot's tail) padded with 0xFFFFFFFF
    payload   block_nbytes        the block's K/V over all layers, raw, in the engine's layout
    checksum  8 bytes             xxh3-64 of everything before it (keyed: see below)

`get` checks all of it against what the caller expects (`BlockKey`): the fingerprint (a file of
another model or layout is never loaded), the hash, the parent hash, the tokens and the prefix
digest, a blake2b chain over the namespace and every token of the prefix: prefixes whose 64-bit
chain hashes collide have different digests, so a collision never loads wrong KV. A file that is
truncated or fails its checksum is damaged: skipped with one warning and removed. A file that
cannot be used and cannot be removed (unreadable, not a regular file, or some other prefix's
block) is remembered as unusable: `contains` no longer reports it, so a request that missed it
recomputes instead of probing it again (until this process writes that block itself).

With a `secret` (a deployment's key), the checksum is keyed (blake2b-64 keyed by it), so a file
forged by whoever can write the folder but lacks the key is damaged, never loaded; keyed stores
use a layout folder of their own (named from the key too), so stores with and without a key,
or with different keys, never take each other's files for damaged ones.

Files are created 0600 and folders 0700: the files hold prompts' token ids in clear, so only the
user running the engine may read them. Files are opened without following links and without
blocking, and only a regular file is read (a FIFO under a block's name cannot hang the engine).

Writes are atomic: a block goes to a temporary file in its folder, named after its host and
process, then is renamed over its final name, so a reader sees a whole file or none. A process
killed mid-write leaves only its temporary file, which the next open removes (its process is gone).
Several processes may share a directory: files are only created by a rename and removed whole, and
a reader keeps reading the file it opened. Each process indexes the files it knows (found when it
opened the store, written, or found by a probe) and keeps those within its byte budget, evicting
the least recently used first (`LruEntries`, as the host tier, one logical tick per use;
a load also refreshes the file's mtime, so the order survives a restart). With P processes writing
one directory at once it can hold up to P budgets until they reopen it. The store is not
thread-safe: one thread uses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import socket
import stat
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from radixkv.cache.eviction import LruEntries, LruEntry
from radixkv.cache.keys import BlockKey

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"RADIXKV" + bytes([FORMAT_VERSION])
# magic, fingerprint digest, block hash, parent hash, has parent, token count, payload bytes,
# prefix digest
HEADER = struct.Struct("<8s32sQQB3xIQ32s")
CHECKSUM = struct.Struct("<Q")
SUFFIX = ".kv"
_PAD = b"\xff" * 4  # pads a key shorter than a block (`_padded`)
TMP_SUFFIX = ".tmp"
FINGERPRINT_FILE = "fingerprint.json"
_DIGEST_BYTES = 32
# A temporary file of another host cannot be tied to a live process: removed once this old.
FOREIGN_TMP_MAX_AGE_S = 3600.0
_HOST = socket.gethostname().replace(".", "_") or "host"
_FILE_MODE = 0o600  # the files hold prompts' token ids: the engine's user alone reads them
_DIR_MODE = 0o700
_COUNTERS = ("num_stored", "num_evicted", "num_damaged", "num_unusable", "num_write_errors")
_OPEN_FOR_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_OPEN_FOR_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def fingerprint_digest(fingerprint: Mapping[str, Any]) -> bytes:
    """blake2b-256 of the fingerprint as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.blake2b(text.encode("ascii"), digest_size=_DIGEST_BYTES).digest()


def block_file_nbytes(block_size: int, block_nbytes: int) -> int:
    """The size of one block file: header, token ids, the block's KV, checksum."""
    return HEADER.size + 4 * block_size + block_nbytes + CHECKSUM.size


# ----------------------------------------------------------------------------------- store
@dataclass(frozen=True, slots=True)
class DiskStoreStats:
    directory: str  # the layout folder
    budget_bytes: int
    num_files: int  # indexed by this process
    num_bytes: int  # their size on disk
    file_nbytes: int  # the size of one block file
    # What only the store sees (the blocks read and written are the tier mover's `MoveTotals`)
    num_stored: int  # put() that wrote a file (not one already there)
    num_evicted: int  # files removed for the budget
    num_damaged: int  # files found truncated or corrupt (or of another layout), removed
    num_unusable: int  # files that could neither be used nor removed (skipped while remembered)
    num_write_errors: int  # put() that failed (disk full, permissions...): nothing stored


class DiskStore:
    """Full KV blocks of one layout under `root`, at most `budget_bytes` of files (see the module
    docstring). `fingerprint`: what the KV depends on (model config, weights identity, dtype,
    block size, layer and head shapes); JSON-serialisable. `block_size` tokens and `block_nbytes`
    payload bytes per block. `secret`: the key of a keyed checksum (None: xxh3, unkeyed).

    Invariants (recomputed by `check_integrity`): the LRU index holds exactly the indexed files,
    each once, under its current key; `num_bytes` is their count times the file size and stays
    within `budget_bytes` (files pinned for a planned read may hold it above, and then nothing
    else is indexed); no tick is ahead of the clock.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        fingerprint: Mapping[str, Any],
        *,
        block_size: int,
        block_nbytes: int,
        budget_bytes: int,
        secret: bytes | None = None,
    ) -> None:
        self.fingerprint = fingerprint_digest(fingerprint)
        # blake2b takes keys of at most 64 bytes: a secret of any length is hashed into one
        self._secret = None if secret is None else hashlib.blake2b(b"radixkv:" + secret).digest()
        self.block_size = block_size
        self.block_nbytes = block_nbytes
        self.file_nbytes = block_file_nbytes(block_size, block_nbytes)
        assert budget_bytes >= self.file_nbytes, "the door checks that the budget holds a block"
        self.budget_bytes = budget_bytes
        self.directory = Path(root) / _layout_name(self.fingerprint, secret)
        self._entries = LruEntries()  # every file indexed (pins do not leave the order)
        # Hashes whose file could not be used nor removed: misses for `contains` until written.
        # Oldest first, at most as many as the budget holds files: a folder that others keep
        # filling with bad files costs a bounded memory (a forgotten one is read, and fails, again).
        self._unusable: dict[int, None] = {}
        self.max_unusable = budget_bytes // self.file_nbytes
        self._pinned: Counter[int] = Counter()  # files a planned read needs: not evicted
        # Told when this process indexes a block (written, or read from another's file) and
        # when it forgets one (evicted, removed, found gone or damaged): the KV events of the disk
        # tier. The files found when the store opened are indexed without a word.
        self.on_stored: Callable[[BlockKey], None] | None = None
        self.on_removed: Callable[[int], None] | None = None
        self._tmp_ids = itertools.count()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        os.makedirs(root, mode=_DIR_MODE, exist_ok=True)
        self.directory.mkdir(mode=_DIR_MODE, exist_ok=True)
        self._write_fingerprint(fingerprint)
        self._scan()

    # ------------------------------------------------------------------ reading
    @property
    def num_files(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return len(self._entries) * self.file_nbytes

    def contains(self, block_hash: int) -> bool:
        """Whether a file of this hash is there (indexed, or written since by another process:
        indexed when it is read), and not found unusable. It may still turn out to hold another
        prefix or be damaged: `get` decides. Changes nothing."""
        if block_hash in self._entries:
            return True
        if block_hash in self._unusable:
            return False
        try:
            st = os.lstat(self._path(block_hash))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == self.file_nbytes

    def probe(self, keys: Sequence[BlockKey]) -> int:
        """How many of `keys`, from the first, have a file (`contains`)."""
        for i, key in enumerate(keys):
            if not self.contains(key.block_hash):
                return i
        return len(keys)

    def get(self, key: BlockKey, out: Any) -> bool:
        """Load the block `key` names into `out` (a writable buffer of `block_nbytes` bytes, e.g.
        a numpy view of a host KV block). True if loaded; False, with `out` in an undefined state,
        if there is no such file, it holds another prefix (a hash collision), it is damaged (one
        warning, and it is removed) or it cannot be read (one warning): a file that cannot be used
        and is still there is remembered as unusable (`contains` says False from then on)."""
        view = memoryview(out).cast("B")
        assert view.nbytes == self.block_nbytes, f"{view.nbytes} != {self.block_nbytes}"
        if self._pinned[key.block_hash]:
            self.unpin([key.block_hash])
        problem = self._load(key, view)
        if problem is not None:
            self._forget(key.block_hash)
            if problem != "gone" and os.path.lexists(self._path(key.block_hash)):
                self._remember_unusable(key.block_hash)
            return False
        self._touch(key)
        return True

    def _load(self, key: BlockKey, view: memoryview) -> str | None:
        """Read the file of `key` into `view`: None if it is the block, else why not (see
        `_read_into`, plus "gone" and "unreadable"). Removes a damaged file."""
        path = self._path(key.block_hash)
        try:
            fd = os.open(path, _OPEN_FOR_READ)
        except FileNotFoundError:
            return "gone"  # evicted by another process, or never there
        except OSError as exc:
            logger.warning("KV block file %s could not be opened (%s): skipped", path, exc)
            return "unreadable"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                logger.warning("KV block file %s is not a regular file: skipped", path)
                return "unreadable"
            with open(fd, "rb", buffering=0, closefd=False) as f:
                problem = self._read_into(f, key, view)
            if problem in ("damaged", "layout"):
                self._remove_damaged(path, st.st_ino, problem)
            elif problem is None:
                with contextlib.suppress(OSError):
                    os.utime(fd)  # the LRU order survives a restart
            return problem
        except OSError as exc:
            logger.warning("KV block file %s could not be read (%s): skipped", path, exc)
            return "unreadable"
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ writing
    def put(self, key: BlockKey, payload: Any) -> bool:
        """Store `payload` (a buffer of `block_nbytes` bytes: the block's K/V) under `key`,
        evicting the least recently used files to stay within the budget. True if the block is
        on disk afterwards (already there counts: its recency is refreshed); False if the write
        failed (counted, logged once as a warning, later ones at debug level): nothing is stored."""
        data = memoryview(payload).cast("B")
        assert data.nbytes == self.block_nbytes, f"{data.nbytes} != {self.block_nbytes}"
        assert len(key.tokens) <= 4 * self.block_size, "a key names at most one block"
        h = key.block_hash
        if self.contains(h):
            self._touch(key)
            return True
        need = self.num_bytes + self.file_nbytes - self.budget_bytes
        if need > 0 and self.evict(need) < need:
            return False  # no room: every other file is about to be read
        path = self._path(h)
        tmp = path.with_name(
            f".{path.stem}.{_HOST}.{os.getpid()}.{next(self._tmp_ids)}{SUFFIX}{TMP_SUFFIX}"
        )
        header = HEADER.pack(
            MAGIC,
            self.fingerprint,
            h,
            key.parent_hash or 0,
            key.parent_hash is not None,
            self.block_size,
            self.block_nbytes,
            key.prefix_digest,
        )
        tokens = self._padded(key.tokens)
        seal = self._checksum((header, tokens, data))
        try:
            path.parent.mkdir(mode=_DIR_MODE, exist_ok=True)
            with open(os.open(tmp, _OPEN_FOR_WRITE, _FILE_MODE), "wb", buffering=0) as f:
                _write_all(f, (header, tokens, data, seal))
            os.replace(tmp, path)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if not isinstance(exc, OSError):
                raise  # an interrupt: nothing stored, nothing left behind
            self._counts["num_write_errors"] += 1
            level = logging.WARNING if self._counts["num_write_errors"] == 1 else logging.DEBUG
            logger.log(level, "KV block %016x not written to %s (%s)", h, self.directory, exc)
            return False
        self._unusable.pop(h, None)
        self._touch(key)
        self._counts["num_stored"] += 1
        return True

    def evict(self, num_bytes: int, keep: int | None = None) -> int:
        """Remove least recently used files until `num_bytes` are freed (or none is left but
        pinned ones, and `keep`); returns the bytes freed. A file already removed by another
        process, or that cannot be removed, counts as freed (`discard`)."""
        victims = []
        for entry in self._entries.order:
            if len(victims) * self.file_nbytes >= num_bytes:
                break
            if entry.block_hash not in self._pinned and entry.block_hash != keep:
                victims.append(entry)
        for entry in victims:
            self.discard(entry.block_hash)
            self._counts["num_evicted"] += 1
        return len(victims) * self.file_nbytes

    def pin(self, block_hashes: Sequence[int]) -> None:
        """Keep these files from eviction until each is read once (`get`) or unpinned: a cache
        that planned to read them may plan writes first, which make room."""
        self._pinned.update(block_hashes)

    def unpin(self, block_hashes: Sequence[int]) -> None:
        """Release pins whose reads will not happen."""
        self._pinned.subtract(block_hashes)
        self._pinned = +self._pinned  # drop counts at zero

    def discard(self, block_hash: int) -> None:
        """Remove the file of `block_hash`, if any (this process's index and the disk; one that
        cannot be removed, such as a folder under its name, is only forgotten)."""
        self._forget(block_hash)
        with contextlib.suppress(OSError):
            os.unlink(self._path(block_hash))

    def clear(self) -> None:
        """Remove every block file of this layout (other processes' included)."""
        for block_hash in [*self._entries, *(h for h, _ in self._scan_files())]:
            self.discard(block_hash)

    def heads(self) -> Iterator[tuple[int, int | None, bytes]]:
        """(block hash, parent hash, tokens) read from the header of every indexed file, the
        tokens without their padding (a key shorter than a block: a snapshot's tail). A file
        that cannot be read is skipped (`get` decides what it is when asked). O(files)."""
        size = HEADER.size + 4 * self.block_size
        for block_hash in list(self._entries):
            try:
                with open(os.open(self._path(block_hash), _OPEN_FOR_READ), "rb") as f:
                    head = f.read(size)
            except OSError:
                continue
            if len(head) != size or head[: len(MAGIC)] != MAGIC:
                continue
            _, _, h, parent, has_parent, *_ = HEADER.unpack_from(head)
            tokens = bytes(head[HEADER.size :])
            while tokens.endswith(_PAD):
                tokens = tokens[: -len(_PAD)]
            if h == block_hash:
                yield h, parent if has_parent else None, tokens

    # ------------------------------------------------------------------ reports
    def stats(self) -> DiskStoreStats:
        return DiskStoreStats(
            directory=str(self.directory),
            budget_bytes=self.budget_bytes,
            num_files=self.num_files,
            num_bytes=self.num_bytes,
            file_nbytes=self.file_nbytes,
            **self._counts,
        )

    def check_integrity(self) -> None:
        """Recompute the invariants in the class docstring; AssertionError names the first one
        broken. O(files)."""
        self._entries.check_integrity("disk")
        if len(self._entries.order) != len(self._entries):
            raise AssertionError("a file is indexed out of the LRU order")
        unpinned = [h for h in self._entries if not self._pinned[h]]
        if self.num_bytes > self.budget_bytes and unpinned:
            raise AssertionError(f"{self.num_bytes} bytes indexed > budget {self.budget_bytes}")
        if len(self._unusable) > self.max_unusable:
            raise AssertionError(f"{len(self._unusable)} unusable hashes > {self.max_unusable}")

    # ---------------------------------------------------------------- internals
    def _padded(self, tokens: bytes) -> bytes:
        """A key's tokens as its file holds them: 4 x block_size bytes, a shorter key's (a
        snapshot's tail) padded with 0xFFFFFFFF words. The key's hash and prefix digest cover
        its exact tokens, so two keys that pad alike never load each other's file."""
        return tokens + _PAD * (self.block_size - len(tokens) // 4)

    def _path(self, block_hash: int) -> Path:
        name = f"{block_hash:016x}"
        return self.directory / name[:2] / f"{name}{SUFFIX}"

    def _remember_unusable(self, block_hash: int) -> None:
        self._unusable[block_hash] = None
        self._counts["num_unusable"] += 1
        if len(self._unusable) > self.max_unusable:
            del self._unusable[next(iter(self._unusable))]

    def _forget(self, block_hash: int) -> None:
        if self._entries.remove(block_hash) is not None and self.on_removed is not None:
            self.on_removed(block_hash)

    def _touch(self, key: BlockKey) -> None:
        """The file becomes the most recently used (indexed if it was not: written just now, or
        by another process), and the index is kept within the budget."""
        block_hash = key.block_hash
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._entries.touch(entry)
        else:
            self._entries.add(LruEntry(block_hash))
            if self.on_stored is not None:
                self.on_stored(key)
        self.evict(self.num_bytes - self.budget_bytes, keep=block_hash)
        self.evict(self.num_bytes - self.budget_bytes)  # only pinned files left: this one too

    def _read_into(self, f: Any, key: BlockKey, view: memoryview) -> str | None:
        """Read an open block file into `view`, checking it against `key`: None if it is the
        block, else why not: "damaged" (truncated, or fails its checksum), "layout" (a whole file
        of another model or layout), "collision" (a whole block of another prefix)."""
        head = f.read(HEADER.size + 4 * self.block_size)
        if len(head) < HEADER.size or head[: len(MAGIC)] != MAGIC:
            return "damaged"
        _, fingerprint, h, parent, has_parent, n, nbytes, digest = HEADER.unpack_from(head)
        if n != self.block_size or nbytes != self.block_nbytes:
            declared = HEADER.size + 4 * n + nbytes + CHECKSUM.size
            return "layout" if os.fstat(f.fileno()).st_size == declared else "damaged"
        if len(head) != HEADER.size + 4 * n or _read_exact(f, view) != nbytes:
            return "damaged"
        tail = f.read(CHECKSUM.size + 1)
        if tail != self._checksum((head, view)):
            return "damaged"
        if fingerprint != self.fingerprint:
            return "layout"
        stored = (h, parent if has_parent else None, bytes(head[HEADER.size :]), digest)
        wanted = (key.block_hash, key.parent_hash, self._padded(key.tokens), key.prefix_digest)
        if stored != wanted:
            return "collision"  # left in place: it is some prefix's block
        return None

    def _checksum(self, parts: Sequence[Any]) -> bytes:
        """The checksum field over `parts`: xxh3-64, or blake2b-64 keyed by the secret."""
        if self._secret is None:
            h = xxhash.xxh3_64()
            for part in parts:
                h.update(part)
            return CHECKSUM.pack(h.intdigest())
        mac = hashlib.blake2b(key=self._secret, digest_size=CHECKSUM.size)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def _remove_damaged(self, path: Path, inode: int, why: str) -> None:
        """One warning, and the file goes (unless another process has replaced it since)."""
        self._counts["num_damaged"] += 1
        what = "is truncated or corrupt" if why == "damaged" else "holds another model or layout"
        logger.warning("KV block file %s %s: skipped and removed", path, what)
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode:
                os.unlink(path)

    def _write_fingerprint(self, fingerprint: Mapping[str, Any]) -> None:
        path = self.directory / FINGERPRINT_FILE
        if path.exists():
            return
        tmp = path.with_name(f".fingerprint.{_HOST}.{os.getpid()}.0.json{TMP_SUFFIX}")
        text = json.dumps(fingerprint, sort_keys=True, indent=1) + "\n"
        try:
            with open(os.open(tmp, _OPEN_FOR_WRITE, _FILE_MODE), "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            logger.debug("could not write %s: %s", path, exc)

    def _scan_files(self) -> Iterator[tuple[int, os.DirEntry[str]]]:
        """(hash, entry) of every block file under the layout folder; removes leftovers of dead
        writers on the way."""
        with os.scandir(self.directory) as top:
            folders = []
            for entry in top:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(entry.path)
                elif entry.name.endswith(TMP_SUFFIX):
                    _remove_if_orphaned(entry)
        for folder in folders:
            with contextlib.suppress(FileNotFoundError), os.scandir(folder) as files:
                for entry in files:
                    if entry.name.endswith(TMP_SUFFIX):
                        _remove_if_orphaned(entry)
                    elif entry.name.endswith(SUFFIX) and len(entry.name) == 16 + len(SUFFIX):
                        with contextlib.suppress(ValueError):
                            yield int(entry.name[:16], 16), entry

    def _scan(self) -> None:
        """Index what is on disk, oldest mtime first (the least recently used); remove files whose
        size is not a block file's (truncated, or of another layout: one warning for all of
        them), and evict down to the budget."""
        found: list[tuple[int, int]] = []
        damaged = 0
        for block_hash, entry in self._scan_files():
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if st.st_size != self.file_nbytes or not stat.S_ISREG(st.st_mode):
                damaged += 1
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                continue
            found.append((st.st_mtime_ns, block_hash))
        for _, block_hash in sorted(found):
            self._entries.add(LruEntry(block_hash))
        if damaged:
            self._counts["num_damaged"] += damaged
            logger.warning(
                "removed %d truncated or foreign KV block files from %s", damaged, self.directory
            )
        self.evict(self.num_bytes - self.budget_bytes)


def _layout_name(fingerprint: bytes, secret: bytes | None) -> str:
    """The layout folder's name: the fingerprint's digest, keyed by the secret if any."""
    if secret is None:
        return fingerprint.hex()[:32]
    return hashlib.blake2b(b"radixkv-layout:" + fingerprint, key=secret, digest_size=16).hexdigest()


def _write_all(f: Any, parts: Sequence[Any]) -> None:
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            view = view[f.write(view) :]


def _read_exact(f: Any, view: memoryview) -> int:
    """Fill `view` from `f`; returns the bytes read (fewer only at the end of the file)."""
    done = 0
    while done < view.nbytes:
        n = f.readinto(view[done:])
        if not n:
            break
        done += n
    return done


def _remove_if_orphaned(entry: os.DirEntry[str]) -> None:
    """Remove a temporary file whose writer is gone: a process of this host that no longer runs,
    or (another host's, which cannot be asked) one older than FOREIGN_TMP_MAX_AGE_S. Temporary
    names are `.<name>.<host>.<pid>.<n>.<suffix>.tmp`, the host without dots."""
    parts = entry.name.split(".")
    if len(parts) != 7 or not parts[3].isdigit():
        return
    try:
        if parts[2] == _HOST:
            orphaned = not _process_alive(int(parts[3]))
        else:
            orphaned = time.time() - entry.stat().st_mtime > FOREIGN_TMP_MAX_AGE_S
        if orphaned:
            os.unlink(entry.path)
    except OSError:
        pass  # gone already, or not ours to remove


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True

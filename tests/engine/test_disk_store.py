"""The disk tier's store: content-addressed block files, checked on load, atomic, shared, budgeted.

Every test calls `check_integrity()` after the store's operations (the `store` factory wraps it).
Processes that share a directory or die mid-write are real processes (`subprocess`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from lifecycle import CheckedCache as Checked

from radixkv.cache.keys import BlockKey, chain_hashes, chain_keys, namespace_seed
from radixkv.engine.tiers.disk_store import (
    CHECKSUM,
    FOREIGN_TMP_MAX_AGE_S,
    HEADER,
    DiskStore,
    fingerprint_digest,
)

B = 4  # tokens per block
NBYTES = 96  # payload bytes per block
FINGERPRINT = {"model": "tiny", "dtype": "float32", "block_size": B, "layers": 2}
FILE = HEADER.size + 4 * B + NBYTES + CHECKSUM.size


MakeStore = Callable[..., Any]


@pytest.fixture
def make_store(tmp_path: Path) -> MakeStore:
    def make(
        budget_files: int = 64, fingerprint: dict | None = None, root: Path | None = None
    ) -> Any:
        store = DiskStore(
            root or tmp_path,
            fingerprint or FINGERPRINT,
            block_size=B,
            block_nbytes=NBYTES,
            budget_bytes=budget_files * FILE,
        )
        store.check_integrity()
        return Checked(store)

    return make


def tokens(*ids: int) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def payload(key: BlockKey) -> np.ndarray:
    """A payload that is a function of the key, so any process can check what it loaded."""
    rng = np.random.default_rng(key.block_hash)
    return rng.integers(0, 256, NBYTES, dtype=np.uint8)


def load(store: Any, key: BlockKey) -> np.ndarray | None:
    out = np.zeros(NBYTES, dtype=np.uint8)
    return out if store.get(key, out) else None


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


def keys_of(namespace: str | None, n_blocks: int, first: int = 1) -> list[BlockKey]:
    return chain_keys(namespace, tokens(*range(first, first + n_blocks * B)), B)


# ------------------------------------------------------------------------------------ keys
def test_keys_are_the_kv_events_chain_and_continue_where_they_left_off() -> None:
    toks = tokens(*range(100, 100 + 5 * B))
    for namespace in (None, "tenant-a"):
        keys = chain_keys(namespace, toks, B)
        seed = None if namespace is None else namespace_seed(namespace)
        assert [k.block_hash for k in keys] == chain_hashes(seed, toks, B)
        # as the KV events say it: a first block has no parent (its namespace seeds its hash)
        assert keys[0].parent_hash is None
        assert [k.parent_hash for k in keys[1:]] == [k.block_hash for k in keys[:-1]]
        assert [k.tokens for k in keys] == [toks[4 * B * i : 4 * B * (i + 1)] for i in range(5)]
        # Hashing the next full blocks past what is known: the same keys.
        assert chain_keys("ignored", toks[8 * B :], B, after=keys[1]) == keys[2:]


def test_equal_prefixes_of_two_namespaces_share_no_key() -> None:
    toks = tokens(*range(3 * B))
    a, b, shared, empty = (chain_keys(ns, toks, B) for ns in ("a", "b", None, ""))
    for one, other in ((a, b), (a, shared), (shared, empty)):
        for x, y in zip(one, other, strict=True):
            assert x.block_hash != y.block_hash and x.prefix_digest != y.prefix_digest


def test_fingerprint_digest_is_canonical() -> None:
    assert fingerprint_digest({"a": 1, "b": [1, 2]}) == fingerprint_digest({"b": [1, 2], "a": 1})
    assert fingerprint_digest({"a": 1}) != fingerprint_digest({"a": 2})


# ------------------------------------------------------------------------------- round trip
def test_blocks_round_trip_and_survive_a_restart(make_store: MakeStore, tmp_path: Path) -> None:
    store = make_store()
    keys = keys_of("t", 4)
    for key in keys:
        assert store.put(key, payload(key))
    assert store.put(keys[0], payload(keys[0]))  # already there: nothing written again
    assert store.stats().num_stored == 4 and store.num_files == 4
    assert len(block_files(tmp_path)) == 4
    for key in keys:
        np.testing.assert_array_equal(load(store, key), payload(key))
    # A fresh process: it finds every block by hashing the prompt again.
    again = make_store()
    assert again.num_files == 4 and again.num_bytes == 4 * FILE
    assert again.probe(keys_of("t", 6)) == 4
    for key in keys:
        np.testing.assert_array_equal(load(again, key), payload(key))
    fingerprint = (again.directory / "fingerprint.json").read_text()
    assert '"model": "tiny"' in fingerprint


def test_a_missing_block_is_a_quiet_miss(make_store: MakeStore, caplog) -> None:
    store = make_store()
    key = keys_of(None, 1)[0]
    with caplog.at_level(logging.WARNING):
        assert load(store, key) is None
        assert not store.contains(key.block_hash) and store.probe([key]) == 0
    assert not caplog.records


# ---------------------------------------------------------------------- tenants on disk
def test_a_fresh_process_of_another_tenant_never_loads_its_files(
    make_store: MakeStore, tmp_path: Path
) -> None:
    writer = make_store()
    a_keys = keys_of("tenant-a", 3)
    for key in a_keys:
        writer.put(key, payload(key))
    reader = make_store()  # a fresh process, same directory
    b_keys = keys_of("tenant-b", 3)  # the very same tokens under another salt
    assert reader.probe(b_keys) == 0
    assert all(load(reader, key) is None for key in b_keys)
    # Even a file renamed to tenant b's name (a forged collision) is not loaded: its parent hash,
    # tokens' prefix digest and chain are tenant a's. It is whole, so it stays.
    a_path, b_path = (writer.inner._path(k.block_hash) for k in (a_keys[0], b_keys[0]))
    b_path.parent.mkdir(exist_ok=True)
    os.replace(a_path, b_path)
    fresh = make_store()
    assert fresh.contains(b_keys[0].block_hash)
    assert load(fresh, b_keys[0]) is None
    assert b_path.exists() and fresh.stats().num_damaged == 0


def test_a_64_bit_collision_with_equal_tokens_is_caught_by_the_prefix_digest(
    make_store: MakeStore,
) -> None:
    store = make_store()
    key = keys_of("t", 2)[1]
    store.put(key, payload(key))
    # Another prefix whose chain hash collides (forged: same hash, parent and tokens).
    forged = replace(key, prefix_digest=bytes(32))
    assert load(store, forged) is None
    np.testing.assert_array_equal(load(store, key), payload(key))
    other_tokens = replace(key, tokens=tokens(9, 9, 9, 9))
    other_parent = replace(key, parent_hash=12345)
    assert load(store, other_tokens) is None and load(store, other_parent) is None


# ------------------------------------------------------------------ fingerprints, damage
def test_another_model_or_layout_uses_another_folder_and_is_never_loaded(
    make_store: MakeStore, caplog
) -> None:
    mine = make_store()
    key = keys_of("t", 1)[0]
    mine.put(key, payload(key))
    other = make_store(fingerprint={**FINGERPRINT, "dtype": "bfloat16"})
    assert other.directory != mine.directory
    assert not other.contains(key.block_hash) and load(other, key) is None
    # A file copied into the other layout's folder by hand: its header says whose it is.
    target = other.inner._path(key.block_hash)
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(mine.inner._path(key.block_hash).read_bytes())
    with caplog.at_level(logging.WARNING, logger="radixkv.engine.tiers.disk_store"):
        assert load(other, key) is None
        assert load(other, key) is None
    assert len(caplog.records) == 1 and "another model or layout" in caplog.text
    assert not target.exists() and other.stats().num_damaged == 1
    np.testing.assert_array_equal(load(mine, key), payload(key))


@pytest.mark.parametrize("where", ["header", "tokens", "payload", "checksum"])
def test_a_corrupt_file_is_skipped_with_one_warning_and_removed(
    make_store: MakeStore, caplog, where: str
) -> None:
    store = make_store()
    key = keys_of("t", 1)[0]
    store.put(key, payload(key))
    path = store.inner._path(key.block_hash)
    data = bytearray(path.read_bytes())
    at = {"header": 20, "tokens": HEADER.size + 1, "payload": FILE - 20, "checksum": FILE - 1}
    data[at[where]] ^= 0x40
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="radixkv.engine.tiers.disk_store"):
        assert load(store, key) is None
        assert load(store, key) is None  # gone: a quiet miss now
    assert len(caplog.records) == 1 and "truncated or corrupt" in caplog.text
    assert not path.exists() and not store.contains(key.block_hash)
    assert store.stats().num_damaged == 1


def test_a_truncated_file_is_caught_at_load_and_at_the_next_open(
    make_store: MakeStore, caplog, tmp_path: Path
) -> None:
    store = make_store()
    keys = keys_of("t", 4)
    for key in keys:
        store.put(key, payload(key))
    paths = [store.inner._path(k.block_hash) for k in keys]
    with open(paths[0], "r+b") as f:  # truncated after this process indexed it
        f.truncate(FILE - 7)
    with caplog.at_level(logging.WARNING, logger="radixkv.engine.tiers.disk_store"):
        assert load(store, keys[0]) is None
    assert len(caplog.records) == 1 and not paths[0].exists()
    caplog.clear()
    for path in paths[1:3]:  # two more, found by the next process's scan: one warning for both
        with open(path, "r+b") as f:
            f.truncate(HEADER.size)
    with caplog.at_level(logging.WARNING, logger="radixkv.engine.tiers.disk_store"):
        fresh = make_store()
    assert len(caplog.records) == 1 and "removed 2" in caplog.text
    assert fresh.num_files == 1 and block_files(tmp_path) == [paths[3]]
    np.testing.assert_array_equal(load(fresh, keys[3]), payload(keys[3]))


# --------------------------------------------------------- files that cannot be used
def unusable_in_place_of(path: Path, kind: str, other: Path) -> None:
    """Make the block file `path` one that exists and cannot be loaded (the ways a co-writer, a
    restore under the wrong name or a failing disk do it; `other` is another block's file)."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":  # to a whole block file: a link is never followed
        path.symlink_to(other)
    elif kind == "directory":
        path.mkdir()
    else:
        assert kind == "swapped"  # another prefix's block under this name
        path.write_bytes(other.read_bytes())


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory", "swapped"])
def test_a_file_that_cannot_be_loaded_is_a_miss_and_is_not_offered_again(
    make_store: MakeStore, kind: str
) -> None:
    """It stays in place (not ours to remove, or some prefix's block), so the store remembers it:
    a request that missed it recomputes instead of probing it again, until this process writes
    that block itself. A FIFO cannot hang the reader."""
    store = make_store()
    keys = keys_of("t", 3)
    for key in keys:
        store.put(key, payload(key))
    path, other = (store.inner._path(k.block_hash) for k in keys[1:])
    unusable_in_place_of(path, kind, other)
    assert store.probe(keys) == 3  # indexed: the store does not know yet
    assert load_or_hang(store, keys[1]) is None
    assert os.path.lexists(path)
    assert not store.contains(keys[1].block_hash) and store.probe(keys) == 1
    assert store.stats().num_unusable == 1
    fresh = make_store()  # another process: its scan removes what is not a regular file
    assert fresh.probe(keys) == (3 if kind == "swapped" else 1)
    if kind != "directory":  # this process writes the block itself: offered again
        assert store.put(keys[1], payload(keys[1])) and store.probe(keys) == 3
        np.testing.assert_array_equal(load(store, keys[1]), payload(keys[1]))


def test_a_file_this_user_may_not_read_is_a_miss_and_is_not_probed_again() -> None:
    """Another user's 0600 file in a folder both may enter (an older, shared deployment): the
    reader, a forked child of another user (the test's own user cannot be denied as root) or
    this user with the file's mode cleared, finds it, misses it once and never offers it again."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="radixkv-shared-"))
    try:
        writer = DiskStore(
            root, FINGERPRINT, block_size=B, block_nbytes=NBYTES, budget_bytes=FILE * 8
        )
        keys = keys_of("t", 3)
        for key in keys:
            writer.put(key, payload(key))
        for folder in (root, *(p for p in root.rglob("*") if p.is_dir())):
            folder.chmod(0o755)
        if os.geteuid() != 0:
            writer._path(keys[1].block_hash).chmod(0)
        assert in_a_child_of_another_user(lambda: read_back_once(root, keys)) == 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_unusable_files_remembered_are_bounded_by_the_budget(make_store: MakeStore) -> None:
    """A folder others keep filling with files that cannot be loaded must not grow the store's
    memory without end: it remembers at most as many as its budget holds files, the oldest
    forgotten first (and then read, and refused, again)."""
    store = make_store(budget_files=3)
    keys = keys_of("t", 6)
    other = store.inner._path(keys[0].block_hash)
    store.put(keys[0], payload(keys[0]))
    for key in keys[1:]:
        store.put(key, payload(key))
        unusable_in_place_of(store.inner._path(key.block_hash), "swapped", other)
        assert load(store, key) is None
    assert store.stats().num_unusable == 5
    assert len(store.inner._unusable) == 3  # checked by every call's check_integrity too
    assert list(store.inner._unusable) == [k.block_hash for k in keys[3:]]
    assert store.contains(keys[1].block_hash)  # forgotten: offered, and refused, again
    assert load(store, keys[1]) is None and not store.contains(keys[1].block_hash)


def read_back_once(root: Path, keys: list[BlockKey]) -> None:
    store = DiskStore(root, FINGERPRINT, block_size=B, block_nbytes=NBYTES, budget_bytes=FILE * 8)
    assert store.probe(keys) == 3
    assert load(store, keys[1]) is None
    assert store.probe(keys) == 1 and not store.contains(keys[1].block_hash)
    assert store.stats().num_unusable == 1
    store.check_integrity()


def in_a_child_of_another_user(check: Callable[[], None]) -> int:
    """Run `check` in a forked child, as user nobody when this process is root; its exit status
    (0: it held; its error on stderr)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            check()
            status = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(status)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def load_or_hang(store: Any, key: BlockKey) -> np.ndarray | None:
    """`load` in a daemon thread: a reader that blocks fails the test instead of hanging it."""
    result: list[Any] = []
    reader = threading.Thread(target=lambda: result.append(load(store, key)), daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert not reader.is_alive(), "the read blocked"
    return result[0]


# ------------------------------------------------------------------- who may read them
def test_files_and_folders_are_the_engines_users_alone(tmp_path: Path) -> None:
    """The files hold prompts' token ids in clear: 0600 files in 0700 folders, whatever the
    umask (a folder the user made beforehand keeps its own mode)."""
    old = os.umask(0o022)
    try:
        root = tmp_path / "kv"
        store = DiskStore(root, FINGERPRINT, block_size=B, block_nbytes=NBYTES, budget_bytes=FILE)
        key = keys_of("t", 1)[0]
        assert store.put(key, payload(key))
    finally:
        os.umask(old)
    path = store._path(key.block_hash)
    for folder in (root, store.directory, path.parent):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    for file in (path, store.directory / "fingerprint.json"):
        assert file.stat().st_mode & 0o777 == 0o600, file


def forge(path: Path, new_payload: bytes) -> None:
    """Replace a block file's payload and recompute its unkeyed checksum, as a co-writer of the
    folder who knows the format (not a key) can."""
    import xxhash

    head = path.read_bytes()[: HEADER.size + 4 * B]
    checksum = xxhash.xxh3_64(head + new_payload).intdigest()
    path.write_bytes(head + new_payload + CHECKSUM.pack(checksum))


def test_a_keyed_checksum_refuses_a_forged_payload(tmp_path: Path) -> None:
    def open_store(secret: bytes | None) -> Any:
        store = DiskStore(
            tmp_path, FINGERPRINT, block_size=B, block_nbytes=NBYTES, budget_bytes=8 * FILE,
            secret=secret,
        )  # fmt: skip
        return Checked(store)

    key = keys_of("t", 1)[0]
    forged = bytes(NBYTES)
    plain = open_store(None)
    plain.put(key, payload(key))
    forge(plain.inner._path(key.block_hash), forged)
    np.testing.assert_array_equal(load(plain, key), np.frombuffer(forged, np.uint8))  # served
    keyed = open_store(b"deployment secret")
    assert keyed.directory != plain.directory  # never each other's files
    keyed.put(key, payload(key))
    np.testing.assert_array_equal(load(keyed, key), payload(key))
    forge(keyed.inner._path(key.block_hash), forged)
    assert load(keyed, key) is None and keyed.stats().num_damaged == 1
    other = open_store(b"another secret")
    assert other.directory not in (keyed.directory, plain.directory)
    assert not other.contains(key.block_hash)
    again = open_store(b"deployment secret")  # the same key finds the same folder
    assert again.directory == keyed.directory


# ---------------------------------------------------------------------------- the budget
def test_the_budget_evicts_least_recently_used_files_first(
    make_store: MakeStore, tmp_path: Path
) -> None:
    store = make_store(budget_files=3)
    a, b, c, d, e = keys_of("t", 5)
    for key in (a, b, c):
        store.put(key, payload(key))
    assert load(store, a) is not None  # a is now the most recent: b goes first
    store.put(d, payload(d))
    assert [store.contains(k.block_hash) for k in (a, b, c, d)] == [True, False, True, True]
    store.put(e, payload(e))  # then c
    assert {p.stem for p in block_files(tmp_path)} == {f"{k.block_hash:016x}" for k in (a, d, e)}
    assert store.num_bytes == 3 * FILE == sum(p.stat().st_size for p in block_files(tmp_path))
    assert store.stats().num_evicted == 2


def test_a_file_pinned_for_a_planned_read_is_not_evicted(make_store: MakeStore) -> None:
    """A cache plans a read, then writes that make room: the file it will read must stay. With no
    room but pinned files, a write is refused (nothing stored) rather than evicting them."""
    store = make_store(budget_files=2)
    a, b, c = keys_of("t", 3)
    for key in (a, b):
        store.put(key, payload(key))
    store.pin([a.block_hash, b.block_hash])
    assert not store.put(c, payload(c)) and store.num_files == 2
    np.testing.assert_array_equal(load(store, a), payload(a))  # the read releases a's pin
    assert store.put(c, payload(c))  # a goes (b is still pinned)
    assert [store.contains(k.block_hash) for k in (a, b, c)] == [False, True, True]
    store.unpin([b.block_hash])
    store.put(a, payload(a))
    assert [store.contains(k.block_hash) for k in (a, b, c)] == [True, False, True]


def test_probing_changes_nothing_and_a_read_indexes_another_processes_file(
    make_store: MakeStore,
) -> None:
    mine, other = make_store(), make_store()
    key = keys_of("t", 1)[0]
    other.put(key, payload(key))
    assert mine.contains(key.block_hash) and mine.probe([key]) == 1
    assert mine.num_files == 0  # a probe is read-only
    np.testing.assert_array_equal(load(mine, key), payload(key))
    assert mine.num_files == 1


def test_recency_survives_a_restart_and_a_smaller_budget_evicts_the_oldest(
    make_store: MakeStore,
) -> None:
    store = make_store()
    keys = keys_of("t", 4)
    for i, key in enumerate(keys):
        store.put(key, payload(key))
        os.utime(store.inner._path(key.block_hash), ns=(10**9 * (i + 1),) * 2)
    assert load(store, keys[0]) is not None  # its mtime becomes now: the most recent
    smaller = make_store(budget_files=2)
    assert [smaller.contains(k.block_hash) for k in keys] == [True, False, False, True]
    assert smaller.num_files == 2


# --------------------------------------------------------------------- atomic writes
def test_a_failed_write_stores_nothing_and_leaves_nothing(
    make_store: MakeStore, caplog, monkeypatch, tmp_path: Path
) -> None:
    store = make_store()
    keys = keys_of("t", 3)

    def disk_full(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with caplog.at_level(logging.WARNING, logger="radixkv.engine.tiers.disk_store"):
        assert not store.put(keys[0], payload(keys[0]))
        assert not store.put(keys[1], payload(keys[1]))
    assert len(caplog.records) == 1  # the first failure warns; later ones are counted
    assert store.stats().num_write_errors == 2 and store.num_files == 0
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".json"]

    def interrupted(src: object, dst: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.put(keys[2], payload(keys[2]))
    assert store.num_files == 0
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".json"]


CHILD_PRELUDE = f"""
import os, sys, numpy as np
from radixkv.engine.tiers.disk_store import DiskStore
from radixkv.cache.keys import chain_keys
B, NBYTES, FILE = {B}, {NBYTES}, {FILE}
FINGERPRINT = {FINGERPRINT!r}
def payload(key):
    return np.random.default_rng(key.block_hash).integers(0, 256, NBYTES, dtype=np.uint8)
def open_store(root, budget_files):
    return DiskStore(root, FINGERPRINT, block_size=B, block_nbytes=NBYTES,
                     budget_bytes=budget_files * FILE)
"""


def run_child(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = CHILD_PRELUDE + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout
    )


def test_a_process_killed_mid_write_leaves_nothing_a_later_start_loads(
    make_store: MakeStore, tmp_path: Path
) -> None:
    """The child writes half a block file, then kills itself (SIGKILL: no cleanup runs)."""
    child = run_child(
        """
        import signal
        import radixkv.engine.tiers.disk_store as ds
        store = open_store(sys.argv[1], 8)
        key = chain_keys("t", np.arange(1, 1 + B, dtype="<u4").tobytes(), B)[0]
        def write_half_then_die(f, parts):
            f.write(parts[0])
            f.write(bytes(parts[2])[: NBYTES // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        ds._write_all = write_half_then_die
        store.put(key, payload(key))
        """,
        str(tmp_path),
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    leftovers = [p for p in tmp_path.rglob(".*.tmp")]
    assert len(leftovers) == 1 and not block_files(tmp_path)
    store = make_store()  # the next start: the dead writer's leftover is removed
    assert not list(tmp_path.rglob(".*.tmp"))
    key = keys_of("t", 1)[0]
    assert not store.contains(key.block_hash) and load(store, key) is None


def test_a_live_writers_temporary_file_is_left_alone(make_store: MakeStore) -> None:
    from radixkv.engine.tiers.disk_store import _HOST

    store = make_store()
    shard = store.directory / "ab"
    shard.mkdir()
    live = shard / f".ab00000000000000.{_HOST}.{os.getpid()}.0.kv.tmp"
    foreign_new = shard / ".ab00000000000001.elsewhere.1.0.kv.tmp"
    foreign_old = shard / ".ab00000000000002.elsewhere.1.0.kv.tmp"
    for path in (live, foreign_new, foreign_old):
        path.write_bytes(b"partial")
    old = os.stat(foreign_old).st_mtime - FOREIGN_TMP_MAX_AGE_S - 10
    os.utime(foreign_old, (old, old))
    make_store()
    assert live.exists() and foreign_new.exists() and not foreign_old.exists()


def test_processes_sharing_a_directory_never_corrupt_each_other(tmp_path: Path) -> None:
    """Three real processes put and get overlapping blocks at once, under budgets small enough
    that they evict each other's files: every block one of them loads is exactly the one it asked
    for, and every file left is whole."""
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                CHILD_PRELUDE
                + textwrap.dedent(
                    """
                    import random
                    root, seed = sys.argv[1], int(sys.argv[2])
                    rng = random.Random(seed)
                    store = open_store(root, 12)
                    keys = chain_keys("shared", np.arange(1, 1 + 40 * B, dtype="<u4").tobytes(), B)
                    loaded = bad = 0
                    for _ in range(600):
                        key = rng.choice(keys)
                        if rng.random() < 0.5:
                            store.put(key, payload(key))
                        else:
                            out = np.zeros(NBYTES, np.uint8)
                            if store.get(key, out):
                                loaded += 1
                                bad += int(not np.array_equal(out, payload(key)))
                        store.check_integrity()
                    print(loaded, bad, store.stats().num_damaged)
                    """
                ),
                str(tmp_path),
                str(seed),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(3)
    ]
    results = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
        results.append(tuple(int(x) for x in out.split()))
    assert all(loaded > 0 and bad == 0 and damaged == 0 for loaded, bad, damaged in results)
    assert not list(tmp_path.rglob(".*.tmp"))
    survey = DiskStore(tmp_path, FINGERPRINT, block_size=B, block_nbytes=NBYTES, budget_bytes=10**9)
    keys = chain_keys("shared", np.arange(1, 1 + 40 * B, dtype="<u4").tobytes(), B)
    present = [k for k in keys if survey.contains(k.block_hash)]
    assert present and survey.num_files == len(present) == len(block_files(tmp_path))
    for key in present:
        np.testing.assert_array_equal(load(survey, key), payload(key))
    assert survey.stats().num_damaged == 0


UNPICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}


def unpickling_lines(source: str) -> list[int]:
    """Lines of `source` that import a pickling module or call torch.load / numpy.load."""
    import ast

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            bad = any(a.name.split(".")[0] in UNPICKLERS for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            bad = (node.module or "").split(".")[0] in UNPICKLERS
        elif isinstance(node, ast.Attribute):
            bad = node.attr == "load" and ast.unparse(node.value) in {"torch", "np", "numpy"}
        else:
            continue
        if bad:
            lines.append(node.lineno)
    return lines


# The one module that unpickles: the engine process's messages, through an unpickler that
# resolves only the project's own names (tests/serve/test_wire.py tries to get past it).
WIRE = "radixkv/serve/wire.py"


def test_nothing_in_the_library_can_unpickle() -> None:
    """No pickle but the engine's wire: a KV directory may be shared, and loading a pickle runs
    code."""
    import radixkv

    assert unpickling_lines("import pickle\nfrom dill import x\ny = torch.load(f)\n") == [1, 2, 3]
    root = Path(radixkv.__file__).parent.parent
    offenders = [
        f"{path.relative_to(root)}:{line}"
        for folder in ("radixkv", "kernels", "scheduler")
        for path in root.joinpath(folder).rglob("*.py")
        for line in unpickling_lines(path.read_text(encoding="utf-8"))
        if path.relative_to(root).as_posix() != WIRE
    ]
    assert not offenders
    assert unpickling_lines(root.joinpath(WIRE).read_text(encoding="utf-8"))  # it is that file


# ------------------------------------------------------------------ property-based
class StoreMachine(RuleBasedStateMachine):
    """Random puts, gets, discards, damage and restarts against a reference model: a dict of
    what must be on disk, kept in LRU order under the same budget."""

    @initialize(budget=st.integers(1, 6))
    def start(self, budget: int) -> None:
        import tempfile

        self.root = Path(tempfile.mkdtemp(prefix="radixkv-store-"))
        self.budget = budget
        self.keys = keys_of("m", 10) + keys_of(None, 4, first=7)
        self.model: dict[int, BlockKey] = {}  # hash -> key, least recently used first
        self.store = self._open()

    def _open(self) -> DiskStore:
        store = DiskStore(
            self.root,
            FINGERPRINT,
            block_size=B,
            block_nbytes=NBYTES,
            budget_bytes=self.budget * FILE,
        )
        store.check_integrity()
        return store

    def _use(self, key: BlockKey) -> None:
        self.model.pop(key.block_hash, None)
        self.model[key.block_hash] = key
        while len(self.model) > self.budget:
            del self.model[next(iter(self.model))]

    @rule(i=st.integers(0, 13))
    def put(self, i: int) -> None:
        key = self.keys[i]
        assert self.store.put(key, payload(key))
        self._use(key)

    @rule(i=st.integers(0, 13))
    def get(self, i: int) -> None:
        key = self.keys[i]
        got = load(self.store, key)
        if key.block_hash in self.model:
            np.testing.assert_array_equal(got, payload(key))
            self._use(key)
        else:
            assert got is None

    @rule(i=st.integers(0, 13))
    def discard(self, i: int) -> None:
        self.store.discard(self.keys[i].block_hash)
        self.model.pop(self.keys[i].block_hash, None)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def damage(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.model)))
        path = self.store._path(h)
        raw = bytearray(path.read_bytes())
        raw[data.draw(st.integers(0, FILE - 1))] ^= 1
        path.write_bytes(bytes(raw))
        assert load(self.store, self.model.pop(h)) is None

    @rule()
    def restart(self) -> None:
        # mtimes are too coarse to order files written within a tick: give the model's order
        for i, h in enumerate(self.model):
            os.utime(self.store._path(h), ns=(10**9 * (i + 1),) * 2)
        self.store = self._open()

    @invariant()
    def matches_the_model(self) -> None:
        self.store.check_integrity()
        assert set(self.store._entries) == set(self.model)
        on_disk = {int(p.stem, 16) for p in block_files(self.root)}
        assert on_disk == set(self.model)

    def teardown(self) -> None:
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

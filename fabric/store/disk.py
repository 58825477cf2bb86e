"""Disk tier of the chunk store: one checksummed file per chunk, LRU within a byte budget.

Chunks evicted from the memory pool (or written through) are kept here so they
survive eviction and engine restarts. Layout under the directory, derived only
from the hex of the 16-byte key, so no key can name a path outside it::

    <dir>/
      .tmp-<pid>-<random>                 a put in flight (removed at start)
      3f/
        3fa94c...e1.chunk                 <32 hex chars of the key>.chunk
      a0/
        a0...

One chunk file (little-endian, ``HEADER_BYTES`` = 48)::

    offset  0        4        6        8                24       32         40        48
            +--------+--------+--------+----------------+--------+----------+---------+---------
            | "FBCK" | version| flags=0| key (16 bytes) | nbytes | checksum | hdr sum | payload
            |        |  u16   |  u16   |                |  u64   |   u64    |   u64   | (nbytes)
            +--------+--------+--------+----------------+--------+----------+---------+---------

``checksum`` is the xxh3-64 of the payload (:func:`fabric.store.checksum.checksum`),
``hdr sum`` the xxh3-64 of the 40 header bytes before it. A file is corrupt when
its magic, version, flags, header checksum, or key-vs-file-name is wrong, when its size
is not ``HEADER_BYTES + nbytes`` (torn write), or when its payload does not match
``checksum`` on read. Corrupt files are counted, deleted and never returned.

- ``put`` writes a temp file in the directory and ``os.replace``\\ s it into
  place, so a reader sees a whole file or none. Two puts of the same key never
  write at once: the second waits for the first, then dedups (or retries if the
  first failed).
- The budget counts header + payload bytes of indexed files plus puts in flight;
  ``put`` evicts least-recently-used files to make room. A file's mtime is its
  last use (set from ``clock`` on write and on every hit), so the LRU order
  survives a restart: at start the index is rebuilt from headers and mtimes.
- One directory belongs to one ``DiskTier``: start-up removes every leftover
  temp file, including another live process's.

NOTE: no fsync by default. This is a cache: a file torn by a crash or power loss
fails its size or checksum check on the next start or read, and costs only a
recompute. ``fsync=True`` makes each put durable before it returns (slow).

Thread safety: one lock guards the index and counters. Payload reads, writes,
hashing and unlinks happen outside it (a slow filesystem must not stall
``contains``, which the transfer server's loop asks, nor the next put): a key
whose file is being unlinked (evicted, removed, corrupt, cleared) is dropped
from the index at once and holds its writer slot until the unlink is done,
so a put of that key waits for it and a new file of it is never deleted.
``table_sizes`` takes no lock at all (the model runner gauges it every step).
"""

from __future__ import annotations

import contextlib
import enum
import io
import logging
import os
import re
import secrets
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fabric.errors import ConfigError, StoreError
from fabric.kv.keys import KEY_BYTES
from fabric.store.checksum import checksum as compute_checksum

__all__ = ["FORMAT_VERSION", "HEADER_BYTES", "MAGIC", "DiskStats", "DiskTier"]

logger = logging.getLogger(__name__)

MAGIC = b"FBCK"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<4sHH16sQQ")  # the part the header checksum covers
_HEADER = struct.Struct("<4sHH16sQQQ")
HEADER_BYTES = _HEADER.size

_U64_MAX = 2**64 - 1
_TEMP_NAME = re.compile(r"\.tmp-\d+-[0-9a-f]+")
_CHUNK_NAME = re.compile(r"([0-9a-f]{32})\.chunk")
_SUBDIR_NAME = re.compile(r"[0-9a-f]{2}")


@dataclass(frozen=True)
class DiskStats:
    """Current occupancy and counters since start.

    ``bytes`` counts header + payload of indexed files (what the budget bounds).
    Every ``read_into`` is a hit or a miss; a corrupt file found on read is a
    miss and also counted in ``corrupt``, as is one dropped at start.
    ``evictions`` counts files dropped for the budget (``remove``/``clear``
    are not evictions).
    """

    files: int
    bytes: int
    budget_bytes: int
    hits: int
    misses: int
    writes: int
    write_failures: int
    evictions: int
    corrupt: int


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_failures: int = 0
    evictions: int = 0
    corrupt: int = 0


@dataclass(eq=False, slots=True)
class _Entry:
    """An indexed file. Compared by identity: a re-put key gets a new entry."""

    nbytes: int

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.nbytes


@dataclass(frozen=True)
class _Header:
    nbytes: int
    checksum: int


class _Read(enum.Enum):
    """Outcome of reading one file: all but OK are misses."""

    OK = "ok"
    GONE = "gone"  # the file vanished: drop the entry
    FAILED = "failed"  # an I/O error that says nothing about the file: keep it
    CORRUPT = "corrupt"  # counted, dropped, deleted


class DiskTier:
    """Chunk key -> file under ``path``, bounded by ``budget_bytes``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        budget_bytes: int,
        *,
        clock: Callable[[], float] = time.time,
        fsync: bool = False,
    ) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
            raise ConfigError(f"budget_bytes: expected an int, got {budget_bytes!r}")
        if budget_bytes <= 0:
            raise ConfigError(f"budget_bytes: must be > 0, got {budget_bytes}")
        self.root = _prepare_root(path)
        self.budget_bytes = budget_bytes
        self._clock = clock
        self._fsync = fsync
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU order, oldest first
        self._used = 0
        self._in_flight = 0  # bytes of puts writing now, counted against the budget
        self._writers: dict[bytes, threading.Event] = {}
        self._counters = _Counters()
        self._closed = False
        self._rebuild()

    # --- queries

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` has a file. No LRU touch, no stats."""
        _key_hex(key)
        with self._lock:
            return key in self._index

    def nbytes(self, key: bytes) -> int | None:
        """Payload size of ``key``, or None when absent."""
        _key_hex(key)
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else entry.nbytes

    def leading_present(self, keys: Sequence[bytes]) -> int:
        """How many of the leading ``keys`` are present (stops at the first absent one)."""
        for k in keys:
            _key_hex(k)
        with self._lock:
            count = 0
            for k in keys:
                if k not in self._index:
                    break
                count += 1
            return count

    def keys(self) -> list[bytes]:
        """Present keys, least recently used first."""
        with self._lock:
            return list(self._index)

    def stats(self) -> DiskStats:
        """Occupancy and counters (also after ``close``)."""
        with self._lock:
            c = self._counters
            return DiskStats(
                files=len(self._index),
                bytes=self._used,
                budget_bytes=self.budget_bytes,
                hits=c.hits,
                misses=c.misses,
                writes=c.writes,
                write_failures=c.write_failures,
                evictions=c.evictions,
                corrupt=c.corrupt,
            )

    # --- writes

    def put(self, key: bytes, data: Any, checksum: int) -> bool:
        """Store ``data`` (a C-contiguous buffer) as ``key``; True when it is present after.

        ``checksum`` is the caller's xxh3-64 of ``data``. A present key is not
        rewritten (dedup, marked used). Returns False, never raising OSError,
        when the chunk exceeds the budget, the budget is held by puts in flight,
        or the write fails (counted in ``write_failures``).
        """
        name = _key_hex(key)
        view = _byte_view(data, writable=False)
        if isinstance(checksum, bool) or not isinstance(checksum, int):
            raise TypeError(f"checksum must be an int, got {checksum!r}")
        if not 0 <= checksum <= _U64_MAX:
            raise ValueError(f"checksum must fit in u64, got {checksum}")
        size = HEADER_BYTES + view.nbytes
        while True:
            evicted: list[bytes] = []
            unlinking = None
            with self._lock:
                self._check_open()
                if key in self._index:
                    self._index.move_to_end(key)
                    break
                other = self._writers.get(key)
                if other is None:
                    room = self._make_room(size, evicted)
                    unlinking = self._hold_writers(evicted)
                    if room:
                        done = self._writers[key] = threading.Event()
                        self._in_flight += size
            self._unlink_held(evicted, unlinking)
            if other is None:
                if not room:
                    return False
                return self._write(key, name, view, checksum, done)
            # NOTE: the same key is being written: wait, then dedup against it,
            # or take over if it failed. Never two writers of one file.
            other.wait()
        _set_mtime(self._path(name), self._clock())
        return True

    def remove(self, key: bytes) -> bool:
        """Delete ``key``'s file; returns whether it was present."""
        _key_hex(key)  # NOTE: validates it
        with self._lock:
            self._check_open()
            entry = self._index.pop(key, None)
            if entry is None:
                return False
            self._used -= entry.file_bytes
            unlinking = self._hold_writers([key])
        self._unlink_held([key], unlinking)
        return True

    def clear(self) -> int:
        """Delete every chunk file; returns how many there were.

        The index is emptied at once; the files are unlinked after, outside
        the lock (thousands of unlinks must not stall ``contains``, ``stats``
        or a ``put`` of another key). Each key being unlinked holds its
        writer slot meanwhile, so a ``put`` of it waits and a new file of it
        is never deleted.
        """
        with self._lock:
            self._check_open()
            keys = list(self._index)
            self._index.clear()
            self._used = 0
            unlinking = self._hold_writers(keys)
        self._unlink_held(keys, unlinking)
        return len(keys)

    def table_sizes(self) -> dict[str, int]:
        """Puts and unlinks in flight, by key (name -> entries).

        NOTE: without the lock: ``len`` of a dict is atomic, and the model
        runner asks this every step (it must never wait for a put's evictions).
        """
        return {"disk_writers": len(self._writers)}

    # --- reads

    def read_into(self, key: bytes, out: Any) -> int | None:
        """Read ``key``'s payload into the writable buffer ``out``; its size, or None.

        ``out`` (memoryview, numpy array, CPU uint8 tensor...) must hold at
        least ``nbytes(key)`` bytes; the payload is read straight into it and
        verified against the header's checksum. None for an absent key and for
        a corrupt file (counted, deleted); ``out``'s contents are then
        unspecified. A hit marks the key most recently used.
        """
        name = _key_hex(key)
        target = _byte_view(out, writable=True)
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
            if entry is None:
                self._counters.misses += 1
                return None
        if target.nbytes < entry.nbytes:
            raise ValueError(f"out holds {target.nbytes} bytes, chunk has {entry.nbytes}")
        result = self._read_file(self._path(name), key, target[: entry.nbytes])
        with self._lock:
            current = self._index.get(key) is entry
            if result is _Read.OK:
                self._counters.hits += 1
                if current:
                    self._index.move_to_end(key)
                return entry.nbytes
            self._counters.misses += 1
            self._counters.corrupt += result is _Read.CORRUPT
            # NOTE: drop only the entry we read: a key evicted and re-put
            # meanwhile has a new file, which nobody has read yet.
            corrupt: list[bytes] = []
            if current and result is not _Read.FAILED:
                del self._index[key]
                self._used -= entry.file_bytes
                if result is _Read.CORRUPT:
                    corrupt.append(key)
            unlinking = self._hold_writers(corrupt)
        if corrupt:
            logger.warning("disk tier: corrupt chunk file %s deleted", self._path(name))
        self._unlink_held(corrupt, unlinking)
        return None

    # --- lifecycle

    def close(self) -> None:
        """Refuse further use (``stats`` still answers). Idempotent; holds no files."""
        with self._lock:
            self._closed = True

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- internals

    def _path(self, name: str) -> Path:
        return self.root / name[:2] / f"{name}.chunk"

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"disk tier {self.root} is closed")

    def _make_room(self, size: int, evicted: list[bytes]) -> bool:
        """Drop LRU entries until ``size`` more bytes fit (lock held); their
        keys go to ``evicted``, for the caller to unlink after the lock."""
        if size > self.budget_bytes:
            logger.debug("disk tier: %d-byte chunk exceeds the whole budget", size)
            return False
        while self._index and self._used + self._in_flight + size > self.budget_bytes:
            key, entry = self._index.popitem(last=False)
            self._used -= entry.file_bytes
            self._counters.evictions += 1
            evicted.append(key)
        if self._used + self._in_flight + size > self.budget_bytes:
            logger.debug("disk tier: puts in flight hold the budget; %d bytes refused", size)
            return False
        return True

    def _hold_writers(self, keys: list[bytes]) -> threading.Event | None:
        """Hold the writer slot of each of ``keys``, just dropped from the
        index, until ``_unlink_held`` deleted its file (lock held).

        NOTE: a key in the index has no writer (put indexes it last); holding
        the slot is what lets the unlink run after the lock: a put of the key
        waits for it, so the file it deletes is never the put's new one.
        """
        if not keys:
            return None
        unlinking = threading.Event()
        for key in keys:
            self._writers[key] = unlinking
        return unlinking

    def _unlink_held(self, keys: list[bytes], unlinking: threading.Event | None) -> None:
        """Delete the files of ``keys`` (lock not held), then free their writer slots."""
        if unlinking is None:
            return
        try:
            for key in keys:
                _remove_file(self._path(key.hex()))
        finally:
            with self._lock:
                for key in keys:
                    del self._writers[key]
            unlinking.set()

    def _write(
        self, key: bytes, name: str, view: memoryview, checksum: int, done: threading.Event
    ) -> bool:
        """Write the file of a put that holds ``key``'s writer slot; index it."""
        ok = False
        try:
            ok = self._write_file(key, name, view, checksum)
        finally:
            with self._lock:
                self._in_flight -= HEADER_BYTES + view.nbytes
                del self._writers[key]
                if ok:
                    self._index[key] = _Entry(view.nbytes)
                    self._used += HEADER_BYTES + view.nbytes
                    self._counters.writes += 1
                else:
                    self._counters.write_failures += 1
            done.set()
        return ok

    def _write_file(self, key: bytes, name: str, view: memoryview, checksum: int) -> bool:
        """Temp file + ``os.replace``; False (temp file removed) on OSError."""
        temp = self.root / f".tmp-{os.getpid()}-{secrets.token_hex(8)}"
        final = self._path(name)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            with open(fd, "wb", buffering=0) as f:
                _write_all(f, _encode_header(key, view.nbytes, checksum))
                _write_all(f, view)
                _set_mtime(f.fileno(), self._clock())
                if self._fsync:
                    os.fsync(f.fileno())
            final.parent.mkdir(exist_ok=True)
            os.replace(temp, final)
            if self._fsync:
                _fsync_dir(final.parent)
            return True
        except OSError as exc:
            logger.warning("disk tier: writing %s failed: %s", final, exc)
            temp.unlink(missing_ok=True)
            return False

    def _read_file(self, path: Path, key: bytes, target: memoryview) -> _Read:
        """Read and verify ``path``'s payload into ``target`` (exactly its size)."""
        try:
            with open(path, "rb", buffering=0) as f:
                header = _decode_header(f.read(HEADER_BYTES), key)
                if header is None or header.nbytes != target.nbytes:
                    return _Read.CORRUPT
                if os.fstat(f.fileno()).st_size != HEADER_BYTES + header.nbytes:
                    return _Read.CORRUPT
                if _fill(f, target) != target.nbytes:
                    return _Read.CORRUPT
                if compute_checksum(target) != header.checksum:
                    return _Read.CORRUPT
                _set_mtime(f.fileno(), self._clock())
                return _Read.OK
        except FileNotFoundError:
            return _Read.GONE
        except OSError as exc:
            logger.warning("disk tier: reading %s failed: %s", path, exc)
            return _Read.FAILED

    def _rebuild(self) -> None:
        """Drop temp files, index valid chunk files by mtime, enforce the budget."""
        for entry in os.scandir(self.root):
            if _TEMP_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                Path(entry.path).unlink(missing_ok=True)
        found: list[tuple[int, str, bytes, int]] = []
        for path in _chunk_files(self.root):
            scanned = _scan_file(path)
            if scanned is None:
                self._counters.corrupt += 1
                logger.warning("disk tier: corrupt chunk file %s deleted", path)
                path.unlink(missing_ok=True)
            else:
                found.append((scanned[0], path.name, *scanned[1:]))
        for _, _, key, nbytes in sorted(found):
            self._index[key] = _Entry(nbytes)
            self._used += HEADER_BYTES + nbytes
        evicted: list[bytes] = []
        with self._lock:
            self._make_room(0, evicted)
            unlinking = self._hold_writers(evicted)
        self._unlink_held(evicted, unlinking)


# --- files and headers


def _remove_file(path: Path) -> None:
    """Delete a chunk file; a missing one is fine, another failure is logged."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("disk tier: cannot delete %s: %s", path, exc)


def _prepare_root(path: str | os.PathLike[str]) -> Path:
    """Resolve, create and probe the directory; ConfigError naming ``path``."""
    root = Path(path).expanduser().resolve()
    if root.exists() and not root.is_dir():
        raise ConfigError(f"path: {root} exists and is not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".tmp-{os.getpid()}-{secrets.token_hex(8)}"
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"path: {root} is not a writable directory ({exc})") from exc
    return root


def _chunk_files(root: Path) -> list[Path]:
    """Paths that look like chunk files: ``<2 hex>/<32 hex>.chunk``."""
    paths = []
    for sub in os.scandir(root):
        if not (_SUBDIR_NAME.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False)):
            continue
        for entry in os.scandir(sub.path):
            if _CHUNK_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                paths.append(Path(entry.path))
    return paths


def _scan_file(path: Path) -> tuple[int, bytes, int] | None:
    """(mtime_ns, key, nbytes) of a valid chunk file's header and size; None if corrupt."""
    name = path.name[: 2 * KEY_BYTES]
    if path.parent.name != name[:2]:
        return None
    key = bytes.fromhex(name)
    try:
        with open(path, "rb", buffering=0) as f:
            header = _decode_header(f.read(HEADER_BYTES), key)
            st = os.fstat(f.fileno())
    except OSError as exc:
        logger.warning("disk tier: cannot read %s: %s", path, exc)
        return None
    if header is None or st.st_size != HEADER_BYTES + header.nbytes:
        return None
    return st.st_mtime_ns, key, header.nbytes


def _encode_header(key: bytes, nbytes: int, checksum: int) -> bytes:
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, 0, key, nbytes, checksum)
    return head + struct.pack("<Q", compute_checksum(head))


def _decode_header(raw: bytes | None, key: bytes) -> _Header | None:
    """The header in ``raw`` if it is whole, valid and names ``key``; else None."""
    if raw is None or len(raw) != HEADER_BYTES:
        return None
    magic, version, flags, file_key, nbytes, checksum, head_sum = _HEADER.unpack(raw)
    if magic != MAGIC or version != FORMAT_VERSION or flags != 0 or file_key != key:
        return None
    if compute_checksum(raw[: _HEAD.size]) != head_sum:
        return None
    return _Header(nbytes, checksum)


def _write_all(f: io.FileIO, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[f.write(view) or 0 :]


def _fill(f: io.FileIO, view: memoryview) -> int:
    """Read into ``view`` until it is full or the file ends; bytes read."""
    got = 0
    while got < view.nbytes:
        step = f.readinto(view[got:])
        if not step:
            break
        got += step
    return got


def _set_mtime(file: int | Path, when: float) -> None:
    """Record a use as the file's mtime (``file``: a path or an open fd)."""
    # NOTE: failures are ignored: only the LRU order after a restart is at stake.
    with contextlib.suppress(OSError):
        os.utime(file, ns=(_ns(when),) * 2)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _ns(seconds: float) -> int:
    return int(seconds * 1_000_000_000)


def _key_hex(key: bytes) -> str:
    """The key's 32 hex chars, the only thing a file name is made of."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {key!r:.60}")
    return key.hex()


def _byte_view(buf: Any, *, writable: bool) -> memoryview:
    """A flat, zero-copy uint8 memoryview of a C-contiguous buffer or CPU tensor."""
    # NOTE: torch is looked up, not imported: whoever passes a tensor imported it.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"disk tier needs a CPU tensor, got device {buf.device}")
        if not buf.is_contiguous():
            raise ValueError("disk tier needs a contiguous tensor")
        buf = buf.detach().reshape(-1).view(torch.uint8).numpy()
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("disk tier needs a C-contiguous buffer")
    if writable and view.readonly:
        raise ValueError("read_into needs a writable buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view

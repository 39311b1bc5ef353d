"""The shards a node reads from an object store, cached on its local disk, bounded.

``<storage.cache_dir>/<sha256>.arrow`` (named by content), ``.<sha256>.lock`` (shared while mapped,
exclusive while downloading), ``.<sha256>.arrow.tmp-<id>`` (a download in progress). Reading a
shard starts downloading the next :data:`READ_AHEAD`; a download streams in :data:`PIECE`-byte
ranges, hashed as it comes, renamed once its size and sha256 match; a mismatch or missing object is
fetched once more, then refused in one line. The cache holds at most ``storage.cache_max_gb``
(default :data:`FREE_SHARE` of the disk's free space, at most :data:`DEFAULT_CAP_GB`); a split
larger than that is refused; room is made by evicting the least recently used unmapped shards."""
from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import IO, Optional

from preprocessing.shard_places import sha256_file
from runtime.storage import Location, StorageSettings, storage_error

#: Share of the cache disk's free space (with what the cache holds) it may fill by default.
FREE_SHARE = 0.5
#: Most gigabytes of the default bound.
DEFAULT_CAP_GB = 200.0
#: Shards downloaded ahead of the one read, and downloads at once per process.
READ_AHEAD = 2
#: Bytes read from the store at a time (one ranged GET each): what a download holds in memory.
PIECE = 32 << 20
_GB = 1e9


def cache_dir(settings: Optional[StorageSettings]) -> Path:
    """``storage.cache_dir``, else ``$XDG_CACHE_HOME/satp/shards``, else ``~/.cache/satp/shards``."""
    if settings is not None and settings.cache_dir:
        return Path(settings.cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "satp" / "shards"


class ShardCache:
    """The cache folder of ``settings`` (see the module docstring); one per reader, several per process."""

    def __init__(self, settings: Optional[StorageSettings]) -> None:
        self.folder = cache_dir(settings)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"{self.folder}: cannot create the shard cache ({exc.strerror}); set storage.cache_dir "
                             "to a folder of the node's local disk") from None
        self.explicit = settings is not None and settings.cache_max_gb is not None
        if self.explicit:
            self.limit = int(settings.cache_max_gb * _GB)
        else:
            room = shutil.disk_usage(self.folder).free + sum(size for _, _, size in self._entries())
            self.limit = int(min(FREE_SHARE * room, DEFAULT_CAP_GB * _GB))

    def _entries(self) -> list[tuple[float, Path, int]]:
        """``(last use, path, bytes)`` of every cached shard."""
        out = []
        for path in self.folder.glob("*.arrow"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # evicted meanwhile
            out.append((st.st_mtime, path, st.st_size))
        return out

    def check_room(self, uri: str, split: str, need: int) -> None:
        """A split of ``need`` bytes of shards must fit the cache whole (every batch reads all over it)."""
        if need > self.limit:
            setting = (f"storage.cache_max_gb={self.limit / _GB:g}" if self.explicit else
                       f"the default bound of {self.limit / _GB:.1f} GB ({FREE_SHARE:.0%} of the free space there)")
            raise ValueError(f"{uri}: the {split} split's shards take {need / _GB:.2f} GB, more than the shard cache "
                             f"{self.folder} may hold ({setting}); raise storage.cache_max_gb, or set "
                             "storage.cache_dir to a larger disk")

    def _lock(self, sha256: str, mode: int) -> IO:
        fh = open(self.folder / f".{sha256}.lock", "a+b")
        fcntl.flock(fh.fileno(), mode)
        return fh

    def open(self, obj: Location, size: int, sha256: str, verify: bool, keep: frozenset[str]) -> tuple:
        """``(memory map, holder, checked)`` of the shard at ``obj``, downloaded unless cached. Keep
        ``holder`` as long as the map (no process evicts it). ``verify``: check a cached copy; ``keep``:
        sha256s not to evict."""
        import pyarrow as pa

        entry = self.folder / f"{sha256}.arrow"
        checked = False
        for _ in range(3):  # a copy evicted by another process between its download and its lock: again
            holder = self._lock(sha256, fcntl.LOCK_SH)
            damaged = False
            if entry.is_file() and entry.stat().st_size == size:
                if checked or not verify or sha256_file(entry) == sha256:
                    os.utime(entry)  # last use, for the eviction order
                    return pa.memory_map(str(entry), "r"), holder, checked or verify
                damaged = True
            holder.close()
            checked = self.fetch(obj, size, sha256, keep, damaged=damaged or entry.is_file())
        raise ValueError(f"{obj.uri}: its copy in the shard cache {self.folder} is evicted as soon as it is fetched; "
                         "raise storage.cache_max_gb")

    def fetch(self, obj: Location, size: int, sha256: str, keep: frozenset[str], damaged: bool = False) -> bool:
        """Download ``obj`` into the cache unless it is there (``damaged``: replace the copy there); True
        when it was downloaded (and so checked) here."""
        entry = self.folder / f"{sha256}.arrow"
        with self._lock(sha256, fcntl.LOCK_EX):
            if entry.is_file() and not damaged:
                return False
            entry.unlink(missing_ok=True)
            for stale in self.folder.glob(f".{sha256}.arrow.tmp-*"):  # a killed download (the lock is ours)
                stale.unlink(missing_ok=True)
            self._make_room(obj, size, keep | {sha256})
            for _ in range(2):  # a missing or damaged object is fetched once more, then refused
                problem = self._download(obj, entry, size, sha256)
                if problem is None:
                    return True
            raise ValueError(f"{obj.uri}: shard {problem}, fetched twice; {_FIX[problem.split(' ')[0]]}")

    def _download(self, obj: Location, entry: Path, size: int, sha256: str) -> str | None:
        """Stream ``obj`` into ``entry`` through a temporary file, checking its size and sha256; None
        when it arrived intact, else what is wrong with it."""
        tmp = entry.with_name(f".{entry.name}.tmp-{uuid.uuid4().hex[:8]}")
        digest, got = hashlib.sha256(), 0
        try:
            with self._writing(lambda: open(tmp, "wb")) as dst:
                try:
                    src = obj.fs.open_input_stream(obj.path)
                except FileNotFoundError:
                    return "missing on the store (the manifest lists it)"
                except OSError as exc:
                    raise storage_error(obj, exc, "reading") from None
                with src:
                    while True:
                        try:
                            piece = src.read_buffer(PIECE)  # one ranged GET; no copy into Python bytes
                        except OSError as exc:
                            raise storage_error(obj, exc, "reading") from None
                        if not piece.size:
                            break
                        digest.update(piece)
                        self._writing(lambda: dst.write(piece))
                        got += piece.size
            if got != size:
                return f"corrupt on the store ({got} bytes, the manifest says {size})"
            if digest.hexdigest() != sha256:
                return "corrupt on the store (sha256 does not match the manifest)"
            os.replace(tmp, entry)
            return None
        finally:
            tmp.unlink(missing_ok=True)

    def _writing(self, write):
        """``write()``, its failure (a full disk) one line naming the cache."""
        try:
            return write()
        except OSError as exc:
            raise ValueError(f"{self.folder}: cannot write the shard cache ({exc.strerror or exc}); free space there, "
                             "lower storage.cache_max_gb or set storage.cache_dir to another disk") from None

    def _make_room(self, obj: Location, size: int, keep: frozenset[str]) -> None:
        """Evict the least recently used shards no process maps (their lock free) until ``size`` more
        fit; refused in one line when the shards in use leave no room."""
        entries = self._entries()
        total = sum(n for _, _, n in entries)
        for _, path, n in sorted(entries):
            if total + size <= self.limit:
                return
            sha = path.name.removesuffix(".arrow")
            if sha in keep:
                continue
            lock = self.folder / f".{sha}.lock"
            with open(lock, "a+b") as fh:
                try:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # mapped or being fetched by some process
                path.unlink(missing_ok=True)
                lock.unlink(missing_ok=True)
                total -= n
        if total + size > self.limit:
            raise ValueError(f"{obj.uri}: no room in the shard cache {self.folder} ({size / _GB:.2f} GB more, "
                             f"{total / _GB:.2f} GB of shards in use of {self.limit / _GB:.2f} GB); raise "
                             "storage.cache_max_gb to hold every split the node reads")


#: What to do about a shard the store gave wrong twice (by the first word of what is wrong).
_FIX = {
    "corrupt": "delete the object and run `satp preprocess JOB.yaml`: only it is written again",
    "missing": "run `satp preprocess JOB.yaml`: it writes the missing shards again",
}


_fetchers: dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def fetcher() -> concurrent.futures.ThreadPoolExecutor:
    """This process's download threads (a forked child, whose parent's threads did not come along, makes its own)."""
    pid = os.getpid()
    if pid not in _fetchers:
        _fetchers.clear()
        _fetchers[pid] = concurrent.futures.ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="satp-shard-fetch")
    return _fetchers[pid]

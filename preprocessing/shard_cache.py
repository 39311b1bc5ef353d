"""The shards a node reads from an object store, cached on its local disk, bounded.

``<storage.cache_dir>/<sha256>.arrow`` (named by content), locked shared while mapped and exclusive
while downloading; a download is renamed into place once its size and sha256 match. The cache holds
at most ``storage.cache_max_gb``; the least recently used shards no reader maps are evicted, so a
split larger than the cache streams through it."""
from __future__ import annotations

import concurrent.futures
import fcntl
import functools
import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import IO, Iterator, Optional

from preprocessing.shard_places import sha256_file
from runtime.storage import (Location, StorageSettings, forwarded_env, s3_client, s3_request_error,
                             storage_error)

#: Share of the cache disk's free space (with what the cache holds) it may fill by default.
FREE_SHARE = 0.5
#: Most gigabytes of the default bound.
DEFAULT_CAP_GB = 200.0
#: Most bytes of shards downloaded ahead of the one read (at least the next shard).
READ_AHEAD_BYTES = 1 << 30
#: Downloads at once per process (connections to the store).
DOWNLOADS = 4
#: Bytes a download holds in memory at a time (off S3 one ranged GET each).
PIECE = 8 << 20
_GB = 1e9


def _amount(nbytes: float) -> str:
    return f"{nbytes / _GB:.2f} GB" if nbytes >= 0.1 * _GB else f"{nbytes / 1e6:.2f} MB"


def cache_dir(settings: Optional[StorageSettings]) -> Path:
    """``storage.cache_dir``, else ``$XDG_CACHE_HOME/satp/shards``, else ``~/.cache/satp/shards``."""
    if settings is not None and settings.cache_dir:
        return Path(settings.cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "satp" / "shards"


class ShardCache:
    """The cache folder of ``settings`` (see the module docstring); one per reader, several per process."""

    def __init__(self, settings: Optional[StorageSettings]) -> None:
        self.settings = settings
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
            room = shutil.disk_usage(self.folder).free + sum(size for _, _, size in self._entries("*.arrow"))
            self.limit = int(min(FREE_SHARE * room, DEFAULT_CAP_GB * _GB))

    def _entries(self, pattern: str) -> list[tuple[float, Path, int]]:
        """``(last use, path, bytes)`` of every file of the cache matching ``pattern``."""
        out = []
        for path in self.folder.glob(pattern):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # evicted meanwhile
            out.append((st.st_mtime, path, st.st_size))
        return out

    def check_window(self, uri: str, split: str, sizes: list[int]) -> None:
        """The cache must hold the split's two largest shards at once (one read, the next downloading)."""
        need = sum(sorted(sizes)[-2:])
        if need > self.limit:
            setting = (f"storage.cache_max_gb={self.limit / _GB:g}" if self.explicit else
                       f"the default bound of {self.limit / _GB:.1f} GB ({FREE_SHARE:.0%} of the free space there)")
            raise ValueError(f"{uri}: the {split} split's reader needs {_amount(need)} of shards at once (one read, "
                             f"the next downloading), more than the shard cache {self.folder} may hold ({setting}); "
                             "raise storage.cache_max_gb, or set storage.cache_dir to a larger disk")

    def _lock(self, sha256: str, mode: int) -> IO:
        fh = open(self.folder / f".{sha256}.lock", "a+b")
        fcntl.flock(fh.fileno(), mode)
        return fh

    def open(self, obj: Location, size: int, sha256: str, verify: bool, keep: frozenset[str]) -> tuple:
        """``(path, holder)`` of the cached copy of the shard at ``obj``, downloaded unless cached; no
        process evicts it while ``holder`` is kept. ``verify``: check a cached copy; ``keep``: sha256s
        not to evict."""
        entry = self.folder / f"{sha256}.arrow"
        checked = False
        for _ in range(3):  # a copy evicted by another process between its download and its lock: again
            holder = self._lock(sha256, fcntl.LOCK_SH)
            damaged = False
            if entry.is_file() and entry.stat().st_size == size:
                if checked or not verify or sha256_file(entry) == sha256:
                    os.utime(entry)  # last use, for the eviction order
                    return entry, holder
                damaged = True
            holder.close()
            checked = self.fetch(obj, size, sha256, keep, damaged=damaged or entry.is_file())
        raise ValueError(f"{obj.uri}: its copy in the shard cache {self.folder} is evicted as soon as it is fetched; "
                         "raise storage.cache_max_gb")

    def fetch(self, obj: Location, size: int, sha256: str, keep: frozenset[str], damaged: bool = False,
              ahead: bool = False) -> bool:
        """Download ``obj`` into the cache unless it is there (``damaged``: replace it); True when it was
        downloaded (and so checked) here. ``ahead``: a read-ahead, given up (False) when there is no room."""
        entry = self.folder / f"{sha256}.arrow"
        if entry.is_file() and not damaged:
            return False  # cached: other readers may hold it (shared), which the exclusive lock would wait out
        with self._lock(sha256, fcntl.LOCK_EX):
            if entry.is_file() and not damaged:
                return False
            entry.unlink(missing_ok=True)
            for stale in self.folder.glob(f".{sha256}.arrow.tmp-*"):  # a killed download (the lock is ours)
                stale.unlink(missing_ok=True)
            for _ in range(2):  # a missing or damaged object is fetched once more, then refused
                with self._lock("room", fcntl.LOCK_EX):  # room made and taken at once, by one download at a time
                    held = self._make_room(size, keep | {sha256})
                    if held + size > self.limit:
                        if ahead:
                            return False
                        raise ValueError(f"{obj.uri}: no room in the shard cache {self.folder} ({_amount(size)} more, "
                                         f"{_amount(held)} of shards in use of {_amount(self.limit)}); raise "
                                         "storage.cache_max_gb to hold the shards the node's readers read at once")
                    tmp = entry.with_name(f".{entry.name}.tmp-{uuid.uuid4().hex[:8]}")
                    with self._writing(lambda: open(tmp, "wb")) as fh:
                        self._writing(lambda: fh.truncate(size))  # counted at its full size while it downloads
                problem = self._download(obj, tmp, entry, size, sha256)
                if problem is None:
                    return True
            raise ValueError(f"{obj.uri}: shard {problem}, fetched twice; {_FIX[problem.split(' ')[0]]}")

    def _download(self, obj: Location, tmp: Path, entry: Path, size: int, sha256: str) -> str | None:
        """Stream ``obj`` into ``entry`` through the temporary file ``tmp``, checking its size and
        sha256; None when it arrived intact, else what is wrong with it."""
        digest, got = hashlib.sha256(), 0
        try:
            with self._writing(lambda: open(tmp, "r+b")) as dst:
                try:
                    for piece in self._pieces(obj):
                        digest.update(piece)
                        self._writing(lambda: dst.write(piece))
                        got += len(piece)
                except FileNotFoundError:
                    return "missing on the store (the manifest lists it)"
            if got != size:
                return f"corrupt on the store ({got} bytes, the manifest says {size})"
            if digest.hexdigest() != sha256:
                return "corrupt on the store (sha256 does not match the manifest)"
            os.replace(tmp, entry)
            return None
        finally:
            tmp.unlink(missing_ok=True)

    def _pieces(self, obj: Location) -> Iterator:
        """The bytes of ``obj`` in order, :data:`PIECE` at most at a time (``FileNotFoundError``: it is missing)."""
        if not obj.uri.startswith("s3://"):
            try:
                with obj.fs.open_input_stream(obj.path) as src:
                    while piece := src.read_buffer(PIECE):  # one ranged GET each; no copy into Python bytes
                        yield piece
            except FileNotFoundError:
                raise
            except OSError as exc:
                raise storage_error(obj, exc, "reading") from None
            return
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, key = obj.path.split("/", 1)
        try:
            client = _s3(self.settings, tuple(sorted(forwarded_env().items())), os.getpid())
            yield from client.get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(PIECE)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise FileNotFoundError(obj.uri) from None
            raise s3_request_error(obj.uri, exc, "reading", self.settings) from None
        except BotoCoreError as exc:
            raise s3_request_error(obj.uri, exc, "reading", self.settings) from None

    def _writing(self, write):
        """``write()``, its failure (a full disk) one line naming the cache."""
        try:
            return write()
        except OSError as exc:
            raise ValueError(f"{self.folder}: cannot write the shard cache ({exc.strerror or exc}); free space there, "
                             "lower storage.cache_max_gb or set storage.cache_dir to another disk") from None

    def _make_room(self, size: int, keep: frozenset[str]) -> int:
        """Evict the least recently used shards no process maps (their lock free) until ``size`` more
        fit; the bytes the cache then holds (downloads in progress at their full size)."""
        # downloads listed first: one renamed into place meanwhile is counted once, not missed
        downloading = {path.name[1:].split(".")[0]: n for _, path, n in self._entries(".*.arrow.tmp-*")}
        entries = self._entries("*.arrow")
        total = sum(downloading.values()) + sum(n for _, path, n in entries if path.stem not in downloading)
        for _, path, n in sorted(entries):
            if total + size <= self.limit:
                break
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
        return total


#: What to do about a shard the store gave wrong twice (by the first word of what is wrong).
_FIX = {
    "corrupt": "delete the object and run `satp preprocess JOB.yaml`: only it is written again",
    "missing": "run `satp preprocess JOB.yaml`: it writes the missing shards again",
}


@functools.lru_cache(maxsize=None)
def fetcher(pid: int) -> concurrent.futures.ThreadPoolExecutor:
    """Process ``pid``'s download threads (a forked child, without its parent's threads, makes its own)."""
    return concurrent.futures.ThreadPoolExecutor(DOWNLOADS, thread_name_prefix="satp-shard-fetch")


@functools.lru_cache(maxsize=None)
def _s3(settings: Optional[StorageSettings], env: tuple, pid: int):
    """The boto3 client of ``settings`` and the standard variables ``env`` in process ``pid``."""
    return s3_client(settings)

"""Where a shard directory lives, a folder or a prefix on an object store (``shards.root`` a URI),
behind one set of operations, so that the build and the readers run the same code on both."""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import uuid
from pathlib import Path
from typing import Iterator, Optional

from preprocessing.locks import writer_lock
from preprocessing.write_errors import write_error
from runtime.storage import Location, StorageSettings, is_uri, resolve, storage_error, validate


def sha256_file(path) -> str:
    return digest_file(path, hashlib.sha256())


def digest_file(path, digest) -> str:
    """``digest`` (a hashlib-style object: ``update``, ``hexdigest``) of a file's bytes, read in 4 MiB
    chunks: a path, or a binary stream (closed after)."""
    with (open(path, "rb") if isinstance(path, (str, os.PathLike)) else path) as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class HashingSink:
    """A binary sink that passes every write on to ``sink`` and counts and hashes (sha256) it."""

    closed = False

    def __init__(self, sink) -> None:
        self.sink, self.digest, self.size = sink, hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.digest.update(view)
        self.sink.write(view)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass


class _Place:
    def write(self, name: str, payload: bytes) -> None:
        """Replace file ``name`` by ``payload`` whole (see :meth:`writer`)."""
        with self.writer(name, "the previous version, if any, is kept") as sink:
            sink.write(payload)


class FolderPlace(_Place):
    """A shard directory in a folder of the local (or a shared) file system."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.root, self.name, self.local = self.path, self.path.name, True

    def at(self, name: str) -> str:
        return str(self.path / name)

    def exists(self) -> bool:
        return self.path.exists()

    def names(self) -> list[str]:
        """The files in it, sorted (none when it does not exist)."""
        return sorted(p.name for p in self.path.iterdir() if p.is_file()) if self.path.is_dir() else []

    def sizes(self, names: list[str]) -> dict[str, Optional[int]]:
        """Each file's size, None where it is missing."""
        return {n: (self.path / n).stat().st_size if (self.path / n).is_file() else None for n in names}

    def read(self, name: str) -> bytes:
        """The file's bytes (``OSError`` when it cannot be read, ``FileNotFoundError`` when missing)."""
        return (self.path / name).read_bytes()

    def delete(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def digest_matches(self, name: str, sha256: str) -> bool:
        """The file's sha256 is ``sha256`` (it is read whole)."""
        return sha256_file(self.path / name) == sha256

    def mkdir(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def lock(self):
        return writer_lock(self.path.with_name(f".{self.name}.lock"), f"the shard directory {self.path}")

    @contextlib.contextmanager
    def writer(self, name: str, kept: str) -> Iterator[HashingSink]:
        """A sink for file ``name``, written to a temporary file in the folder, synced and renamed
        when the block ends without an error (``kept``: what a failed write leaves, for its line)."""
        path = self.path / name
        tmp = path.with_name(f".{name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as fh:
                sink = HashingSink(fh)
                yield sink
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:  # Arrow's words name no file (a full disk: "Error writing bytes to file ...")
            raise write_error(path, exc, kept) from None
        finally:
            tmp.unlink(missing_ok=True)


class StorePlace(_Place):
    """A shard directory under a prefix of an object store (or another file system of pyarrow.fs);
    every failure is one line naming the object (:func:`runtime.storage.storage_error`)."""

    local = False

    def __init__(self, loc: Location) -> None:
        self.loc, self.root, self.name = loc, loc.uri, loc.name

    def at(self, name: str) -> str:
        return self.loc.join(name).uri

    def _listing(self) -> list:
        try:
            return self.loc.children()
        except OSError as exc:
            raise storage_error(self.loc, exc, "listing") from None

    def exists(self) -> bool:
        return bool(self._listing())

    def names(self) -> list[str]:
        import pyarrow.fs as pafs

        return sorted(info.base_name for info in self._listing() if info.type == pafs.FileType.File)

    def sizes(self, names: list[str]) -> dict[str, Optional[int]]:
        """Each object's size, None where it is missing (one listing of the prefix)."""
        found = {info.base_name: info.size for info in self._listing()}
        return {n: found.get(n) for n in names}

    def read(self, name: str) -> bytes:
        obj = self.loc.join(name)
        try:
            return obj.read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(f"{obj.uri}: missing") from None
        except OSError as exc:
            raise storage_error(obj, exc, "reading") from None

    def delete(self, name: str) -> None:
        obj = self.loc.join(name)
        try:
            obj.fs.delete_file(obj.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise storage_error(obj, exc, "writing") from None

    def digest_matches(self, name: str, sha256: str) -> bool:
        """True: an object's bytes are not read back here (its size is checked from the listing, its
        sha256 by every reader when it first reads it, :mod:`preprocessing.shard_cache`)."""
        return True

    def mkdir(self) -> None:
        """Nothing: a prefix exists with its first object."""

    def lock(self):
        digest = hashlib.sha256(self.root.encode()).hexdigest()[:16]
        return writer_lock(Path(tempfile.gettempdir()) / "satp-locks" / f"{self.name}-{digest}.lock",
                           f"the shard directory {self.root}")

    @contextlib.contextmanager
    def writer(self, name: str, kept: str) -> Iterator[HashingSink]:
        """A sink for object ``name``: one upload, completed when the block ends without an error (a failed
        one is deleted again: pyarrow cannot abandon an upload)."""
        obj = self.loc.join(name)
        try:
            stream = obj.fs.open_output_stream(obj.path)
        except OSError as exc:
            raise storage_error(obj, exc, "writing") from None
        try:
            with stream:
                yield HashingSink(stream)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                obj.fs.delete_file(obj.path)
            if isinstance(exc, OSError):
                raise storage_error(obj, exc, "writing") from None
            raise


def open_place(where: str | Path, settings: Optional[StorageSettings] = None):
    """The place of a shard directory: :class:`FolderPlace` of a path, :class:`StorePlace` of a URI
    (a value that is neither, e.g. ``s3:/b/p``, a URI that lost a slash: ``ValueError``)."""
    text = validate(where, "shard directory")
    if not is_uri(text):
        return FolderPlace(where if isinstance(where, Path) else text)
    return StorePlace(resolve(text, settings, key="shard directory"))


def file_place(path: str | Path, settings: Optional[StorageSettings] = None):
    """``(place of the directory, file name)`` of a file's path or an object's URI."""
    text = str(path)
    if is_uri(validate(text, "shard")):
        parent, name = text.rstrip("/").rsplit("/", 1)
        return open_place(parent, settings), name
    return FolderPlace(Path(path).parent), Path(path).name

"""Where a run's lease lies (:mod:`pipeline.train.lease`): a file (:class:`FileRecord`) or an S3
object (:class:`ObjectRecord`), with the same operations, each atomic where two commands race:
``create`` (only if none exists), ``read``, ``rewrite`` and ``remove_if`` (only if unchanged since read)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from pathlib import Path
from typing import Optional

from preprocessing.write_errors import FULL


def lease_error(exc: OSError, path: Path, doing: str) -> OSError:
    """An ``OSError`` of the lease file as one line (a full disk said in words), with its errno."""
    if exc.errno in FULL:
        error = OSError(f"{path}: the disk is full (No space left on device) while trying to {doing}; "
                        "free space there and run the command again")
    else:
        error = OSError(f"{path}: cannot {doing} ({exc.strerror or exc})")
    error.errno = exc.errno
    return error


def _write_new(path: Path, data: bytes) -> Path:
    """``data`` in a new temporary file beside ``path`` (flushed to storage); returns its path."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _create(path: Path, data: bytes) -> bool:
    """Create ``path`` holding ``data`` if it does not exist (atomically); whether it was created."""
    tmp = _write_new(path, data)
    try:
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:
            if os.stat(tmp).st_nlink == 2:  # NFS: the link was made, its reply was lost
                return True
            raise
    finally:
        tmp.unlink(missing_ok=True)


def _take_over(path: Path, seen: bytes) -> bool:
    """Remove the expired lease ``path`` if it still holds ``seen``; whether it was removed."""
    aside = path.with_name(f".{path.name}.{uuid.uuid4().hex}.expired")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False  # someone else took it over first
    try:
        if aside.read_bytes() == seen:
            return True
        with contextlib.suppress(FileExistsError):  # refreshed or taken meanwhile: a live lease, put back
            os.link(aside, path)
        return False
    finally:
        aside.unlink(missing_ok=True)


def _sweep(path: Path, stale_after_s: float) -> None:
    """Remove what writers of the lease killed mid-write left beside it (a temporary record, a record
    renamed aside), once older than ``stale_after_s`` (the lease's expiry: no live writer keeps one that long)."""
    for left in path.parent.glob(f".{path.name}.*"):
        with contextlib.suppress(OSError):
            if time.time() - left.stat().st_mtime > stale_after_s:
                left.unlink()


@dataclasses.dataclass(frozen=True)
class Seen:
    """A lease record as read: its bytes, what a conditional request names it by, when it was written."""

    data: bytes
    tag: object  # a file: its bytes; an object: its ETag
    modified: float  # time.time() of its last write


class FileRecord:
    """The lease as a file of a local or shared file system (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def prepare(self, stale_after_s: float) -> None:
        """The run's folder made; what killed writers left beside the lease removed."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise lease_error(exc, self.path.parent, "create the run's folder") from None
        _sweep(self.path, stale_after_s)

    def create(self, data: bytes) -> bool:
        return _create(self.path, data)

    def read(self) -> Optional[Seen]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            modified = self.path.stat().st_mtime
        except FileNotFoundError:
            modified = time.time()
        return Seen(data, data, modified)

    def remove_if(self, seen: Seen) -> bool:
        return _take_over(self.path, seen.tag)

    def rewrite(self, seen: Seen, data: bytes) -> bool:
        os.replace(_write_new(self.path, data), self.path)  # whole: a reader sees the old record or the new
        return True


class ObjectRecord:
    """The lease as an object of an S3 store, each change a conditional request (see the module docstring)."""

    #: The S3 API's answers to a condition that does not hold (412; 409: a concurrent conditional write).
    CONDITION_FAILED = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")
    MISSING = ("NoSuchKey", "404")

    def __init__(self, uri: str, storage=None) -> None:
        from runtime.storage import s3_client

        self.path = uri
        self.bucket, self.key = uri.removeprefix("s3://").split("/", 1)
        self.client, self.storage = s3_client(storage), storage

    def prepare(self, stale_after_s: float) -> None:
        """Nothing: a prefix exists with its first object, and nothing is left beside the lease."""

    def _request(self, doing: str, call, *tolerated: str):
        """``call()``; the error codes ``tolerated`` (a failed condition, a missing object) give None."""
        from botocore.exceptions import BotoCoreError, ClientError

        from runtime.storage import s3_request_error

        try:
            return call()
        except ClientError as exc:
            error = exc.response.get("Error", {})
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if error.get("Code") in tolerated or status in tolerated:
                return None
            raise s3_request_error(self.path, exc, doing, self.storage) from None
        except BotoCoreError as exc:
            raise s3_request_error(self.path, exc, doing, self.storage) from None

    def create(self, data: bytes) -> bool:
        done = self._request("writing", lambda: self.client.put_object(
            Bucket=self.bucket, Key=self.key, Body=data, IfNoneMatch="*"), *self.CONDITION_FAILED)
        return done is not None

    def read(self) -> Optional[Seen]:
        def get():
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
            return Seen(got["Body"].read(), got["ETag"], got["LastModified"].timestamp())

        return self._request("reading", get, *self.MISSING)

    def remove_if(self, seen: Seen) -> bool:
        done = self._request("writing", lambda: self.client.delete_object(
            Bucket=self.bucket, Key=self.key, IfMatch=seen.tag), *self.CONDITION_FAILED, *self.MISSING)
        return done is not None

    def rewrite(self, seen: Seen, data: bytes) -> bool:
        done = self._request("writing", lambda: self.client.put_object(
            Bucket=self.bucket, Key=self.key, Body=data, IfMatch=seen.tag), *self.CONDITION_FAILED, *self.MISSING)
        return done is not None


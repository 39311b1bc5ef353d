"""The run lease: one command at a time per run name (``train.storage_path`` + ``train.run_name``),
and per sweep (``tune.storage_path`` + ``tune.name``: :mod:`pipeline.sweep.trials`).

``<run folder>/satp-lease.json`` with a heartbeat, not ``flock``: the folder may be on storage
several nodes mount (NFS), where advisory locks are unreliable, and a lock outlives a killed holder.
A lease expires when its holder is gone: on the same machine, its process no longer runs; from
another, no heartbeat for :data:`EXPIRES_S` (unreadable: unmodified as long). ``satp train`` refuses
at once; :func:`pipeline.train.driver.train_job` waits up to :data:`WAIT_S`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

from pipeline.train.lease_records import FileRecord, ObjectRecord, lease_error
from runtime.command import command_pid, warn

log = logging.getLogger(__name__)

LEASE_FILE = "satp-lease.json"
HEARTBEAT_S = 10.0
EXPIRES_S = 60.0
WAIT_S = EXPIRES_S + 2 * HEARTBEAT_S


class LeaseHeld(ValueError):
    """Another live command holds the run's lease (a one-line message naming it)."""


@dataclasses.dataclass
class Holder:
    """What a lease file records."""

    host: str  # hostname, for people
    machine: str  # boot id + pid namespace: "the same machine" for the liveness check
    pid: int
    pid_started: Optional[int]  # the process's start time in clock ticks since boot (a reused pid differs)
    started: float  # when the lease was taken (time.time())
    heartbeat: float  # when its holder last refreshed it
    token: str  # this holding, unique
    command: str

    def describe(self) -> str:
        now = time.time()
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (f"{self.command} on host {self.host}, pid {self.pid}, since {since} "
                f"(last heartbeat {max(0.0, now - self.heartbeat):.0f} s ago)")


# ----------------------------------------------------------------------------- this machine
def _read_text(path: str) -> Optional[str]:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def this_machine() -> str:
    """An id shared by the processes that can see each other's pids: the kernel's boot id and the
    pid namespace (containers on one host have their own); the hostname where neither exists."""
    boot = _read_text("/proc/sys/kernel/random/boot_id")
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = None
    return f"{boot}:{namespace}" if boot else socket.gethostname()


def process_started(pid: int) -> Optional[int]:
    """The start time of process ``pid`` (clock ticks since boot; Linux), None where unknown."""
    stat = _read_text(f"/proc/{pid}/stat")
    try:
        return int(stat.rsplit(")", 1)[1].split()[19]) if stat else None
    except (IndexError, ValueError):
        return None


def process_running(pid: int, started: Optional[int]) -> bool:
    """Whether ``pid`` is the same process as when it took the lease, and has not exited."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is not None and stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]:
        return False  # exited, not yet reaped
    now_started = process_started(pid)
    return started is None or now_started is None or now_started == started


# ----------------------------------------------------------------------------- the file
def encode(holder: Holder) -> bytes:
    """The record, with a checksum of its fields (a flipped byte makes it unreadable, not wrong)."""
    fields = dataclasses.asdict(holder)
    body = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return json.dumps({**fields, "sha256": hashlib.sha256(body.encode()).hexdigest()}, sort_keys=True).encode() + b"\n"


def decode(data: bytes) -> Holder:
    """The holder of a lease file's bytes; ``ValueError`` when they are not a whole record."""
    try:
        fields = json.loads(data)
        digest = fields.pop("sha256")
        body = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        if hashlib.sha256(body.encode()).hexdigest() != digest:
            raise ValueError("its checksum does not match")
        return Holder(**fields)
    except (TypeError, KeyError, AttributeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a lease record ({type(exc).__name__})") from None


def expiry(holder: Holder) -> Optional[str]:
    """Why ``holder``'s lease has expired (see the module docstring), or None while it holds."""
    if holder.machine == this_machine():
        return None if process_running(holder.pid, holder.pid_started) else "its process is no longer running"
    age = time.time() - holder.heartbeat
    if age > EXPIRES_S:
        return f"its last heartbeat is {age:.0f} s old (more than {EXPIRES_S:.0f} s)"
    return None


def lease_record(run_dir: str | Path, storage=None):
    """The lease of ``run_dir``: a :class:`FileRecord`, or an :class:`ObjectRecord` of an ``s3://``
    URI (the pre-flight refuses other schemes: :func:`pipeline.train.preflight.check_run_store`)."""
    from runtime.storage import is_uri

    if not is_uri(str(run_dir)):
        return FileRecord(Path(run_dir) / LEASE_FILE)
    return ObjectRecord(f"{str(run_dir).rstrip('/')}/{LEASE_FILE}", storage)


# ----------------------------------------------------------------------------- holding it
class RunLease:
    """The lease of one run folder, held by this process while the command runs (a context manager)."""

    def __init__(self, run_dir: str | Path, run_name: str, command: str = "satp train", kind: str = "run",
                 key: str = "train.run_name", storage=None) -> None:
        """``kind`` / ``key``: what the folder is and the job key that names it, for the messages;
        ``storage``: the job's store settings where ``run_dir`` is a URI."""
        self.record = lease_record(run_dir, storage)
        self.path = self.record.path  # named in every message
        self.run_name, self.command, self.kind, self.key = run_name, command, kind, key
        self.holder: Optional[Holder] = None
        self.lost: Optional[str] = None  # why this holder no longer holds it (see _refresh)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquire(self, wait_s: float = 0.0) -> "RunLease":
        """Take the lease, taking over an expired one; raise :class:`LeaseHeld` if another command
        holds it ``wait_s`` seconds from now, an ``OSError`` or ``ValueError`` (one line) if it cannot
        be written."""
        deadline = time.monotonic() + wait_s
        self.record.prepare(EXPIRES_S)
        while True:
            now = time.time()
            pid = command_pid()  # the process the user started
            mine = Holder(host=socket.gethostname(), machine=this_machine(), pid=pid,
                          pid_started=process_started(pid), started=now, heartbeat=now,
                          token=uuid.uuid4().hex, command=self.command)
            try:
                if self.record.create(encode(mine)):
                    self.holder = mine
                    self._stop.clear()
                    self._thread = threading.Thread(target=self._beat, name="satp-lease-heartbeat", daemon=True)
                    self._thread.start()
                    return self
            except OSError as exc:
                raise lease_error(exc, self.path, "write the run's lease") from None
            refusal = self._expire_or_refuse()
            if refusal is None:
                continue
            if time.monotonic() >= deadline:
                raise LeaseHeld(refusal)
            time.sleep(min(HEARTBEAT_S / 2, max(0.05, deadline - time.monotonic())))

    def _expire_or_refuse(self) -> Optional[str]:
        """Take over the lease on record if it expired (None: try again), else why it holds (one line)."""
        try:
            seen = self.record.read()
        except OSError as exc:
            raise lease_error(exc, self.path, "read the run's lease") from None
        if seen is None:
            return None  # released meanwhile
        try:
            holder: Optional[Holder] = decode(seen.data)
            why = expiry(holder)
            who = holder.describe()
        except ValueError as exc:
            holder, age = None, max(0.0, time.time() - seen.modified)
            why = f"it is unreadable ({exc}) and unchanged for {age:.0f} s" if age > EXPIRES_S else None
            who = f"an unreadable lease ({exc}), modified {age:.0f} s ago"
        if why is None:
            expires = ("it is released when that command ends, or when it no longer runs" if holder is not None
                       and holder.machine == this_machine() else
                       f"it expires {EXPIRES_S:.0f} s after its holder's last heartbeat")
            return (f"{self.path}: {self.kind} {self.run_name!r} is held by {who}; {expires}: wait for it, or pick "
                    f"another {self.key}")
        if self.record.remove_if(seen):
            warn(f"{self.path}: the lease of {self.kind} {self.run_name!r} held by {who} has expired ({why}): taken over")
        return None

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self._refresh():
                return

    def _refresh(self) -> bool:
        """Write a new heartbeat into the lease if it is still this holder's; whether to go on. An
        unreadable or deleted record is written again; another holder's means the lease was lost."""
        try:
            seen = self.record.read()
        except (OSError, ValueError) as exc:
            log.warning("%s: heartbeat not written (%s)", self.path, exc)
            return True
        try:
            on_file = decode(seen.data) if seen is not None else None
        except ValueError:
            on_file = None
        if on_file is not None and on_file.token != self.holder.token:
            self.lost = f"it is now held by {on_file.describe()}"
            warn(f"{self.path}: this command no longer holds the lease of {self.kind} {self.run_name!r} ({self.lost})")
            return False
        self.holder = dataclasses.replace(self.holder, heartbeat=time.time())
        try:
            data = encode(self.holder)
            if not (self.record.create(data) if seen is None else self.record.rewrite(seen, data)):
                return self._refresh()  # changed meanwhile: another command's now (said there), or read again
        except (OSError, ValueError) as exc:  # a full disk, a store that does not answer: an older heartbeat stays
            log.warning("%s: heartbeat not written (%s)", self.path, exc)
        return True

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still this holder's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.holder is None:
            return
        # gone, or another holder's now, or the store does not answer (it expires)
        with contextlib.suppress(OSError, ValueError):
            seen = self.record.read()
            if seen is not None and decode(seen.data).token == self.holder.token:
                self.record.remove_if(seen)
        self.holder = None

    def __enter__(self) -> "RunLease":
        return self if self.holder is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

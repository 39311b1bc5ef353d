"""The run lease (pipeline.train.lease) with real files: taken, refreshed, repaired, released,
refused while its holder lives, taken over once it is gone (here: from another machine, whose
heartbeat stopped). Its faults (a holder killed, a record damaged, a full disk, commands racing
for it) are in test_faults_training."""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from pipeline.train import lease
from pipeline.train.lease import Holder, LeaseHeld, RunLease

ROOT = Path(__file__).resolve().parents[1]

def record(run_dir: Path, **fields) -> Holder:
    """Write a lease record as a holder elsewhere would have (``fields`` over a live-looking one)."""
    now = time.time()
    holder = Holder(**{"host": "node-b", "machine": "another-boot:1", "pid": 4242, "pid_started": None,
                       "started": now - 300, "heartbeat": now, "token": "t" * 32, "command": "satp train", **fields})
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "record.tmp"
    tmp.write_bytes(lease.encode(holder))
    os.replace(tmp, run_dir / lease.LEASE_FILE)  # whole, as every writer of a lease writes it
    return holder


def test_taken_released_and_taken_again(tmp_path):
    run_dir = tmp_path / "runs" / "r"  # created by the lease
    with RunLease(run_dir, "r") as held:
        on_file = lease.decode((run_dir / lease.LEASE_FILE).read_bytes())
        assert (on_file.pid, on_file.host, on_file.token) == (os.getpid(), socket.gethostname(), held.holder.token)
        assert sorted(p.name for p in run_dir.iterdir()) == [lease.LEASE_FILE]  # no temporary file left
    assert not (run_dir / lease.LEASE_FILE).exists()
    with pytest.raises(RuntimeError):
        with RunLease(run_dir, "r"):
            raise RuntimeError("the command failed")
    assert not (run_dir / lease.LEASE_FILE).exists()


def test_a_holder_on_another_machine_expires_with_its_heartbeat(tmp_path, capfd):
    run_dir = tmp_path / "r"
    record(run_dir)  # refreshed just now
    with pytest.raises(LeaseHeld, match=r"held by satp train on host node-b, pid 4242, since .*heartbeat 0 s ago"):
        RunLease(run_dir, "r").acquire()
    record(run_dir, heartbeat=time.time() - lease.EXPIRES_S - 30)
    with RunLease(run_dir, "r"):
        pass
    assert "last heartbeat is 90 s old" in capfd.readouterr().err


def _on_file(run_dir: Path):
    try:
        return lease.decode((run_dir / lease.LEASE_FILE).read_bytes())
    except (OSError, ValueError):
        return None


def test_the_heartbeat_refreshes_repairs_and_a_holder_that_lost_its_lease_leaves_the_new_one(tmp_path, monkeypatch,
                                                                                            capfd):
    monkeypatch.setattr(lease, "HEARTBEAT_S", 0.05)
    run_dir = tmp_path / "r"
    path = run_dir / lease.LEASE_FILE
    with RunLease(run_dir, "r") as held:
        first = held.holder.heartbeat
        deadline = time.monotonic() + 30
        while _on_file(run_dir).heartbeat == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _on_file(run_dir).heartbeat > first
        # damaged where it lies (bytes flipped), then deleted: its holder writes it again
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        while _on_file(run_dir) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _on_file(run_dir).token == held.holder.token
        path.unlink()
        while _on_file(run_dir) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _on_file(run_dir).token == held.holder.token
        other = record(run_dir)  # another command took it over (say this one stalled past the expiry)
        deadline = time.monotonic() + 60
        while held.lost is None and time.monotonic() < deadline:
            on_file = _on_file(run_dir)
            if on_file is None or on_file.token != other.token:
                # the heartbeat had read its own record just before the takeover and wrote it over the
                # other's (two writers on shared storage: the next heartbeat settles it): take it over again
                record(run_dir)
            time.sleep(0.05)
        assert "now held by satp train on host node-b, pid 4242" in held.lost
    assert _on_file(run_dir).token == other.token  # not deleted by the loser
    assert "this command no longer holds the lease of run 'r'" in capfd.readouterr().err


def test_waiting_takes_the_lease_when_it_expires(tmp_path, monkeypatch):
    """train_job waits for a lease held from another machine to expire (a Tune trial retried on
    another node after its node died)."""
    monkeypatch.setattr(lease, "EXPIRES_S", 1.0)
    run_dir = tmp_path / "r"
    record(run_dir, heartbeat=time.time())
    started = time.monotonic()
    with RunLease(run_dir, "r").acquire(wait_s=30):
        assert time.monotonic() - started >= 0.9


def test_the_record_is_checked():
    holder = Holder(host="h", machine="m", pid=1, pid_started=2, started=3.0, heartbeat=4.0, token="t", command="c")
    data = lease.encode(holder)
    assert lease.decode(data) == holder
    flipped = json.loads(data)
    flipped["pid"] = 7
    with pytest.raises(ValueError, match="checksum"):
        lease.decode(json.dumps(flipped).encode())
    with pytest.raises(ValueError, match="not a lease record"):
        lease.decode(data[: len(data) // 2])

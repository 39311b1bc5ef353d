"""The run lease without a shared disk: ``train.storage_path`` an ``s3://`` URI, the lease an object
made atomic by conditional requests, on a real S3 API server (moto on loopback, :mod:`s3_server`)."""
from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time

import pytest

from pipeline.train import lease
from pipeline.train.lease import Holder, LeaseHeld, RunLease
from tests.s3_server import s3_server  # noqa: F401  (the session's server, a fixture)


def _key(uri: str) -> tuple[str, str]:
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    return bucket, f"{key}/{lease.LEASE_FILE}"


def _on_store(server, run_dir: str) -> Holder | None:
    """The record on the store, read behind satp's back (None: no lease object)."""
    bucket, key = _key(run_dir)
    try:
        return lease.decode(server.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    except server.client().exceptions.NoSuchKey:
        return None


def _other_node(heartbeat_age_s: float) -> Holder:
    """The record of a holder on another machine whose last heartbeat is ``heartbeat_age_s`` old."""
    now = time.time()
    return Holder(host="node-b", machine="another-boot:1", pid=4242, pid_started=1, started=now - heartbeat_age_s,
                  heartbeat=now - heartbeat_age_s, token="theirs", command="satp train")


def _put(server, run_dir: str, payload: bytes) -> None:
    bucket, key = _key(run_dir)
    server.client().put_object(Bucket=bucket, Key=key, Body=payload)


def _poll(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_one_writer_of_many_racing_and_the_others_refused_naming_the_holder(s3_server):
    run_dir = s3_server.prefix("runs") + "/run"
    leases = [RunLease(run_dir, "run") for _ in range(8)]
    won, refused, start = [], [], threading.Barrier(len(leases))

    def take(one: RunLease) -> None:
        start.wait()
        try:
            won.append(one.acquire())
        except LeaseHeld as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=take, args=(one,)) for one in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 7
    holder = _on_store(s3_server, run_dir)
    assert holder.token == won[0].holder.token
    assert all(line.startswith(f"{run_dir}/{lease.LEASE_FILE}: run 'run' is held by satp train on host "
                               f"{socket.gethostname()}, pid ") and "\n" not in line for line in refused), refused[0]
    won[0].release()
    assert _on_store(s3_server, run_dir) is None
    with RunLease(run_dir, "run"):  # free again
        pass


def test_a_lease_of_another_node_holds_while_its_heartbeat_is_fresh_and_is_taken_over_after(s3_server, capfd):
    run_dir = s3_server.prefix("runs") + "/run"
    _put(s3_server, run_dir, lease.encode(_other_node(heartbeat_age_s=5)))
    with pytest.raises(LeaseHeld) as held:
        RunLease(run_dir, "run").acquire()
    assert "held by satp train on host node-b, pid 4242" in str(held.value)
    assert f"it expires {lease.EXPIRES_S:.0f} s after its holder's last heartbeat" in str(held.value)
    _put(s3_server, run_dir, lease.encode(_other_node(heartbeat_age_s=lease.EXPIRES_S + 5)))  # node-b died
    mine = RunLease(run_dir, "run").acquire()
    try:
        assert _on_store(s3_server, run_dir).token == mine.holder.token
        warning = capfd.readouterr().err.strip()
        assert warning.startswith(f"satp: warning: {run_dir}/{lease.LEASE_FILE}: the lease of run 'run' held by "
                                  "satp train on host node-b") and "has expired (its last heartbeat is" in warning
    finally:
        mine.release()


def test_the_heartbeat_refreshes_the_object_and_a_holder_replaced_behind_it_stops(s3_server, monkeypatch, capfd):
    monkeypatch.setattr(lease, "HEARTBEAT_S", 0.2)
    run_dir = s3_server.prefix("runs") + "/run"
    mine = RunLease(run_dir, "run").acquire()
    try:
        first = _on_store(s3_server, run_dir).heartbeat
        _poll(lambda: _on_store(s3_server, run_dir).heartbeat > first)
        _put(s3_server, run_dir, lease.encode(_other_node(heartbeat_age_s=0)))  # taken by another node
        _poll(lambda: mine.lost is not None)
        assert mine.lost.startswith("it is now held by satp train on host node-b")
        assert "this command no longer holds the lease of run 'run'" in capfd.readouterr().err
    finally:
        mine.release()
    assert _on_store(s3_server, run_dir).token == "theirs"  # another holder's lease is not deleted


def test_an_unreadable_lease_object_expires_when_unchanged_for_the_expiry(s3_server, monkeypatch):
    run_dir = s3_server.prefix("runs") + "/run"
    _put(s3_server, run_dir, b'{"host": "cut sh')
    with pytest.raises(LeaseHeld, match=r"is held by an unreadable lease \(not a lease record"):
        RunLease(run_dir, "run").acquire()
    monkeypatch.setattr(lease, "EXPIRES_S", 0.5)
    time.sleep(1.5)  # the object's age is measured by its LastModified (whole seconds): past the expiry
    with RunLease(run_dir, "run") as mine:
        assert json.loads(s3_server.client().get_object(Bucket=_key(run_dir)[0], Key=_key(run_dir)[1])["Body"]
                          .read())["token"] == mine.holder.token


def test_a_store_that_refuses_the_lease_is_one_line_naming_the_object(s3_server, monkeypatch):
    run_dir = s3_server.prefix("runs") + "/run"
    for key, value in zip(("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"), s3_server.keys["reader"]):
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError) as denied:
        RunLease(run_dir, "run").acquire()
    assert str(denied.value).startswith(f"{run_dir}/{lease.LEASE_FILE}: access denied writing it: ")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.keys["admin"][0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.keys["admin"][1])
    with pytest.raises(ValueError) as missing:
        RunLease("s3://satp-no-such-bucket/runs/run", "run").acquire()
    assert str(missing.value) == (f"s3://satp-no-such-bucket/runs/run/{lease.LEASE_FILE}: the bucket "
                                  f"'satp-no-such-bucket' does not exist at {s3_server.url}; create it, or correct "
                                  "the URI")


def test_a_local_lease_is_still_a_file(tmp_path):
    with RunLease(tmp_path / "run", "run") as mine:
        on_file = lease.decode((tmp_path / "run" / lease.LEASE_FILE).read_bytes())
        assert dataclasses.asdict(on_file) == dataclasses.asdict(mine.holder)
    assert not (tmp_path / "run" / lease.LEASE_FILE).exists()

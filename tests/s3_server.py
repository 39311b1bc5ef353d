"""A real S3 API server on loopback for the tests: moto in server mode, started by the session.

:func:`s3_server` (session-scoped) starts ``moto_server`` on a free loopback port, creates a
bucket and two IAM users through it, an admin (every action) and a reader (only reads and
listings: :data:`READER_ACTIONS`), then turns moto's IAM checks on: from then on every request must be signed
with a key moto knows, and the reader's writes are refused as AWS refuses them (``AccessDenied``).
The test process's environment names the endpoint and the admin's key (``AWS_*``), as a user's
would; :meth:`S3Server.env` gives the variables for a subprocess, with other keys when asked.
The server holds its state in memory and is stopped when the session ends.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime.ports import free_ports

BUCKET = "satp-tests"
#: what the reader may do (moto 5.2.6 checks ListObjectsV2 under its own name, AWS under s3:ListBucket)
READER_ACTIONS = ["s3:GetObject", "s3:ListBucket", "s3:ListObjectsV2"]


@dataclass
class S3Server:
    url: str  # http://127.0.0.1:PORT
    bucket: str
    keys: dict[str, tuple[str, str]]  # user -> (access key id, secret)

    def env(self, user: str = "admin", endpoint: str | None = None) -> dict[str, str]:
        """The standard variables of a process that reaches the server as ``user``."""
        key, secret = self.keys[user]
        return {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": endpoint or self.url}

    def client(self, user: str = "admin"):
        """A boto3 client of the server (to look at or damage objects behind satp's back)."""
        import boto3

        key, secret = self.keys[user]
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id=key,
                            aws_secret_access_key=secret)

    def prefix(self, name: str) -> str:
        """A fresh ``s3://`` prefix in the bucket for one test."""
        return f"s3://{self.bucket}/{name}-{uuid.uuid4().hex[:8]}"


def _wait_listening(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with status {proc.returncode}")
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto_server did not answer at {url} within {timeout_s:.0f} s")


def _users(url: str) -> dict[str, tuple[str, str]]:
    """The admin and the reader (before moto checks keys: any key creates them)."""
    import boto3

    iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", aws_access_key_id="setup",
                       aws_secret_access_key="setup")
    keys = {}
    for user, actions in (("admin", ["*"]), ("reader", READER_ACTIONS)):
        iam.create_user(UserName=user)
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
        iam.put_user_policy(UserName=user, PolicyName=f"{user}-policy", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
    return keys


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """The session's moto server (see the module docstring); the environment names it for the session."""
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("moto") / "moto_server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_listening(url, proc)
        keys = _users(url)
        server = S3Server(url, BUCKET, keys)
        server.client().create_bucket(Bucket=BUCKET)
        # from here on moto checks every request's key and the user's policy
        request = urllib.request.Request(f"{url}/moto-api/reset-auth", data=b"0", method="POST",
                                         headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request, timeout=10).close()
        saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                                "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_PROFILE")}
        for k in saved:
            os.environ.pop(k, None)
        os.environ.update(server.env())
        yield server
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

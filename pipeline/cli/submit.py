"""``satp submit JOB.yaml``: run a job on a Ray cluster through Ray's job-submission client.

Ray's CLI has no form that takes a job YAML; its ``ray job submit`` runs the
command after ``--``. This wraps :class:`ray.job_submission.JobSubmissionClient`
for the one-argument form: the job YAML is validated locally first (a bad job
never reaches the cluster), the working directory is uploaded, and the
entrypoint is ``python -m pipeline.cli train JOB.yaml`` (the same command the
documented ``ray job submit`` line runs). Logs are streamed; the exit status is
non-zero when the job fails.

For a cluster on this machine (a loopback address), the job's relative paths
(data, shards, runs) resolve against the local project directory: the entrypoint
gets ``SATP_WORKDIR`` (see :func:`enter_workdir`).

What is uploaded: the working directory without :data:`EXCLUDES`, the job's own data and
output folders inside it (``data.root``, ``shards.root``, ``train.storage_path``,
``tune.storage_path``, the MLflow SQLite file: :func:`job_excludes`) and what its ``.gitignore``
/ ``.rayignore`` list. Ray's job server takes at most 100 MiB in one upload and answers a larger
one with a 413 traceback after zipping it; :func:`check_upload_size` sums the same files first
(Ray stores them unzipped) and refuses in one line saying how big, what is biggest and how to
leave it out.
"""
from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from pipeline.config import load_job

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
#: never uploaded (gitignore syntax, at any depth): environments, caches, wheels, the project's data and
#: run folders; :func:`job_excludes` adds the job's own folders wherever they are
EXCLUDES = [".venv", ".git", "runs", "data", "mlruns", "*.db", "__pycache__", ".pytest_cache", "*.egg-info", ".whl"]


def is_local(address: str) -> bool:
    host = urlparse(address if "://" in address else f"http://{address}").hostname or ""
    return host in ("127.0.0.1", "localhost", "::1")


def enter_workdir() -> None:
    """In a job started by ``satp submit`` (or with ``SATP_WORKDIR`` set): run from that directory,
    so relative data/runs paths of the job land in the project, not in Ray's temporary copy."""
    workdir = os.environ.get("SATP_WORKDIR")
    if workdir:
        if not Path(workdir).is_dir():
            raise ValueError(f"SATP_WORKDIR={workdir}: not a directory on this node")
        os.chdir(workdir)


def build_entrypoint(job_rel: str, overrides: list[str], restart: bool = False) -> str:
    parts = ["python", "-m", "pipeline.cli", "train", job_rel]
    for item in overrides:
        parts += ["--set", item]
    if restart:
        parts.append("--restart")
    return " ".join(shlex.quote(p) for p in parts)


def job_excludes(job, working_dir: Path) -> list[str]:
    """The job's data and output folders that lie inside ``working_dir``, as anchored excludes: a
    job's data travel through shared storage (or stay on this machine), never in its upload."""
    paths = [job.data.root, job.shards.root, job.train.storage_path or "runs",
             job.tune.storage_path if job.tune is not None else None]
    uri = job.mlflow.tracking_uri or ""
    if uri.startswith("sqlite:///"):
        paths.append(uri.removeprefix("sqlite:///"))
    out = []
    for path in filter(None, paths):
        full = (working_dir / Path(path).expanduser()).resolve()  # relative paths: against the job's directory
        if full != working_dir and full.is_relative_to(working_dir):
            out.append("/" + full.relative_to(working_dir).as_posix())
    return out


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def check_upload_size(working_dir: Path, excludes: list[str]) -> int:
    """Raise ``ValueError`` (one line) when what Ray would upload of ``working_dir`` is over the job
    server's limit; return its size. The files are walked with Ray's own traversal (its default
    excludes, ``excludes``, ``.gitignore`` and ``.rayignore`` files), which zips them unzipped."""
    from ray._private import ray_constants
    from ray._private.runtime_env.packaging import GCS_STORAGE_MAX_SIZE, _dir_travel, _get_excludes

    limit = min(ray_constants.DASHBOARD_CLIENT_MAX_SIZE, GCS_STORAGE_MAX_SIZE)
    include_gitignore = os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"
    sizes: dict[str, int] = {}

    def count(path: Path) -> None:
        if path.is_file():
            rel = path.relative_to(working_dir)
            entry = rel.parts[0] + ("/" if len(rel.parts) > 1 else "")
            # a stored zip entry: its bytes, its name twice (local header, central directory), 76 bytes of headers
            sizes[entry] = sizes.get(entry, 0) + path.stat().st_size + 2 * len(str(rel)) + 76

    patterns = ray_constants.get_runtime_env_default_excludes() + list(excludes)
    _dir_travel(working_dir, [_get_excludes(working_dir, patterns)], count, include_gitignore=include_gitignore)
    total = sum(sizes.values())
    if total > limit:
        biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
        shown = ", ".join(f"{name} {_mb(size)}" for name, size in biggest)
        raise ValueError(f"{working_dir}: {_mb(total)} to upload as the job's working directory, over the "
                         f"{_mb(limit)} Ray's job server accepts; biggest: {shown}; leave out what the job does not "
                         f"need with a line per path in {working_dir / '.rayignore'} (gitignore syntax, e.g. "
                         f"/{biggest[0][0]}), or keep data and outputs outside the working directory")
    return total


def submit(
    job_path: str | Path,
    *,
    address: Optional[str] = None,
    overrides: Optional[list[str]] = None,
    wait: bool = True,
    working_dir: str | Path = ".",
    out=sys.stdout,
    restart: bool = False,
) -> int:
    """Submit ``job_path`` to the cluster at ``address``; return 0 on success (or when not waiting)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    overrides = list(overrides or [])
    job = load_job(job_path, overrides)  # raises ValueError before anything is submitted
    working_dir = Path(working_dir).resolve()
    job_file = Path(job_path).resolve()
    try:
        job_rel = str(job_file.relative_to(working_dir))
    except ValueError:
        raise ValueError(f"{job_path}: the job file must be inside the working directory {working_dir}") from None
    excludes = EXCLUDES + job_excludes(job, working_dir)
    check_upload_size(working_dir, excludes)
    address = address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS
    env_vars = {"OUTDATED_IGNORE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    if is_local(address):
        env_vars["SATP_WORKDIR"] = str(working_dir)
    from pipeline.registry.versions import git_commit

    env_vars["SATP_GIT_COMMIT"] = git_commit(working_dir)
    try:
        client = JobSubmissionClient(address)
    except Exception as exc:  # ConnectionError, RuntimeError from the SDK
        raise ValueError(f"cannot reach the Ray job server at {address}: {str(exc).splitlines()[0]}") from None
    job_id = client.submit_job(
        entrypoint=build_entrypoint(job_rel, overrides, restart),
        runtime_env={"working_dir": str(working_dir), "excludes": excludes, "env_vars": env_vars},
        metadata={"satp_job": job.name},
    )
    print(f"submitted {job_id} to {address}: {job.name}", file=out, flush=True)
    if not wait:
        return 0

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            out.write(lines)
            out.flush()

    try:
        asyncio.run(tail())
    except Exception as exc:  # log streaming is best effort; the status decides
        print(f"(log streaming stopped: {exc})", file=out)
    status = client.get_job_status(job_id)
    while not status.is_terminal():
        time.sleep(1)
        status = client.get_job_status(job_id)
    print(f"job {job_id}: {status.value}", file=out, flush=True)
    return 0 if status == JobStatus.SUCCEEDED else 1

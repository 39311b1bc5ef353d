"""``satp submit JOB.yaml``: ``satp train JOB.yaml`` as a Ray job (:class:`ray.job_submission.JobSubmissionClient`),
its logs streamed, its exit status the job's (:func:`exit_status`).

Before anything is uploaded it runs ``satp train``'s pre-flight and sums what Ray would upload by its
documented rules (:class:`IgnoreRules`), refusing in one line what Ray's job server would refuse
after zipping it (:func:`check_upload_size`).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Iterator, Optional
from urllib.parse import urlparse

from pipeline.config import load_job

#: what Ray's job server takes in one upload: its HTTP server's request limit (a constant of Ray's; ``ray.init``'s
#: own upload, which does not pass the job server, takes more)
UPLOAD_LIMIT = 100 * 2**20
#: never uploaded (gitignore syntax, at any depth): Ray's documented default excludes (off while satp uploads:
#: :func:`rays_default_excludes_off`), caches, wheels, the project's data and run folders
EXCLUDES = [".git", ".venv", "venv", "__pycache__", "runs", "data", "mlruns", "*.db", ".pytest_cache", "*.egg-info",
            ".whl"]
#: the ignore files Ray reads in every directory it uploads (``RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1``: not .gitignore)
IGNORE_FILES = (".gitignore", ".rayignore")
#: the most nodes the State API lists in one answer (Ray's ``RAY_MAX_LIMIT_FROM_API_SERVER``)
NODES_LIMIT = 10_000


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


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def job_server(address: Optional[str], out) -> str:
    """The job server to submit to: ``address``, else ``$RAY_ADDRESS``, else the satp cluster's on this
    machine (one line to ``out`` says so); a one-line ``ValueError`` when there is none."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        return address
    from runtime.local_cluster import ClusterRecord

    record = ClusterRecord.load()
    if record is None or not record.alive():
        raise ValueError("no Ray job server to submit to: no --address, no $RAY_ADDRESS, and no satp cluster runs on "
                         "this machine; start one (satp cluster start) or name a cluster's job server "
                         "(--address http://HOST:8265)")
    if not record.dashboard:
        raise ValueError("the satp cluster of this machine runs no job server (it was started with --no-dashboard): "
                         "satp cluster stop, then satp cluster start without --no-dashboard; or name a cluster's job "
                         "server (--address http://HOST:8265)")
    print(f"satp submit: the satp cluster's job server at {record.dashboard} (satp cluster status)", file=out,
          flush=True)
    return record.dashboard


def preflight(job, working_dir: Path, local: bool) -> None:
    """``satp train``'s checks before Ray (:mod:`pipeline.train.preflight`), here before the upload; a
    one-line ``ValueError``. The job alone, then its folders where this machine sees them: for a cluster
    on this machine all of them (relative to ``working_dir``); for another, a dataset at an absolute
    ``data.root`` that exists here too (shared storage)."""
    from pipeline.train.preflight import check_config, check_data_root, check_output_dirs
    from preprocessing.sources import dataset_dir

    check_config(job)
    with contextlib.chdir(working_dir):
        if local:
            check_data_root(job.data)
            check_output_dirs(job)
        elif Path(job.data.root).expanduser().is_absolute() and dataset_dir(job.data).expanduser().exists():
            check_data_root(job.data)


def check_cluster(job, address: str) -> None:
    """The cluster's alive nodes (the State API of its job server) against the job's workers, as ``satp
    train`` checks them once it has joined the cluster (:func:`pipeline.train.preflight.check_resources`)."""
    from ray.util.state import list_nodes

    from pipeline.train.preflight import check_resources

    try:
        nodes = list_nodes(address=address, filters=[("state", "=", "ALIVE")], limit=NODES_LIMIT)
    except Exception as exc:  # ConnectionError, RayStateApiException, an authentication error
        raise ValueError(f"cannot ask the Ray cluster at {address} for its nodes: {_first_line(exc)}") from None
    check_resources(job, address=address, nodes=[{"Alive": True, "Resources": node.resources_total} for node in nodes])


def exit_status(info) -> tuple[int, str]:
    """The exit status for a job that ended (its ``JobDetails``) and what the last line adds: 0 when it
    SUCCEEDED; when it FAILED, its command's exit status (128 + N for one killed by signal N); else 1
    (STOPPED, or failed before its command ran: Ray's message says why)."""
    from ray.job_submission import JobStatus

    if info.status == JobStatus.SUCCEEDED:
        return 0, ""
    code = info.driver_exit_code
    if info.status == JobStatus.FAILED and code:
        status = 128 - code if code < 0 else code
        return status, f" (exit status {status})"
    message = (info.message or "").strip().splitlines()
    return 1, f": {message[0]}" if message else ""


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
        full = (working_dir / Path(path).expanduser()).resolve()  # relative paths: against the working directory
        if full != working_dir and full.is_relative_to(working_dir):
            out.append("/" + full.relative_to(working_dir).as_posix())
    return out


def _segment_regex(segment: str) -> str:
    """One path segment of a gitignore pattern as a regex: ``*`` and ``?`` within the segment, classes
    (``[!...]`` negated; none matches ``/``), ``\\`` takes the next character as it is."""
    out, i = "", 0
    while i < len(segment):
        char = segment[i]
        end = segment.find("]", i + (3 if segment[i + 1:i + 2] in ("!", "^") else 2)) if char == "[" else -1
        if char == "*":
            out += "[^/]*"
        elif char == "?":
            out += "[^/]"
        elif char == "\\" and i + 1 < len(segment):
            i += 1
            out += re.escape(segment[i])
        elif end != -1:
            body = segment[i + 1:end].replace("[", "\\[")
            out += f"[^{body[1:]}/]" if body[0] in "!^" else f"[{body}]"
            i = end
        else:
            out += re.escape(char)
        i += 1
    return out


def _pattern(line: str) -> Optional[tuple[re.Pattern, bool, bool]]:
    """A line of gitignore syntax as (regex of a path relative to its base, negated, directories only);
    None for a blank line, a comment or a pattern git would not read."""
    text = line.rstrip("\r\n").rstrip(" ")
    if text.endswith("\\") and len(text) < len(line.rstrip("\r\n")):  # "\ " keeps a trailing space
        text += " "
    if not text or text.startswith("#"):
        return None
    negated = text.startswith("!")
    text = text[1:] if negated else text
    dirs_only = text.endswith("/")
    text = text.rstrip("/")
    if not text:
        return None
    anchored = "/" in text  # a slash at the start or in the middle: relative to the base, else at any depth
    segments = text.removeprefix("/").split("/")
    regex = "" if anchored else "(?:[^/]+/)*"
    for n, segment in enumerate(segments):
        last = n == len(segments) - 1
        if segment == "**":
            regex += ".*" if last else "(?:[^/]+/)*"
        else:
            regex += _segment_regex(segment) + ("" if last else "/")
    try:
        return re.compile(regex), negated, dirs_only
    except re.error:
        return None


class IgnoreRules:
    """The patterns of one source in gitignore syntax (an ignore file, or the runtime environment's
    ``excludes``) for the directory ``base`` (relative to the working directory; "" for itself): the
    last pattern that matches a path decides whether it is left out."""

    def __init__(self, base: str, lines: list[str]):
        self.base = base
        self.patterns = [pattern for pattern in map(_pattern, lines) if pattern is not None]

    def ignores(self, rel: str, is_dir: bool) -> bool:
        path = rel[len(self.base) + 1:] if self.base else rel
        ignored = False
        for regex, negated, dirs_only in self.patterns:
            if (is_dir or not dirs_only) and regex.fullmatch(path):
                ignored = not negated
        return ignored


def upload_files(working_dir: Path, excludes: list[str]) -> dict[str, int]:
    """The files Ray uploads of ``working_dir`` with ``excludes``: their paths (relative to it) and sizes.

    A path is left out when one source leaves it out, as Ray combines them: ``excludes``, or the ignore
    files (:data:`IGNORE_FILES`) of any directory above it, each relative to its own directory; a
    directory left out is not entered. Links are followed, as Ray does."""
    names = IGNORE_FILES if os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1" else (".rayignore",)
    files: dict[str, int] = {}

    def walk(directory: Path, rel: str, rules: list[IgnoreRules]) -> None:
        rules = rules + [IgnoreRules(rel, (directory / name).read_text(errors="replace").splitlines())
                         for name in names if (directory / name).is_file()]
        for entry in directory.iterdir():
            path = f"{rel}/{entry.name}" if rel else entry.name
            is_dir = entry.is_dir()
            if any(source.ignores(path, is_dir) for source in rules):
                continue
            if is_dir:
                walk(entry, path, rules)
            elif entry.is_file():
                files[path] = entry.stat().st_size

    walk(working_dir, "", [IgnoreRules("", excludes)])
    return files


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def check_upload_size(working_dir: Path, excludes: list[str]) -> int:
    """Raise ``ValueError`` (one line) when what Ray would upload of ``working_dir`` (:func:`upload_files`)
    is over :data:`UPLOAD_LIMIT`; return its size as Ray zips it (stored, not compressed)."""
    sizes: dict[str, int] = {}
    for rel, size in upload_files(working_dir, excludes).items():
        top, _, below = rel.partition("/")
        entry = top + ("/" if below else "")
        # a stored zip entry: its bytes, its name twice (local header, central directory), 76 bytes of headers
        sizes[entry] = sizes.get(entry, 0) + size + 2 * len(rel.encode()) + 76
    total = sum(sizes.values())
    if total > UPLOAD_LIMIT:
        biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
        shown = ", ".join(f"{name} {_mb(size)}" for name, size in biggest)
        raise ValueError(f"{working_dir}: {_mb(total)} to upload as the job's working directory, over the "
                         f"{_mb(UPLOAD_LIMIT)} Ray's job server accepts; biggest: {shown}; leave out what the job does "
                         f"not need with a line per path in {working_dir / '.rayignore'} (gitignore syntax, e.g. "
                         f"/{biggest[0][0]}), or keep data and outputs outside the working directory")
    return total


@contextlib.contextmanager
def rays_default_excludes_off() -> Iterator[None]:
    """Ray's default excludes off while it packs the upload (``RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES``
    empty, as Ray documents): :data:`EXCLUDES` names them, and with its own Ray warns of each one found."""
    name = "RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES"
    saved = os.environ.get(name)
    os.environ[name] = ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def runtime_env(working_dir: Path, excludes: list[str], local: bool) -> dict:
    """The job's runtime environment: the upload, ``SATP_WORKDIR`` for a cluster on this machine, and
    ``SATP_GIT_COMMIT`` (the commit its run records; the upload holds no ``.git``) in a git checkout."""
    from pipeline.registry.versions import git_commit

    env_vars = {"SATP_WORKDIR": str(working_dir)} if local else {}
    commit = git_commit(working_dir)
    if commit != "unknown":
        env_vars["SATP_GIT_COMMIT"] = commit
    return {"working_dir": str(working_dir), "excludes": excludes, **({"env_vars": env_vars} if env_vars else {})}


def submit(job_path: str | Path, *, address: Optional[str] = None, overrides: Optional[list[str]] = None,
           wait: bool = True, working_dir: str | Path = ".", out=sys.stdout, restart: bool = False) -> int:
    """Submit ``job_path`` to the cluster at ``address`` (:func:`job_server`) once it passed the
    pre-flight; return its exit status (:func:`exit_status`; without ``wait``, 0 once submitted)."""
    overrides = list(overrides or [])
    job = load_job(job_path, overrides)  # raises ValueError before anything is submitted
    working_dir = Path(working_dir).resolve()
    job_file = Path(job_path).resolve()
    try:
        job_rel = str(job_file.relative_to(working_dir))
    except ValueError:
        raise ValueError(f"{job_path}: the job file must be inside the working directory {working_dir}") from None
    address = job_server(address, out)
    local = is_local(address)
    preflight(job, working_dir, local)
    excludes = EXCLUDES + job_excludes(job, working_dir)
    check_upload_size(working_dir, excludes)
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(address)
    except Exception as exc:  # ConnectionError, RuntimeError from the SDK
        raise ValueError(f"cannot reach the Ray job server at {address}: {_first_line(exc)}") from None
    check_cluster(job, address)
    with rays_default_excludes_off():
        job_id = client.submit_job(entrypoint=build_entrypoint(job_rel, overrides, restart),
                                   runtime_env=runtime_env(working_dir, excludes, local),
                                   metadata={"satp_job": job.name})
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
    info = client.get_job_info(job_id)
    while not info.status.is_terminal():
        time.sleep(1)
        info = client.get_job_info(job_id)
    status, detail = exit_status(info)
    print(f"job {job_id}: {info.status.value}{detail}", file=out, flush=True)
    return status

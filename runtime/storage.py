"""Where data live: a plain path or a URI of an object store or any other file system, resolved into
a ``pyarrow.fs`` file system and a path inside it.

Schemes: ``s3://`` (also MinIO at ``endpoint_url``), ``file://``, any other scheme ``pyarrow.fs``
or fsspec knows; anything else is refused in one line. Credentials come from the standard chain only
(:func:`forwarded_env`); a bucket is never created. Faults (:func:`storage_error`) are one line.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import uuid
from typing import Any, Optional
from urllib.parse import urlsplit

#: ``scheme://``: a URI; ``scheme:/`` without the second slash: a URI that lost one.
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
_LOST_SLASH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")
#: S3 bucket names: 3-63 lowercase letters, digits, dots and hyphens, starting and ending with a letter or digit.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: The standard variables of the credential chains and endpoints, forwarded to the tasks of other nodes.
STANDARD_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                      "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                      "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "GOOGLE_APPLICATION_CREDENTIALS")
#: Seconds: a connection that takes longer fails; a request without a byte for this long fails.
CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_S = 3.0, 20.0
#: Attempts of one request (transient faults are retried by the AWS SDK's standard strategy).
ATTEMPTS = 4
#: The pre-flight's: one attempt each, a store that does not answer is named within seconds.
CHECK_CONNECT_TIMEOUT_S, CHECK_REQUEST_TIMEOUT_S = 2.0, 5.0
#: AWS error codes in pyarrow's messages (``AWS Error NO_SUCH_BUCKET during ...``) -> what is wrong.
_REFUSED_CREDENTIALS = ("INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "INVALID_CLIENT_TOKEN_ID",
                        "EXPIRED_TOKEN", "MISSING_AUTHENTICATION_TOKEN", "UNRECOGNIZED_CLIENT")


@dataclasses.dataclass(frozen=True)
class StorageSettings:
    """How a job reaches its object store and caches what it reads from it (the job's ``storage``
    section, :mod:`pipeline.config.storage`); picklable, for tasks and workers. None: the default."""

    #: The S3 API's endpoint, ``http(s)://host[:port]`` (default: ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, AWS).
    endpoint_url: Optional[str] = None
    #: The store's region (default: ``AWS_REGION``, ``AWS_DEFAULT_REGION``, the profile's).
    region: Optional[str] = None
    #: A node's local folder for the shards read from a store (see :mod:`preprocessing.shard_cache`).
    cache_dir: Optional[str] = None
    #: Most gigabytes the cache holds (default: a share of the free space of its disk, capped).
    cache_max_gb: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class Location:
    """A resolved place: ``fs`` (a ``pyarrow.fs.FileSystem``) and ``path`` inside it; ``uri`` as
    the user wrote it (a plain path for the local file system), named in every message."""

    uri: str
    fs: Any
    path: str
    endpoint: Optional[str] = None  # an S3 endpoint other than AWS's, for messages

    @property
    def local(self) -> bool:
        return not is_uri(self.uri)

    @property
    def name(self) -> str:
        """The last component (``s3://b/shards/ds-1`` -> ``ds-1``)."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def join(self, *names: str) -> "Location":
        """The location ``names`` below this one."""
        tail = "/".join(n.strip("/") for n in names)
        return dataclasses.replace(self, uri=f"{self.uri.rstrip('/')}/{tail}", path=f"{self.path.rstrip('/')}/{tail}")

    def children(self) -> list:
        """The ``pyarrow.fs.FileInfo`` of what the folder (a prefix) holds; none where it does not exist."""
        import pyarrow.fs as pafs

        return self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))

    def read_bytes(self) -> bytes:
        """What the file (an object) holds; ``FileNotFoundError`` when there is none."""
        with self.fs.open_input_stream(self.path) as source:
            return source.read()

    def write_bytes(self, data: bytes) -> None:
        """Replace the file (an object) by ``data`` whole: a reader sees the old bytes or the new (a
        local file is written beside it, then renamed; an object is one upload)."""
        if not self.local:
            with self.fs.open_output_stream(self.path) as out:
                out.write(data)
            return
        folder, name = os.path.split(self.path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as out:
            out.write(data)
        os.replace(tmp, self.path)


def is_uri(value: str | os.PathLike) -> bool:
    """``scheme://...`` other than ``file://`` (a plain path in URI form)."""
    found = _URI.match(str(value))
    return bool(found) and found.group(1).lower() != "file"


def absolute(value: str | os.PathLike) -> str:
    """``value`` as every process reads it alike: a URI as written, a path made absolute."""
    return str(value) if is_uri(value) else os.path.realpath(os.path.expanduser(value))


def validate(value: str | os.PathLike, key: str) -> str:
    """``value`` of setting ``key`` as it will be used: a plain path (``file:///p`` -> ``/p``) or a
    well-formed URI (trailing slashes dropped); a one-line ``ValueError`` naming ``key`` otherwise.
    Reads nothing and reaches no network (job files are validated with it)."""
    text = str(value)
    lost = _LOST_SLASH.match(text)
    if lost:
        raise ValueError(f"{key}: {text!r} is neither a path nor a URI (a URI has two slashes: "
                         f"{lost.group(1)}://{text[lost.end():]})")
    found = _URI.match(text)
    if not found:
        return text
    scheme = found.group(1).lower()
    parts = urlsplit(text)
    if parts.query or parts.fragment:
        raise ValueError(f"{key}: {text}: a URI with '?' or '#' parts; the store's settings go in the job's "
                         "storage section (storage.endpoint_url, storage.region)")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{key}: {text}: a file:// URI of another host; use a path of this machine")
        return parts.path or "/"
    if scheme in ("s3", "gs", "gcs") and not _BUCKET.match(parts.netloc):
        raise ValueError(f"{key}: {text}: {parts.netloc!r} is not a bucket name (3-63 lowercase letters, digits, "
                         f"'.' or '-'): expected {scheme}://BUCKET/PREFIX")
    return text.rstrip("/") if parts.path.strip("/") else f"{scheme}://{parts.netloc}"


def endpoint_parts(url: str, key: str) -> tuple[str, str]:
    """``("http", "host:port")`` of an endpoint URL ``http(s)://host[:port]``; ``ValueError`` naming ``key``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
        raise ValueError(f"{key}: {url!r}: expected an endpoint URL http(s)://HOST[:PORT]")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"{key}: {url!r}: the port is not a number") from None
    return parts.scheme, parts.netloc


def s3_endpoint(settings: Optional[StorageSettings]) -> tuple[Optional[str], Optional[str]]:
    """``(endpoint URL, the setting that named it)`` for S3: the job's, else the standard variables'."""
    if settings is not None and settings.endpoint_url:
        return settings.endpoint_url, "storage.endpoint_url"
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(var):
            return os.environ[var], var
    return None, None


def _s3_place(settings: Optional[StorageSettings]) -> tuple[Optional[tuple[str, str]], Optional[str]]:
    """``(endpoint's (scheme, host:port) or None, region)`` of S3, each the job's, else the standard variables'."""
    endpoint, named = s3_endpoint(settings)
    region = (settings.region if settings is not None else None) or os.environ.get("AWS_REGION") \
        or os.environ.get("AWS_DEFAULT_REGION")
    return (endpoint_parts(endpoint, named) if endpoint else None), region


def resolve(value: str | os.PathLike, settings: Optional[StorageSettings] = None, key: str = "path",
            quick: bool = False) -> Location:
    """The :class:`Location` of a path or URI (see the module docstring); ``quick``: the
    pre-flight's short timeouts and single attempts (S3). Connects to nothing yet."""
    text = validate(value, key)
    if not is_uri(text):
        import pyarrow.fs as pafs

        return Location(text, pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(text)))
    scheme = _URI.match(text).group(1).lower()
    if scheme == "s3":
        fs = _s3(*_s3_place(settings), quick, os.getpid(), tuple(sorted(forwarded_env().items())))
        return Location(text, fs, text[len("s3://"):], s3_endpoint(settings)[0])
    import pyarrow as pa
    import pyarrow.fs as pafs

    try:
        fs, path = pafs.FileSystem.from_uri(text)
        return Location(text, fs, path)
    except pa.ArrowInvalid as exc:
        if "Unrecognized filesystem type" not in str(exc):
            raise ValueError(f"{key}: {text}: {str(exc).splitlines()[0]}") from None
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{key}: {text}: cannot open this file system ({str(exc).splitlines()[0]})") from None
    return _fsspec(text, scheme, key)


def _fsspec(text: str, scheme: str, key: str) -> Location:
    """A protocol pyarrow does not know, through fsspec (when installed and it knows the protocol)."""
    try:
        import fsspec
        from fsspec.core import url_to_fs
    except ImportError:
        fsspec = None
    known = fsspec is not None and scheme in fsspec.available_protocols()
    if not known:
        raise ValueError(f"{key}: {text}: no file system for scheme {scheme!r} (expected a path, s3://BUCKET/PREFIX, "
                         "gs://BUCKET/PREFIX or another scheme pyarrow.fs or fsspec knows)")
    import pyarrow.fs as pafs

    try:
        fs, path = url_to_fs(text)
    except (ImportError, ValueError, OSError) as exc:  # the protocol's package missing, bad options
        raise ValueError(f"{key}: {text}: fsspec cannot open it ({str(exc).splitlines()[0]})") from None
    return Location(text, pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path)


@functools.lru_cache(maxsize=16)
def _s3(endpoint: Optional[tuple[str, str]], region: Optional[str], quick: bool, pid: int, env: tuple):
    """One S3 client per setting, process (``pid``: a forked child makes its own) and value of the
    standard variables (``env``: the SDK reads the credentials from them when the client is made)."""
    import pyarrow.fs as pafs

    options = {"scheme": endpoint[0], "endpoint_override": endpoint[1]} if endpoint else {}
    return pafs.S3FileSystem(
        region=region, allow_bucket_creation=False,
        connect_timeout=CHECK_CONNECT_TIMEOUT_S if quick else CONNECT_TIMEOUT_S,
        request_timeout=CHECK_REQUEST_TIMEOUT_S if quick else REQUEST_TIMEOUT_S,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1 if quick else ATTEMPTS), **options)


def ray_storage(value: str, settings: Optional[StorageSettings] = None, key: str = "train.storage_path") -> dict:
    """Ray's ``RunConfig`` arguments of a storage path: ``storage_path`` alone for a plain path; for a
    URI the path inside its file system and ``storage_filesystem`` (this job's endpoint and region)."""
    loc = resolve(value, settings, key)
    return {"storage_path": value} if loc.local else {"storage_path": loc.path, "storage_filesystem": loc.fs}


def s3_client(settings: Optional[StorageSettings] = None):
    """A boto3 S3 client for what pyarrow cannot ask (conditional writes: a run's lease), reaching
    the store as :func:`resolve` does (endpoint, region, timeouts, retries)."""
    import boto3
    from botocore.config import Config

    _, region = _s3_place(settings)  # the endpoint checked
    config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=REQUEST_TIMEOUT_S,
                    retries={"max_attempts": ATTEMPTS, "mode": "standard"})
    return boto3.session.Session().client("s3", endpoint_url=s3_endpoint(settings)[0], region_name=region,
                                          config=config)


def s3_request_error(uri: str, exc: BaseException, doing: str, settings: Optional[StorageSettings] = None) -> ValueError:
    """The one-line ``ValueError`` of a boto3 request on object ``uri`` that failed with ``exc``,
    in :func:`storage_error`'s words (its codes are the AWS SDK's)."""
    from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

    loc = Location(uri, None, uri, s3_endpoint(settings)[0])
    if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError)):
        return storage_error(loc, OSError(f"AWS Error NETWORK_CONNECTION {exc}"), doing)
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = re.sub(r"(?<!^)(?=[A-Z])", "_", error.get("Code", "")).upper()  # NoSuchBucket -> NO_SUCH_BUCKET
        return storage_error(loc, OSError(f"AWS Error {code} during {doing} operation: {error.get('Message', '')}"),
                             doing)
    return storage_error(loc, exc, doing)


def forwarded_env() -> dict[str, str]:
    """The standard variables of :data:`STANDARD_VARIABLES` set in this process: what a Ray task or
    worker needs in its runtime env to reach the store as this driver does."""
    return {k: os.environ[k] for k in STANDARD_VARIABLES if os.environ.get(k)}


def storage_error(loc: Location, exc: BaseException, doing: str) -> ValueError:
    """The one-line ``ValueError`` of an operation on ``loc`` (``doing``: ``reading``, ``writing``,
    ``listing``) that failed with ``exc``: what is wrong, in words, and what to do."""
    uri = loc.uri
    text = str(exc).replace("\n", " ")
    code = re.search(r"AWS Error ([A-Z_]+)", text)
    code = code.group(1) if code else ""
    detail = re.sub(r"\s*\(Request ID: [^)]*\)", "", text.split(" operation: ", 1)[-1]).strip().rstrip(".")
    where = loc.endpoint or "the store"
    bucket = urlsplit(loc.uri).netloc
    if code == "NETWORK_CONNECTION" or "curlCode" in text:
        fix = ("check storage.endpoint_url (or AWS_ENDPOINT_URL) and that the store runs" if loc.endpoint
               else "check the network, or name the store's endpoint in storage.endpoint_url")
        return ValueError(f"{uri}: cannot reach {where} ({detail}); {fix}")
    if code in _REFUSED_CREDENTIALS:
        return ValueError(f"{uri}: {where} refused the credentials ({detail}); set AWS_ACCESS_KEY_ID and "
                          "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws/credentials) to a key it knows")
    if code == "NO_SUCH_BUCKET":
        return ValueError(f"{uri}: the bucket {bucket!r} does not exist at {where}; create it, or correct the URI")
    if code == "ACCESS_DENIED" or "PERMISSION_DENIED" in text or "Permission denied" in text:
        may, grant = ("write", "s3:PutObject and s3:DeleteObject") if doing == "writing" else \
            ("read", "s3:ListBucket and s3:GetObject")
        return ValueError(f"{uri}: access denied {doing} it: the credentials in use may not {may} there; grant them "
                          f"{may} access (S3: {grant}), or use other credentials or another prefix")
    return ValueError(f"{uri}: {doing} it failed ({detail})")


def check(uri: str, write: bool = True, settings: Optional[StorageSettings] = None, key: str = "shards.root") -> None:
    """The pre-flight of a URI setting ``key``, within seconds: the store answers, takes the credentials,
    holds the bucket, lets them list the prefix and, with ``write``, write below it (an object written
    and deleted again); else one ``ValueError`` line. A plain path: nothing to do here."""
    loc = resolve(uri, settings, key, quick=True)
    if loc.local:
        return
    try:
        loc.children()
    except OSError as exc:
        raise storage_error(loc, exc, "listing") from None
    if not write:
        return
    probe = loc.join(f".satp-write-check-{uuid.uuid4().hex[:12]}")
    try:
        with probe.fs.open_output_stream(probe.path) as out:
            out.write(b"satp write check\n")
        probe.fs.delete_file(probe.path)
    except OSError as exc:
        raise storage_error(loc, exc, "writing") from None

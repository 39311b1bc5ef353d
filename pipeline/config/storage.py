"""The ``storage`` section of a job: how an object store is reached and what a node caches of it.

Used when ``shards.root`` is a URI (``s3://bucket/prefix``: :mod:`runtime.storage`)::

    storage:
      endpoint_url: http://minio.internal:9000   # the S3 API's endpoint (default: AWS_ENDPOINT_URL_S3,
                                                 # AWS_ENDPOINT_URL, else AWS itself)
      region: eu-central-1                       # default: AWS_REGION / AWS_DEFAULT_REGION, the profile's
      cache_dir: /local/ssd/satp-shards          # default: ~/.cache/satp/shards
      cache_max_gb: 400                          # default: half the cache disk's free space, at most 200

Credentials never go in a job file: the standard variables and files supply them
(``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``~/.aws``, the instance's
role; ``GOOGLE_APPLICATION_CREDENTIALS``). Strict like every section: unknown keys and mistyped
values are errors, the endpoint must be ``http(s)://HOST[:PORT]``.
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator

from preprocessing.config import StrictModel
from runtime.storage import StorageSettings, endpoint_parts, is_uri


class StorageConfig(StrictModel):
    """The job's object store settings (see the module docstring)."""

    endpoint_url: Optional[str] = None
    region: Optional[str] = Field(default=None, min_length=1)
    cache_dir: Optional[str] = Field(default=None, min_length=1)
    cache_max_gb: Optional[float] = Field(default=None, gt=0)

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            endpoint_parts(value, "storage.endpoint_url")
        return value

    @field_validator("cache_dir")
    @classmethod
    def _local_folder(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and is_uri(value):
            raise ValueError(f"storage.cache_dir: {value}: the cache is a folder of the node's local disk, not a URI")
        return value

    def settings(self) -> StorageSettings:
        """What :mod:`runtime.storage` and the shard readers take (picklable, for tasks and workers)."""
        return StorageSettings(**self.model_dump())

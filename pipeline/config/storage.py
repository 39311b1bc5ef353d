"""The ``storage`` section of a job: how an object store is reached and what a node caches of it,
when ``shards.root`` is a URI (:mod:`runtime.storage`; docs/nodes.md). Credentials never go in a job
file: the standard variables and files supply them.
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

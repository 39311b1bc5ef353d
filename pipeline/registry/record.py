"""What the registry recorded for a version when it was registered, checked against what it serves.

A version's two files (``weights.pt``, ``satp_model.json``) lie in the artifact store, where anyone
who can write there can replace them; checking them against each other (the weights against the
``weights_sha256`` of the JSON beside them) does not notice a version whose pair was replaced by
another version's: it served version 1's predictions as version 2, and ``satp models`` listed it as
the champion. The registry's own record of the version (its tags, in the tracking store) is written
once, at registration: the weights' sha256 (``satp.weights_sha256``), the run, task, data hash,
commit and configuration hash, and since issue 37 the sha256 of each file's bytes
(``satp.files_sha256``). :func:`record_problem` compares what the files say against it; loading
(:func:`pipeline.registry.versions.load_model`) refuses a version that differs, in one line naming it
and what differs, and ``satp models`` marks it. Only the standard library is needed (no torch):
the listing checks every version.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping, Optional

#: A version's two files (:mod:`pipeline.registry.model_format`).
META_FILE = "satp_model.json"
WEIGHTS_FILE = "weights.pt"
#: The registry tag with each file's sha256 (a JSON object: file name -> hex digest).
FILES_TAG = "satp.files_sha256"
WEIGHTS_TAG = "satp.weights_sha256"
#: ``(what, registry tag, how the file states it)`` compared when both sides hold a value.
_IDENTITY = (
    ("run_id", "run_id", lambda meta: meta.get("run_id")),
    ("task", "task", lambda meta: (meta.get("task") or {}).get("name")),
    ("data_manifest_hash", "data_manifest_hash", lambda meta: meta.get("data_manifest_hash") or "unknown"),
    ("git_commit", "git_commit", lambda meta: meta.get("git_commit")),
    ("config_hash", "satp.config_hash", lambda meta: (meta.get("provenance") or {}).get("config_hash")),
)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def files_tag(paths: Mapping[str, Path]) -> str:
    """The :data:`FILES_TAG` value of the files about to be logged (``{file name: path}``)."""
    return json.dumps({name: file_sha256(Path(path)) for name, path in sorted(paths.items())}, sort_keys=True)


def _short(value: Any) -> str:
    text = str(value)
    return text[:12] if len(text) == 64 else text


def record_problem(tags: Mapping[str, str], meta: Mapping[str, Any], files: Path, version: str) -> Optional[str]:
    """What differs between ``version``'s registry record (``tags``) and what it serves: the
    ``satp_model.json`` it holds (``meta``) and the files in ``files`` (one clause), or None."""
    recorded = tags.get(WEIGHTS_TAG)
    if not recorded:
        return f"the registry records no {WEIGHTS_TAG} for version {version} (it was not registered by satp)"
    differs = []
    served = meta.get("weights_sha256")
    if served != recorded:
        differs.append(f"weights_sha256 {_short(served)} (recorded {_short(recorded)})")
    for what, tag, stated in _IDENTITY:
        mine, theirs = tags.get(tag), stated(meta)
        if mine and theirs and mine != "unknown" and str(theirs) != mine:
            differs.append(f"{what} {_short(theirs)} (recorded {_short(mine)})")
    try:
        digests = json.loads(tags[FILES_TAG]) if tags.get(FILES_TAG) else {}
    except ValueError:
        return f"the {FILES_TAG} tag of version {version} is damaged"
    for name, digest in sorted(digests.items()):
        path = files / name
        actual = file_sha256(path) if path.is_file() else "missing"
        if actual != digest:
            differs.append(f"{name} sha256 {_short(actual)} (recorded {_short(digest)})")
    if not differs:
        return None
    return f"not what the registry recorded for version {version} at registration: " + ", ".join(differs)

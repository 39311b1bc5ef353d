"""Writing OGB's raw layout (gzip CSV) atomically, shared by the offline dataset builders.

Layout of one dataset folder (``<root>/ogbg_code2`` or ``<root>/ogbg_ppa``)::

    RELEASE_v1.txt
    raw/*.csv.gz          no header; one line per edge / node / graph
    split/<kind>/{train,valid,test}.csv.gz
    mapping/*.csv.gz      with a header (code2 only)

Files are written with a fixed gzip mtime so that the same input gives identical bytes.
The whole folder is built under a temporary name beside it and renamed at the end, so a crash
never leaves a folder that OGB would take for a complete dataset.
"""
from __future__ import annotations

import contextlib
import gzip
import io
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np

OGB_DIR = {"ogbg-code2": "ogbg_code2", "ogbg-ppa": "ogbg_ppa"}
SPLIT_KIND = {"ogbg-code2": "project", "ogbg-ppa": "species"}


def write_gz_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write(text.encode("utf-8"))


def write_gz_array(path: Path, array: np.ndarray, fmt: str = "%d") -> None:
    """Write a 1-D or 2-D array as comma-separated lines (no header)."""
    arr = np.asarray(array)
    if arr.ndim == 1:
        arr = arr.reshape(-1, 1)
    if not arr.size:
        write_gz_text(path, "")
        return
    if fmt == "%d":
        lines = [",".join(map(str, row)) for row in arr.astype(np.int64).tolist()]
        write_gz_text(path, "\n".join(lines) + "\n")
        return
    buf = io.StringIO()
    np.savetxt(buf, arr, fmt=fmt, delimiter=",")
    write_gz_text(path, buf.getvalue())


@contextlib.contextmanager
def atomic_dataset_dir(root: Path, name: str, force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes ``root/<ogb dir of name>``."""
    final = Path(root) / OGB_DIR[name]
    if final.exists() and not force:
        raise ValueError(f"{final}: already exists (pass --force to rebuild it)")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        (tmp / "RELEASE_v1.txt").write_text("satp offline build of OGB's raw layout, version 1\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_splits(folder: Path, name: str, split_ids: dict[str, np.ndarray]) -> None:
    for split in ("train", "valid", "test"):
        write_gz_array(folder / "split" / SPLIT_KIND[name] / f"{split}.csv.gz", np.sort(split_ids[split]))


def assign_groups(group_sizes: dict[str, int], fractions: tuple[float, float, float]) -> dict[str, str]:
    """Assign whole groups (projects, species) to train/valid/test, deterministically.

    Groups go, largest first (ties by name), to the split furthest below its target share; the
    first three go to train, valid, test so that every split is non-empty.
    """
    if len(group_sizes) < 3:
        raise ValueError(f"need at least 3 groups to split by group, got {len(group_sizes)}")
    total = sum(group_sizes.values())
    splits = ("train", "valid", "test")
    filled = dict.fromkeys(splits, 0)
    out: dict[str, str] = {}
    order = sorted(group_sizes, key=lambda g: (-group_sizes[g], g))
    # seed each split with one group: the largest to train, the two smallest to valid and test
    seeds = {order[0]: "train", order[-1]: "test", order[-2]: "valid"}
    for group, split in seeds.items():
        out[group] = split
        filled[split] += group_sizes[group]
    for group in order:
        if group in out:
            continue
        split = max(splits, key=lambda s: (fractions[splits.index(s)] * total - filled[s], -splits.index(s)))
        out[group] = split
        filled[split] += group_sizes[group]
    return out

"""Writing OGB's raw layout (gzip CSV, fixed mtime: the same input gives identical bytes) for the
offline builders; a dataset folder is built under a temporary name and renamed at the end."""
from __future__ import annotations

import contextlib
import csv
import gzip
import io
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np

OGB_DIR = {"ogbg-code2": "ogbg_code2", "ogbg-ppa": "ogbg_ppa", "pattern": "sbm_pattern", "cluster": "sbm_cluster"}
SPLIT_KIND = {"ogbg-code2": "project", "ogbg-ppa": "species", "pattern": "benchmark", "cluster": "benchmark"}
_ROWS_PER_WRITE = 1 << 21  # format_int_csv works on this many rows at a time (bounded memory)


def write_gz_text(path: Path, text: str, compresslevel: int = 9) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                compresslevel=compresslevel) as gz:
        gz.write(text.encode("utf-8"))


def write_mapping(path: Path, header: tuple[str, str], values: list, compresslevel: int = 9) -> None:
    """A mapping table: ``header``, then one ``index,value`` line per value (quoted as CSV needs)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(enumerate(values))
    write_gz_text(path, buf.getvalue(), compresslevel)


def format_int_csv(array: np.ndarray) -> bytes:
    """Integer rows ``[R, C]`` (or ``[R]``) as CSV bytes, vectorised (right-aligned fixed-width cells,
    padding dropped): the bytes of ``",".join(map(str, row))`` per line."""
    arr = np.asarray(array)
    arr = arr.reshape(-1, 1) if arr.ndim == 1 else arr
    if not arr.size:
        return b""
    flat = arr.astype(np.int64, copy=False).reshape(-1)
    negative = flat < 0
    magnitude = np.abs(flat).astype(np.uint64)  # abs(int64 min) wraps; as uint64 it is right
    most = len(str(int(magnitude.max())))  # digits of the largest magnitude
    if most < 10:
        magnitude = magnitude.astype(np.uint32)  # faster division
    unsigned = magnitude.dtype.type
    digits = np.ones(flat.size, dtype=np.uint8)
    for power in range(1, most):
        digits += magnitude >= unsigned(10**power)
    width = most + int(negative.any())
    cells = np.zeros((flat.size, width + 1), dtype=np.uint8)
    for k in range(most):  # k-th digit from the right; 0 (padding) where the value is shorter
        digit = ((magnitude // unsigned(10**k)) % unsigned(10)).astype(np.uint8) + np.uint8(48)
        digit *= digits > k
        cells[:, width - 1 - k] = digit
    if negative.any():
        rows = np.flatnonzero(negative)
        cells[rows, width - 1 - digits[rows].astype(np.int64)] = ord("-")
    cells[:, width] = ord(",")
    cells[arr.shape[1] - 1 :: arr.shape[1], width] = ord("\n")
    return cells[cells != 0].tobytes()


def format_fixed_csv(array: np.ndarray, decimals: int) -> bytes:
    """Rows of values in ``[0, 10)`` as CSV bytes with ``decimals`` (1..8) digits, vectorised. Rounds ``np.rint(value * 10**decimals)``, half to even (Python's formatting when
    the product is exact); zero unsigned; other values outside ``[0, 10)`` or NaN: ValueError."""
    if not 1 <= decimals <= 8:
        raise ValueError(f"decimals: expected 1 to 8, got {decimals}")
    arr = np.asarray(array)
    arr = arr.reshape(-1, 1) if arr.ndim == 1 else arr
    if not arr.size:
        return b""
    scaled = np.multiply(arr.reshape(-1), 10.0**decimals, dtype=np.float64)
    np.rint(scaled, out=scaled)
    if not (scaled.min() >= 0 and scaled.max() < 10 ** (decimals + 1)):  # NaN fails both
        raise ValueError(f"format_fixed_csv: values must round into [0, 10), got {arr.min()} .. {arr.max()}")
    rest = scaled.astype(np.uint32)  # < 10**9 < 2**32
    ten = np.uint32(10)
    cells = np.empty((rest.size, decimals + 3), dtype=np.uint8)  # digit, ".", decimals, separator
    for column in range(decimals + 1, 1, -1):  # last decimal first
        quotient = rest // ten
        cells[:, column] = rest - quotient * ten
        rest = quotient
    cells[:, 0] = rest
    # every byte so far is a digit value; store the others less ord("0") (mod 256), then one
    # contiguous += ord("0") makes all of them ASCII
    cells[:, 1] = (ord(".") - ord("0")) % 256
    cells[:, -1] = (ord(",") - ord("0")) % 256
    cells[arr.shape[1] - 1 :: arr.shape[1], -1] = (ord("\n") - ord("0")) % 256
    cells += np.uint8(ord("0"))
    return cells.tobytes()


def write_gz_array(path: Path, array: np.ndarray, compresslevel: int = 9) -> None:
    """Write a 1-D or 2-D integer array as comma-separated lines (no header), in blocks of rows."""
    arr = np.asarray(array)
    arr = arr.reshape(-1, 1) if arr.ndim == 1 else arr
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                compresslevel=compresslevel) as gz:
        for start in range(0, arr.shape[0], _ROWS_PER_WRITE):
            gz.write(format_int_csv(arr[start : start + _ROWS_PER_WRITE]))


def check_out_dir(root: Path, name: str, force: bool = False) -> None:
    """One-line ``ValueError`` unless ``root`` can hold the dataset's folder (checked before minutes of work)."""
    root = Path(root)
    for part in (root, *root.parents):
        if part.exists():
            if not part.is_dir():
                raise ValueError(f"{root}: not a directory ({'it' if part == root else part} is a file)")
            break
    final = root / OGB_DIR[name]
    if final.exists() and not force:
        raise ValueError(f"{final}: already exists (pass --force to rebuild it)")


@contextlib.contextmanager
def atomic_dataset_dir(root: Path, name: str, force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes ``root/<ogb dir of name>``."""
    final = Path(root) / OGB_DIR[name]
    check_out_dir(root, name, force)
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
    """Whole groups to train/valid/test: largest first to the split furthest below its share; the first
    three to train, valid, test so that none is empty."""
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

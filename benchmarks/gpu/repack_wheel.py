"""Repack a wheel without some of its files, with a RECORD that pip accepts.

    python benchmarks/gpu/repack_wheel.py SRC.whl DST.whl [--drop ray/jars/ --drop 'ray/x/*.map' ...] \
        [--lzma ray/_raylet.so ...] [--lzma-min-size 262144]

``--drop P`` removes every member whose path starts with ``P`` (a directory prefix ends in
``/``), or matches ``P`` as an ``fnmatch`` pattern when ``P`` holds a ``*``. ``--lzma P``
stores the members starting with ``P`` LZMA-compressed (preset 9e) instead of deflated, and so
does ``--lzma-min-size N`` for every member of at least N bytes: a ZIP method that Python's
``zipfile`` (and so pip) reads wherever the ``lzma`` module exists, ~30% smaller than deflate on
native libraries; everything else is deflated at level 9. RECORD is rewritten from the bytes kept (``sha256=<urlsafe b64>,size``), the
file name, METADATA and WHEEL stay as they were: pip sees the same distribution, less files.
Only the standard library is used. Deterministic: same input, same output bytes.
"""
from __future__ import annotations

import argparse
import base64
import csv
import fnmatch
import hashlib
import io
import lzma
import os
import sys
import zipfile


class _Lzma9:
    """zipfile's LZMA compressor (ZIP method 14: 2-byte version, 2-byte props size, props,
    raw LZMA1 stream) at preset 9 | EXTREME instead of the library default (6)."""

    def __init__(self) -> None:
        self._comp = None

    def _init(self) -> bytes:
        filt = {"id": lzma.FILTER_LZMA1, "preset": 9 | lzma.PRESET_EXTREME}
        props = lzma._encode_filter_properties(filt)  # noqa: SLF001 (as zipfile itself does)
        self._comp = lzma.LZMACompressor(lzma.FORMAT_RAW, filters=[filt])
        return bytes([9, 4]) + len(props).to_bytes(2, "little") + props

    def compress(self, data: bytes) -> bytes:
        if self._comp is None:
            return self._init() + self._comp.compress(data)
        return self._comp.compress(data)

    def flush(self) -> bytes:
        if self._comp is None:
            return self._init() + self._comp.flush()
        return self._comp.flush()


def record_line(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) if "*" in pattern else name.startswith(pattern)


def repack(src: str, dst: str, drop: list[str], lzma_prefixes: list[str], lzma_min_size: int = 0) -> dict:
    zin = zipfile.ZipFile(src)
    names = [i.filename for i in zin.infolist()]
    records = [n for n in names if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise SystemExit(f"{src}: expected one .dist-info/RECORD, found {records}")
    record_name = records[0]
    kept, dropped, dropped_bytes = [], [], 0
    for info in zin.infolist():
        if info.filename == record_name:
            continue
        if any(matches(info.filename, p) for p in drop):
            dropped.append(info.filename)
            dropped_bytes += info.compress_size
            continue
        kept.append(info)
    unused = [p for p in drop if not any(matches(n, p) for n in dropped)]
    if unused:
        raise SystemExit(f"{src}: nothing matched --drop {unused}")

    rows = []
    orig_get_compressor = zipfile._get_compressor  # noqa: SLF001

    def get_compressor(compress_type, compresslevel=None):
        if compress_type == zipfile.ZIP_LZMA:
            return _Lzma9()
        return orig_get_compressor(compress_type, compresslevel)

    zipfile._get_compressor = get_compressor  # noqa: SLF001
    try:
        with zipfile.ZipFile(dst, "w") as zout:
            for info in kept:
                data = zin.read(info)
                out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                out.external_attr = info.external_attr
                out.create_system = info.create_system
                if info.is_dir():
                    zout.writestr(out, b"")
                    continue
                if any(info.filename.startswith(p) for p in lzma_prefixes) or (
                        lzma_min_size and len(data) >= lzma_min_size):
                    out.compress_type = zipfile.ZIP_LZMA
                    zout.writestr(out, data)
                else:
                    out.compress_type = zipfile.ZIP_DEFLATED
                    zout.writestr(out, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
                rows.append(record_line(info.filename, data))
            rows.append([record_name, "", ""])
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(rows)
            rec = zipfile.ZipInfo(record_name, date_time=zin.getinfo(record_name).date_time)
            rec.external_attr = zin.getinfo(record_name).external_attr
            zout.writestr(rec, buf.getvalue().encode(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    finally:
        zipfile._get_compressor = orig_get_compressor  # noqa: SLF001
    return {"dropped_files": len(dropped), "dropped_compressed_bytes": dropped_bytes, "kept_files": len(kept) + 1}


def verify(path: str) -> None:
    """Every member reads back and matches RECORD; every file is in RECORD."""
    z = zipfile.ZipFile(path)
    record_name = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD"))
    rows = {r[0]: r for r in csv.reader(io.StringIO(z.read(record_name).decode())) if r}
    for info in z.infolist():
        if info.is_dir() or info.filename == record_name:
            continue
        row = rows.get(info.filename)
        if row is None:
            raise SystemExit(f"{path}: {info.filename} missing from RECORD")
        if record_line(info.filename, z.read(info)) != row:
            raise SystemExit(f"{path}: {info.filename} does not match RECORD")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--drop", action="append", default=[], help="member path prefix to leave out")
    ap.add_argument("--lzma", action="append", default=[], help="member path prefix to store LZMA-compressed")
    ap.add_argument("--lzma-min-size", type=int, default=0, help="store members of at least this many bytes LZMA-compressed")
    args = ap.parse_args(argv)
    stats = repack(args.src, args.dst, args.drop, args.lzma, args.lzma_min_size)
    verify(args.dst)
    print(f"repacked {os.path.basename(args.src)}: {os.path.getsize(args.src) / 2**20:.2f} -> "
          f"{os.path.getsize(args.dst) / 2**20:.2f} MiB, left out {stats['dropped_files']} files "
          f"({stats['dropped_compressed_bytes'] / 2**20:.1f} MiB compressed), kept {stats['kept_files']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Repack a wheel for the GPU kit (``benchmarks/gpu/make_wheels.sh``), with a RECORD that pip accepts.

    python benchmarks/gpu/repack_wheel.py SRC.whl DST.whl MIN_BYTES [DROP ...]

Members whose path starts with a DROP prefix (or matches it as an ``fnmatch`` pattern when it holds a
``*``) are left out; members of at least MIN_BYTES are stored LZMA-compressed at preset 9e (a ZIP
method that ``zipfile``, and so pip, reads wherever the ``lzma`` module exists: ~30% smaller than
deflate on native libraries), the rest deflated at level 9. RECORD is rewritten from the bytes kept.
"""
from __future__ import annotations

import base64
import csv
import fnmatch
import hashlib
import io
import lzma
import os
import sys
import zipfile


class _Lzma9(zipfile.LZMACompressor):
    """zipfile's LZMA member (2-byte version, 2-byte props size, props, raw LZMA1) at preset 9e, not 6."""

    def _init(self) -> bytes:
        filt = {"id": lzma.FILTER_LZMA1, "preset": 9 | lzma.PRESET_EXTREME}
        props = lzma._encode_filter_properties(filt)  # noqa: SLF001 (as zipfile itself does)
        self._comp = lzma.LZMACompressor(lzma.FORMAT_RAW, filters=[filt])
        return bytes([9, 4]) + len(props).to_bytes(2, "little") + props


def repack(src: str, dst: str, min_bytes: int, drop: list[str]) -> None:
    def dropped(name: str) -> list[str]:
        return [p for p in drop if (fnmatch.fnmatchcase(name, p) if "*" in p else name.startswith(p))]

    zipfile.LZMACompressor = _Lzma9  # what zipfile's writer instantiates for ZIP_LZMA
    rows, used = [], set()
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        record = next(n for n in zin.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD"))
        for info in zin.infolist():
            hits = dropped(info.filename)
            used.update(hits)
            if hits or info.filename == record:
                continue
            data = zin.read(info)
            out = zipfile.ZipInfo(info.filename, info.date_time)
            out.external_attr, out.create_system = info.external_attr, info.create_system
            out.compress_type = (zipfile.ZIP_STORED if info.is_dir() else zipfile.ZIP_LZMA
                                 if min_bytes and len(data) >= min_bytes else zipfile.ZIP_DEFLATED)
            zout.writestr(out, data, compresslevel=9)
            if not info.is_dir():
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                rows.append([info.filename, f"sha256={digest}", str(len(data))])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows + [[record, "", ""]])
        out = zipfile.ZipInfo(record, zin.getinfo(record).date_time)
        out.external_attr = zin.getinfo(record).external_attr
        zout.writestr(out, buf.getvalue(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    if set(drop) - used:
        raise SystemExit(f"{src}: nothing matched {sorted(set(drop) - used)}")
    with zipfile.ZipFile(dst) as check:
        bad = check.testzip()  # every member reads back with its CRC
    if bad is not None:
        raise SystemExit(f"{dst}: {bad} does not read back")
    print(f"repacked {os.path.basename(src)}: {os.path.getsize(src) / 2**20:.2f} -> {os.path.getsize(dst) / 2**20:.2f} MiB")


if __name__ == "__main__":
    repack(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])

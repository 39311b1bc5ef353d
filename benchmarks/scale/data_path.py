"""Scale benchmark: ``BENCH=scale make bench``.

For each size N (``SATP_SCALE_GRAPHS``, default "1581,15810"; the full ogbg-ppa has 158,100 graphs), in
a fresh directory D (under ``SATP_SCALE_DIR``, default the system temporary directory), the project's own commands as subprocesses::

    satp data synthetic-ppa --out D/data --graphs N
    satp preprocess jobs/ppa.yaml --set data.root=D/data --set data.source=synthetic \\
        --set shards.root=D/shards --no-progress

each with its peak RSS (``os.wait4``'s ``ru_maxrss``: the largest process of its tree, what ``/usr/bin/time -v``
prints), and:

- while ``satp preprocess`` runs, a thread of this process samples every second the processes of
  the run's own session (it is started with ``start_new_session=True``, so a concurrent run on the
  same machine is not counted): the driver's and each Ray worker's (``/proc/PID/cmdline`` starting
  with ``ray::``) high-water RSS (``VmHWM``), and the use of ``/dev/shm`` (Ray's object store;
  machine-wide, reported above its level when the size started);
- ``SATP_SCALE_KILL`` K (default "half": half the shards the splits make; 0: no kill): the first preprocess run is killed (SIGKILL to its process group, then to anything
  left in its session) once K shard sidecars (``D/shards/*/*.json`` but the manifest and the
  vocabulary) exist, and the rerun that resumes it is timed;
- a last rerun on the finished directory (nothing to do) is timed;
- disk use (``du -sb``): what the generator wrote (D/data before preprocessing), the columnar raw
  store ``D/data/ogbg_ppa/columnar`` and the shards.

D is deleted after each size; a size whose estimated disk use (~45 GB at full size: raw ~8, columnar
~12, shards ~25) does not fit the free space is skipped with a line saying so.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.machine import cpu_model

ROOT = Path(__file__).resolve().parents[2]
JOB = "jobs/ppa.yaml"
FULL_GRAPHS = 158_100
# bytes per graph at full size (measured: raw ~8 GB, columnar ~12 GB, shards ~25 GB for 158,100 graphs)
BYTES_PER_GRAPH = {"raw": 8e9 / FULL_GRAPHS, "columnar": 12e9 / FULL_GRAPHS, "shards": 25e9 / FULL_GRAPHS}
DISK_MARGIN = 1.15
MIB = 2**20


# ---------------------------------------------------------------- machine and disk

def nproc() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def du_bytes(path: Path) -> int:
    """``du -sb``: apparent sizes of every file, directory and link under ``path`` (0 when absent)."""
    path = Path(path)
    if not path.exists():
        return 0
    total = path.lstat().st_size
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except OSError:
                pass
    return total


def needed_bytes(graphs: int) -> int:
    return int(graphs * sum(BYTES_PER_GRAPH.values()) * DISK_MARGIN)


def sidecars(shards_root: Path) -> int:
    """Finished shards: their ``*.json`` sidecars (the manifest and the vocabulary are not shards)."""
    return sum(1 for p in Path(shards_root).glob("*/*.json") if p.name not in ("manifest.json", "vocab.json"))


# ---------------------------------------------------------------- /proc sampling

def _status_kib(pid: str, key: bytes) -> int:
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` (this benchmark started it: ``start_new_session=True``)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == sid:
                out.append(int(pid))
        except OSError:  # gone meanwhile
            pass
    return out


def plasma_bytes(pid: str, seen: set) -> int:
    """Bytes allocated (``st_blocks``) in the ``/dev/shm`` files process ``pid`` holds open: the raylet's
    plasma store file (created there and unlinked), i.e. this Ray's object store in use."""
    total = 0
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if not os.readlink(path).startswith("/dev/shm/"):
                continue
            st = os.stat(path)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def shm_used() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class Sampler(threading.Thread):
    """Every ``period`` s: VmHWM of the driver and of each ``ray::`` process in session ``sid``; the bytes
    of the raylet's plasma file in /dev/shm (the object store), and /dev/shm's use machine-wide."""

    def __init__(self, period: float = 1.0):
        super().__init__(daemon=True)
        self.period, self.sid = period, None
        self.driver_kib = self.worker_kib = self.workers_sum_kib = self.plasma_peak = 0
        self.shm_base = self.shm_peak = shm_used()
        self._stop_event, self._lock = threading.Event(), threading.Lock()

    def watch(self, sid: int | None) -> None:
        with self._lock:
            self.sid = sid
        if sid is not None:
            self.sample()

    def sample(self) -> None:
        with self._lock:
            sid = self.sid
        self.shm_peak = max(self.shm_peak, shm_used())
        if sid is None:
            return
        total, plasma, seen = 0, 0, set()
        for pid in map(str, session_pids(sid)):
            cmd = _cmdline(pid)
            if cmd.startswith(b"ray::"):
                hwm = _status_kib(pid, b"VmHWM:")
                self.worker_kib = max(self.worker_kib, hwm)
                total += _status_kib(pid, b"VmRSS:")
            elif b"pipeline.cli" in cmd:
                self.driver_kib = max(self.driver_kib, _status_kib(pid, b"VmHWM:"))
            elif b"raylet" in cmd.split(b"\0", 1)[0]:
                plasma += plasma_bytes(pid, seen)
        self.workers_sum_kib = max(self.workers_sum_kib, total)
        self.plasma_peak = max(self.plasma_peak, plasma)

    def run(self) -> None:
        while not self._stop_event.wait(self.period):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


# ---------------------------------------------------------------- one timed command

def _env(satp_home: Path) -> dict:
    """The commands' environment: preprocess starts its own local Ray (its processes are what the
    sampler measures), never someone else's: no ``RAY_ADDRESS``, and a ``satp_home`` without the
    record of a running ``satp cluster``."""
    env = dict(os.environ, OUTDATED_IGNORE="1", RAY_USAGE_STATS_ENABLED="0", SATP_HOME=str(satp_home))
    env.pop("RAY_ADDRESS", None)
    return env


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL to the run's process group, then to anything left in its session (Ray's processes)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        left = [p for p in session_pids(proc.pid) if p != proc.pid]
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


def timed(cmd: list[str], logs: Path, name: str, sampler: Sampler | None = None,
          kill_after: int = 0, shards_root: Path | None = None) -> dict:
    """Run ``cmd`` in a new session; wall seconds, peak RSS (KiB, the largest process of its tree: ``wait4``),
    and, with ``kill_after``, the sidecar count and seconds at which it was killed."""
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.out", "wb") as out, open(logs / f"{name}.err", "wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(logs / "satp-home"), stdout=out, stderr=err,
                                start_new_session=True)
        if sampler is not None:
            sampler.watch(proc.pid)
        killed = None
        try:
            pid = 0
            if kill_after > 0:
                while True:
                    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # reaps it when it has ended
                    if pid:
                        break
                    done = sidecars(shards_root)
                    if done >= kill_after:
                        killed = (done, time.perf_counter() - t0)
                        _kill_session(proc)
                        break
                    time.sleep(0.2)
            if not pid:
                _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - t0
            proc.returncode = os.waitstatus_to_exitcode(status)
        except BaseException:
            _kill_session(proc)
            raise
        finally:
            if sampler is not None:
                sampler.watch(None)
    if killed is None and proc.returncode != 0:
        tail = (logs / f"{name}.err").read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(cmd[2:])} exited with {proc.returncode}:\n" + "\n".join(tail))
    if killed is not None:
        _kill_session(proc)  # what a killed driver's Ray left behind
    return {"wall": wall, "maxrss_kib": None if killed else usage.ru_maxrss, "killed": killed,
            "stdout": (logs / f"{name}.out").read_text(errors="replace")}


# ---------------------------------------------------------------- one size

def _planned_shards(splits: dict, overrides: list[str]) -> int:
    from pipeline.config import load_job

    job = load_job(str(ROOT / JOB), overrides)
    per, cap = job.shards.graphs_per_shard, job.data.max_graphs_per_split
    return sum(math.ceil((min(n, cap) if cap else n) / per) for n in splits.values())


def measure_size(graphs: int, d: Path, kill_after: int | str = 0) -> dict:
    """Generate, preprocess (killed and resumed with ``kill_after``), rerun; the figures of one size."""
    py = [sys.executable, "-m", "pipeline.cli"]
    logs = d / "logs"
    row = {"graphs": graphs}
    gen = timed([*py, "data", "synthetic-ppa", "--out", str(d / "data"), "--graphs", str(graphs)], logs, "generate")
    row["gen_wall"], row["gen_rss_kib"] = gen["wall"], gen["maxrss_kib"]
    row["raw_bytes"] = du_bytes(d / "data")
    overrides = [f"data.root={d / 'data'}", "data.source=synthetic", f"shards.root={d / 'shards'}"]
    pre = [*py, "preprocess", JOB, *(a for o in overrides for a in ("--set", o)), "--no-progress"]
    if kill_after == "half":
        splits = json.loads(gen["stdout"].strip().splitlines()[-1])["splits"]
        row["planned_shards"] = _planned_shards(splits, overrides)
        kill_after = row["planned_shards"] // 2
    sampler = Sampler()
    sampler.start()
    try:
        first = timed(pre, logs, "preprocess", sampler, kill_after=int(kill_after), shards_root=d / "shards")
        row["pre_wall"], row["pre_rss_kib"], row["killed"] = first["wall"], first["maxrss_kib"], first["killed"]
        if first["killed"] is not None:
            time.sleep(2)
            resume = timed(pre, logs, "resume", sampler)
            row["resume_wall"], row["resume_rss_kib"] = resume["wall"], resume["maxrss_kib"]
            out_dir = resume["stdout"].strip().splitlines()[-1]
        else:
            out_dir = first["stdout"].strip().splitlines()[-1]
        rerun = timed(pre, logs, "rerun", sampler)
        row["rerun_wall"] = rerun["wall"]
    finally:
        sampler.stop()
    manifest = json.loads((Path(out_dir) / "manifest.json").read_text())
    row["shards"] = len(manifest["shards"])
    row["manifest_graphs"] = sum(int(v["graphs"]) for v in manifest["splits"].values())
    row["driver_kib"], row["worker_kib"] = sampler.driver_kib, sampler.worker_kib
    row["workers_sum_kib"] = sampler.workers_sum_kib
    row["plasma_bytes"] = sampler.plasma_peak
    row["shm_bytes"] = max(0, sampler.shm_peak - sampler.shm_base)
    row["columnar_bytes"] = du_bytes(d / "data" / "ogbg_ppa" / "columnar")
    row["shards_bytes"] = du_bytes(d / "shards")
    return row


# ---------------------------------------------------------------- report

def _mib(kib: int | None) -> str:
    return "?" if not kib else f"{kib / 1024:,.0f}"


def _mb(n: int) -> str:
    return f"{n / MIB:,.2f}" if n < 10 * MIB else f"{n / MIB:,.1f}"


def _row(r: dict) -> str:
    killed = r.get("killed")
    kill_cell = f"{killed[0]} shards at {killed[1]:.1f} s" if killed else "-"
    resume = f"{r['resume_wall']:.1f}" if killed else "-"
    pre = f"{r['pre_wall']:.1f}" if not killed else "killed"
    store = _mb(r["plasma_bytes"]) if r["plasma_bytes"] else f"{_mb(r['shm_bytes'])}*"
    cells = [f"{r['graphs']:,}", f"{r['gen_wall']:.1f}", _mib(r["gen_rss_kib"]), pre,
             _mib(r["driver_kib"]), _mib(r["worker_kib"]), store, kill_cell, resume,
             f"{r['rerun_wall']:.1f}", _mb(r["raw_bytes"]), _mb(r["columnar_bytes"]), _mb(r["shards_bytes"])]
    return "| " + " | ".join(cells) + " |"


def run(sizes: list[int] | None = None, kill_after: int | str | None = None) -> str:
    """The markdown section (see the module docstring)."""
    if sizes is None:
        sizes = [int(s) for s in os.environ.get("SATP_SCALE_GRAPHS", "1581,15810").split(",") if s.strip()]
    if kill_after is None:
        kill_after = os.environ.get("SATP_SCALE_KILL", "half")
    if kill_after != "half":
        kill_after = int(kill_after)
    load0 = os.getloadavg()
    rows, notes = [], []
    base = Path(os.environ.get("SATP_SCALE_DIR") or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    for n in sizes:
        print(f"== scale: {n:,} graphs", file=sys.stderr, flush=True)
        free, need = shutil.disk_usage(base).free, needed_bytes(n)
        if need > free:
            notes.append(f"- {n:,} graphs: **skipped**, needs ~{need / 1e9:.1f} GB of disk "
                         f"(estimate x{DISK_MARGIN}), {free / 1e9:.1f} GB free under {base}")
            continue
        d = Path(tempfile.mkdtemp(prefix=f"satp-scale-{n}-", dir=base))
        try:
            row = measure_size(n, d, kill_after)
            rows.append(row)
            if row.get("planned_shards") is not None and row.get("killed") is None:
                notes.append(f"- {n:,} graphs: the first preprocess run finished before "
                             f"{row['planned_shards'] // 2} of {row['planned_shards']} shards were seen: not killed")
            print(_row(row), file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    load1 = os.getloadavg()
    cmd_kill = ("the first preprocess run is killed (SIGKILL to its process group and session) once "
                + ("half of its shards" if kill_after == "half" else f"{kill_after} shards")
                + " are finished, and the rerun that resumes it is timed; " if kill_after else "")
    lines = [
        "## Scale: synthetic ogbg-ppa, generate + preprocess (`BENCH=scale make bench`)",
        "",
        "Per size N, in a fresh directory D, each command with its peak RSS (`wait4`, as `/usr/bin/time -v`):",
        "",
        "    satp data synthetic-ppa --out D/data --graphs N",
        "    satp preprocess jobs/ppa.yaml --set data.root=D/data --set data.source=synthetic "
        "--set shards.root=D/shards --no-progress",
        "",
        f"then {cmd_kill}the same preprocess command once more on the finished directory (nothing to do). "
        f"(Sizes from `SATP_SCALE_GRAPHS`, full ogbg-ppa = {FULL_GRAPHS:,} graphs; `SATP_SCALE_KILL` K, half or 0.)",
        "",
        f"CPU: {cpu_model()}, nproc {nproc()}. Load average (1/5/15 min) at start "
        f"{load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, at end {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}. "
        "The machine may be shared with other work: wall times include time spent waiting for CPUs "
        "other processes held.",
        "",
        "| graphs | generate s | generate peak RSS MiB | preprocess s | driver peak RSS MiB "
        "| largest Ray worker peak RSS MiB | object store peak MiB | killed at | resume s "
        "| finished rerun s | raw MiB | columnar MiB | shards MiB |",
        "|" + "---|" * 13,
        *(_row(r) for r in rows),
        "",
        "- generate peak RSS: the largest process of the command's tree (the "
        "generator's worker processes included); driver and Ray worker peaks: high-water RSS (`VmHWM`) "
        "of the `satp preprocess` process and of its own `ray::` processes (its session), sampled every "
        "second over all of its runs; object store: peak bytes allocated in the run's own raylet's plasma "
        "file in `/dev/shm` (with * when none was seen: peak `/dev/shm` use above its level when the size "
        "started, machine-wide, so another Ray on the machine would count too); preprocess s: the first "
        "run, `killed` when it was killed (killed at: finished shards seen and seconds since its start; "
        "resume s: the rerun that finished it); raw: what the generator "
        "wrote (`D/data` before preprocessing); columnar: `D/data/ogbg_ppa/columnar`; shards: `D/shards`.",
    ]
    for r in rows:
        finished = r["resume_rss_kib"] if r.get("killed") else r["pre_rss_kib"]
        lines.append(f"- {r['graphs']:,} graphs: {r['shards']} shards, {r['manifest_graphs']:,} graphs in the "
                     f"manifest; maximum RSS of the preprocess run that finished {_mib(finished)} MiB "
                     f"(its largest waited-for process); all Ray workers together at most "
                     f"{_mib(r['workers_sum_kib'])} MiB RSS; `/dev/shm` peak above start (machine-wide) "
                     f"{_mb(r['shm_bytes'])} MiB")
    lines += notes
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())

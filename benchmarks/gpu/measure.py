"""How the GPU check runs and measures its commands (:mod:`benchmarks.gpu.check` and its parts
``steps``, ``scale``, ``multirank``, ``tune``, ``pattern``, ``cluster``, ``code2batch``): the repository root and the dry-run
switch, the budget clock, the commands' environment and ``satp`` command lines, one train-step benchmark process
(:mod:`benchmarks.gpu.step`), background commands, :func:`measure` (wall time, exit status, peak
memory of the process tree and the GPU, stopped on a timeout or when asked), disk use, and the
per-epoch figures of a ``satp train`` run read back from MLflow (:func:`_pipeline_metrics`), the pycode
data of two parts, the tables of commands and checks, the logs' bundle for ``$OUT``: what the
parts share sits here, below all of them, so that no part imports another's module."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
DRY_RUN = os.environ.get("SATP_GPU_DRY_RUN") == "1"


class Clock:
    def __init__(self, budget: float) -> None:
        self.start, self.budget = time.monotonic(), budget

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)


def device() -> str:
    """The device a part measured, for its section: the card, the cores, torch."""
    import torch

    card = torch.cuda.get_device_name() if not DRY_RUN else "CPU (dry run: tiny sizes and model, CPU workers)"
    return f"{card}, {os.cpu_count()} cores, torch {torch.__version__}"


def out_dir() -> Optional[Path]:
    """``$OUT`` (the device tool's output folder), made if missing; None when unset."""
    if not os.environ.get("OUT"):
        return None
    out = Path(os.environ["OUT"])
    out.mkdir(parents=True, exist_ok=True)
    return out


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                DS_ACCELERATOR="cpu" if DRY_RUN else "cuda", OUTDATED_IGNORE="1", RAY_USAGE_STATS_ENABLED="0")


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=max(timeout, 1), **kw)


def satp(*args: str) -> list[str]:
    """A ``satp`` command line in this interpreter."""
    return [sys.executable, "-m", "pipeline.cli", *args]


def overrides(sets: list[str]) -> list[str]:
    """``--set`` arguments of ``satp`` for ``KEY=VALUE`` settings."""
    return [a for s in sets for a in ("--set", s)]


def _last_line(text: str, limit: int | None = 300) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


def _step(spec: dict, timeout: float) -> dict:
    try:
        proc = _run([sys.executable, "-m", "benchmarks.gpu.step", json.dumps(spec)], timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:  # the traceback's last lines: the failing call and the error (a CUDA one names its kernel)
        lines = [line.strip() for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()]
        return {"error": " / ".join(lines[-3:])[-600:]}
    return json.loads(_last_line(proc.stdout, limit=None))


def _start(cmd: list[str], log: Path, env: Optional[dict] = None) -> subprocess.Popen:
    """``cmd`` in the background (``env``: default :func:`_env`), its output to ``log`` (a pipe would
    block a chatty command)."""
    handle = open(log, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or _env(), stdout=handle, stderr=subprocess.STDOUT, text=True)
    proc.log = log  # type: ignore[attr-defined]
    handle.close()
    return proc


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[bool, str]:
    """``(ok, output)`` of a background command, killed after ``timeout`` seconds."""
    timed_out = False
    try:
        proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        timed_out = True
    output = Path(proc.log).read_text()  # type: ignore[attr-defined]
    return proc.returncode == 0 and not timed_out, output + ("\ntimed out" if timed_out else "")


def measure(cmd: list[str], timeout: float, log: Path, sample_s: float = 1.0,
            should_stop: Optional[Callable[[], Optional[str]]] = None, check_s: float = 2.0,
            grace_s: float = 0.0) -> dict:
    """Run ``cmd`` (stdout to ``log``, stderr to ``log`` + ``.err``), killed with its process tree after
    ``timeout`` s, or as soon as ``should_stop()`` (called every ``check_s`` seconds) returns a reason;
    with ``grace_s`` the command first gets SIGINT (a ``satp train`` driver then shuts Ray down
    itself) and that long to exit. Returns its wall time, exit status, why it was stopped
    (``stopped``: None, ``"timeout"`` or the reason) and memory (used by the ``scale``,
    ``multirank``, ``pattern``, ``cluster`` and ``code2batch`` parts):

    - ``max_rss_gb``: ``ru_maxrss`` of ``wait4`` on the command, i.e. the largest single process of its
      tree that was waited for (what ``/usr/bin/time -v`` prints as "Maximum resident set size");
    - ``tree_rss_gb``: the peak, sampled every ``sample_s``, of the summed RSS of the command's whole
      process tree (Ray's GCS, raylet, workers and their loader processes; pages shared between
      processes are counted once per process, so this overstates shared memory);
    - ``machine_used_gb``: the peak of the machine's used memory (``psutil``'s ``used``: without page
      cache and /dev/shm) above its level at the start;
    - ``gpu_mem_gb``: the peak of the device memory in use on GPU 0, all processes (NVML), when NVML loads;
      ``gpu_processes``: the most processes on it at once.
    """
    import threading

    import psutil

    err = open(str(log) + ".err", "w")
    out = open(log, "w")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=err, text=True)
    out.close()
    err.close()
    base_used = psutil.virtual_memory().used
    peaks = {"tree": 0, "used": 0, "gpu": 0, "procs": 0}
    nvml = None
    try:
        import pynvml

        pynvml.nvmlInit()
        nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:
        pass
    stop = threading.Event()
    root = psutil.Process(proc.pid)

    def tree() -> list:
        try:
            return [root] + root.children(recursive=True)
        except psutil.Error:
            return []

    def sample() -> None:
        while not stop.is_set():
            rss = 0
            for p in tree():
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            peaks["tree"] = max(peaks["tree"], rss)
            peaks["used"] = max(peaks["used"], psutil.virtual_memory().used - base_used)
            if nvml is not None:
                try:
                    peaks["gpu"] = max(peaks["gpu"], nvml[0].nvmlDeviceGetMemoryInfo(nvml[1]).used)
                    peaks["procs"] = max(peaks["procs"], len(nvml[0].nvmlDeviceGetComputeRunningProcesses(nvml[1])))
                except Exception:
                    pass
            stop.wait(sample_s)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    stopped = None
    checked = start
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        now = time.monotonic()
        if now - start > timeout:
            stopped = "timeout"
        elif should_stop is not None and now - checked >= check_s:
            checked = now
            stopped = should_stop()
        if stopped:
            procs = {p.pid: p for p in tree()}  # the processes this command started, by id
            if grace_s > 0:
                proc.send_signal(signal.SIGINT)
                while time.monotonic() - now < grace_s:
                    procs.update((p.pid, p) for p in tree())
                    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                    if pid:
                        break
                    time.sleep(0.5)
            for p in reversed(list(procs.values()) + tree()):  # children first; what is left of them
                try:
                    p.kill()
                except psutil.Error:
                    pass
            if not pid:
                pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.2)
    timed_out = stopped == "timeout"
    seconds = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    stop.set()
    thread.join()
    stdout = Path(log).read_text()
    stderr = Path(str(log) + ".err").read_text()
    return {
        "ok": proc.returncode == 0 and not stopped, "returncode": proc.returncode, "timed_out": timed_out,
        "stopped": stopped,
        "seconds": seconds, "max_rss_gb": usage.ru_maxrss * 1024 / 1e9, "tree_rss_gb": peaks["tree"] / 1e9,
        "machine_used_gb": peaks["used"] / 1e9, "gpu_mem_gb": peaks["gpu"] / 1e9 if nvml is not None else None,
        "gpu_processes": peaks["procs"] if nvml is not None else None,
        "tail": _last_line(stdout if proc.returncode == 0 else (stderr or stdout)),
        "stdout_tail": stdout[-4000:], "stderr_tail": stderr[-4000:],
    }


def pycode_data(work_dir: Path, timeout: float, logs: Path) -> dict:
    """``satp data pycode`` over this machine's standard library into ``work_dir / "data"`` (the
    ``multirank`` and ``tune`` parts' data), or the data an earlier call on this warm machine left."""
    if (work_dir / "data" / "ogbg_code2").is_dir():
        return {"ok": True, "reused": True, "seconds": 0.0, "tail": "reused", "max_rss_gb": 0.0}
    return measure(satp("data", "pycode", "--out", str(work_dir / "data"), "--workers", str(min(16, os.cpu_count() or 1))),
                   timeout, logs / "pycode.log")


def step_lines(steps: dict[str, dict], disk: Optional[dict[str, str]] = None) -> list[str]:
    """The table of a part's commands (:func:`measure` results by label): status, wall time, memory, with
    ``disk`` the disk use after each (by label); a failed one's last line below the table."""
    lines = ["| step | status | wall s | peak RSS, largest process (GB) | peak RSS, process tree (GB) "
             "| peak GPU memory (GB) |" + (" disk after (GB) |" if disk else ""), "|---" * (6 + bool(disk)) + "|"]
    failed = []
    for label, r in steps.items():
        status = ("reused (an earlier call's data)" if r.get("reused") else f"skipped: {r['skipped']}" if r.get("skipped")
                  else "ok" if r.get("ok") else "cut by the budget (SIGINT)" if r.get("timed_out")
                  else f"stopped: {r['stopped']}" if r.get("stopped") else f"FAILED ({r.get('returncode')})")
        lines.append(f"| {label} | {status} | {r.get('seconds', 0):.0f} | {_gb(r.get('max_rss_gb'))} "
                     f"| {_gb(r.get('tree_rss_gb'))} | {_gb(r.get('gpu_mem_gb'))} |" + (f" {disk[label]} |" if disk else ""))
        if not (r.get("ok") or r.get("skipped") or r.get("stopped") or r.get("timed_out")) and r.get("tail"):
            failed.append(f"{label}: `{r['tail'][:400]}`")
    return lines + [line for f in failed for line in ("", f)]


def check_lines(checks: list[tuple[str, bool, str]], after: str) -> list[str]:
    """The table of a part's checks ``(check, passed, detail)``, then the count that passed and ``after``."""
    lines = ["", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c} | {'**pass**' if ok else '**FAIL**'} | {d} |" for c, ok, d in checks]
    return lines + ["", f"{sum(ok for _, ok, _ in checks)} of {len(checks)} checks passed; {after}."]


def copy_logs(logs: Path, out_dir: Optional[Path], prefix: str) -> None:
    """The logs' tails as ONE file in ``$OUT`` (the device tool brings back at most 8 files)."""
    if out_dir is None:
        return
    parts = [f"===== {log.name} (last 12,000 characters)\n{log.read_text(errors='replace')[-12000:]}"
             for log in sorted(logs.glob("*.log*"), key=lambda p: p.stat().st_mtime)]
    (out_dir / f"gpu_{prefix}_logs.txt").write_text("\n".join(parts))


def disk_gb(path: str | Path) -> float:
    """Bytes on disk (allocated blocks) of the file or under the directory ``path``, in GB; 0 when absent."""
    if os.path.isfile(path):
        return os.lstat(path).st_blocks * 512 / 1e9
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_blocks * 512
            except OSError:
                pass
    return total / 1e9


def _gb(value) -> str:
    return "-" if value is None else f"{value:.2f}"


EPOCH_KEYS = ("graphs_per_s", "epoch_seconds", "data_wait_frac", "eval_seconds", "train_loss")


def _pipeline_metrics(tracking_uri: str, run_name: str, metric: str = "f1") -> list[dict]:
    """Per-epoch figures of ``satp train``'s MLflow run named ``run_name``, as Ray Train's controller
    logged them (:mod:`pipeline.train.epoch_logger`): throughput, data-wait share, times, loss, val/test metric."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"tags.mlflow.runName = '{run_name}'")
    if not runs:
        return []
    run_id = runs[0].info.run_id
    by_epoch: dict[int, dict] = {}
    for key in (*EPOCH_KEYS, f"val_{metric}", f"test_{metric}"):
        for m in client.get_metric_history(run_id, key):
            by_epoch.setdefault(m.step, {})[key] = m.value
    return [dict(epoch=k, **v) for k, v in sorted(by_epoch.items())]

"""What the GPU check's time-to-accuracy parts share (``pattern``, ``cluster``:
:mod:`~benchmarks.gpu.accuracy_sbm`; ``code2batch``: :mod:`~benchmarks.gpu.accuracy_code2`; docs/gpu.md,
"Time to accuracy on one GPU"): the part and its budget, the reserves around ``satp train``, the dry
runs' tiny model, the work folder (``SATP_ACC_DIR``, default ``runs/gpu-PART``, kept between calls on a
warm machine: data and shards are made once and runs have fixed names, so a second call resumes a run
the first call's budget cut) and its ledger of earlier calls, ``satp preprocess`` and ``satp train``
under :func:`benchmarks.gpu.measure.measure` with a watch on the run's checkpoints, and the run's
history and time to target read back from them."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Optional

from benchmarks.gpu.measure import DRY_RUN, ROOT, Clock, measure, out_dir, overrides, satp

PART = os.environ.get("SATP_GPU_PART") or "pattern"
BUDGET_S = float(os.environ.get("SATP_GPU_BUDGET_S") or ((540 if PART == "code2batch" else 420) if DRY_RUN else 510))
#: a call that only makes the part's data and shards (part ``first`` runs one while it measures steps)
PREPARE_ONLY = os.environ.get("SATP_ACC_PREPARE_ONLY") == "1"
GRACE_S = 20.0  # SIGINT to `satp train` at the budget's end, then this long before its process tree is killed
END_RESERVE_S = 15.0  # for reading the checkpoints and writing the section
STARTUP_S = 30.0 if DRY_RUN else 60.0  # `satp train` before its first step: Ray, the worker group, data, engine
# the tiny model and CPU workers of the dry runs (the same commands and code path)
DRY_SETS = ["resources.use_gpu=false", "resources.cpus_per_worker=1", "train.loader_workers=0", "train.precision=fp32",
            "model.hidden_dim=16", "model.num_layers=2", "model.num_heads=2", "mlflow.log_system_metrics=false"]


# ----------------------------------------------------------------------------- helpers
def _digest(items: list[str]) -> str:
    return hashlib.sha256("\n".join(items).encode()).hexdigest()[:8]


def _work_dir(part: str) -> Path:
    return Path(os.environ.get("SATP_ACC_DIR") or ROOT / "runs" / (f"gpu-{part}-dry" if DRY_RUN else f"gpu-{part}"))


class Ledger:
    """``WORK/runs.json``: what earlier calls of the part did on this machine (runs that ended, segments)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = json.loads(path.read_text()) if path.is_file() else {}

    def get(self, key: str) -> dict:
        return self.data.setdefault(key, {})

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def _previous(storage: Path, name: str):
    from pipeline.train.checkpoint import CheckpointManager
    from pipeline.train.rerun import previous_run

    try:
        return previous_run(CheckpointManager(storage / name))
    except ValueError:
        return None


def run_state(storage: Path, name: str) -> Optional[dict]:
    """The run's latest checkpoint state (``state.json``: history, best, epoch, steps, stopped), or None."""
    previous = _previous(storage, name)
    return previous.state if previous is not None else None


class Watch:
    """Called by :func:`benchmarks.gpu.measure.measure` every few seconds while ``satp train`` runs: records
    when each epoch of this call appeared in a checkpoint (wall seconds since the command started) and
    returns a reason to stop the run when ``stop(state)`` gives one (None: it goes on). The checkpoint
    found before the command (an earlier call's; deleted by ``--restart``) is not this call's."""

    def __init__(self, storage: Path, name: str, stop: Optional[Callable[[dict], Optional[str]]] = None,
                 restart: bool = False) -> None:
        self.storage, self.name, self.stop = storage, name, stop
        initial = _previous(storage, name)
        self.initial = initial.checkpoint if initial is not None else None
        self.done_before = 0 if (initial is None or restart) else len(initial.state.get("history") or [])
        self.start = time.monotonic()
        self.seen: dict[int, float] = {}
        self.reason: Optional[str] = None

    def __call__(self) -> Optional[str]:
        previous = _previous(self.storage, self.name)
        if previous is None or previous.checkpoint == self.initial:
            return None
        state = previous.state
        for entry in state.get("history") or []:
            if int(entry["epoch"]) >= self.done_before:
                self.seen.setdefault(int(entry["epoch"]), round(time.monotonic() - self.start, 1))
        if self.stop is not None:
            self.reason = self.stop(state)
        return self.reason


def train(job: str, sets: list[str], name: str, storage: Path, log: Path, timeout: float,
          stop: Optional[Callable[[dict], Optional[str]]] = None, restart: bool = False) -> dict:
    """``satp train job --set ...`` under :func:`measure`: stopped at ``timeout`` (SIGINT, then killed) or
    when ``stop(state)`` returns a reason; returns the measurement, the epochs' observed wall times and the
    run's state from its latest checkpoint."""
    cmd = satp("train", job, *overrides(sets + [f"train.run_name={name}"])) + (["--restart"] if restart else [])
    watch = Watch(storage, name, stop, restart)
    print(f"   satp train {job} ({name}; timeout {timeout:.0f} s)", flush=True)
    result = measure(cmd, timeout, log, should_stop=watch, check_s=2.0, grace_s=GRACE_S)
    watch()  # the epochs of the last seconds
    result["observed_s"] = watch.seen
    result["epochs_before"] = watch.done_before
    result["state"] = run_state(storage, name)
    result["summary"] = [line for line in result["stdout_tail"].splitlines()
                         if line.startswith(("run ", "target ", "stopped ", "test ", "registered"))]
    return result


def _preprocess(part: str, job: str, sets: list[str], clock, logs: Path, reserve_s: float) -> tuple[dict, Optional[str]]:
    """``satp preprocess`` of a part's job (finished shards are reused), leaving ``reserve_s`` of the
    budget for what follows; returns the step's measurement and the shard directory (None: failed)."""
    print(f"== gpu {part}: satp preprocess ({clock.left():.0f} s left)", flush=True)
    result = measure(satp("preprocess", job, "--no-progress", *overrides(sets)),
                     max(30.0, clock.left() - reserve_s), logs / "preprocess.log")
    return result, (result["tail"].strip() if result["ok"] else None)


def _begin(part: str):
    """A call of ``part``: its budget clock, work and log folders, ``$OUT``, the ledger with this call
    entered (not a :data:`PREPARE_ONLY` one), its call number, and the Ray storage and MLflow store under
    the work folder."""
    clock = Clock(BUDGET_S)
    work = _work_dir(part)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(work / "runs.json")
    call = len(ledger.get("calls")) + 1
    if not PREPARE_ONLY:
        ledger.data["calls"][str(call)] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": BUDGET_S}
    return clock, work, logs, out_dir(), ledger, call, work / "ray", f"sqlite:///{work / 'mlflow.db'}"


def history_of(state: Optional[dict]) -> list[dict]:
    return list((state or {}).get("history") or [])


def time_to(history: list[dict], metric: str, value: float) -> Optional[dict]:
    """The product's time to target (:func:`pipeline.train.stopping.time_to_target`) of ``history``."""
    from pipeline.train import stopping
    from pipeline.config.train import TargetConfig

    return stopping.time_to_target(history, TargetConfig(metric=metric, value=value), "max")

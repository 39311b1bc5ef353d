"""GPU check, part ``first`` (``benchmarks/gpu/run.sh first``): two questions in one device session.

1. PATTERN's training step at 32 graphs per step, eager, compiled and captured (part ``steps``' rows, one
   process each: a CUDA error in one mode leaves the others' rows), while part ``pattern`` makes its
   data and shards beside them (not counted against the run);
2. ``satp train jobs/pattern.yaml`` to val_acc 0.865 (part ``pattern``, timed from the command's start)
   in the mode that trains the most graphs in the time left (graphs/s x (time left - its warm-up)); a
   run that fails in that mode runs again in the next one while the budget allows.

``SATP_GPU_DRY_RUN=1``: both on the CPU with tiny sizes (``captured`` measured as ``compiled``, trained
as ``static``: no CUDA graphs there).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from benchmarks.gpu.measure import DRY_RUN, ROOT, Clock, _env, _finish, _start, device, out_dir
from benchmarks.gpu import steps

BUDGET_S = float(os.environ.get("SATP_GPU_BUDGET_S") or (360 if DRY_RUN else 480))
LABEL = "PATTERN, 32 graphs/step"
MODES = ("eager", "compiled", "captured")  # captured after compiled: it finds compiled's Inductor cache
STEPS_SHARE = 0.4  # of the budget, at most, for the step rows
TRAIN_MIN_S = 150 if DRY_RUN else 120  # less left than this: no (further) training run
#: the accuracy part's call, its section written to the file named by argv[1]
ACCURACY = "import sys; from benchmarks.gpu.accuracy_sbm import run; open(sys.argv[1], 'w').write(run('pattern'))"


def ranked(rows: dict[str, dict], left_s: float) -> list[str]:
    """The modes whose rows worked, the one that trains the most graphs in ``left_s`` first."""
    worked = {mode: r for mode, r in rows.items() if "error" not in r and r.get("graphs_per_s")}
    return sorted(worked, key=lambda mode: -worked[mode]["graphs_per_s"] * max(0.0, left_s - worked[mode].get("warmup_s", 0)))


def _accuracy_env(budget_s: float, mode: Optional[str], out: Path, prepare_only: bool = False) -> dict:
    sets = " ".join(filter(None, [os.environ.get("SATP_ACC_SET", ""), f"train.step={mode}" if mode else ""]))
    env = dict(_env(), SATP_GPU_PART="pattern", SATP_GPU_BUDGET_S=f"{budget_s:.0f}", SATP_ACC_SET=sets, OUT=str(out))
    if prepare_only:
        env["SATP_ACC_PREPARE_ONLY"] = "1"
    return env


def _train_failed(out: Path) -> Optional[str]:
    """The tail of a ``satp train`` of part ``pattern`` that failed (not stopped by the budget), else None."""
    try:
        train = json.loads((out / "gpu_pattern.json").read_text())["steps"]["train"]
    except (OSError, ValueError, KeyError):
        return "the part wrote no gpu_pattern.json"
    if train.get("skipped") or train.get("stopped") or train.get("returncode") in (0, None):
        return None
    return (train.get("tail") or f"exit {train.get('returncode')}")[-600:]


def run() -> str:
    title = "### GPU check, part first (`benchmarks/gpu/run.sh first`): PATTERN's step modes, then time to 86.5"
    clock = Clock(BUDGET_S)
    steps.WORK.mkdir(parents=True, exist_ok=True)
    out = out_dir() or steps.WORK / "first-out"
    out.mkdir(parents=True, exist_ok=True)
    raw: dict = {"budget_s": BUDGET_S, "rows": {}, "trainings": []}

    def save() -> None:
        (out / "gpu_first.json").write_text(json.dumps(raw, indent=1, default=str))

    # the data and shards of part pattern, made while the step rows run
    prepared = steps.WORK / "first-prepare.md"
    # (its own budget ends before the run's minimum: it stops itself)
    prepare = _start([sys.executable, "-c", ACCURACY, str(prepared)], steps.WORK / "first-prepare.log",
                     env=_accuracy_env(clock.left() - TRAIN_MIN_S, None, out, prepare_only=True))
    files = steps.shard_dirs(("pattern",))  # the shards part steps makes and reuses
    steps_clock = Clock(min(BUDGET_S * STEPS_SHARE, clock.left() - TRAIN_MIN_S))
    lines = [title, "", f"Device: {device()}; budget {BUDGET_S:.0f} s.", "",
             f"1. Training steps, {LABEL} (`benchmarks/gpu/steps.py`'s rows; {steps.PATTERN_GRAPHS} PATTERN graphs, "
             "bf16, the job's model), measured while part pattern made its data and shards:", ""] + steps.HEADER
    for mode in MODES:
        result = (steps.step_row(LABEL, mode, files, steps_clock) if steps_clock.left() > 30
                  else {"error": "skipped: the step rows' share of the budget spent"})
        raw["rows"][mode] = result
        print(f"   {json.dumps(result)[:400]}", flush=True)
        lines.append(steps._row(LABEL, mode, result))
        save()
    ok, _ = _finish(prepare, clock.left())
    raw["prepared"] = ok
    lines += ["", "Data and shards (part pattern, before the run; not counted against it): "
              + ("ready." if ok else "not ready in time: the run's own call makes what is missing.")]
    if prepared.is_file():
        lines += ["", prepared.read_text().strip()]

    # the run, in the mode that trains the most graphs in the budget left; the next mode if it fails
    order = ranked(raw["rows"], clock.left()) or ["eager"]
    lines += ["", f"2. `satp train jobs/pattern.yaml` to val_acc 0.865, step modes in the order they train the most "
                  f"graphs in the {clock.left():.0f} s left: {', '.join(order)}.", ""]
    for mode in order:
        if clock.left() < TRAIN_MIN_S:
            lines.append(f"- {mode}: not run ({clock.left():.0f} s left).")
            break
        train_mode = "static" if DRY_RUN and mode == "captured" else mode
        section = steps.WORK / f"first-{train_mode}.md"
        print(f"== gpu first: part pattern with train.step={train_mode} ({clock.left():.0f} s left)", flush=True)
        budget = clock.left() - 15
        try:
            subprocess.run([sys.executable, "-c", ACCURACY, str(section)], cwd=ROOT, env=_accuracy_env(budget, train_mode, out),
                           timeout=budget + 60)
        except subprocess.TimeoutExpired:
            pass
        failed = _train_failed(out)
        raw["trainings"].append({"mode": train_mode, "failed": failed})
        save()
        if section.is_file():
            lines += [section.read_text().strip().replace("### GPU check, part pattern", f"#### train.step {train_mode}: part pattern", 1), ""]
        if failed is None:
            break
        lines += [f"`train.step={train_mode}` failed: `{failed}`", ""]
    lines += [f"Part wall time {BUDGET_S - clock.left():.0f} s."]
    save()
    return "\n".join(lines)

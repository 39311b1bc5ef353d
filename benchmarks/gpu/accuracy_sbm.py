"""GPU check, parts ``pattern`` and ``cluster`` (``benchmarks/gpu/run.sh PART``): time to accuracy of
``jobs/pattern.yaml`` / ``jobs/cluster.yaml`` on one GPU, on the full benchmark regenerated on the
machine: the benchmarks' settings, the variant the environment asks for (``SATP_ACC_*``), data,
shards and the run to ``train.target``, and the part's section (verdict, calls, curve)."""
from __future__ import annotations

import json
import math
import os
import shutil
from typing import Any, Optional

from benchmarks.gpu.accuracy_report import _fmt, _pct, _save_plot, curve_table
from benchmarks.gpu.accuracy_runs import (BUDGET_S, DRY_SETS, END_RESERVE_S, GRACE_S, PART, PREPARE_ONLY, STARTUP_S, _begin,
                                          _digest, _preprocess, history_of, run_state, time_to, train)
from benchmarks.gpu.measure import DRY_RUN, ROOT, copy_logs, device, measure, satp, step_lines

SBM = {
    "pattern": dict(job="jobs/pattern.yaml", builder="sbm-pattern", folder="sbm_pattern", target=0.865, target_s=300,
                    paper_gcn=86.749, paper_pna=86.865, dry_graphs=280),
    "cluster": dict(job="jobs/cluster.yaml", builder="sbm-cluster", folder="sbm_cluster", target=0.774, target_s=600,
                    paper_gcn=77.247, paper_pna=77.751, dry_graphs=280),
}


# ----------------------------------------------------------------------------- pattern, cluster
def sbm_variant(job) -> tuple[str, list[str], list[str]]:
    """``(label, --set overrides, notes)`` of the variant the environment asks for (default: the job's)."""
    t = job.train
    base_batch = t.max_graphs_per_batch or 32
    per_graph = max(1, t.node_budget // base_batch)  # node slots per graph (jobs: 6400 / 32 = 200 > 191 nodes)
    fast = os.environ.get("SATP_ACC_FAST") == "1"
    batch = int(os.environ.get("SATP_ACC_BATCH") or (4 * base_batch if fast else 0)) or None
    lr = float(os.environ["SATP_ACC_LR"]) if os.environ.get("SATP_ACC_LR") else None
    warmup = int(os.environ["SATP_ACC_WARMUP_STEPS"]) if os.environ.get("SATP_ACC_WARMUP_STEPS") else None
    sets, notes = [], []
    if batch and batch != base_batch:
        sets += [f"train.max_graphs_per_batch={batch}", f"train.bucket_size={batch}", f"train.node_budget={batch * per_graph}"]
        if (t.eval_node_budget or 2 * t.node_budget) < batch * per_graph:
            sets.append(f"train.eval_node_budget={batch * per_graph}")
        if lr is None:
            lr = t.lr * math.sqrt(batch / base_batch)
            notes.append(f"lr {t.lr:g} x sqrt({batch} / {base_batch}) = {lr:.3g} (square-root rule, docs/gpu.md)")
        if warmup is None and fast and t.warmup_steps:
            warmup = max(1, round(t.warmup_steps * base_batch / batch / 4))
            notes.append(f"warm-up {t.warmup_steps:,} steps of {base_batch} graphs ({t.warmup_steps * base_batch / 1e4:.0f} epochs "
                         f"of 10,000) -> {warmup} steps of {batch} (a quarter of those epochs)")
    if lr is not None:
        sets.append(f"train.lr={lr:.6g}")
    if warmup is not None:
        sets.append(f"train.warmup_steps={warmup}")
    sets += (os.environ.get("SATP_ACC_SET") or "").split()
    label = "job" if not sets else ("fast" if fast and not os.environ.get("SATP_ACC_SET") else "variant")
    return label, sets, notes


def run(part: Optional[str] = None) -> str:
    """The part ``part`` (default ``SATP_GPU_PART``): its section."""
    from pipeline.config import load_job

    part = part or PART
    spec = SBM[part]
    title = f"### GPU check, part {part} (`benchmarks/gpu/run.sh {part}`): time to accuracy, `{spec['job']}` on one GPU"
    clock, work, logs, out_dir, ledger, call, storage, tracking = _begin(part)
    common = [f"data.root={work / 'data'}", f"shards.root={work / 'shards'}", f"train.storage_path={storage}",
              f"mlflow.tracking_uri={tracking}"] + (DRY_SETS if DRY_RUN else [])
    job = load_job(ROOT / spec["job"], common)
    label, variant, notes = sbm_variant(job)
    metric_key = os.environ.get("SATP_ACC_METRIC") or "val_acc"
    target_value = float(os.environ.get("SATP_ACC_TARGET") or spec["target"])
    target_sets = [f"train.target.metric={metric_key}", f"train.target.value={target_value:.10g}"]
    sets = common + variant + target_sets
    name = f"gpu-{part}-{label}-{_digest(variant)}"
    restart = os.environ.get("SATP_ACC_RESTART") == "1"
    raw: dict[str, Any] = {"part": part, "call": call, "budget_s": BUDGET_S, "work": str(work), "run_name": name,
                           "sets": sets, "variant": variant, "steps": {}}

    def save() -> None:
        if out_dir is not None:
            (out_dir / f"gpu_{part}.json").write_text(json.dumps(raw, indent=1, default=str))
        ledger.save()

    # 1. the data, regenerated on the machine (seed 0; reused on a warm machine)
    data_dir = work / "data" / spec["folder"]
    graphs = str(spec["dry_graphs"]) if DRY_RUN else "full"
    marker = work / "data.txt"
    steps = raw["steps"]
    if data_dir.is_dir() and marker.is_file() and marker.read_text().strip() == graphs:
        steps["generate"] = {"skipped": "reused (an earlier call on this machine)"}
    else:
        if data_dir.exists():
            shutil.rmtree(data_dir)
        gen = satp("data", spec["builder"], "--out", str(work / "data")) + (["--graphs", graphs] if DRY_RUN else [])
        print(f"== gpu {part}: {' '.join(gen[3:])} ({clock.left():.0f} s left)", flush=True)
        steps["generate"] = measure(gen, min(240.0, clock.left() * 0.4), logs / "generate.log")
        if steps["generate"]["ok"]:
            marker.write_text(graphs)
    save()

    # 2. the shards (preprocessing reuses finished ones)
    shard_dir = None
    if data_dir.is_dir() and (steps["generate"].get("ok") or steps["generate"].get("skipped")):
        steps["preprocess"], shard_dir = _preprocess(part, spec["job"], common, clock, logs, reserve_s=120)
    else:
        steps["preprocess"] = {"skipped": "no data"}
    save()
    if PREPARE_ONLY:
        return "\n".join(step_lines({f"satp data {spec['builder']}": steps["generate"],
                                     f"satp preprocess {spec['job']}": steps["preprocess"]}))

    # 3. training to the target, on one GPU worker, until the target or the budget
    record = ledger.get("runs").setdefault(name, {"segments": []})
    if restart:
        record.update(ended=None, segments=[])
    result: dict = {}
    if record.get("ended"):
        steps["train"] = {"skipped": f"the run had ended in an earlier call ({record['ended']}); SATP_ACC_RESTART=1 trains it again"}
        state = run_state(storage, name)
    elif shard_dir and clock.left() > STARTUP_S + GRACE_S + END_RESERVE_S:
        print(f"== gpu {part}: satp train, target {metric_key} >= {target_value:g} ({clock.left():.0f} s left)", flush=True)
        result = train(spec["job"], sets, name, storage, logs / f"train-call{call}.log",
                       clock.left() - GRACE_S - END_RESERVE_S, restart=restart)
        steps["train"] = {k: v for k, v in result.items() if k != "state"}
        state = result["state"]
        after = history_of(state)
        segment = {"call": call, "wall_s": result["seconds"], "returncode": result["returncode"],
                   "stopped": result["stopped"], "epochs_before": result["epochs_before"], "epochs_after": len(after),
                   "observed_s": result["observed_s"]}
        record["segments"].append(segment)
        if result["returncode"] == 0 and not result["stopped"]:
            record["ended"] = (state or {}).get("stopped") or "all epochs"
    else:
        steps["train"] = {"skipped": "no shards" if not shard_dir else "time budget spent"}
        state = run_state(storage, name)
    history = history_of(state)
    reached = time_to(history, metric_key, target_value)
    best = (state or {}).get("best") or {}
    raw.update(history=history, best=best, time_to_target=reached, stopped=(state or {}).get("stopped"),
               segments=record["segments"])
    save()

    # the section
    t = job.train
    m = job.model
    lines = [title, "",
             f"Device: {device()}; budget {BUDGET_S:.0f} s (call {call} of the part on this "
             f"machine); work directory `{work}`; run `{name}`.", ""]
    lines += [f"Job file: `{spec['job']}` ({m.num_layers} layers, hidden {m.hidden_dim}, {m.num_heads} heads, RWPE-{job.transform.rwpe_steps}, "
              f"k-subtree {m.gnn_type.upper()} k={m.k_hops}, dropout {m.dropout:g}; lr {t.lr:g}, {t.max_graphs_per_batch} graphs per "
              f"step, {t.warmup_steps} warm-up steps then {t.scheduler}, weight decay {t.weight_decay:g}, precision {t.precision}), "
              f"one GPU worker; variant: **{label}**" + (f" (`--set` {' '.join('`' + s + '`' for s in variant)})" if variant else
                                                         " (the job file's settings)") + ".",
              f"Data: `satp data {spec['builder']}` ({'full size' if not DRY_RUN else graphs + ' graphs'}, seed 0), generated on the machine.",
              f"Target: `--set train.target.metric={metric_key} --set train.target.value={target_value:g}`: the run stops at the "
              f"first evaluation whose {metric_key} reaches {target_value:g} (MLPerf's rule: the held-out evaluation metric "
              "decides, the test split never stops a run); reported: the test accuracy at the best validation epoch. "
              f"The target: test accuracy >= {100 * spec['target']:.1f} within {spec['target_s'] // 60} minutes "
              f"(paper, k-subtree SAT: GCN {spec['paper_gcn']}, PNA {spec['paper_pna']}).", ""]
    lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    lines += step_lines({f"1. satp data {spec['builder']}": steps["generate"], f"2. satp preprocess {spec['job']}":
                         steps["preprocess"], f"3. satp train {spec['job']} (call {call})": steps["train"]})
    if result.get("summary"):
        lines += ["", "`satp train` said: " + " / ".join(f"`{s}`" for s in result["summary"])]
    train_s = sum(h.get("epoch_seconds", 0) + h.get("eval_seconds", 0) for h in history)
    last = history[-1] if history else {}
    lines += ["", "| | value |", "|---|---|",
              f"| epochs evaluated / optimizer steps | {len(history)} / {last.get('steps', 0):,} |",
              f"| training + evaluation so far (elapsed_s) | {_fmt(last.get('elapsed_s'), '.1f')} s |"]
    if reached:
        target_epoch = reached["epoch"]
        entry = history[target_epoch] if target_epoch < len(history) else {}
        wall = _observed_wall(record["segments"], target_epoch)
        lines += [f"| **time to target** ({metric_key} >= {target_value:g}) | **{reached['time_to_target_s']:.1f} s** "
                  f"({reached['time_to_target_s'] / 60:.2f} min; epoch {target_epoch}, {reached['steps_to_target']:,} steps) |",
                  f"| wall-clock from `satp train`'s start to that evaluation's checkpoint | {_fmt(wall, '.0f')} s"
                  + (" (the call that reached it)" if len(record["segments"]) > 1 else "") + " |",
                  f"| {metric_key} / test acc at the target epoch | {_pct(entry.get(metric_key))} / {_pct(entry.get('test_acc'))} |"]
    else:
        lines.append(f"| time to target ({metric_key} >= {target_value:g}) | **not reached** "
                     f"(best {metric_key} {_pct(max((h.get(metric_key) or 0 for h in history), default=None))}) |")
    lines += [f"| best validation epoch: val acc / **test acc** | {best.get('epoch', '-')}: {_pct(best.get('val'))} / "
              f"**{_pct(best.get('test'))}** |",
              f"| target: test acc >= {100 * spec['target']:.1f} in <= {spec['target_s']} s | "
              + _verdict(reached, best, spec) + " |"]
    if len(record["segments"]) > 1 or (record["segments"] and record["segments"][0]["epochs_before"]):
        lines += ["", "Calls of this run on this machine (a call the budget cuts is resumed by the next; `elapsed_s` "
                      "sums the training and evaluation of all of them, without their start-up):", "",
                  "| call | wall s | epochs before -> after | stopped by |", "|---|---|---|---|"]
        for s in record["segments"]:
            lines.append(f"| {s['call']} | {s['wall_s']:.0f} | {s['epochs_before']} -> {s['epochs_after']} "
                         f"| {s['stopped'] or ('exit ' + str(s['returncode']))} |")
    if history:
        lines += ["", "Per epoch (the curve; `wall s`: seen by this call's watcher, +-2 s, this call's epochs only):", ""]
        observed = next((s.get("observed_s") or {} for s in record["segments"] if s["call"] == call), {})
        lines += curve_table(history, "acc", observed, reached["epoch"] if reached else None)
    if not reached and history:
        lines += ["", f"Not reached in this call: `benchmarks/gpu/run.sh {part}` again on the same machine resumes the run."]
    if out_dir is not None and history:
        _save_plot(history, "acc", {"metric": metric_key, "value": target_value}, out_dir / f"gpu_{part}_metric_vs_time.png")
    lines += ["", f"Part wall time {BUDGET_S - clock.left():.0f} s; training + evaluation in this run's history {train_s:.0f} s."]
    save()
    copy_logs(logs, out_dir, part)
    return "\n".join(lines)


def _verdict(reached: Optional[dict], best: dict, spec: dict) -> str:
    test = best.get("test")
    if test is None:
        return "no evaluation yet"
    acc_ok = test >= spec["target"]
    time_ok = reached is not None and (reached.get("time_to_target_s") or 1e9) <= spec["target_s"]
    return (f"test acc {100 * test:.3f} {'>=' if acc_ok else '<'} {100 * spec['target']:.1f}: "
            f"{'met' if acc_ok else 'NOT met'}; time: "
            + (f"{reached['time_to_target_s']:.0f} s {'<=' if time_ok else '>'} {spec['target_s']} s: "
               f"{'met' if time_ok else 'NOT met'}" if reached else "target not reached"))


def _observed_wall(segments: list[dict], epoch: int) -> Optional[float]:
    for s in segments:
        seen = s.get("observed_s") or {}
        value = seen.get(epoch, seen.get(str(epoch)))
        if value is not None and s["epochs_before"] <= epoch:
            return value
    return None

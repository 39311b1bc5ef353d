"""GPU check, part ``code2batch`` (``benchmarks/gpu/run.sh code2batch``): the paper's code2 recipe (32 graphs
per step, lr 1e-4) for 3 epochs against ``jobs/code2.yaml``'s default batch and lr on one GPU, to the
recipe's validation F1: the pycode corpus from the image's own packages, the shards, the probe that
sizes the runs (N training functions), the two runs, and the part's section."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.gpu.accuracy_report import _fmt, _save_plot, curve_table
from benchmarks.gpu.accuracy_runs import (BUDGET_S, DRY_SETS, END_RESERVE_S, GRACE_S, STARTUP_S, _begin, _digest,
                                          _preprocess, history_of, run_state, time_to, train)
from benchmarks.gpu.measure import DRY_RUN, ROOT, Clock, _gb, _step, copy_logs, device, measure, satp, step_lines

CPUS = min(16, os.cpu_count() or 1)
CODE2_JOB = "jobs/code2.yaml"
CODE2_PACKAGES = "json,email,http,urllib,xml,logging" if DRY_RUN else "torch,sympy,networkx,scipy,pandas,numpy"
RESERVED = {"jedi", "docutils", "hypothesis", "ipython"}  # never used (docs/data.md)
TESTS = os.environ.get("SATP_CODE2BATCH_TESTS") == "1"  # the packages' test directories too
RECIPE_BATCH, RECIPE_LR, RECIPE_EPOCHS = 32, 1e-4, 3
EVAL_GRAPHS_PER_S = 300.0 if DRY_RUN else 4000.0  # code2 evaluation at budget 131072, for sizing only
DEFAULT_CAP_MIN_S = 30.0 if DRY_RUN else 60.0  # the job's default gets at least this much training + evaluation


# ----------------------------------------------------------------------------- code2batch
def package_dirs(names: list[str]) -> tuple[list[str], list[str]]:
    """The source directories of the importable packages ``names`` (not imported), and the names skipped."""
    import importlib.util

    dirs, skipped = [], []
    for name in names:
        if name.lower() in RESERVED:
            skipped.append(f"{name} (reserved for an independent check)")
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            skipped.append(f"{name} (not installed)")
            continue
        dirs.append(locations[0])
    return dirs, skipped


def choose_subset(left: float, rate: float, train_size: int, evals: int, cap: int) -> tuple[int, dict]:
    """Training functions N that let the recipe do its 3 epochs at ``rate`` graphs/s (85% of it) and leave
    the default its run, in ``left`` seconds; the arithmetic comes back for the section."""
    eval_s = evals / EVAL_GRAPHS_PER_S + 2.0
    default_reserve = STARTUP_S + DEFAULT_CAP_MIN_S + GRACE_S
    room = left - default_reserve - STARTUP_S - RECIPE_EPOCHS * eval_s - GRACE_S - END_RESERVE_S
    fit = int(max(room, 0.0) / RECIPE_EPOCHS * rate * 0.85)
    n = max(1, min(train_size, cap, fit))
    return n, {"left_s": left, "eval_s_est": eval_s, "default_reserve_s": default_reserve, "recipe_train_room_s": room,
               "fits": fit, "rate": rate}


def run() -> str:
    import numpy as np

    from pipeline.config import load_job
    from pipeline.train.loader import open_split

    title = "### GPU check, part code2batch (`benchmarks/gpu/run.sh code2batch`): the paper's batch vs the job's, on one GPU"
    clock, work, logs, out_dir, ledger, call, storage, tracking = _begin("code2batch")
    max_train = int(os.environ.get("SATP_CODE2BATCH_TRAIN") or (300 if DRY_RUN else 100_000))
    common = [f"data.root={work / 'data'}", "data.source=pycode", f"data.max_graphs_per_split={max_train}",
              f"shards.root={work / 'shards'}", "resources.num_workers=1", f"train.storage_path={storage}",
              f"mlflow.tracking_uri={tracking}"]
    if DRY_RUN:
        common += DRY_SETS + ["model.num_heads=2", "train.eval_node_budget=8192"]
    names = [n.strip() for n in (os.environ.get("SATP_CODE2BATCH_PACKAGES") or CODE2_PACKAGES).split(",") if n.strip()]
    sources, skipped = package_dirs(names)
    raw: dict[str, Any] = {"part": "code2batch", "call": call, "budget_s": BUDGET_S, "work": str(work), "sources": sources,
                           "skipped_packages": skipped, "steps": {}, "runs": {}}
    steps = raw["steps"]

    def save() -> None:
        if out_dir is not None:
            (out_dir / "gpu_code2batch.json").write_text(json.dumps(raw, indent=1, default=str))
        ledger.save()

    # 1. the corpus, from the image's own packages (reused on a warm machine when the same)
    data_dir = work / "data" / "ogbg_code2"
    marker = work / "data.json"
    if data_dir.is_dir() and marker.is_file() and json.loads(marker.read_text()) == [sources, TESTS]:
        steps["pycode"] = {"skipped": "reused (an earlier call on this machine)"}
    else:
        if data_dir.exists():
            shutil.rmtree(data_dir)
        gen = satp("data", "pycode", "--out", str(work / "data"), *[a for d in sources for a in ("--source", d)],
                   *(["--include-tests"] if TESTS else []), "--workers", str(CPUS))
        print(f"== gpu code2batch: satp data pycode over {len(sources)} packages ({clock.left():.0f} s left)", flush=True)
        steps["pycode"] = measure(gen, clock.left() * 0.45, logs / "pycode.log")
        if steps["pycode"]["ok"]:
            marker.write_text(json.dumps([sources, TESTS]))
            try:
                raw["corpus"] = json.loads(steps["pycode"]["tail"])
            except ValueError:
                pass
    save()

    # 2. the shards
    shard_dir = None
    if data_dir.is_dir() and (steps["pycode"].get("ok") or steps["pycode"].get("skipped")):
        steps["preprocess"], shard_dir = _preprocess("code2batch", CODE2_JOB, common, clock, logs, reserve_s=150)
    else:
        steps["preprocess"] = {"skipped": "no corpus"}
    save()
    if not shard_dir:
        return _code2_section(title, raw, None, None, {}, clock, work)

    sizes = {s: len(open_split(shard_dir, s)) for s in ("train", "valid", "test")}
    largest = int(np.max(open_split(shard_dir, "train").num_nodes))
    budget32 = RECIPE_BATCH * largest  # 32 of the largest graphs fit: every step takes 32 random graphs
    raw.update(split_sizes=sizes, largest_train_graph=largest)
    job = load_job(ROOT / CODE2_JOB, common)

    # 3. the probe: the recipe's step on these shards, for N
    plan = ledger.get("plan")
    if plan.get("shard_dir") == shard_dir and plan.get("n") and not os.environ.get("SATP_CODE2BATCH_N"):
        n, sizing = int(plan["n"]), dict(plan.get("sizing") or {}, reused=True)
        steps["probe"] = {"skipped": "N of an earlier call on this machine (its runs resume)"}
        rate = sizing.get("rate")
    else:
        probe_spec = dict(precision="fp32" if DRY_RUN else "bf16", extractor=job.model.extractor, node_budget=budget32,
                          max_graphs=RECIPE_BATCH, bucket_size=RECIPE_BATCH, shards=shard_dir, detail=False,
                          seconds=1.0 if DRY_RUN else 6.0, warmup=2 if DRY_RUN else 15,
                          loader_workers=1 if DRY_RUN else job.train.loader_workers, tiny=DRY_RUN)
        print(f"== gpu code2batch: probe, 32 graphs per step ({clock.left():.0f} s left)", flush=True)
        t0 = time.monotonic()
        probe = _step(probe_spec, min(180.0 if DRY_RUN else 90.0, clock.left() / 3))
        steps["probe"] = dict(probe, seconds=time.monotonic() - t0, ok="error" not in probe, precision=probe_spec["precision"])
        rate = probe.get("graphs_per_s") or (20.0 if DRY_RUN else 600.0)  # assumed when the probe failed
        n, sizing = choose_subset(clock.left(), rate, sizes["train"], sizes["valid"] + sizes["test"], max_train)
        if os.environ.get("SATP_CODE2BATCH_N"):
            n = min(int(os.environ["SATP_CODE2BATCH_N"]), sizes["train"])
            sizing["forced"] = True
        plan.update(shard_dir=shard_dir, n=n, sizing=sizing)
    raw.update(n=n, sizing=sizing, probe_rate=rate)
    subset = [f"train.train_subset={n}"] if n < sizes["train"] else []
    save()

    # 4. the paper's recipe, stopped after its 3rd epoch
    recipe_sets = [f"train.max_graphs_per_batch={RECIPE_BATCH}", f"train.bucket_size={RECIPE_BATCH}",
                   f"train.node_budget={budget32}", "train.micro_batches_per_step=1", f"train.lr={RECIPE_LR:g}"] + subset
    recipe_name = f"gpu-code2batch-recipe-{_digest(recipe_sets)}"
    default_lr = os.environ.get("SATP_CODE2BATCH_DEFAULT_LR")
    default_sets = subset + ([f"train.lr={default_lr}"] if default_lr else [])
    default_name = f"gpu-code2batch-default-{_digest(default_sets)}"
    runs = ledger.get("runs")

    def three_epochs(state: dict) -> Optional[str]:
        return f"{RECIPE_EPOCHS} epochs done" if int(state.get("epoch", -1)) >= RECIPE_EPOCHS - 1 else None

    rec = runs.setdefault(recipe_name, {"segments": []})
    default_reserve = STARTUP_S + DEFAULT_CAP_MIN_S + GRACE_S + END_RESERVE_S
    if rec.get("ended"):
        steps["recipe"] = {"skipped": f"ended in an earlier call ({rec['ended']})"}
    elif clock.left() > default_reserve + STARTUP_S + 20:
        print(f"== gpu code2batch: the paper's recipe, N={n} ({clock.left():.0f} s left)", flush=True)
        recipe_result = train(CODE2_JOB, common + recipe_sets, recipe_name, storage, logs / f"recipe-call{call}.log",
                              clock.left() - default_reserve - GRACE_S, stop=three_epochs)
        steps["recipe"] = {k: v for k, v in recipe_result.items() if k != "state"}
        rec["segments"].append({"call": call, "wall_s": recipe_result["seconds"], "stopped": recipe_result["stopped"],
                                "observed_s": recipe_result["observed_s"]})
        if three_epochs(recipe_result["state"] or {}):
            rec["ended"] = f"{RECIPE_EPOCHS} epochs"
    else:
        steps["recipe"] = {"skipped": "time budget spent"}
    recipe_hist = history_of(run_state(storage, recipe_name))[:RECIPE_EPOCHS]
    save()

    # 5. the job's default, to the recipe's 3-epoch validation F1
    target = recipe_hist[-1].get("val_f1") if recipe_hist else None
    target = float(f"{target:.6g}") if target is not None else None  # the value --set passes, exactly
    recipe_s = recipe_hist[-1].get("elapsed_s") if recipe_hist else None
    drec = runs.setdefault(default_name, {"segments": []})
    if target is None:
        steps["default"] = {"skipped": "the recipe has no evaluated epoch: no target"}
    elif drec.get("ended") and drec.get("target") == target:
        steps["default"] = {"skipped": f"ended in an earlier call ({drec['ended']})"}
    elif clock.left() > STARTUP_S + GRACE_S + END_RESERVE_S:
        cap = max(DEFAULT_CAP_MIN_S, 0.25 * (recipe_s or 0.0))

        def capped(state: dict) -> Optional[str]:
            hist = state.get("history") or []
            return f"cap of {cap:.0f} s of training + evaluation" if hist and hist[-1].get("elapsed_s", 0) >= cap else None

        print(f"== gpu code2batch: the job's default to val_f1 {target:.4f} ({clock.left():.0f} s left)", flush=True)
        default_result = train(CODE2_JOB, common + default_sets + ["train.target.metric=val_f1", f"train.target.value={target:.10f}"],
                               default_name, storage, logs / f"default-call{call}.log",
                               clock.left() - GRACE_S - END_RESERVE_S, stop=capped)
        steps["default"] = {k: v for k, v in default_result.items() if k != "state"}
        drec["segments"].append({"call": call, "wall_s": default_result["seconds"], "stopped": default_result["stopped"],
                                 "observed_s": default_result["observed_s"], "target": target, "cap_s": cap})
        reason = (default_result["state"] or {}).get("stopped") or (default_result["stopped"] if default_result["stopped"]
                                                                     and default_result["stopped"] != "timeout" else None)
        if reason or default_result["returncode"] == 0:
            drec.update(ended=reason or "all epochs", target=target)
    else:
        steps["default"] = {"skipped": "time budget spent"}
    default_hist = history_of(run_state(storage, default_name))
    raw["runs"] = {"recipe": {"name": recipe_name, "sets": recipe_sets, "history": recipe_hist},
                   "default": {"name": default_name, "sets": default_sets, "history": default_hist, "target_val_f1": target}}
    save()
    if out_dir is not None:
        for key, hist in (("recipe", recipe_hist), ("default", default_hist)):
            if hist:
                _save_plot(hist, "f1", {"metric": "val_f1", "value": target} if target else None,
                           out_dir / f"gpu_code2batch_{key}_f1_vs_time.png")
    text = _code2_section(title, raw, recipe_hist, default_hist, {"recipe": rec, "default": drec}, clock, work)
    save()
    copy_logs(logs, out_dir, "code2batch")
    return text


def _code2_section(title: str, raw: dict, recipe_hist, default_hist, records: dict, clock: Clock, work: Path) -> str:
    steps = raw["steps"]
    lines = [title, "",
             f"Device: {device()}; budget {BUDGET_S:.0f} s (call {raw['call']} on this machine); "
             f"work directory `{work}`.", "",
             f"Corpus: `satp data pycode --source DIR ...{' --include-tests' if TESTS else ''} --workers {CPUS}` over "
             f"{len(raw['sources'])} "
             f"package directories of the image ({', '.join('`' + Path(s).name + '`' for s in raw['sources'])})"
             + (f"; skipped: {', '.join(raw['skipped_packages'])}" if raw["skipped_packages"] else "") + "."]
    corpus = raw.get("corpus")
    if corpus:
        lines.append(f"Built: {corpus.get('graphs', 0):,} functions, {corpus.get('projects', '-')} projects, split "
                     f"{corpus.get('splits')}, {corpus.get('avg_nodes')} nodes on average, largest {corpus.get('max_nodes', 0):,}.")
    if raw.get("split_sizes"):
        s = raw["split_sizes"]
        lines.append(f"Shards (`data.max_graphs_per_split`): train {s['train']:,}, valid {s['valid']:,}, test {s['test']:,} "
                     f"functions; largest training graph {raw['largest_train_graph']:,} nodes.")
    table = {"1. satp data pycode": steps.get("pycode", {"skipped": "-"}),
             "2. satp preprocess jobs/code2.yaml": steps.get("preprocess", {"skipped": "-"})}
    probe = steps.get("probe")
    if probe is not None:
        table["3. probe: benchmarks/gpu/step.py, 32 graphs/step"] = dict(
            probe, returncode="error", tail=probe.get("error"), gpu_mem_gb=probe.get("peak_mem_gb"))
    for key, label in (("recipe", "4. the paper's recipe (satp train)"), ("default", "5. the job's default (satp train)")):
        if key in steps:
            table[label] = steps[key]
    lines += ["", *step_lines(table)]
    if recipe_hist is None:
        return "\n".join(lines + ["", f"Part wall time {BUDGET_S - clock.left():.0f} s."])
    n, sizing = raw["n"], raw["sizing"]
    rate = raw.get("probe_rate")
    lines += ["", f"Probe (`benchmarks/gpu/step.py` on the train shards, the recipe's batches: 32 random graphs per step, "
                  f"the job's model, {(probe or {}).get('precision', 'bf16')}): " + (f"**{probe['graphs_per_s']:,.0f} graphs/s**, {probe.get('step_ms', 0):.1f} ms "
                                                 f"per step, peak {_gb(probe.get('peak_mem_gb'))} GB"
                                                 if probe and probe.get("graphs_per_s") else
                                                 f"{(probe or {}).get('skipped') or (probe or {}).get('error', '-')}"
                                                 + (f" (rate used: {rate:,.0f} graphs/s)" if rate else "")) + ".",
              f"**N = {n:,} training functions** (`train.train_subset`, the same for both runs) of the {raw['split_sizes']['train']:,} "
              + ("(forced by SATP_CODE2BATCH_N)" if sizing.get("forced") else
                 f"(what lets 3 epochs at 85% of the probe's rate fit {sizing.get('recipe_train_room_s', 0):.0f} s, after "
                 f"{sizing.get('default_reserve_s', 0):.0f} s kept for the default run and ~{STARTUP_S:.0f} s of start-up each)"
                 + (" [N of an earlier call]" if sizing.get("reused") else "")) + "."]
    runs = raw.get("runs", {})
    lines += ["", f"Runs of `{CODE2_JOB}`'s model on one GPU worker: (1) the paper's recipe, `--set` "
              + " ".join(f"`{s}`" for s in runs.get("recipe", {}).get("sets", [])) + f", stopped after its {RECIPE_EPOCHS}rd "
              "epoch (the paper's schedule, not one squeezed into 3 epochs); (2) the job's default"
              + "".join(f" `--set {s}`" for s in runs.get("default", {}).get("sets", [])) + " with `train.target` val_f1 = "
              "the recipe's 3-epoch val F1: the product stops it there and reports its time to target.", ""]
    target = raw.get("runs", {}).get("default", {}).get("target_val_f1")
    recipe_s = recipe_hist[-1].get("elapsed_s") if recipe_hist else None
    done = len(recipe_hist) >= RECIPE_EPOCHS
    reached = time_to(default_hist or [], "val_f1", target) if target is not None else None
    lines += ["| | the paper's recipe (32 graphs/step, lr 1e-4) | the job's default |", "|---|---|---|"]
    lines.append(f"| epochs / steps | {len(recipe_hist)} / {(recipe_hist[-1].get('steps', 0) if recipe_hist else 0):,} "
                 f"| {len(default_hist or [])} / {((default_hist or [{}])[-1].get('steps', 0)):,} |")
    lines.append(f"| graphs per step (mean) | {_per_step(recipe_hist, n)} | {_per_step(default_hist, n)} |")
    lines.append(f"| graphs/s (last epoch, pipeline) | {_fmt(recipe_hist[-1].get('graphs_per_s') if recipe_hist else None, ',.0f')} "
                 f"| {_fmt(default_hist[-1].get('graphs_per_s') if default_hist else None, ',.0f')} |")
    lines.append(f"| val F1 at the end | {_fmt(recipe_hist[-1].get('val_f1') if recipe_hist else None)} "
                 f"| {_fmt(default_hist[-1].get('val_f1') if default_hist else None)} |")
    lines.append(f"| training + evaluation s | {_fmt(recipe_s, '.1f')}{'' if done else ' (cut before 3 epochs)'} "
                 f"| {_fmt(default_hist[-1].get('elapsed_s') if default_hist else None, '.1f')} |")
    if target is not None:
        lines.append(f"| time to val F1 >= {target:.4f} (the recipe's after {len(recipe_hist)} epochs) | {_fmt(recipe_s, '.1f')} s "
                     f"| " + (f"**{reached['time_to_target_s']:.1f} s** (epoch {reached['epoch']}, {reached['steps_to_target']:,} steps)"
                              if reached else "**not reached**") + " |")
        if reached and recipe_s:
            ratio = reached["time_to_target_s"] / recipe_s
            lines.append(f"| **ratio** (target <= 0.10) | | **{ratio:.3f}**: {'met' if ratio <= 0.1 else 'NOT met'} |")
        elif default_hist and recipe_s:
            lines.append(f"| ratio (target <= 0.10) | | > {default_hist[-1].get('elapsed_s', 0) / recipe_s:.3f} "
                         f"(not reached in the {default_hist[-1].get('elapsed_s', 0):.0f} s it ran): NOT met |")
    if recipe_hist:
        per_epoch = recipe_hist[-1]["elapsed_s"] / len(recipe_hist)
        full = raw["split_sizes"]["train"]
        g = recipe_hist[-1].get("graphs_per_s") or 0
        evals = statistics.fmean(h.get("eval_seconds", 0) for h in recipe_hist)
        if g:
            lines += ["", f"The recipe on all {full:,} training functions, extrapolated from its measured epochs "
                          f"({g:,.0f} graphs/s in training, {evals:.1f} s per evaluation): 3 epochs ~ "
                          f"{RECIPE_EPOCHS * (full / g + evals):.0f} s of training + evaluation (measured here on {n:,}: "
                          f"{per_epoch:.1f} s per epoch)."]
    for key, hist in (("recipe", recipe_hist), ("default", default_hist)):
        if hist:
            seg = (records.get(key) or {}).get("segments") or []
            observed = seg[-1].get("observed_s", {}) if seg else {}
            lines += ["", f"Per epoch, {'the paper' + chr(39) + 's recipe' if key == 'recipe' else 'the job' + chr(39) + 's default'}:", ""]
            lines += curve_table(hist, "f1", observed, reached["epoch"] if key == "default" and reached else None)
    lines += ["", f"Part wall time {BUDGET_S - clock.left():.0f} s."]
    return "\n".join(lines)


def _per_step(history, n: int) -> str:
    if not history:
        return "-"
    steps = history[-1].get("steps") or 0
    return f"{n * len(history) / steps:,.0f}" if steps else "-"

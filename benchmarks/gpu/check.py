"""GPU check (``benchmarks/gpu/run.sh [PART]`` on a bare GPU machine, or ``BENCH=gpu make bench``): one
part per run, each sized to one device session and returning its own section for benchmarks/RESULTS.md;
``SATP_GPU_PART`` picks it (:data:`PARTS`; docs/gpu.md, "The GPU check in parts"). :func:`run` dispatches;
the ``perf`` part (the default) is this module:

1. parity: the CUDA tests (:data:`GPU_TESTS`: the attention implementations against each other, the fused
   message kernels against torch, no host synchronisation in a training step);
2. the train-step benchmark (:mod:`benchmarks.gpu.step`: the product's trainer, one process per row) on
   shards of code2-shaped synthetic graphs with the model of ``jobs/code2.yaml`` (:data:`STEP_ROWS`:
   bf16 and fp32, k-subtree and k-subgraph, node budgets, the SAT authors' 32-graph batches), and on
   ppa-shaped ones with ``jobs/ppa.yaml`` (:data:`PPA_ROWS`);
3. the pipeline on one GPU: ``satp data pycode`` -> ``satp preprocess`` -> ``satp train jobs/code2.yaml``
   (per-epoch figures from MLflow) and the step benchmark on the same shards: the pipeline's overhead.

Rows run in order of importance until ``SATP_GPU_BUDGET_S`` (default 420 s) is spent; raw figures go to
``$OUT/gpu_results.json``. ``SATP_GPU_DRY_RUN=1``: any part on the CPU with tiny sizes.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu.measure import (DRY_RUN, ROOT, Clock, _finish, _last_line, _pipeline_metrics, _start, _step, copy_logs,
                                    device, measure, out_dir, overrides, satp, step_lines)

PARTS = ("perf", "first", "steps", "scale", "multirank", "tune", "pattern", "cluster", "code2batch")
PART = os.environ.get("SATP_GPU_PART") or "perf"
BUDGET_S = float(os.environ.get("SATP_GPU_BUDGET_S", "420"))
SYNTHETIC_GRAPHS = 256 if DRY_RUN else 16384  # code2-shaped graphs for the k-subtree rows (over several epochs)
SUBGRAPH_GRAPHS = 128 if DRY_RUN else 4096  # with 2-hop subgraph indices in the shards
PPA_GRAPHS = 64 if DRY_RUN else 2048  # ppa-shaped graphs (~243 nodes, ~4.4k directed edges each)
PIPELINE_EPOCHS = 1 if DRY_RUN else 2
STEP_TIMING = dict(seconds=1.0, warmup=2, loader_workers=1, tiny=True) if DRY_RUN else dict(seconds=4.0, warmup=10, loader_workers=4)
PYCODE_WORKERS = 4  # parsing processes of the background `satp data pycode`: the step rows keep the other cores
STEP_TIMEOUT_S = 900 if DRY_RUN else 150
REFERENCE = ("SAT authors' code, same model, 32 graphs per batch, fp32, one H200 (measured with their code): 299 graphs/s, "
             "6.2 GB; k-subgraph (k=2): 9.0 GB")

# (label, spec) in order of importance. Before the pipeline: the k-subgraph extractor with its fused
# message sums (gnn_messages auto = Triton on CUDA): its throughput and its memory at the SAT
# authors' batches (32 random graphs), also with the GNN recomputed in the backward pass
# (recompute_gnn), then bf16 k-subtree at the code2 job's budget. After it: fp32 for bf16 >= fp32,
# the smaller budget, what recomputation costs, the k-subgraph rows on the torch message path (the
# comparison), the rest. ``top_ops``: the profile's top operators.
STEP_ROWS = [
    ("bf16, k-subgraph k=2, budget 32768", dict(precision="bf16", extractor="subgraph", node_budget=32768, top_ops=12)),
    ("bf16, k-subgraph k=2, 32 random graphs/batch (the reference's batches)",
     dict(precision="bf16", extractor="subgraph", node_budget=10**6, max_graphs=32, bucket_size=32, detail=False)),
    ("bf16, k-subgraph k=2, 32 random graphs/batch, GNN recomputed",
     dict(precision="bf16", extractor="subgraph", node_budget=10**6, max_graphs=32, bucket_size=32, recompute_gnn=True,
          detail=False)),
    ("bf16, k-subtree, budget 131072", dict(precision="bf16", extractor="subtree", node_budget=131072, detail=False)),
    # throughput and memory only (detail=False: no profile or FLOP count)
    ("fp32, k-subtree, budget 65536", dict(precision="fp32", extractor="subtree", node_budget=65536, detail=False)),
    ("bf16, k-subtree, budget 65536", dict(precision="bf16", extractor="subtree", node_budget=65536, detail=False)),
    ("bf16, k-subgraph k=2, budget 32768, GNN recomputed",
     dict(precision="bf16", extractor="subgraph", node_budget=32768, recompute_gnn=True, detail=False)),
    ("bf16, k-subgraph k=2, budget 32768, torch messages",
     dict(precision="bf16", extractor="subgraph", node_budget=32768, gnn_messages="torch", detail=False)),
    ("fp32, k-subgraph k=2, 32 random graphs/batch (the reference's batches)",
     dict(precision="fp32", extractor="subgraph", node_budget=10**6, max_graphs=32, bucket_size=32, detail=False)),
    ("bf16, k-subgraph k=2, 32 random graphs/batch, torch messages",
     dict(precision="bf16", extractor="subgraph", node_budget=10**6, max_graphs=32, bucket_size=32,
          gnn_messages="torch", detail=False)),
    ("fp32, k-subtree, 32 random graphs/batch (the reference's batches)",
     dict(precision="fp32", extractor="subtree", node_budget=10**6, max_graphs=32, bucket_size=32, detail=False)),
    ("bf16, k-subtree, budget 65536, fused message sums",
     dict(precision="bf16", extractor="subtree", node_budget=65536, gnn_messages="fused", detail=False)),
]
ROWS_BEFORE_PIPELINE = 4
# jobs/ppa.yaml's budget (16384) was chosen by analogy with code2; these rows measure it and 4x more.
# ``graph_set`` names the synthetic shards (:func:`_shard_dirs`; default: the row's extractor, code2-shaped).
PPA_ROWS = [
    ("bf16, k-subtree, budget 16384 (jobs/ppa.yaml)", dict(job="jobs/ppa.yaml", graph_set="ppa", precision="bf16",
                                                          node_budget=16384, detail=False)),
    ("bf16, k-subtree, budget 65536", dict(job="jobs/ppa.yaml", graph_set="ppa", precision="bf16",
                                           node_budget=65536, detail=False)),
]
# the pipeline runs at a budget that gives the small pycode train split (~11k graphs) enough steps
# per epoch (~40) for a per-epoch rate; the step benchmark runs at the same budget, in and out of Ray
PIPELINE_NODE_BUDGET = 16384


GPU_TESTS = ["tests/test_model_gpu.py", "tests/test_train_gpu.py", "tests/test_edge_messages.py"]
PARITY_CMD = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GPU_TESTS]


def parity(proc: subprocess.Popen, clock: Clock) -> tuple[str, dict]:
    """The CUDA tests' outcome (started in the background by :func:`run`)."""
    ok, out = _finish(proc, min(150, clock.left()))
    summary = _last_line(out)
    lines = ["#### Parity and sync-free steps (CUDA tests)", "", f"`python -m pytest -q {' '.join(GPU_TESTS)}`: {summary}"]
    if not ok:
        failed = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR", "E "))][:12]
        lines += [""] + [f"- {line[:300]}" for line in failed]
    return "\n".join(lines), {"ok": ok, "summary": summary, "output": out[-6000:]}


def _shard_dirs(tmp: Path) -> dict[str, str]:
    """The step rows' shards: code2-shaped (``subtree``; ``subgraph`` with 2-hop indices) and ``ppa``."""
    from benchmarks.gpu.step import job_for
    from benchmarks.graphs.jobs import job_shards

    sets = {"subtree": ({}, SYNTHETIC_GRAPHS), "subgraph": ({"extractor": "subgraph"}, SUBGRAPH_GRAPHS),
            "ppa": ({"job": "jobs/ppa.yaml"}, PPA_GRAPHS)}
    return {name: str(job_shards(job_for(spec), tmp / f"shards-{name}", n)) for name, (spec, n) in sets.items()}


def _row(label: str, r: dict) -> str:
    if "error" in r:
        return f"| {label} | failed: {r['error']} |" + " |" * 7
    busy = f"{r['gpu_busy_ms_per_step']:.1f} ({r['kernels_per_step']:.0f})" if "gpu_busy_ms_per_step" in r else "-"
    syncs = f"{r['host_syncs_per_step']:.1f}" if "host_syncs_per_step" in r else "-"
    mfu = f"{100 * r['mfu']:.2f}%" if r.get("mfu") is not None else "-"
    return (f"| {label} | **{r['graphs_per_s']:,.0f}** | {r['step_ms']:.1f} | {r['graphs_per_step']:.0f} / "
            f"{r['nodes_per_step']:,.0f} | {100 * r['data_wait_frac']:.1f}% | {busy} | {syncs} | {mfu} | {r['peak_mem_gb']:.2f} |")


STEP_HEADER = [
    "| configuration | graphs/s | step (ms) | graphs / nodes per step | data wait | GPU busy ms (kernels) per step "
    "| host syncs per step | MFU | peak GPU mem (GB) |",
    "|---|---|---|---|---|---|---|---|---|",
]


def _code2_heading() -> list[str]:
    return [
        "#### Train step (`benchmarks/gpu/step.py`), code2-shaped synthetic graphs, model of `jobs/code2.yaml`", "",
        f"{SYNTHETIC_GRAPHS} graphs (k-subgraph rows: {SUBGRAPH_GRAPHS}, 2-hop indices in the shards), lognormal sizes "
        "(mean 125, sigma 0.75, 10-1000 nodes), the job's transform; 4 layers, hidden 256, 4 heads, FFN 2x, dropout 0.2, "
        "k=2 GCN extractor with edge embeddings, mean readout, 5 x 5002 heads, AdamW + warm-up/cosine, grad clip 1.0: "
        "the product's `Trainer` on those shards in a `LocalContext` (its loaders, 4 DataLoader workers, pinned memory, "
        f"DeepSpeed ZeRO 0 engine, `Code2Task`), one micro-batch per step. Warm-up {STEP_TIMING['warmup']} steps, then >= "
        f"{STEP_TIMING['seconds']:g} s of whole steps. GPU busy: kernel time per step (torch.profiler, 3 steps); host "
        "syncs: `torch.cuda.set_sync_debug_mode` over the same steps; MFU against the card's dense bf16 / fp32 (no TF32) peak.",
        "", f"Reference: {REFERENCE}.",
    ]


def _ppa_heading() -> list[str]:
    from pipeline.config import load_job

    m = load_job(ROOT / "jobs/ppa.yaml").model
    return [
        "#### Train step (`benchmarks/gpu/step.py`), ppa-shaped synthetic graphs, model of `jobs/ppa.yaml`", "",
        f"{PPA_GRAPHS} graphs as `satp data synthetic-ppa` makes them (`benchmarks.graphs.jobs.job_shards`: ~243 "
        "nodes, 60-600, average degree ~18, 7 float edge features, node input the sum of incident edge features); "
        f"the model, task (`PPATask`, 37 classes) and optimizer of `jobs/ppa.yaml` ({m.num_layers} layers, hidden "
        f"{m.hidden_dim}, {m.num_heads} heads, k={m.k_hops} {m.gnn_type.upper()} {m.extractor} extractor); "
        "measured as the code2 rows.",
    ]


def step_benchmark(clock: Clock, tmp: Path, rows: list, heading=_code2_heading) -> tuple[str, dict]:
    files = _shard_dirs(tmp)
    results = {}
    lines = heading() + [""] + STEP_HEADER
    for label, spec in rows:
        if clock.left() < 60:
            results[label] = {"error": "skipped: GPU check time budget spent"}
        else:
            spec = dict(spec, **STEP_TIMING)
            spec["shards"] = files[spec.pop("graph_set", spec.get("extractor"))]
            if DRY_RUN:
                spec["node_budget"] = min(spec["node_budget"], 2048)
            print(f"   gpu step: {label} ...", flush=True)
            results[label] = _step(spec, min(STEP_TIMEOUT_S, clock.left() - 30))
            print(f"   {json.dumps(results[label])[:400]}", flush=True)
        shown = label
        if spec.get("extractor") == "subgraph" and "gnn_messages" in results[label]:
            shown += f" [{results[label]['gnn_messages']} message sums]"
        lines.append(_row(shown, results[label]))
    lines += _top_ops_tables(results)
    return "\n".join(lines), results


def _top_ops_tables(results: dict) -> list[str]:
    """The profile's top operators of the rows that asked for them (``top_ops``)."""
    lines = []
    for label, r in results.items():
        for key, title in (("top_device_ops", "device time"), ("top_host_ops", "host time")):
            if r.get(key):
                lines += ["", f"Top operators by {title} per step, {label} (torch.profiler, 3 steps):", "",
                          "| operator | calls | device ms | host ms (self) |", "|---|---|---|---|"]
                lines += [f"| `{name}` | {calls:g} | {dev:.2f} | {host:.2f} |" for name, calls, dev, host in r[key]]
    return lines


def pipeline(clock: Clock, tmp: Path, pycode: subprocess.Popen, pycode_started: float) -> tuple[str, dict]:
    """``satp preprocess`` and ``satp train jobs/code2.yaml`` on the pycode data made in the background,
    the epochs as MLflow has them, then the step benchmark on the same shards."""
    work = tmp / "pipeline"
    tracking = f"sqlite:///{work / 'mlflow.db'}"
    sets = [
        f"data.root={work / 'data'}", f"shards.root={work / 'shards'}", "data.source=pycode", "data.include_tests=true",
        f"train.epochs={PIPELINE_EPOCHS}", "train.warmup_epochs=1", "resources.num_workers=1",
        f"train.node_budget={PIPELINE_NODE_BUDGET}", "train.micro_batches_per_step=1",  # one batch per step, as measured
        f"train.storage_path={work / 'ray'}", f"mlflow.tracking_uri={tracking}", "train.run_name=gpu-check",
    ]
    if DRY_RUN:
        sets += ["resources.use_gpu=false", "resources.cpus_per_worker=2", "data.max_graphs_per_split=300",
                 "train.loader_workers=1", "model.hidden_dim=32", "model.num_layers=1"]
    ok, output = _finish(pycode, clock.left() - 60)
    corpus = _last_line(output, 200)
    steps = {f"satp data pycode --include-tests ({PYCODE_WORKERS} processes, beside the step rows)":
             {"ok": ok, "seconds": time.monotonic() - pycode_started, "tail": corpus}}
    for label, args in (("satp preprocess jobs/code2.yaml", ("preprocess", "jobs/code2.yaml", "--no-progress")),
                        ("satp train jobs/code2.yaml", ("train", "jobs/code2.yaml"))):
        if not all(r.get("ok") for r in steps.values()):
            break
        steps[label] = (measure(satp(*args, *overrides(sets)), clock.left() - 30, tmp / f"pipeline-{args[0]}.log")
                        if clock.left() >= 45 else {"skipped": "time budget spent"})
    lines = ["#### The pipeline on one GPU: `satp data pycode` -> `satp preprocess` -> `satp train`", "",
             f"`jobs/code2.yaml` with `--set` {' '.join('`' + s + '`' for s in sets)} (paths under a temp dir).", "",
             *step_lines(steps), "", f"Corpus: `{corpus}`"]
    trained = steps.get("satp train jobs/code2.yaml", {}).get("ok")
    epochs = _pipeline_metrics(tracking, "gpu-check") if trained else []
    out: dict = {"commands": steps, "epochs": epochs}
    if epochs:
        lines += ["", "| epoch | graphs/s | epoch s | data wait | eval s | train loss | val F1 | test F1 |", "|---|---|---|---|---|---|---|---|"]
        for e in epochs:
            lines.append(
                f"| {e['epoch']} | {e.get('graphs_per_s', float('nan')):,.0f} | {e.get('epoch_seconds', float('nan')):.1f} "
                f"| {100 * e.get('data_wait_frac', float('nan')):.1f}% | {e.get('eval_seconds', float('nan')):.1f} "
                f"| {e.get('train_loss', float('nan')):.3f} | {e.get('val_f1', float('nan')):.4f} | {e.get('test_f1', float('nan')):.4f} |"
            )
    if epochs and clock.left() > 60:
        from pipeline.config import load_job

        job = load_job(ROOT / "jobs/code2.yaml")
        spec = dict(precision="bf16", extractor=job.model.extractor, node_budget=PIPELINE_NODE_BUDGET, top_ops=12,
                    shards=steps["satp preprocess jobs/code2.yaml"]["tail"].strip(),
                    **dict(STEP_TIMING, loader_workers=job.train.loader_workers))
        if DRY_RUN:
            spec.update(node_budget=2048, loader_workers=1)
        label = "step benchmark, pycode shards"
        r = out["step_on_shards"] = _step(spec, min(STEP_TIMEOUT_S, clock.left() - 20))
        lines += ["", "Step benchmark on the same shards and settings (bf16, the pipeline's node budget, the job's loader "
                      "workers):", "", *STEP_HEADER, _row(label, r)]
        if "error" not in r:
            last = epochs[-1]["graphs_per_s"]
            lines += ["", f"Pipeline (last epoch) / {label}: {last:,.0f} / {r['graphs_per_s']:,.0f} graphs/s "
                          f"= {last / r['graphs_per_s']:.2f} (target >= 0.80); host CPU per step "
                          f"{r.get('host_cpu_per_step_ms', float('nan')):.1f} ms."]
        lines += _top_ops_tables({label: r})
    return "\n".join(lines), out


#: part -> its module (``perf``: this one)
MODULES = {"first": "first", "steps": "steps", "scale": "scale", "multirank": "multirank", "tune": "tune",
           "pattern": "accuracy_sbm", "cluster": "accuracy_sbm", "code2batch": "accuracy_code2"}


def run() -> str:
    """The part ``SATP_GPU_PART`` names (default ``perf``)."""
    import torch

    if PART not in PARTS:
        raise SystemExit(f"SATP_GPU_PART={PART!r}: expected one of {', '.join(PARTS)}")
    if not torch.cuda.is_available() and not DRY_RUN:
        return f"### GPU check, part {PART}\n\nNo CUDA device: nothing measured."
    if PART in MODULES:
        return importlib.import_module(f"benchmarks.gpu.{MODULES[PART]}").run()
    return run_perf()


def run_perf() -> str:
    clock = Clock(BUDGET_S)
    sections = ["### GPU check, part perf (`benchmarks/gpu/run.sh [perf]`, or `BENCH=gpu make bench`)", "",
                f"Device: {device()}; budget {BUDGET_S:.0f} s."]
    out = out_dir()
    raw: dict = {}
    with tempfile.TemporaryDirectory(prefix="satp-gpu-") as tmp:
        tmp_path = Path(tmp)
        parity_proc = _start(PARITY_CMD, tmp_path / "parity.log")  # both run while the graphs are made
        pycode_started = time.monotonic()
        (tmp_path / "pipeline").mkdir()
        pycode_proc = _start(satp("data", "pycode", "--out", str(tmp_path / "pipeline" / "data"), "--include-tests",
                                  "--workers", str(PYCODE_WORKERS)), tmp_path / "pipeline-pycode.log")
        _shard_dirs(tmp_path)
        parts = (
            ("parity", lambda: parity(parity_proc, clock)),
            ("step", lambda: step_benchmark(clock, tmp_path, STEP_ROWS[:ROWS_BEFORE_PIPELINE])),
            ("ppa step", lambda: step_benchmark(clock, tmp_path, PPA_ROWS, heading=_ppa_heading)),
            ("pipeline", lambda: pipeline(clock, tmp_path, pycode_proc, pycode_started)),
            ("step, more rows", lambda: step_benchmark(clock, tmp_path, STEP_ROWS[ROWS_BEFORE_PIPELINE:ROWS_BEFORE_PIPELINE + 2] if DRY_RUN else STEP_ROWS[ROWS_BEFORE_PIPELINE:])),
        )
        for name, part in parts:
            print(f"== gpu check: {name} ({clock.left():.0f} s left)", flush=True)
            try:
                text, raw[name] = part()
            except Exception as exc:  # one failed part must not lose the others' figures
                text, raw[name] = f"#### {name}\n\nfailed: {type(exc).__name__}: {str(exc)[:300]}", {"error": str(exc)}
            sections += ["", text]
            if out is not None:
                (out / "gpu_results.json").write_text(json.dumps(raw, indent=1, default=str))
        copy_logs(tmp_path, out, "perf")
    sections += ["", f"GPU check wall time: {BUDGET_S - clock.left():.0f} s."]
    return "\n".join(sections)


if __name__ == "__main__":
    print(run())

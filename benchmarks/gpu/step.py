"""GPU train-step benchmark: the product's trainer, timed; one configuration per process.

``python -m benchmarks.gpu.step '<json spec>'`` prints one JSON line of figures. What is timed is the
step ``satp train`` takes: a :class:`pipeline.train.trainer.Trainer` built from the job's worker setup
(:func:`pipeline.train.plan.worker_setup`) in a :class:`pipeline.train.context.LocalContext` on this
machine's GPU (its loaders, batch capacities, DeepSpeed engine and :class:`pipeline.train.step.TrainStep`,
as a Ray Train worker builds them), trained by :meth:`~pipeline.train.trainer.Trainer.train_epoch`
epoch after epoch; its ``on_step`` callback does the measuring (:class:`_Timer`). Figures:

* ``graphs_per_s``: graphs trained per second over a window of whole steps after warm-up
  (synchronised at the window's ends only; the intervals across an epoch's end are left out), and
  ``data_wait_frac``, the share of that window the loop waited for the training loader;
* ``profile`` (``detail``, default true): kernels launched, GPU busy time and stream synchronisations
  per step (``torch.profiler``), the host synchronisations per step (``torch.cuda.set_sync_debug_mode``),
  with ``top_ops`` the top operators by device and by host time;
* ``flops_per_graph`` (eager steps: ``torch.utils.flop_counter`` over a few steps, the packed
  attention's ``12 * sum_g n_g^2 * d`` per layer added analytically: its kernel is not counted) and
  ``mfu``, the model FLOP utilisation against the card's dense peak for the precision;
* ``peak_mem_gb``: ``torch.cuda.max_memory_allocated`` (on a CPU: the process's peak RSS).

Spec keys, each a setting of the job (:func:`job_for`): ``job`` (default ``jobs/code2.yaml``),
``precision``, ``extractor`` (subtree | subgraph), ``attention``, ``gnn_messages`` (:mod:`sat.edge_messages`),
``recompute_gnn``, ``node_budget``, ``max_graphs`` (graphs per batch cap), ``bucket_size``
(``bucket_size = max_graphs`` gives random batches, as the SAT authors' loader), ``loader_workers``,
``step`` (``train.step``: eager | static | compiled | captured; ``warmup_s`` then includes compilation
and capture), ``tiny`` (a small model, for dry runs on a CPU); one micro-batch per step. The data:
``shards`` (a shard directory). The measurement: ``seconds`` (timed window), ``warmup`` (steps),
``detail``, ``top_ops``. ``host_cpu_per_step_ms`` is the CPU time of the measuring process (all its
threads) per step.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: dense peak FLOP/s by card name fragment: (bf16 tensor cores, fp32 without TF32)
PEAK_FLOPS = {"H200": (989e12, 67e12), "H100 PCIe": (756e12, 51e12), "H100": (989e12, 67e12), "A100": (312e12, 19.5e12)}
#: spec key -> the job's setting
SETTINGS = {"precision": "train.precision", "extractor": "model.extractor", "attention": "model.attention",
            "gnn_messages": "model.gnn_messages", "recompute_gnn": "model.recompute_gnn",
            "node_budget": "train.node_budget", "max_graphs": "train.max_graphs_per_batch",
            "bucket_size": "train.bucket_size", "loader_workers": "train.loader_workers", "step": "train.step"}
PROFILE_STEPS = FLOP_STEPS = 3


def job_for(spec: dict, storage: str | Path | None = None):
    """The job a spec measures: its job file with the spec's settings, one worker, one micro-batch
    per step, no MLflow; the k-hop subgraph indices that a k-subgraph extractor reads."""
    import torch

    from pipeline.config import load_job

    sets = [f"{SETTINGS[k]}={v}" for k, v in spec.items() if k in SETTINGS and v is not None]
    sets += ["resources.num_workers=1", f"resources.use_gpu={str(torch.cuda.is_available()).lower()}",
             "train.micro_batches_per_step=1", "mlflow.enabled=false"]
    if storage is not None:
        sets.append(f"train.storage_path={storage}")
    if spec.get("tiny"):  # dry runs on a CPU: the same code paths, a small model
        sets += ["model.hidden_dim=32", "model.num_layers=1", "resources.cpus_per_worker=2"]
    job = load_job(ROOT / spec.get("job", "jobs/code2.yaml"), sets)
    if job.model.extractor == "subgraph" and not job.transform.k_hops:
        job = load_job(ROOT / spec.get("job", "jobs/code2.yaml"), sets + [f"transform.k_hops={job.model.k_hops}"])
    return job


def peak_flops(precision: str) -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next(((bf16 if precision == "bf16" else fp32) for key, (bf16, fp32) in PEAK_FLOPS.items() if key in name), None)


class _Device:
    """The CUDA calls of the measurement, with CPU stand-ins for a dry run on a machine without GPU."""

    def __init__(self) -> None:
        import torch

        self.torch, self.cuda = torch, torch.cuda.is_available()
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def peak_gb(self) -> float:
        import resource

        if self.cuda:
            return self.torch.cuda.max_memory_allocated() / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    def sync_debug(self, mode) -> None:
        if self.cuda:
            self.torch.cuda.set_sync_debug_mode(mode)

    def name(self) -> str:
        return self.torch.cuda.get_device_name() if self.cuda else "cpu (dry run)"


class _Waits:
    """The trainer's training loader, with the seconds its batches were waited for added up."""

    def __init__(self, loader) -> None:
        self.loader, self.seconds = loader, 0.0

    def __iter__(self):
        batches = iter(self.loader)
        while True:
            started = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.seconds += time.perf_counter() - started
            yield batch


class _Done(Exception):
    """Raised by :class:`_Timer` when the measurement is complete: it ends the trainer's epoch."""


class _Timer:
    """The trainer's ``on_step``: warm-up steps, the timed window, then (``detail``) profiled steps
    and, for eager steps, counted FLOPs; the figures in :attr:`result`."""

    def __init__(self, spec: dict, dev: _Device, sizes, waits: _Waits) -> None:
        self.spec, self.dev, self.sizes, self.waits = spec, dev, sizes, waits
        self.phase, self.count, self.result = "warmup", 0, {}
        self.started = time.perf_counter()
        self.window = {"s": 0.0, "cpu_s": 0.0, "wait_s": 0.0, "graphs": 0, "nodes": 0, "steps": 0, "overflow": 0}

    def _mark(self, trainer, epoch: int) -> None:
        self.last = (epoch, time.perf_counter(), time.process_time(), self.waits.seconds, trainer.step.overflow)

    def __call__(self, trainer, global_step: int) -> None:
        epoch, step = divmod(global_step - 1, trainer.batches.steps_per_epoch)
        self.count += 1
        if self.phase == "warmup":
            if self.count >= self.spec.get("warmup", 20):
                self.dev.sync()
                self.result["warmup_s"] = time.perf_counter() - self.started
                self.dev.reset_peak()
                self.phase, self.count = "window", 0
                self._mark(trainer, epoch)
            return
        if self.phase == "window":
            w, (last_epoch, t0, cpu0, wait0, overflow0) = self.window, self.last
            if epoch == last_epoch:  # an interval across an epoch's end holds the epoch's end: not a step
                if w["s"] + time.perf_counter() - t0 >= self.spec.get("seconds", 8.0) and w["steps"] >= 4:
                    self.dev.sync()
                    self.phase, self.count = "profile", 0
                batches = trainer.batches.step(epoch, step)
                w["s"] += time.perf_counter() - t0
                w["cpu_s"] += time.process_time() - cpu0
                w["wait_s"] += self.waits.seconds - wait0
                w["graphs"] += sum(len(b) for b in batches)
                w["nodes"] += int(sum(self.sizes[b].sum() for b in batches))
                w["overflow"] += max(0, trainer.step.overflow - overflow0)
                w["steps"] += 1
            self._mark(trainer, epoch)
            if self.phase == "profile":
                self.result["peak_mem_gb"] = self.dev.peak_gb()
                if not self.spec.get("detail", True):
                    raise _Done
                self._start_profile()
            return
        if self.phase == "profile" and self.count == PROFILE_STEPS:
            self._stop_profile()
            if trainer.job.train.step != "eager":
                raise _Done
            self.phase, self.count, self.attention_cells, self.flop_graphs = "flops", 0, 0, 0
            from torch.utils.flop_counter import FlopCounterMode

            self.counter = FlopCounterMode(display=False)
            self.counter.__enter__()
            return
        if self.phase == "flops":
            batches = trainer.batches.step(epoch, step)
            self.attention_cells += sum(int((self.sizes[b].astype("float64") ** 2).sum()) for b in batches)
            self.flop_graphs += sum(len(b) for b in batches)
            if self.count == FLOP_STEPS:
                self.counter.__exit__(None, None, None)
                self._flops(trainer)
                raise _Done

    def _start_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.dev.cuda else []))
        self.profiler.__enter__()
        self.caught_context = warnings.catch_warnings(record=True)
        self.caught = self.caught_context.__enter__()
        warnings.simplefilter("always")
        self.dev.sync_debug("warn")  # the steps' own host synchronisations

    def _stop_profile(self) -> None:
        from torch.autograd import DeviceType

        self.dev.sync_debug(0)
        self.caught_context.__exit__(None, None, None)
        self.dev.sync()
        self.profiler.__exit__(None, None, None)
        events, steps = self.profiler.events(), PROFILE_STEPS
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        # (setting the debug mode warns that it is a prototype: not a sync)
        syncs = [w for w in self.caught if "synchronizing CUDA operation" in str(w.message)]
        self.result.update({
            "kernels_per_step": len(kernels) / steps,
            "gpu_busy_ms_per_step": sum(e.time_range.elapsed_us() for e in kernels) / 1000 / steps,
            "stream_syncs_per_step": sum(e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize")
                                         for e in events) / steps,
            "host_syncs_per_step": len(syncs) / steps,
            "sync_sources": sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})[:5],
        })
        top = self.spec.get("top_ops", 0)
        if top:
            table = self.profiler.key_averages()

            def rows(key):  # (name, calls, self device ms, self host ms) per step
                return [(e.key[:80], round(e.count / steps, 1), round(e.self_device_time_total / 1000 / steps, 2),
                         round(e.self_cpu_time_total / 1000 / steps, 2))
                        for e in sorted(table, key=key, reverse=True)[:top]]

            self.result["top_device_ops"] = rows(lambda e: e.self_device_time_total)
            self.result["top_host_ops"] = rows(lambda e: e.self_cpu_time_total)

    def _flops(self, trainer) -> None:
        """FLOPs per graph of the counted steps, forward and backward: exact attention's
        ``12 * sum_g n_g^2 * d`` per layer added where the packed kernel (not counted) ran."""
        total = float(self.counter.get_total_flops())
        if self.result.get("attention_impl") == "varlen":
            config = trainer.engine.module.config
            total += 12.0 * self.attention_cells * config.hidden_dim * config.num_layers
        flops = total / max(self.flop_graphs, 1)
        peak = peak_flops(trainer.precision)
        gps = self.result.get("graphs_per_s")
        self.result.update(flops_per_graph=flops, mfu=flops * gps / peak if peak and gps else None)


def measure(spec: dict) -> dict:
    """Build the product's trainer for ``spec`` and time its steps (see the module docstring)."""
    import numpy as np
    import torch

    from pipeline.train.capacity import describe
    from pipeline.train.context import LocalContext
    from pipeline.train.loader import open_split
    from pipeline.train.plan import worker_setup
    from pipeline.train.trainer import Trainer
    from sat.edge_messages import resolve_impl as resolve_messages

    dev = _Device()
    storage = Path(tempfile.mkdtemp(prefix="satp-step-"))
    (storage / "run").mkdir()
    try:
        setup = worker_setup(job_for(spec, storage), spec["shards"])
        sizes = np.asarray(open_split(setup.shard_dir, "train").num_nodes)
        built = time.perf_counter()
        timer = None
        trainer = Trainer(setup, LocalContext(storage / "run", dev.device),
                          on_step=lambda t, global_step: timer(t, global_step))
        build_s = time.perf_counter() - built
        trainer.train_loader = waits = _Waits(trainer.train_loader)
        timer = _Timer(spec, dev, sizes, waits)
        probe = torch.empty(1, device=dev.device, dtype=torch.bfloat16 if trainer.precision == "bf16" else torch.float32)
        timer.result.update(attention_impl=trainer.engine.module.layers[0].attn.resolve_impl(probe),
                            gnn_messages=resolve_messages(trainer.engine.module.config.gnn_messages, dev.device))
        epoch = 0
        try:
            while True:
                trainer.train_epoch(epoch)
                epoch += 1
        except _Done:
            pass
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    w = timer.window
    return dict(timer.result, **{
        "graphs_per_s": w["graphs"] / w["s"], "step_ms": 1000 * w["s"] / w["steps"],
        "graphs_per_step": w["graphs"] / w["steps"], "nodes_per_step": w["nodes"] / w["steps"],
        "steps": w["steps"], "window_s": w["s"], "data_wait_frac": w["wait_s"] / w["s"],
        "host_cpu_per_step_ms": 1000 * w["cpu_s"] / w["steps"], "overflow_share": w["overflow"] / w["steps"],
        "device": dev.name(), "torch": torch.__version__, "precision": trainer.precision,
        "step_mode": trainer.job.train.step, "capacity": describe(trainer.capacities["train"]), "build_s": build_s,
    })


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(measure(json.loads(sys.argv[1]))))

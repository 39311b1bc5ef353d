"""``satp demo`` (``make demo``): ``jobs/code2-local.yaml`` end to end on this machine's CPUs, printing
the test F1 beside the best constant predictor's and the registered model's URI."""
from __future__ import annotations

import time
from pathlib import Path

LOCAL_JOB = Path(__file__).resolve().parents[2] / "jobs" / "code2-local.yaml"


def run_demo(overrides: list[str]) -> int:
    import ray

    from pipeline.config import load_job
    from pipeline.train.driver import train_job

    start = time.time()
    job = load_job(LOCAL_JOB, overrides)
    if not ray.is_initialized():
        cpus = max(2, int(job.resources.max_workers * job.resources.cpus_per_worker))
        from runtime.ray_cluster import connect

        # the satp cluster when one runs, else a local one with its dashboard (on loopback), to
        # watch the demo's run in
        connect(None, num_cpus=cpus, dashboard=True)
    outcome = train_job(job)
    m = outcome.metric
    best = outcome.best
    elapsed = time.time() - start
    print("\n==== satp demo ====", flush=True)
    print(f"job               {LOCAL_JOB.name} ({job.resources.max_workers} CPU workers, DeepSpeed)")
    print(f"epochs            {len(outcome.history)} (best epoch {best['epoch']}, val {m} {best['val']:.4f})")
    if not outcome.trained:
        print("                  (this run had finished before with this configuration: nothing trained; "
              "satp train jobs/code2-local.yaml --restart trains it again)")
    print(f"test {m:<13}{best['test']:.4f}")
    if outcome.constant is not None:
        verdict = "beats" if best["test"] > outcome.constant else "does NOT beat"
        print(f"constant {m:<9}{outcome.constant:.4f}  (best constant predictor; the model {verdict} it)")
    reg = outcome.registered or {}
    print(f"registered model  {reg.get('registered_uri')}")
    if reg.get("registered_model"):
        alias = f"models:/{reg['registered_model']}@champion"
        print(f"champion          {alias} {'is this version' if reg.get('champion') else 'unchanged'} ({reg.get('reason')})")
    print(f"tracking URI      {outcome.tracking_uri}")
    print(f"elapsed           {elapsed:.0f} s")
    return 0

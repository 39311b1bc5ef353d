"""``satp train``, ``satp submit`` and ``satp demo`` (registered by :mod:`pipeline.cli`)."""
from __future__ import annotations

import argparse

from pipeline.cli.args import add_job_arguments, log_to_stderr


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a job on Ray Train + DeepSpeed and register the model")
    add_job_arguments(p, "train.lr=3e-4")
    p.add_argument("--no-register", action="store_true", help="do not log/register the model in MLflow")
    p.add_argument("--restart", action="store_true",
                   help="start the run name over (deletes its checkpoints) when it holds a checkpoint, e.g. of "
                        "another configuration; without it such a run stops before training")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "submit", help="submit a job YAML to a Ray cluster (Ray job submission), stream its logs",
        description="Run satp train JOB.yaml as a Ray job. Before anything is uploaded, satp train's pre-flight runs "
                    "here: the job file, its names and model, its data where this machine sees them, and the "
                    "cluster's nodes against the job's workers.",
        epilog="exit status: 0 the job succeeded (with --no-wait: it was submitted); 2 refused before the upload, in "
               "one line (a bad job, data or cluster for it, no job server: what satp train refuses with 2); when the "
               "job failed on the cluster, its own exit status as Ray reports it (satp train's: 2 a job it refused "
               "there, 1 an error, 130 or 143 interrupted; 128+N for a command killed by signal N); 1 when Ray "
               "reports none (the job was stopped, or failed before its command ran: its last line says why)")
    p.add_argument("job", help="job YAML inside the working directory")
    p.add_argument("--address", default=None,
                   help="the cluster's job server, http://HOST:PORT (default $RAY_ADDRESS, else the satp cluster of "
                        "this machine: satp cluster status shows its job server)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no-wait", action="store_true", help="return once submitted")
    p.add_argument("--working-dir", default=".", help="directory uploaded as the job's working dir (default .)")
    p.add_argument("--restart", action="store_true", help="passed to satp train in the job (see satp train --help)")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("demo", help="the main job end to end, locally on CPU (offline Python-source dataset)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_demo)


def summary(outcome) -> str:
    m = outcome.metric
    best = outcome.best
    lines = []
    if not outcome.trained:
        lines.append(f"run {outcome.run_name} had finished with this configuration (epoch {outcome.history[-1]['epoch']}"
                     f" of its checkpoint {outcome.checkpoint_path}): nothing trained, nothing registered again; "
                     "to train it again pass --restart, or raise train.epochs to continue it")
    lines.append(f"run {outcome.run_name}: best epoch {best['epoch']} val {m} {best['val']:.4f}, test {m} {best['test']:.4f}")
    if outcome.constant is not None:
        lines.append(f"test {m} {best['test']:.4f} vs best constant predictor {outcome.constant:.4f}")
    lines += stopping_lines(outcome)
    reg = outcome.registered
    if reg and reg.get("registered_uri"):
        what = "registered model" if outcome.trained else "its model"
        lines.append(f"{what}: {reg['registered_uri']} (tracking {outcome.tracking_uri})")
    return "\n".join(lines)


def stopping_lines(outcome) -> list[str]:
    """The summary's lines on the job's target and an early stop (pipeline.train.stopping)."""
    lines = []
    target, reached = outcome.target, outcome.time_to_target
    if target is not None and reached is not None:
        steps = f", {reached['steps_to_target']:,} steps" if reached.get("steps_to_target") is not None else ""
        seconds = reached.get("time_to_target_s")
        took = f"after {_duration(seconds)} of training and evaluation" if seconds is not None else "(time not recorded)"
        lines.append(f"target {target['metric']} {target['value']:g} reached {took} (epoch {reached['epoch']}{steps})")
    elif target is not None:
        from pipeline.tasks import TASK_CLASSES

        values = [h[target["metric"]] for h in outcome.history if h.get(target["metric"]) is not None]
        pick = max if TASK_CLASSES[outcome.task].mode == "max" else min
        best = f"{pick(values):.4f}" if values else "none"
        lines.append(f"target {target['metric']} {target['value']:g} not reached (best {target['metric']} {best})")
    if outcome.stopped:
        lines.append(f"stopped early: {outcome.stopped}")
    return lines


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s" if minutes else f"{seconds:.1f} s"


def cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.cli.submit import enter_workdir
    from pipeline.config import load_job
    from pipeline.train.lease import RunLease
    from pipeline.train.plan import resolve_job, run_checkpoints, run_dir, store_env
    from pipeline.train.preflight import early_checks
    from runtime.interrupts import deferred

    job_path = Path(args.job).resolve()
    enter_workdir()
    job = load_job(job_path, args.overrides)
    # the pre-flight's first steps before the heavy imports (the job alone, the data root, the
    # --address, this machine for a local cluster): seconds; train_plan runs the rest of it
    early_checks([job], address=args.address)
    report = _divert_ray_output(job)
    log_to_stderr()
    resolved = resolve_job(job)
    # the run's lease, held to the end: a run another command holds is refused here, before Ray
    lease = RunLease(run_dir(resolved), resolved.train.run_name, storage=resolved.storage.settings()).acquire()
    try:
        if args.restart or not run_checkpoints(resolved).list():
            # nothing to decide (a new run, or one started over): Ray joined (or a local cluster
            # started) in a thread while the driver's modules load below; a run with checkpoints
            # joins Ray once its plan decided that it trains (a finished one needs no Ray)
            from runtime.ray_cluster import connect_in_background

            connect_in_background(args.address, env_vars=store_env(resolved))
        from pipeline.train.driver import train_plan
        from pipeline.train.plan import JobPlan
        from runtime.ray_logs import RetryNotice

        plan = JobPlan.resolve(job, address=args.address, restart=args.restart)
        notice = RetryNotice(job.train.max_failures, "train.max_failures", str(report))
        outcome = train_plan(plan, register=not args.no_register, lease=lease, callbacks=[notice])
    except KeyboardInterrupt as exc:
        from runtime.interrupts import Interrupted, as_interrupted, ending

        ending()  # more signals from here on are ignored: the line below and Ray's shutdown run whole
        raise Interrupted(as_interrupted(exc).signum, kept=kept_after_interrupt(resolved)) from None
    finally:
        with deferred():
            lease.release()
    print(summary(outcome), flush=True)
    return 0


def _divert_ray_output(job):
    """Ray's lines to ``runs/logs/<run>-<time>.log``, satp's on the terminal (:mod:`pipeline.console`)."""
    import time

    from pipeline import console
    from pipeline.config.train import runs_dir

    name = f"{job.train.run_name or job.name}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    return console.divert_ray_output(runs_dir() / "logs" / name)


def kept_after_interrupt(job) -> str:
    """What an interrupted ``satp train`` of ``job`` (resolved) kept, and how to go on (one line)."""
    from pipeline.train.plan import run_checkpoints
    from pipeline.train.rerun import previous_run

    train = job.train
    previous = previous_run(run_checkpoints(job), warn=False)  # the rerun names what is damaged
    if previous is None:
        return (f"run {train.run_name} had written no checkpoint yet (finished shards are kept): the same command "
                "starts it again")
    return (f"run {train.run_name} kept its checkpoint of epoch {previous.epoch} ({previous.checkpoint}): the same "
            f"command resumes after epoch {previous.epoch}")


def cmd_submit(args: argparse.Namespace) -> int:
    from pipeline.cli.submit import submit

    return submit(args.job, address=args.address, overrides=args.overrides, wait=not args.no_wait,
                  working_dir=args.working_dir, restart=args.restart)


def cmd_demo(args: argparse.Namespace) -> int:
    from pipeline.cli.demo import run_demo

    log_to_stderr()
    return run_demo(args.overrides)

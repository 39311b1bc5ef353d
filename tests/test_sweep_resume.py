"""A sweep interrupted with Ctrl-C and run again: the summary of a
resumed trial counts the epochs it ran before the interruption, and Ray's own ``Tuner.restore(...)``
hint is not printed beside satp's.

The interruption lands at the moment that exposed the bug: a trial's Train run has checkpointed its best
epoch, whose report had not reached Tune's driver yet; the resumed run goes on from that checkpoint,
so Tune's results never hold that epoch (the summary printed "best val_f1 0.0000"), while its
checkpoint does (registration and MLflow's catch-up read it).

Real Ray Tune (two driver processes on the session's cluster, a real SIGINT) through the sweep's own
``fit_trials`` and ``summarize``; the trial is a small Tune function that, like a trial's Train run,
resumes from its own checkpoints' ``state.json`` (``pipeline.train.checkpoint``'s layout), so that a
whole Train run per trial is not needed to see what Tune keeps of its results across a restore.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
BEST = 0.0553  # epoch 1's val_f1, reached before the interruption; the epochs after it score 0

DRIVER = textwrap.dedent('''
    import json, sys, time
    from pathlib import Path

    import ray
    from ray import tune

    from pipeline.sweep.summary import saved_states, summarize
    from pipeline.sweep.trials import fit_trials

    base = Path(sys.argv[1])
    ray.init(address=sys.argv[2], log_to_driver=False)

    def trial(config):
        train = Path(config["train_dir"])
        states = sorted(train.glob("epoch-*/state.json"))
        history = json.loads(states[-1].read_text())["history"] if states else []
        for epoch in range(len(history), 4):
            row = {"epoch": epoch, "val_f1": BEST if epoch == 1 else 0.0, "best_val_f1": BEST if epoch else 0.0}
            history.append(row)
            directory = train / f"epoch-{epoch}"
            directory.mkdir(parents=True)
            (directory / "state.json").write_text(json.dumps({"epoch": epoch, "history": history}))
            if epoch == 1 and not (base / "resume").exists():
                (base / "started").touch()
                time.sleep(600)  # interrupted with epoch 1 checkpointed, its report not yet at Tune's driver
            tune.report({**row, "epochs_done": epoch + 1, "checkpoint_path": str(directory)})

    def new_tuner():
        return tune.Tuner(tune.with_resources(trial, {"cpu": 0.5}), param_space={"train_dir": str(base / "train")},
                          tune_config=tune.TuneConfig(metric="val_f1", mode="max", num_samples=1),
                          run_config=tune.RunConfig(name="s", storage_path=str(base / "tune"), verbose=1))

    sweep = base / "tune" / "s"
    results, resumed = fit_trials(sweep, trial, new_tuner, None, "")
    [t] = summarize(results, "val_f1", "max", "val_f1", 4, saved_states(sweep))
    print("SUMMARY " + json.dumps({"resumed": resumed, "status": t.status, "epochs": t.epochs, "best": t.best,
                                   "best_val": t.best_val, "curve": t.curve}), flush=True)
''').replace("BEST", repr(BEST))


def _driver(base: Path, address: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(base), address], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ))


def _summary(output: str) -> dict:
    return json.loads(next(line for line in output.splitlines() if line.startswith("SUMMARY "))[8:])


def test_a_resumed_trial_keeps_its_best_epoch_from_before_the_interrupt(ray_cluster, tmp_path):
    address = ray_cluster.get_runtime_context().gcs_address
    first = _driver(tmp_path, address)
    deadline = time.monotonic() + 240
    while not (tmp_path / "started").exists():  # the trial has reported epoch 0 and checkpointed epoch 1
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
        time.sleep(0.2)
    first.send_signal(signal.SIGINT)
    interrupted, _ = first.communicate(timeout=240)
    assert _summary(interrupted)["status"] == "interrupted", interrupted[-3000:]
    assert "Tuner.restore(" not in interrupted  # satp says how to resume (the same command); Ray does not

    (tmp_path / "resume").touch()
    second = _driver(tmp_path, address)
    resumed, _ = second.communicate(timeout=240)
    summary = _summary(resumed)
    assert summary["resumed"] and summary["status"] == "finished", resumed[-3000:]
    assert summary["epochs"] == 4 and summary["best"] == BEST and summary["best_val"] == BEST
    assert summary["curve"] == [[0, 0.0], [1, BEST], [2, 0.0], [3, 0.0]]

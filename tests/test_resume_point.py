"""Which checkpoint a rerun resumes from, and which ones it deletes (no Ray: a run directory laid
out as Ray Train and :func:`pipeline.train.checkpoint.save` leave it after an interrupt), as
:class:`pipeline.train.checkpoint.CheckpointManager` sees it."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.train import checkpoint as ckpt
from pipeline.train.checkpoint import SNAPSHOT, CheckpointManager


def _checkpoint(run_dir: Path, name: str, epoch: int, world: int = 2, ranks_done: int | None = None,
                truncate: bool = False) -> Path:
    """A checkpoint directory as the ranks upload it; ``ranks_done`` ranks finished their upload."""
    path = run_dir / name
    for rank in range(world if ranks_done is None else ranks_done):
        files = {f"ds/last/rank{rank}.pt": b"x" * (100 + rank)}
        if rank == 0:
            files["state.json"] = json.dumps({"epoch": epoch, "world_size": world}).encode()
        for rel, data in files.items():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_bytes(data)
        (path / ckpt.RANK_FILE.format(rank=rank)).write_text(json.dumps({k: len(v) for k, v in files.items()}))
    if truncate:
        (path / "ds/last/rank1.pt").write_bytes(b"x" * 10)  # an upload cut short
    return path


def _register(run_dir: Path, *names: str) -> None:
    results = [{"checkpoint_dir_name": n, "metrics": {}} for n in names]
    (run_dir / SNAPSHOT).write_text(json.dumps({"checkpoint_results": results,
                                                "latest_checkpoint_result": results[-1] if results else None}))


def test_the_newest_complete_checkpoint_wins_over_what_ray_registered(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, "checkpoint_a", 0)
    newest = _checkpoint(run, "checkpoint_b", 2)
    _register(run, "checkpoint_a")  # Ray registered epoch 0 only: interrupted before it polled again
    assert CheckpointManager(run).newest_intact() == newest.name
    assert CheckpointManager(run).verify(newest.name) is None


def test_a_partial_upload_is_never_resumed_from(tmp_path):
    run = tmp_path / "run"
    registered = _checkpoint(run, "checkpoint_a", 0)
    half = _checkpoint(run, "checkpoint_b", 1, ranks_done=1)  # rank 1 never uploaded
    cut = _checkpoint(run, "checkpoint_c", 2, truncate=True)  # rank 1's file cut short
    _register(run, "checkpoint_a")
    manager = CheckpointManager(run)
    assert manager.verify(half.name) is not None and manager.verify(cut.name) is not None
    assert manager.newest_intact() == registered.name


def test_prune_removes_what_ray_never_registered_but_the_resume_point(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, "checkpoint_a", 0)
    _checkpoint(run, "checkpoint_b", 1)
    _checkpoint(run, "checkpoint_c", 2, ranks_done=1)
    keep = _checkpoint(run, "checkpoint_d", 3)
    _register(run, "checkpoint_a")
    manager = CheckpointManager(run)
    assert manager.prune(keep=keep.name) == ["checkpoint_b", "checkpoint_c"]
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoint_a", "checkpoint_d"]
    _register(run, "checkpoint_e")  # a later fit registered its own and Ray pruned checkpoint_a
    _checkpoint(run, "checkpoint_e", 4)
    manager.prune(keep="checkpoint_e")
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoint_e"]
    assert manager.registered() == ["checkpoint_e"]


def test_without_ray_s_record_nothing_is_deleted(tmp_path):
    run = tmp_path / "run"
    only = _checkpoint(run, "checkpoint_a", 0)  # interrupted before Ray registered anything
    assert CheckpointManager(run).prune() == []
    assert CheckpointManager(run).newest_intact() == only.name

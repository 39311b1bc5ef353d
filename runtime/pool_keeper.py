"""How many warm worker processes of each kind a local raylet keeps, and when it starts them
(:class:`runtime.worker_pool.WorkerPool` counts and prestarts them).

:func:`keep_warm` tops the pool up every second, in the process that ``satp cluster start`` leaves beside
its cluster (``python -m runtime.pool_keeper``), until the raylet is gone. How many of a kind it keeps:
the most that were in use at once within the last :data:`USAGE_WINDOW_S` (so the second trial of a sweep
finds what the first one used; Train's helper actors not counted, :data:`runtime.worker_pool.TRAIN_HELPERS`),
at least what one ``satp train`` run of the cluster's size needs (:func:`runtime.worker_pool.default_targets`),
and never more than :func:`warm_limit` idle processes in all: each holds 0.2-0.6 GB, and each costs
seconds of CPU to start, which a busy machine pays while its runs wait. The defaults have room whatever
fills the limit: Ray keeps idle processes of a finished job's kinds (as many as the node's CPUs) for good,
and so held a test's warm controller back for minutes. An idle cluster restarts its warm processes every
:data:`runtime.worker_pool.KEEP_ALIVE_S` (their keep-alive). No process is prestarted while the machine's
CPUs were more than :data:`BUSY_CPU_PERCENT` busy in the last :data:`BUSY_WINDOW_S` seconds (:class:`CpuBusy`):
a prestart uses idle CPU, never a run's (on 2 cores a refill of five processes during a run's set-up made
it seconds longer; with spare cores the pool refills while runs go on; a command's own cluster prestarts
what its one run takes at once, ``once``).
"""
from __future__ import annotations

import argparse
import collections
import logging
import sys
import time
from typing import Optional

from runtime.worker_pool import Kind, WorkerPool, default_targets

log = logging.getLogger(__name__)

USAGE_WINDOW_S = 600.0
CLEANER_CHECK_ROUNDS = 10  # keep_warm's rounds between looks for orphaned placement-group cleaners
BUSY_CPU_PERCENT = 60.0
BUSY_WINDOW_S = 3.0


def warm_limit(defaults: dict[Kind, int], starts_at_once: int) -> int:
    """The most idle processes a pool holds: one run's (``defaults``) and one more round of starts."""
    return sum(defaults.values()) + starts_at_once


def within_limit(targets: dict[Kind, int], defaults: dict[Kind, int], limit: int) -> dict[Kind, int]:
    """``targets`` cut to ``limit`` processes in all: ``defaults`` first, then the other kinds by
    their count (the most used first)."""
    ordered = sorted(targets.items(), key=lambda item: (item[0] not in defaults, -item[1], item[0]))
    kept, room = {}, limit
    for kind, count in ordered:
        if room <= 0:
            break
        kept[kind] = min(count, room)
        room -= kept[kind]
    return kept



class UsageMemory:
    """The most processes of each kind in use at once within the last ``window_s`` seconds."""

    def __init__(self, window_s: float = USAGE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: collections.deque = collections.deque()

    def add(self, busy: collections.Counter, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, dict(busy)))
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()

    def peaks(self) -> dict[Kind, int]:
        peaks: dict[Kind, int] = {}
        for _, counts in self._samples:
            for kind, count in counts.items():
                peaks[kind] = max(peaks.get(kind, 0), count)
        return peaks


class Requests:
    """Prestarts asked for and not yet seen: for ``ttl_s`` seconds a kind counts as holding what was
    asked for, and is not asked for again (the raylet starts a process at once or not at all)."""

    def __init__(self, ttl_s: float = 5.0) -> None:
        self.ttl_s = ttl_s
        self._expected: dict[Kind, tuple[int, float]] = {}  # kind -> (processes expected, deadline)

    def add(self, kind: Kind, seen: int, count: int, now: float) -> None:
        self._expected[kind] = (seen + count, now + self.ttl_s)

    def counted(self, available: collections.Counter, now: float) -> collections.Counter:
        counted = collections.Counter(available)
        for kind, (expected, deadline) in list(self._expected.items()):
            if available.get(kind, 0) >= expected or now > deadline:
                del self._expected[kind]
            else:
                counted[kind] = expected
        return counted


class CpuBusy:
    """Whether the machine's CPUs were busy (more than ``percent`` used) at any sample within the
    last ``window_s`` seconds; sampled once per call of :meth:`busy` (since the call before)."""

    def __init__(self, percent: float = BUSY_CPU_PERCENT, window_s: float = BUSY_WINDOW_S) -> None:
        import psutil

        self.percent, self.window_s = percent, window_s
        self._samples: collections.deque = collections.deque()
        psutil.cpu_percent(interval=None)  # starts the first interval

    def add(self, used: float, now: float) -> None:
        self._samples.append((now, used))
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()

    def busy(self, now: Optional[float] = None) -> bool:
        import psutil

        self.add(psutil.cpu_percent(interval=None), time.monotonic() if now is None else now)
        return self.was_busy()

    def was_busy(self) -> bool:
        return any(used > self.percent for _, used in self._samples)


def keep_warm(pool: WorkerPool, defaults: dict[Kind, int], interval_s: float = 1.0,
              once: bool = False) -> None:
    """Top the pool up every ``interval_s`` until the raylet is gone (see the module docstring);
    ``once``: until it has held ``defaults`` once (a command's own cluster, for its one run)."""
    usage, requests, cpus = UsageMemory(), Requests(), CpuBusy()
    limit = warm_limit(defaults, pool.starts_at_once)
    rounds = 0
    while pool.alive():
        try:
            if rounds % CLEANER_CHECK_ROUNDS == 0 and pool.end_orphaned_cleaners():
                log.info("ended Ray Train's placement-group cleaners of runs whose driver has gone")
            rounds += 1
            available, busy = pool.census()
            now = time.monotonic()
            usage.add(busy, now)
            targets = dict(defaults)
            for kind, peak in usage.peaks().items():
                targets[kind] = max(targets.get(kind, 0), peak)
            targets = within_limit(targets, defaults, limit)
            if once and all(available.get(kind, 0) >= count for kind, count in defaults.items()):
                return
            if cpus.busy(now) and not once:  # a command's own cluster: its run is about to take them
                time.sleep(interval_s)
                continue
            counted = requests.counted(available, now)
            room = limit - sum(counted.values())
            lacking = sum(max(0, count - counted.get(kind, 0)) for kind, count in defaults.items())
            wanted = targets if room > 0 else defaults  # the defaults have room whatever fills the limit
            for kind, count in pool.top_up(wanted, counted, most=max(room, lacking)).items():
                requests.add(kind, counted.get(kind, 0), count, now)
                log.info("prestarted %d %s worker process(es)", count, kind.describe())
        except Exception as exc:  # the raylet going away mid-call, a slow answer: try again
            if not pool.alive():
                break
            log.debug("worker pool: %s", exc)
        time.sleep(interval_s)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="keep a local raylet's warm worker processes topped up")
    parser.add_argument("--raylet-address", required=True, help="host:node_manager_port")
    parser.add_argument("--raylet-pid", type=int, required=True)
    parser.add_argument("--gcs-address", required=True, help="host:port")
    parser.add_argument("--workers", type=int, required=True, help="Train workers of one run (the default pool)")
    parser.add_argument("--forked-workers", action="store_true", help="the cluster's fork server starts Train workers")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    keep_warm(WorkerPool(args.raylet_address, args.raylet_pid, args.gcs_address),
              default_targets(args.workers, forked=args.forked_workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())

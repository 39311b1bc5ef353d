"""``satp data ...`` and ``satp preprocess``.

::

    satp data pycode --out ROOT [--source DIR ...] [--include-tests] [--force]
        Python source (default: this interpreter's standard library) -> ROOT/ogbg_code2 (OGB raw layout)
    satp data synthetic-ppa --out ROOT [--graphs N] [--seed S] [--force]
        a synthetic ogbg-ppa -> ROOT/ogbg_ppa (OGB raw layout)
    satp preprocess JOB.yaml [--set dotted.key=value ...] [--address ADDR] [--no-progress]
        the job's data/transform/shards sections -> Arrow shards (one Ray task per shard);
        prints the shard directory

Errors (``ValueError`` / ``OSError``) become one line ``satp: error: ...`` and exit status 2
(see :mod:`pipeline.cli`).
"""
from __future__ import annotations

import argparse
import json

from pipeline.config import add_job_arguments


def _pycode(args: argparse.Namespace) -> int:
    from preprocessing.pycode import build_pycode

    summary = build_pycode(args.out, args.source or None, include_tests=args.include_tests, force=args.force)
    print(json.dumps(summary))
    return 0


def _synthetic_ppa(args: argparse.Namespace) -> int:
    from preprocessing.synthetic import build_synthetic_ppa

    summary = build_synthetic_ppa(args.out, args.graphs, seed=args.seed, force=args.force)
    print(json.dumps(summary))
    return 0


def _preprocess(args: argparse.Namespace) -> int:
    from pipeline.config import load_job
    from preprocessing.build import preprocess

    job = load_job(args.job, args.overrides)
    out = preprocess(job.data, job.transform, job.shards, address=args.address, progress=not args.no_progress)
    print(out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="build an offline dataset in OGB's raw layout")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="BUILDER")

    py = data_sub.add_parser("pycode", help="ogbg-code2 from Python source (default: the standard library)")
    py.add_argument("--out", required=True, help="OGB root directory (writes OUT/ogbg_code2)")
    py.add_argument("--source", action="append", metavar="DIR", help="source directory (repeatable)")
    py.add_argument("--include-tests", action="store_true", help="keep test directories")
    py.add_argument("--force", action="store_true", help="replace an existing OUT/ogbg_code2")
    py.set_defaults(func=_pycode)

    ppa = data_sub.add_parser("synthetic-ppa", help="a synthetic ogbg-ppa")
    ppa.add_argument("--out", required=True, help="OGB root directory (writes OUT/ogbg_ppa)")
    ppa.add_argument("--graphs", type=int, default=2000, help="number of graphs (default 2000)")
    ppa.add_argument("--seed", type=int, default=0)
    ppa.add_argument("--force", action="store_true", help="replace an existing OUT/ogbg_ppa")
    ppa.set_defaults(func=_synthetic_ppa)

    pre = sub.add_parser("preprocess", help="a job's dataset into Arrow shards, in parallel on Ray")
    add_job_arguments(pre, "transform.k_hops=3")
    pre.add_argument("--no-progress", action="store_true", help="no progress bar")
    pre.set_defaults(func=_preprocess)

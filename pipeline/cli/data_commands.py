"""``satp data pycode | synthetic-ppa | sbm-pattern | sbm-cluster`` (offline datasets in OGB's raw
layout) and ``satp preprocess JOB.yaml`` (the job's dataset into Arrow shards; prints their directory).
"""
from __future__ import annotations

import argparse
import json
import time

from pipeline.cli.args import add_job_arguments


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _pycode(args: argparse.Namespace) -> int:
    from preprocessing.pycode import build_pycode

    start = time.perf_counter()
    summary = build_pycode(args.out, args.source or None, include_tests=args.include_tests, force=args.force,
                           workers=args.workers, environment=args.environment)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(summary))
    return 0


def _synthetic_ppa(args: argparse.Namespace) -> int:
    from preprocessing.synthetic import build_synthetic_ppa

    summary = build_synthetic_ppa(args.out, args.graphs, seed=args.seed, force=args.force, workers=args.workers)
    print(json.dumps(summary))
    return 0


def _sbm(args: argparse.Namespace) -> int:
    from preprocessing.sbm import build_sbm, format_statistics

    start = time.perf_counter()
    summary = build_sbm(args.out, args.benchmark, args.graphs, seed=args.seed, force=args.force)
    summary["seconds"] = time.perf_counter() - start
    print(format_statistics(summary))
    return 0


def _preprocess(args: argparse.Namespace) -> int:
    from pipeline.config import load_job
    from pipeline.train.preflight import check_data_root, check_shards_root
    from runtime.ray_address import probe, resolve_address

    job = load_job(args.job, args.overrides)
    target = resolve_address(args.address)
    if target:  # a dead address: one line in seconds, not minutes
        probe(target)
    # the path checks of satp train's pre-flight, before torch and Ray load (~10 s): one line naming the key
    check_data_root(job.data)
    check_shards_root(job)
    from preprocessing.build import preprocess

    if target:
        from runtime.ray_cluster import connect

        connect(args.address, log_to_driver=False)
    out = preprocess(job.data, job.transform, job.shards, address=args.address, progress=not args.no_progress,
                     force=args.force, storage=job.storage.settings())
    print(out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="build an offline dataset in OGB's raw layout")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="BUILDER")

    py = data_sub.add_parser(
        "pycode", help="ogbg-code2 from Python source (default: the standard library)",
        description="ogbg-code2 (OGB raw layout) from Python source: by default the standard library without "
        "tests; --environment: the code2-scale corpus of the standard library and every installed package "
        "(docs/data.md).")
    py.add_argument("--out", required=True, help="OGB root directory (writes OUT/ogbg_code2)")
    corpus = py.add_mutually_exclusive_group()
    corpus.add_argument("--source", action="append", metavar="DIR", help="source directory (repeatable)")
    corpus.add_argument("--environment", action="store_true",
                        help="the standard library and the packages installed in this environment (sysconfig's "
                             "purelib and platlib), tests included, nothing downloaded: one project per top-level "
                             "module or package (>= 300k functions in satp's venv). Always leaves out jedi, "
                             "docutils, hypothesis and IPython (reserved for an independent check)")
    py.add_argument("--include-tests", action="store_true", help="keep test directories")
    py.add_argument("--force", action="store_true", help="replace an existing OUT/ogbg_code2")
    py.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                    help="parsing processes (default: the usable CPUs, at most 16); the output does not depend on it")
    py.set_defaults(func=_pycode)

    ppa = data_sub.add_parser("synthetic-ppa", help="a synthetic ogbg-ppa")
    ppa.add_argument("--out", required=True, help="OGB root directory (writes OUT/ogbg_ppa)")
    ppa.add_argument("--graphs", type=int, default=2000, help="number of graphs (default 2000)")
    ppa.add_argument("--seed", type=int, default=0)
    ppa.add_argument("--force", action="store_true", help="replace an existing OUT/ogbg_ppa")
    ppa.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                     help="generating processes (default: the usable CPUs, at most 16); "
                          "the output does not depend on it")
    ppa.set_defaults(func=_synthetic_ppa)

    for benchmark in ("pattern", "cluster"):
        sbm = data_sub.add_parser(f"sbm-{benchmark}", help=f"{benchmark.upper()} by the SBM recipe of Dwivedi et al.")
        sbm.add_argument("--out", required=True, help=f"root directory (writes OUT/sbm_{benchmark})")
        sbm.add_argument("--seed", type=int, default=0)
        sbm.add_argument("--graphs", type=int, default=None,
                         help="total graphs for quick runs, split as the benchmark (default: full size)")
        sbm.add_argument("--force", action="store_true", help=f"replace an existing OUT/sbm_{benchmark}")
        sbm.set_defaults(func=_sbm, benchmark=benchmark)

    pre = sub.add_parser("preprocess", help="a job's dataset into Arrow shards, in parallel on Ray")
    add_job_arguments(pre, "transform.k_hops=3")
    pre.add_argument("--force", action="store_true",
                     help="build the shards again from scratch; the old directory stays until the new one is complete")
    pre.set_defaults(func=_preprocess)

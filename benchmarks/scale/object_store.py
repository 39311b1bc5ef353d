"""Shards read from an object store against the same shards on local disk: the training loader alone.

    python -m benchmarks.scale.object_store [--graphs N ...] [--epochs E] [--rounds R]

For each size N (``--graphs``, repeatable; default ``SATP_STORE_GRAPHS``, "1000,4000"), synthetic
ogbg-ppa graphs (``satp data synthetic-ppa``) preprocessed with ``jobs/ppa.yaml``'s transform and
shard size into a local directory, then copied as they are into a bucket of an S3 API server on
loopback (``moto_server``, started here: objects in memory or its temporary files, no network).
Each source is then read in a fresh process, as a Ray Train worker reads its split:
``pipeline.train.loader.open_split`` of the directory (its ``s3://`` URI, with ``AWS_ENDPOINT_URL``
naming the server), ``NodeBudgetSampler`` over the split's node counts at ``jobs/ppa.yaml``'s node
budget, and ``ShardDataset.batch`` of every batch, ``E`` epochs (default 3). Epoch 1 counts from
``open_split`` on: for the store with an empty cache, reading the manifest and downloading every
shard into the cache (read-ahead, sha256 checked as they arrive); for the local disk, and for a
second reader of the store on the same node (the cache filled: a restarted run, another worker),
the first read's sha256 checks. Later epochs decode from the mapped files on all three. The three
readers take turns, ``R`` rounds (default 3); each figure is the median of its rounds, beside the
load average of the machine while they ran. Beside them: the server's own speed, one GET of the
largest shard with its body read and dropped (boto3, the median of 3).

Peak RSS is ``/usr/bin/time -v``'s maximum resident set size of the reader process (the mapped
shard pages it touched included), and the peak of its private memory (``RssAnon``, sampled every
10 ms).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.machine import describe

ROOT = Path(__file__).resolve().parents[2]
JOB = "jobs/ppa.yaml"
BUCKET = "satp-bench"
MIB = 2**20


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def measure(source: str, epochs: int, budget: int) -> dict:
    """One reader process's numbers (see the module docstring); run by ``--child``."""
    import preprocessing.reader  # noqa: F401  (imported before the clock starts, as in a running worker)
    from pipeline.train.batching import NodeBudgetSampler
    from pipeline.train.loader import open_split

    peak = {"anon": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak["anon"] = max(peak["anon"], _status_kib("RssAnon"))

    threading.Thread(target=sample, daemon=True).start()
    started = time.perf_counter()
    ds = open_split(source, "train")
    sampler = NodeBudgetSampler(ds.num_nodes, budget, seed=0)
    rates = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        graphs = 0
        for ids in sampler:
            graphs += ds.batch(ids).num_graphs
        now = time.perf_counter()
        rates.append(graphs / (now - started))
        started = now
    done.set()
    return {"rates": rates, "anon_kib": max(peak["anon"], _status_kib("RssAnon")), "graphs": len(ds)}


def _moto(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"moto_server did not start on port {port}")


def _store_env(port: int) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}


def _child(source: str, epochs: int, budget: int, env: dict[str, str]) -> dict:
    """One reader process under ``/usr/bin/time -v``: its numbers, with time's maximum resident set size."""
    out = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "benchmarks.scale.object_store", "--child",
                          source, "--epochs", str(epochs), "--budget", str(budget)], cwd=ROOT, env={**os.environ, **env},
                         capture_output=True, text=True, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    maximum = [line for line in out.stderr.splitlines() if "Maximum resident set size (kbytes)" in line]
    row["time_max_rss_kib"] = int(maximum[-1].rsplit(":", 1)[1])
    return row


def _get_mib_s(port: int, uri: str) -> float:
    """MiB/s of one GET of object ``uri`` from the server, its body read and dropped (the median of 3)."""
    import boto3

    client = boto3.client("s3", **_client_args(port))
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    rates = []
    for _ in range(3):
        started, size = time.perf_counter(), 0
        for chunk in client.get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(8 * MIB):
            size += len(chunk)
        rates.append(size / MIB / (time.perf_counter() - started))
    return statistics.median(rates)


def _client_args(port: int) -> dict:
    return {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1", "aws_access_key_id": "bench",
            "aws_secret_access_key": "bench"}


def measure_size(graphs: int, base: Path, port: int, epochs: int, rounds: int) -> list[dict]:
    """The three readers' rows for ``graphs`` synthetic ppa graphs (see the module docstring)."""
    import pyarrow.fs as pafs

    from pipeline.config import load_job
    from preprocessing import preprocess
    from preprocessing.synthetic import build_synthetic_ppa

    build_synthetic_ppa(base / "data", graphs, seed=0)
    job = load_job(ROOT / JOB, [f"data.root={base / 'data'}", "data.source=synthetic", f"shards.root={base / 'shards'}"])
    local = preprocess(job.data, job.transform, job.shards, progress=False)
    uri = f"s3://{BUCKET}/ppa-{graphs}/{local.name}"
    store = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", access_key="bench",
                              secret_key="bench", region="us-east-1")
    pafs.copy_files(str(local), uri.removeprefix("s3://"), destination_filesystem=store)
    train = sorted(local.glob("train-*.arrow"), key=lambda p: p.stat().st_size)
    get = _get_mib_s(port, f"{uri}/{train[-1].name}")
    cache = {"XDG_CACHE_HOME": str(base / "cache")}  # emptied before each first reader of the store
    readers = (("local disk", str(local), {}),
               ("s3:// (moto, loopback), cache empty", uri, {**_store_env(port), **cache}),
               ("s3:// (moto, loopback), cache filled", uri, {**_store_env(port), **cache}))
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in readers}
    loads = []
    for _ in range(rounds):
        shutil.rmtree(base / "cache", ignore_errors=True)
        for name, source, env in readers:
            loads.append(os.getloadavg()[0])
            runs[name].append(_child(source, epochs, job.train.node_budget, env))
    rows = []
    for name, results in runs.items():
        rates = [statistics.median(r["rates"][e] for r in results) for e in range(epochs)]
        whole = statistics.median(r["graphs"] * epochs / sum(r["graphs"] / v for v in r["rates"]) for r in results)
        rows.append({"size": graphs, "graphs": results[0]["graphs"], "train_mib": sum(p.stat().st_size for p in train) / MIB,
                     "source": name, "rates": rates, "whole": whole, "get_mib_s": get,
                     "load": f"{min(loads):.0f}-{max(loads):.0f}",
                     **{k: statistics.median(r[k] for r in results) for k in ("time_max_rss_kib", "anon_kib")}})
    return rows


def run(sizes: list[int] | None = None, epochs: int = 3, rounds: int = 3) -> str:
    """The markdown section (see the module docstring)."""
    import boto3

    from runtime.ports import free_ports

    if sizes is None:
        sizes = [int(s) for s in os.environ.get("SATP_STORE_GRAPHS", "1000,4000").split(",") if s.strip()]
    port = free_ports(1)[0]
    server = _moto(port)
    rows = []
    try:
        boto3.client("s3", **_client_args(port)).create_bucket(Bucket=BUCKET)
        for n in sizes:
            base = Path(tempfile.mkdtemp(prefix=f"satp-store-{n}-"))
            try:
                rows += measure_size(n, base, port, epochs, rounds)
            finally:
                shutil.rmtree(base, ignore_errors=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    head = "| graphs (train split) | train shards MiB | source | " + " | ".join(
        f"epoch {e + 1} graphs/s" for e in range(epochs)) + " | whole run graphs/s | peak RSS MiB (time -v) | " \
        "peak private RSS MiB | load average |"
    lines = [
        "## Shards on an object store: the loader from s3:// against local disk",
        "",
        f"Machine: {describe()}.",
        "",
        f"Command: `python -m benchmarks.scale.object_store {' '.join(f'--graphs {n}' for n in sizes)} "
        f"--epochs {epochs} --rounds {rounds}` (train split of synthetic ogbg-ppa, `{JOB}`'s transform, shard size and "
        "node budget; each reader a fresh process, the three taking turns, medians of the rounds; epoch 1 includes "
        "`open_split` and the first read's sha256 checks, with an empty cache every download too).",
        "",
        head,
        "|" + "---|" * (7 + epochs),
    ]
    for r in rows:
        rates = " | ".join(f"{v:,.0f}" for v in r["rates"])
        lines.append(f"| {r['size']:,} ({r['graphs']:,}) | {r['train_mib']:.0f} | {r['source']} | {rates} | "
                     f"{r['whole']:,.0f} | {r['time_max_rss_kib'] / 1024:.0f} | {r['anon_kib'] / 1024:.0f} | {r['load']} |")
    lines += ["", "The server alone, one GET of the largest train shard (MiB/s): " + ", ".join(
        f"{r['size']:,} graphs {r['get_mib_s']:.0f}" for r in rows[::3]) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale.object_store", description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=int, action="append", metavar="N",
                        help="a size (repeatable; default SATP_STORE_GRAPHS or 1000,4000)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="turns of the three readers (medians reported)")
    parser.add_argument("--child", metavar="SOURCE", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.epochs, args.budget)))
        return 0
    print(run(args.graphs, args.epochs, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())

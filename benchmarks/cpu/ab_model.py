"""A/B of the CPU model benchmark: a base commit against the working tree, interleaved in one run.

    .venv/bin/python -m benchmarks.cpu.ab_model [BASE] [--rounds N]      # BASE default: 995638f

Machines differ (FACTS.md: AVX-512 bf16 on one, AVX2 only on the next), so "not slower than
before" is only meaningful within one run on one machine. This checks ``BASE`` out into a
temporary git worktree and runs :func:`benchmarks.cpu.model.measure` for each configuration from
the base tree and from this tree alternately (A, B, A, B, ...), each in a fresh process with the
same interpreter, and prints a markdown table of the per-configuration medians and the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [
    ("dense, fp32, k-subtree", dict(attention="dense", precision="fp32", extractor="subtree", warmup=1, steps=8)),
    ("dense, bf16 autocast, k-subtree", dict(attention="dense", precision="bf16", extractor="subtree", warmup=1, steps=8)),
    ("dense, fp32, k-subgraph (k=2)", dict(attention="dense", precision="fp32", extractor="subgraph", warmup=1, steps=4)),
]


def _measure(tree: Path, spec: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=str(tree))
    # the model benchmark's module in that tree (benchmarks/bench_model.py before the rooms of issue 31)
    module = "benchmarks.cpu.model" if (tree / "benchmarks" / "cpu" / "model.py").is_file() else "benchmarks.bench_model"
    proc = subprocess.run([sys.executable, "-m", module, json.dumps(spec)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", nargs="?", default="995638f")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text() or "amx_bf16" in Path("/proc/cpuinfo").read_text()
    configs = [c for c in CONFIGS if bf16 or c[1]["precision"] != "bf16"]  # emulated bf16 takes hours
    with tempfile.TemporaryDirectory(prefix="satp-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            rows = []
            for label, spec in configs:
                runs: dict[str, list[float]] = {"base": [], "head": []}
                for _ in range(args.rounds):
                    for name, tree in (("base", base), ("head", ROOT)):
                        res = _measure(tree, spec)
                        print(f"{label} [{name}]: {res.get('graphs_per_s', res.get('error'))}", flush=True)
                        if "graphs_per_s" in res:
                            runs[name].append(res["graphs_per_s"])
                rows.append((label, runs))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"\n### CPU model benchmark, base {args.base} vs this tree ({head} + working tree), interleaved\n")
    print(f"Command: `.venv/bin/python -m benchmarks.cpu.ab_model {args.base} --rounds {args.rounds}`; "
          f"`benchmarks/cpu/model.py` settings; graphs/s, median of {args.rounds} fresh processes each; "
          f"load average at end {os.getloadavg()[0]:.1f}.\n")
    print("| configuration | base graphs/s | this tree graphs/s | ratio |")
    print("|---|---|---|---|")
    for label, runs in rows:
        if runs["base"] and runs["head"]:
            a, b = statistics.median(runs["base"]), statistics.median(runs["head"])
            print(f"| {label} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
        else:
            print(f"| {label} | failed | failed | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

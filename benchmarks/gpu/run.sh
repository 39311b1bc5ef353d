#!/usr/bin/env bash
# The GPU check of issue 11, one command on one GPU machine:
#
#   benchmarks/gpu/run.sh            # from the repository root (or anywhere)
#
# 1. If ray/deepspeed/mlflow/ogb/pydantic are not importable (a bare image with only torch, PyG
#    and pyarrow), installs the wheel kit `.whl/` (built on a CPU machine by
#    benchmarks/gpu/make_wheels.sh; no network needed; SATP_KIT names another folder) with
#    benchmarks/gpu/install_kit.sh.
# 2. Runs `BENCH=gpu python -m benchmarks.run` (benchmarks/bench_gpu.py: parity tests, the
#    train-step benchmark, the real pipeline on one GPU), which prints a table and appends it to
#    benchmarks/RESULTS.md.
# 3. With $OUT set (the device tool's output folder), copies the section and raw figures there.
#
# Budget: SATP_GPU_BUDGET_S (default 420 s) for the measurements; the whole run stays under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
PY=${PYTHON:-python3}
export OUTDATED_IGNORE=1 RAY_USAGE_STATS_ENABLED=0 DS_ACCELERATOR=cuda
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import ray, deepspeed, mlflow, ogb, pydantic" >/dev/null 2>&1; then
  echo "== installing the wheel kit (${SATP_KIT:-.whl})"
  # shellcheck disable=SC1091
  PYTHON=$PY source benchmarks/gpu/install_kit.sh "${SATP_KIT:-.whl}"
fi
"$PY" - <<'EOF'
import torch, ray, deepspeed, mlflow, torch_geometric
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "none (k-subgraph messages on the torch path)"
print(f"== torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton_version}, PyG {torch_geometric.__version__}, ray {ray.__version__}, "
      f"deepspeed {deepspeed.__version__}, mlflow {mlflow.__version__}; GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
EOF

before=$(wc -l < benchmarks/RESULTS.md)
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; fi  # the check writes its raw figures there as it goes
BENCH=gpu "$PY" -m benchmarks.run
if [ -n "${OUT:-}" ]; then
  tail -n +"$((before + 1))" benchmarks/RESULTS.md > "$OUT/gpu_section.md"
fi
echo "== GPU check done in $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# The GPU check, in parts that each fit one device session (15 minutes of device time,
# the machine's start included; at most 10 minutes per command), one part per command:
#
#   benchmarks/gpu/run.sh [PART]     # from the repository root (or anywhere); PART:
#
#   perf       (the default, and what the check did before it had parts) parity tests, the train-step
#              benchmarks (code2 and ppa shapes), the real pipeline on pycode; SATP_GPU_BUDGET_S=420
#   first      PATTERN's training step at 32 graphs per step, eager vs compiled vs
#              captured (~2 minutes, while part pattern makes its data), then satp train jobs/pattern.yaml to
#              val_acc 0.865 with the mode that trains the most graphs in the time left (benchmarks/gpu/first.py);
#              SATP_GPU_BUDGET_S=480
#   steps      eager vs compiled vs captured training steps (train.step) for PATTERN at 32 and 128 graphs per
#              step and code2 at budgets 16384 and 131072: graphs/s, step ms, kernel ms per step; satp train's
#              start-up breakdown, cold and warm compile caches (benchmarks/gpu/steps.py); SATP_GPU_BUDGET_S=510
#   scale      a synthetic ogbg-ppa of SATP_SCALE_GRAPHS graphs (default 158100, full size) built on the
#              machine, `satp preprocess jobs/ppa.yaml`, one epoch of `satp train jobs/ppa.yaml` on one GPU
#              worker; wall time, peak RSS, GPU memory and disk of each step (benchmarks/gpu/scale.py);
#              SATP_GPU_BUDGET_S=510; data kept in runs/gpu-scale for a rerun on the same warm machine
#   multirank  two Ray Train workers sharing the GPU (gloo), equal batches per rank, gathered
#              evaluation against a 1-rank one, checkpoint, resume (benchmarks/gpu/multirank.py);
#              SATP_GPU_BUDGET_S=330
#   tune       a `satp tune` sweep of 4 one-worker trials sharing the GPU (0.25 each, 3 at once), ASHA
#              stopping one, the best registered (benchmarks/gpu/tune.py); SATP_GPU_BUDGET_S=480
#   pattern    time to accuracy of jobs/pattern.yaml on one GPU: the full PATTERN generated on the machine
#              (`satp data sbm-pattern`), `satp preprocess`, `satp train` with train.target val_acc >= 0.865
#              (SATP_ACC_TARGET); time to target, test acc at the best val epoch, the per-epoch curve
#              (benchmarks/gpu/accuracy_sbm.py); SATP_ACC_FAST=1 (or SATP_ACC_BATCH/_LR/_WARMUP_STEPS/_SET) for
#              a GPU-fast variant; SATP_GPU_BUDGET_S=510; data and runs kept in runs/gpu-pattern: a second
#              call on the same warm machine resumes a run the budget cut
#   cluster    the same for jobs/cluster.yaml (target val_acc >= 0.774); its 10 minutes need two calls
#   code2batch the paper's code2 recipe (32 graphs/step, lr 1e-4) for 3 epochs vs jobs/code2.yaml's
#              default batch and lr, one GPU, to the recipe's validation F1, on `satp data pycode` over the
#              image's own packages (SATP_CODE2BATCH_*); SATP_GPU_BUDGET_S=510
#
# 1. If ray/deepspeed/mlflow/ogb/pydantic are not importable (a bare image with only torch, PyG
#    and pyarrow), installs the wheel kit `.whl/` (built on a CPU machine by
#    benchmarks/gpu/make_wheels.sh; no network needed; SATP_KIT names another folder) with
#    benchmarks/gpu/install_kit.sh.
# 2. Runs `SATP_GPU_PART=PART BENCH=gpu python -m benchmarks.run` (benchmarks/gpu/check.py), which
#    prints the part's table and appends it to benchmarks/RESULTS.md as its own section.
# 3. With $OUT set (the device tool's output folder), copies the section (perf: gpu_section.md,
#    others: gpu_PART_section.md) and the raw figures and logs there (written as the part goes).
#
# Budget: SATP_GPU_BUDGET_S (per part, above) for the measurements; with the kit's ~30 s of
# installation, perf and multirank stay under 8 minutes, first and tune under 9, scale, pattern, cluster and code2batch under 10
# (`timeout -s INT 590`).
# SATP_GPU_DRY_RUN=1 runs a part on the CPU with tiny sizes (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
PART=${1:-perf}
case "$PART" in
  perf | first | steps | scale | multirank | tune | pattern | cluster | code2batch) ;;
  *) echo "usage: benchmarks/gpu/run.sh [perf|first|steps|scale|multirank|tune|pattern|cluster|code2batch] (got: $PART)" >&2; exit 2 ;;
esac
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
echo "== GPU check, part $PART"
SATP_GPU_PART=$PART BENCH=gpu "$PY" -m benchmarks.run
if [ -n "${OUT:-}" ]; then
  if [ "$PART" = perf ]; then section=gpu_section.md; else section=gpu_${PART}_section.md; fi
  tail -n +"$((before + 1))" benchmarks/RESULTS.md > "$OUT/$section"
fi
echo "== GPU check, part $PART, done in $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# Build the offline "wheel kit" that the GPU check brings to a bare GPU machine.
#
#   bash benchmarks/gpu/make_wheels.sh                 # CPython 3.12 -> .whl/        (the GPU image)
#   PYVER=3.11 bash benchmarks/gpu/make_wheels.sh      # CPython 3.11 -> .whl-cp311/  (dry run here)
#   bash benchmarks/gpu/install_kit.sh [.whl]          # on the GPU machine (offline)
#
# The GPU image has Python 3.12, torch 2.11.0+cu130, torch-geometric 2.8.0.post1, pyarrow, numpy,
# scipy, pandas, scikit-learn, einops, tqdm, pyyaml, msgpack, psutil, py-cpuinfo, ninja,
# nvidia-ml-py and their own dependencies (aiohttp, attrs, requests, jinja2, MarkupSafe, fsspec,
# filelock, typing_extensions, setuptools, ...), no network, and at most 64 MiB of files travel
# per run (repository included). It lacks ray, deepspeed, mlflow, ogb and pydantic: the kit is
# them plus every run-time dependency of the pipeline that the image lacks (the lists below),
# each pinned to the version the project's .venv runs. Idempotent; downloads and repacked wheels
# are cached in .whl-cache/ (git-ignored, like .whl/ and .whl-cp311/).
#
# - wheels with compiled code: `pip download --no-deps --only-binary=:all:` for cpXY manylinux
#   x86_64, then repacked (repack_wheel.py) with their members of >= 256 KiB LZMA-compressed
#   (pip unpacks them; ~25-30% smaller than deflate);
# - ray: its 76 MiB wheel also loses the Java jar, RLlib, Serve, Ray LLM, and the dashboard web
#   client's source maps and flame-graph viewer (RAY_DROP): ~27 MiB;
# - pure-Python wheels: the py3-none-any files as published;
# - deepspeed (no wheel on PyPI): `DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation`
#   with the .venv's torch (pure Python; ops are JIT-compiled on first use);
# - mlflow: mlflow-skinny (the whole `mlflow` Python package except the UI's JavaScript and a
#   model catalog; mlflow-tracing's files are a byte-for-byte subset of it) + SQLAlchemy/alembic/
#   Mako and cryptography for the SQLite store and registry, instead of the full `mlflow` wheel
#   and its server/UI/plotting dependencies (flask, gunicorn, graphene, matplotlib, docker, ...);
# - Ray's dashboard dependencies (grpcio, opencensus, prometheus ...): `satp train` starts its
#   local Ray with the dashboard (runtime/ray_cluster.py: Ray Train's placement-group cleaner asks
#   the State API), which Ray refuses to start without them.
# Then it checks that pip accepts every wheel for the target interpreter and that the kit fits
# BUDGET_MIB, and writes MANIFEST.txt beside the wheels.
set -euo pipefail

PYVER=${PYVER:-3.12}
case "$PYVER" in
  3.11 | 3.12 | 3.13) ABI=cp${PYVER/./} ;;
  *) echo "PYVER must be 3.11, 3.12 or 3.13" >&2; exit 2 ;;
esac
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ $PYVER == 3.12 ]]; then DEFAULT_OUT=$ROOT/.whl; else DEFAULT_OUT=$ROOT/.whl-$ABI; fi
OUT=${OUT:-$DEFAULT_OUT}
CACHE=${CACHE:-$ROOT/.whl-cache}
PY=${PY:-$ROOT/.venv/bin/python}          # downloads, builds deepspeed (needs torch), repacks
BUDGET_MIB=${BUDGET_MIB:-56}              # 64 MiB per run, less the repository and headroom
LZMA_MIN=${LZMA_MIN:-262144}              # LZMA for members of binary wheels this big; 0: none

RAY_VERSION=2.60.0
DEEPSPEED_VERSION=0.19.8

# Wheels with compiled code: one per interpreter and platform.
BINARY=(
  "ray==$RAY_VERSION"
  pydantic_core==2.50.5            # pydantic
  rpds-py==2026.9.1                # jsonschema -> referencing (ray)
  protobuf==7.36.2                 # ray, opentelemetry-proto, tensorboardX (abi3)
  cryptography==50.0.2             # mlflow's registry tables import cryptography.fernet (abi3)
  cffi==2.1.1                      # cryptography's _cffi_backend
  grpcio==1.85.3                   # ray dashboard
)
# Pure-Python wheels.
PURE=(
  # ray core, Train, Tune
  click==8.5.1
  jsonschema==4.26.0
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  packaging==26.4
  tensorboardX==2.6.5              # ray[tune]: Tune's TensorBoard logger
  # ray dashboard (ray/dashboard/optional_deps.py)
  aiohttp-cors==0.8.1
  opencensus==0.11.4
  opencensus-context==0.1.3
  google-api-core==2.44.0          # opencensus
  googleapis-common-protos==1.76.0
  proto-plus==1.29.0
  google-auth==2.63.0
  pyasn1==0.6.5
  pyasn1-modules==0.4.2
  prometheus-client==0.26.0
  opentelemetry-exporter-prometheus==0.66b2
  # job configs (pydantic) and DeepSpeed's config
  pydantic==2.14.4
  annotated-types==0.8.0
  typing-inspection==0.4.5
  hjson==3.1.0
  # ogb (Evaluator, dataset loaders)
  ogb==1.3.6
  outdated==0.2.2
  littleutils==0.2.4
  six==1.17.0                      # ogb.utils.url (python-dateutil >= 3 no longer brings six)
  # mlflow client, SQLite store, registry, mlflow.pytorch
  mlflow-skinny==3.17.2
  SQLAlchemy==2.1.9                # pure-Python wheel (2.0 MiB, no C speedups) not the 4.5 MiB one
  alembic==1.20.1
  Mako==1.4.3
  cachetools==7.3.3
  cloudpickle==3.1.3
  importlib-metadata==9.1.0
  zipp==4.1.2
  opentelemetry-api==1.45.2
  opentelemetry-sdk==1.45.2
  opentelemetry-proto==1.45.2
  opentelemetry-semantic-conventions==0.66b2
  python-dotenv==1.2.4
  sqlparse==0.6.1
  fastapi==0.165.0                 # `import mlflow` -> mlflow.genai -> mlflow.gateway imports fastapi
  starlette==1.10.0
  anyio==4.16.0
  annotated-doc==0.0.7
  databricks-sdk==0.162.0          # `import mlflow` asks find_spec("databricks.agents"): needs the namespace
  # the GPU check runs the CUDA tests (tests/test_model_gpu.py)
  pytest==9.2.0
  pluggy==1.7.0
  iniconfig==2.3.1
  Pygments==2.21.0                 # pytest 9 imports it
  pytest-timeout==2.4.0            # pyproject's pytest settings name its marker
)
# Parts of Ray's wheel that neither a local cluster (with its dashboard), Ray Train (V2,
# TorchTrainer) nor Ray Tune use.
RAY_DROP=(
  ray/jars/                                     # ray_dist.jar, 30.7 MiB: Java workers
  ray/rllib/                                    # RLlib
  ray/serve/                                    # Ray Serve
  ray/llm/                                      # Ray LLM
  'ray/dashboard/client/build/*.map'            # the web UI's source maps (1.5 MiB)
  ray/dashboard/client/build/speedscope-1.5.3/  # the UI's flame-graph viewer
)

PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
TARGET=(--python-version "$PYVER" --implementation cp --abi "$ABI" "${PLATFORMS[@]}")

log() { printf '[make_wheels %s] %s\n' "$ABI" "$*" >&2; }
quiet() { grep -v "^WARNING: Location 'file:" || true; }   # this machine's pip.conf names absent local indexes
mkdir -p "$CACHE/$ABI" "$CACHE/any" "$OUT"

# 1. downloads (pip skips the files it has)
log "downloading ${#BINARY[@]} binary wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: "${TARGET[@]}" -d "$CACHE/$ABI" "${BINARY[@]}" 2> >(quiet >&2)
log "downloading ${#PURE[@]} pure-Python wheels"
# (py3-none-any only: SQLAlchemy, for one, also has binary wheels that would otherwise win)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation py \
  --abi none --platform any -d "$CACHE/any" "${PURE[@]}" 2> >(quiet >&2)

# 2. deepspeed: built once (pure Python, the same for every interpreter)
ds=$(ls "$CACHE"/any/deepspeed-"$DEEPSPEED_VERSION"-*.whl 2>/dev/null | head -1 || true)
if [[ -z $ds ]]; then
  log "building deepspeed $DEEPSPEED_VERSION (DS_BUILD_OPS=0)"
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$CACHE/any" \
    "deepspeed==$DEEPSPEED_VERSION" 2> >(quiet >&2)
  ds=$(ls "$CACHE"/any/deepspeed-"$DEEPSPEED_VERSION"-*.whl | head -1)
fi
[[ $(basename "$ds") == *-py3-none-any.whl ]] || { echo "deepspeed wheel is not pure Python: $ds" >&2; exit 1; }

# 3. binary wheels repacked (cached per settings)
pick() {  # pick DIR SPEC [SUFFIX]: the cached wheel of name==version SPEC (file name ending SUFFIX)
  local dir=$1 spec=$2 suffix=${3:-.whl} name ver norm f base fname fver
  name=${spec%%==*}; ver=${spec#*==}
  norm=$(echo "$name" | tr 'A-Z-.' 'a-z__')
  for f in "$dir"/*"$suffix"; do
    base=$(basename "$f"); fname=${base%%-*}; fver=${base#*-}; fver=${fver%%-*}
    if [[ $(echo "$fname" | tr 'A-Z-.' 'a-z__') == "$norm" && $fver == "$ver" ]]; then echo "$f"; return; fi
  done
  echo "no cached wheel for $spec in $dir" >&2; return 1
}
settings="lzma>=$LZMA_MIN | ${RAY_DROP[*]} | $(sha256sum "$ROOT/benchmarks/gpu/repack_wheel.py" | cut -c1-16)"
packed_dir=$CACHE/$ABI/packed-$(echo "$settings" | sha256sum | cut -c1-12)
for d in "$CACHE/$ABI"/packed-* "$CACHE/$ABI"/slim-*; do  # repacks made with other settings
  [[ -d $d && $d != "$packed_dir" ]] && rm -rf "$d"
done
mkdir -p "$packed_dir"
files=("$ds")
for spec in "${BINARY[@]}"; do
  src=$(pick "$CACHE/$ABI" "$spec")
  dst=$packed_dir/$(basename "$src")
  if [[ ! -f $dst ]]; then
    drop=()
    if [[ $spec == ray==* ]]; then
      drop=("${RAY_DROP[@]}")
      log "repacking $(basename "$src") (~3 min)"
    fi
    "$PY" "$ROOT/benchmarks/gpu/repack_wheel.py" "$src" "$dst.tmp" "$LZMA_MIN" "${drop[@]}" | sed "s/^/[make_wheels $ABI] /" >&2
    mv "$dst.tmp" "$dst"
  fi
  files+=("$dst")
done
for spec in "${PURE[@]}"; do files+=("$(pick "$CACHE/any" "$spec" -none-any.whl)"); done

# 4. the kit: exactly these wheels, nothing left over from earlier runs
rm -f "$OUT"/*.whl "$OUT"/MANIFEST.txt
cp "${files[@]}" "$OUT"/

# 5. checks: pip takes each wheel for the target interpreter; the kit fits
check_dir=$(mktemp -d)
"$PY" -m pip install -q --dry-run --no-index --no-deps --only-binary=:all: "${TARGET[@]}" \
  --target "$check_dir" "$OUT"/*.whl 2> >(quiet >&2)
rmdir "$check_dir"
total=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
{
  echo "# wheel kit for CPython $PYVER manylinux x86_64 (benchmarks/gpu/make_wheels.sh)"
  echo "# install offline: bash benchmarks/gpu/install_kit.sh $(basename "$OUT")"
  for f in "$OUT"/*.whl; do
    awk -v s="$(stat -c %s "$f")" -v n="$(basename "$f")" 'BEGIN { printf "%8.2f MiB  %s\n", s / 1048576, n }'
  done
  awk -v s="$total" -v n="${#files[@]}" 'BEGIN { printf "%8.2f MiB  total, %d wheels\n", s / 1048576, n }'
} > "$OUT/MANIFEST.txt"
cat "$OUT/MANIFEST.txt"
if (( total > BUDGET_MIB * 1048576 )); then
  echo "the kit is $((total / 1048576)) MiB, over the ${BUDGET_MIB} MiB budget" >&2
  exit 1
fi

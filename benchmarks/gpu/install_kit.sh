#!/usr/bin/env bash
# Install the offline wheel kit (benchmarks/gpu/make_wheels.sh) on a bare GPU machine.
#
#   bash benchmarks/gpu/install_kit.sh [KIT]      # KIT: .whl (default, cp312) or .whl-cp311
#   source /tmp/site/env.sh                       # PATH (ray CLI), OUTDATED_IGNORE, ...
# or, in one step, from a bash script:
#   source benchmarks/gpu/install_kit.sh [KIT]    # installs (in a subshell), then sources env.sh
# Sourced, it leaves the caller's variables and shell options alone and returns non-zero on failure.
#
# Never touches the network: pip runs with --no-index --no-deps, and only on KIT/*.whl.
# The kit goes to $SITE (/tmp/site) with --target, and $SITE joins the import path AFTER the
# interpreter's own site-packages, through a `satp-kit.pth` file there: every process of that
# interpreter sees it, Ray's raylet-spawned workers and DeepSpeed's subprocesses included,
# whatever their environment, and the image's packages (torch, numpy, ...) are never shadowed.
# Only where that site-packages is not writable does it fall back to PYTHONPATH=$SITE (set in
# env.sh, inherited by Ray's workers), which puts the kit BEFORE site-packages.
#
# Env: PYTHON (python3), SITE (/tmp/site), IMPORT_PATH (pth, or pythonpath to skip the .pth file).
_satp_install_kit() (  # a subshell: nothing leaks into a shell that sources this file
  set -euo pipefail

  ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  KIT=${1:-.whl}
  [[ $KIT == /* ]] || KIT=$ROOT/$KIT
  PYTHON=${PYTHON:-python3}
  SITE=${SITE:-/tmp/site}
  IMPORT_PATH=${IMPORT_PATH:-pth}

  start=$(date +%s.%N)
  compgen -G "$KIT/*.whl" > /dev/null || { echo "install_kit: no wheels in $KIT (run benchmarks/gpu/make_wheels.sh)" >&2; exit 1; }
  # The binary wheels (ray, grpcio, cryptography, ...) hold LZMA-compressed members.
  "$PYTHON" -c 'import lzma' || { echo "install_kit: this Python lacks lzma (the kit's binary wheels hold LZMA members; LZMA_MIN=0 make_wheels.sh builds one without)" >&2; exit 1; }

  rm -rf "$SITE"
  mkdir -p "$SITE"
  PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
    --disable-pip-version-check --no-warn-script-location --no-warn-conflicts \
    --target "$SITE" "$KIT"/*.whl

  # The last existing, writable site directory: .pth entries are appended to sys.path when their
  # directory is processed, so the last one puts the kit after every site-packages of the image.
  purelib=$("$PYTHON" -c 'if True:
    import os, site, sysconfig
    dirs = [d for d in site.getsitepackages() if os.path.isdir(d) and os.access(d, os.W_OK)]
    print(dirs[-1] if dirs else sysconfig.get_path("purelib"))')
  {
    echo "# written by benchmarks/gpu/install_kit.sh: source it before running the project"
    echo "export PATH=\"$SITE/bin:\$PATH\""
    echo "export OUTDATED_IGNORE=1              # ogb: no PyPI version check (no network)"
    echo "export RAY_USAGE_STATS_ENABLED=0"
  } > "$SITE/env.sh"
  rm -f "$purelib/satp-kit.pth" 2>/dev/null || true
  if [[ $IMPORT_PATH == pth && -w $purelib ]] && echo "$SITE" > "$purelib/satp-kit.pth" 2>/dev/null; then
    how="$purelib/satp-kit.pth (after site-packages)"
  else
    echo "export PYTHONPATH=\"$SITE\${PYTHONPATH:+:\$PYTHONPATH}\"" >> "$SITE/env.sh"
    how="PYTHONPATH in $SITE/env.sh (IMPORT_PATH=$IMPORT_PATH, $purelib writable: $([[ -w $purelib ]] && echo yes || echo no); the kit comes BEFORE site-packages)"
  fi
  installed=$(date +%s.%N)

  # One-line import check, from a neutral directory, with env.sh's settings.
  check_log=$(mktemp)
  check_py='
import importlib, importlib.metadata as md, sys
out = []
for name in ("ray", "deepspeed", "mlflow", "ogb", "pydantic"):
    mod = importlib.import_module(name)
    where = "kit" if mod.__file__.startswith(sys.argv[1]) else "image"
    version = getattr(mod, "__version__", "?")
    out.append(f"{name} {version} ({where})")
print("KIT| " + ", ".join(out))
# Where the image already has a package, its version wins (the kit comes after it on sys.path):
# list the kit requirements that such a version does not meet (absent optional ones are not listed).
from packaging.requirements import Requirement
bad = set()
for dist in md.distributions(path=[sys.argv[1]]):
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            who = dist.metadata["Name"]
            bad.add(f"{who} needs {req.name}{req.specifier}, has {have}")
print("KIT| version conflicts: " + ("; ".join(sorted(bad)) or "none"))
'
  # shellcheck disable=SC1091
  if ! versions=$(cd / && source "$SITE/env.sh" && "$PYTHON" -c "$check_py" "$SITE" 2> "$check_log"); then
    echo "install_kit: import check failed:" >&2
    tail -30 "$check_log" >&2
    exit 1
  fi
  rm -f "$check_log"
  done_at=$(date +%s.%N)
  awk -v a="$start" -v b="$installed" -v c="$done_at" -v n="$(ls "$KIT"/*.whl | wc -l)" -v k="$KIT" \
    'BEGIN { printf "install_kit: %d wheels from %s installed in %.1f s, imports checked in %.1f s\n", n, k, b - a, c - b }'
  echo "install_kit: import path: $how"
  echo "$versions" | sed -n 's/^KIT| /install_kit: /p'
)

# (Called as a plain command, never in an && / || list: bash would ignore its `set -e` there.)
if [[ ${BASH_SOURCE[0]} != "$0" ]]; then  # sourced
  _satp_install_kit "$@"
  _satp_kit_rc=$?
  # shellcheck disable=SC1091
  [[ $_satp_kit_rc != 0 ]] || source "${SITE:-/tmp/site}/env.sh"
  unset -f _satp_install_kit
  return $_satp_kit_rc
else
  _satp_install_kit "$@"
fi

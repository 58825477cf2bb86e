#!/usr/bin/env bash
# GPU check of the fused pack/unpack kernels (fabric/kv/csrc/), for a lent GPU machine.
#
# Fresh machine, so this script brings what it needs:
#   1. a python with CUDA torch: $PYTHON, python3 or python if theirs is a CUDA
#      build, else a venv at $FABRIC_GPU_VENV (default ~/.cache/fabric/gpu-venv,
#      system site packages visible) with torch from PyPI (a CUDA build);
#   2. this repo (pip install -e . unless fabric imports already; if pip cannot reach an index the repo is
#      used from PYTHONPATH), ninja for the JIT build, nvcc from the toolkit;
#   3. nixl for the push step: pip's if it imports, else wheels from
#      $FABRIC_WHEELS (default .whl: nixl==1.5.1 and nixl-cu13==1.5.1, fetched
#      where an index is reachable with `pip download --no-deps --only-binary=:all:
#      --python-version 3.12 ... -d .whl`), installed with --no-index into
#      $FABRIC_GPU_SITE; without it the push is skipped (and said so);
#   4. python benchmarks/gpu_check.py "$@": builds the extension, checks
#      bit-exact round trips (pack/unpack kernels, fold64), measures GB/s,
#      pushes a 16k-token Llama-3-8B cache through a VRAM pool next to a raw
#      NIXL VRAM WRITE, writes benchmarks/results/gpu-check-<date>.json
#      (copied to $OUT when set).
# Always ends with one JSON line {"bit_exact": .., "pack_vs_d2d": .., "unpack_vs_d2d": ..,
# "push_vs_raw_vram": .., "fold64_vs_d2d": ..}.
# Usage: benchmarks/gpu_check.sh [--reps N] [--skip-bench] [--skip-push] ...
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
started=$(date +%s)

fail() {
  echo "gpu_check: $*" >&2
  echo '{"bit_exact": false, "pack_vs_d2d": null, "unpack_vs_d2d": null, "push_vs_raw_vram": null}'
  exit 1
}

has_cuda_torch() {
  "$1" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' >/dev/null 2>&1
}

# Prints the python to use; progress goes to stderr.
pick_python() {
  local py venv
  for py in "${PYTHON:-}" python3 python; do
    if [ -n "$py" ] && command -v "$py" >/dev/null && has_cuda_torch "$py"; then
      command -v "$py"
      return 0
    fi
  done
  venv=${FABRIC_GPU_VENV:-$HOME/.cache/fabric/gpu-venv}
  if [ ! -x "$venv/bin/python" ]; then
    echo "gpu_check: creating $venv" >&2
    python3 -m venv --system-site-packages "$venv" >&2 || return 1
  fi
  if ! has_cuda_torch "$venv/bin/python"; then
    echo "gpu_check: installing CUDA torch from PyPI into $venv" >&2
    "$venv/bin/python" -m pip install -q torch >&2 || return 1
  fi
  echo "$venv/bin/python"
}

find_nvcc() {
  local candidate
  for candidate in "$(command -v nvcc 2>/dev/null)" "${CUDA_HOME:-/none}/bin/nvcc" \
    /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader >&2
PY=$(pick_python) || fail "no python with CUDA torch (pip install torch failed: no index reachable?)"
export PATH="$(dirname "$PY"):$PATH"  # the venv's ninja and scripts
"$PY" -c 'import torch; print("gpu_check: torch", torch.__version__, "cuda", torch.version.cuda,
  "device", torch.cuda.is_available())' >&2 || fail "torch does not import"
"$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' || fail "torch sees no CUDA device"

NVCC=$(find_nvcc) || fail "nvcc not found: the JIT build needs the CUDA toolkit (set CUDA_HOME)"
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}
# NOTE: /usr/local/bin/nvcc can be a wrapper script; the toolkit is what CUDA_HOME must name.
[ -f "$CUDA_HOME/include/cuda_runtime.h" ] || for root in /usr/local/cuda /usr/local/cuda-*; do
  if [ -f "$root/include/cuda_runtime.h" ]; then CUDA_HOME=$root; break; fi
done
echo "gpu_check: CUDA_HOME=$CUDA_HOME ($("$NVCC" --version | tail -1))" >&2

if ! "$PY" -c 'import fabric.kv.cuda' >/dev/null 2>&1 && ! "$PY" -m pip install -q -e . >&2; then
  echo "gpu_check: pip install -e . failed; using the repo from PYTHONPATH" >&2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c 'import fabric.kv.cuda' || fail "fabric does not import (missing dependencies?)"
wheels=${FABRIC_WHEELS:-.whl}
if ! "$PY" -c 'import nixl' >/dev/null 2>&1 && compgen -G "$wheels/*.whl" >/dev/null; then
  site=${FABRIC_GPU_SITE:-/tmp/fabric-gpu-site}
  echo "gpu_check: installing $(ls "$wheels"/*.whl | wc -l) wheel(s) from $wheels into $site" >&2
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl >&2
  then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
"$PY" -c 'import nixl' >/dev/null 2>&1 \
  || echo "gpu_check: nixl does not import: the VRAM push step will be skipped" >&2
# NOTE: torch's JIT runs the `ninja` binary, so it must be on PATH (pip may put
# it in the user base's bin).
export PATH="$PATH:$("$PY" -m site --user-base 2>/dev/null || echo /nonexistent)/bin"
if ! command -v ninja >/dev/null; then
  "$PY" -m pip install -q ninja >&2 || fail "ninja missing and not installable (torch JIT needs it)"
  command -v ninja >/dev/null || fail "ninja installed but not on PATH"
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

log=$(mktemp)
"$PY" benchmarks/gpu_check.py "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  cp benchmarks/results/gpu-check-*.json "$OUT"/ 2>/dev/null || true
  cp "$log" "$OUT/gpu-check.log" || true
fi
echo "gpu_check: finished in $(($(date +%s) - started)) s (exit $status)" >&2
last=$(tail -n 1 "$log")
rm -f "$log"
# NOTE: the python's last line is the JSON summary unless it crashed first.
case "$last" in
  '{"bit_exact"'*) exit "$status" ;;
  *) fail "benchmarks/gpu_check.py failed (exit $status) before its summary" ;;
esac

#!/usr/bin/env bash
# The GPU check rehearsed on a CPU machine (CI calls it from .ci/run; make gpu-dry-run), so that
# no GPU time is spent finding a missing package:
#  1. the carried wheelhouse (scripts/gpu_wheelhouse.sh): downloaded, within its size budget,
#     resolved for Python 3.12 from the wheelhouse alone without installing it;
#  2. a Python 3.11 stand-in of the GPU machine's image: a venv of its package set
#     (scripts/gpu_image_packages.txt, CPU builds; torch 2.13.0 CPU for the image's 2.11.0
#     cu130) and the Python 3.11 twin of the wheelhouse (the same scripts/gpu_requirements.txt);
#  3. scripts/gpu_check.sh --dry-run over them, as on the GPU machine: its venv over the image
#     filled --no-index --no-deps from the wheelhouse, `pip check`, the import of every module
#     tests/gpu and the GPU benchmarks reach, tests/gpu with TRITON_INTERPRET=0 where every test
#     must skip with the no-CUDA reason, and every GPU benchmark refusing to run (exit 2).
# Cached under $LORASTREAM_GPU_DRY_RUN_CACHE (default ~/.cache/lorastream-ci/gpu-dry-run), keyed
# by the package lists: cold 8-10 minutes here (the image stand-in: triton's and transformers'
# downloads), warm about 80 s.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${LORASTREAM_GPU_DRY_RUN_CACHE:-$HOME/.cache/lorastream-ci/gpu-dry-run}
python=${PYTHON:-python3.11}
requirements=scripts/gpu_requirements.txt
began=$(date +%s)
say() { echo "gpu dry run [$(( $(date +%s) - began )) s]: $*"; }
mkdir -p "$cache"

say "the wheelhouse for Python 3.12"
PYTHON=$python scripts/gpu_wheelhouse.sh "$cache/wheelhouse-cp312"

image=$cache/image-$(cksum < scripts/gpu_image_packages.txt | cut -d' ' -f1)
if [ ! -e "$image/.complete" ]; then
  say "building the image stand-in $image (cold: minutes)"
  rm -rf "$image" "$cache"/image-*
  "$python" -m venv "$image"
  "$image/bin/python" -m pip install --quiet --upgrade pip
  "$image/bin/python" -m pip install --quiet -r scripts/gpu_image_packages.txt
  touch "$image/.complete"
fi

wheelhouse=$cache/wheelhouse-cp311-$(cksum < "$requirements" | cut -d' ' -f1)
if [ ! -e "$wheelhouse/.complete" ]; then
  say "the wheelhouse's Python 3.11 twin"
  rm -rf "$wheelhouse" "$cache"/wheelhouse-cp311-*
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$wheelhouse" \
    -r "$requirements"
  touch "$wheelhouse/.complete"
fi

say "scripts/gpu_check.sh --dry-run"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
PYTHON=$image/bin/python LORASTREAM_GPU_WHEELHOUSE=$wheelhouse LORASTREAM_GPU_VENV=$work/venv \
  LORASTREAM_GPU_CHECK_BUDGET_S=600 bash scripts/gpu_check.sh --dry-run "$work/out" > /dev/null \
  || status=$?
cat "$work/out/summary.txt" 2>/dev/null || true
if [ "$status" -ne 0 ]; then
  echo "--- gpu-check.log"
  cat "$work/out/gpu-check.log"
  say "FAILED (scripts/gpu_check.sh --dry-run exited $status)"
  exit 1
fi
say "passed"

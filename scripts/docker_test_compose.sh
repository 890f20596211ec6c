#!/usr/bin/env bash
# `make test-compose`: tests/compose_live against a real Docker engine — the images built from
# docker/, the CPU-profile stack up, checked through its published ports, then `down -v`.
# Needs the engine and the compose v2 plugin (scripts/docker_host_prepare.sh sets up both, the
# local base image and docker/local/). Extra arguments go to pytest.
# docker/local/ is per clone (git ignores it): it is filled here from this machine, as the
# preparation's step 5 does (scripts/docker_local.sh), and checked before any build: what is
# still missing stops the run at once, naming the step.
# Environment: PY (the venv's python, default .venv/bin/python); LORASTREAM_PYTHON_IMAGE,
# LORASTREAM_TORCH_INDEX_URL and LORASTREAM_BUILD_EXTRAS as for docker-compose.yml (defaults below
# when the local base image and a torch wheel in docker/local/wheels are there); those of
# scripts/docker_local.sh; LORASTREAM_COMPOSE_KEEP=1 leaves the stack up.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/docker_local.sh
PY=${PY:-.venv/bin/python}
LOCAL_BASE=lorastream/python:3.11-bookworm
EXTRAS=${LORASTREAM_BUILD_EXTRAS:-docker/local}

if [ -z "${LORASTREAM_PYTHON_IMAGE:-}" ] && docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
    export LORASTREAM_PYTHON_IMAGE=$LOCAL_BASE
fi
# The local base image means a machine without registry access: no torch index either, unless set.
need_torch=0
if [ "${LORASTREAM_PYTHON_IMAGE:-}" = "$LOCAL_BASE" ] && [ -z "${LORASTREAM_TORCH_INDEX_URL+set}" ]; then
    need_torch=1
fi
fill_docker_local "$EXTRAS"
check_docker_local "$EXTRAS" "$need_torch" || exit 1
if compgen -G "$EXTRAS/wheels/torch-*.whl" >/dev/null; then
    export LORASTREAM_TORCH_INDEX_URL=${LORASTREAM_TORCH_INDEX_URL-}  # the wheelhouse has torch
fi
echo "base image ${LORASTREAM_PYTHON_IMAGE:-python:3.11-slim}," \
     "torch index '${LORASTREAM_TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}'"
export LORASTREAM_TEST_COMPOSE=1  # tests/compose_live skip without it
exec "$PY" -m pytest -q -m compose -o log_cli=true --log-cli-level=WARNING --durations=0 \
    tests/compose_live "$@"

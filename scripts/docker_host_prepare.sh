#!/usr/bin/env bash
# Prepares a Debian bookworm machine without container-registry access to build and run the
# compose stack (docs/deploy.md, "Without registry access"). Idempotent: each step checks first.
#
#   sudo scripts/docker_host_prepare.sh      # engine, compose plugin, dockerd, base image, extras
#   make test-compose                        # or: docker compose --profile cpu up -d --build
#
# Steps (times on a 2-core VM, November 2026; skipped steps take under a second):
#   1. apt: docker.io (Debian's engine 20.10) and debootstrap              ~30 s
#   2. the compose v2 CLI plugin from Debian trixie's docker-compose       ~15 s
#   3. dockerd, started by hand when no daemon answers                     ~5 s
#   4. the base image $LORASTREAM_PYTHON_IMAGE (default lorastream/python:3.11-bookworm), a
#      python:3.11-slim stand-in made by debootstrap and `docker import`   ~2-3 min
#   5. docker/local/: the host's CA bundle and the torch CPU wheel from pip's local
#      find-links, which docker/Dockerfile installs from                   ~1 s
# Environment: LORASTREAM_PYTHON_IMAGE (the base image's name), DEBIAN_MIRROR (debootstrap's
# mirror; default the first bookworm URI apt uses), DOCKERD_LOG (default /var/log/dockerd.log).
set -euo pipefail

BASE_IMAGE=${LORASTREAM_PYTHON_IMAGE:-lorastream/python:3.11-bookworm}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/dockerd.log}
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
REPO_ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOCAL_DIR=$REPO_ROOT/docker/local

step() { printf '== %s (%(%H:%M:%S)T)\n' "$*" -1; }

if [ "$(id -u)" != 0 ]; then
    echo "run as root (apt-get, dockerd, debootstrap)" >&2
    exit 1
fi

# The mirror apt already uses for bookworm (deb822 or one-line sources), else deb.debian.org.
debian_mirror() {
    local uri
    uri=$(grep -hoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list \
        /etc/apt/sources.list.d/* 2>/dev/null | head -n1 | awk '{print $2}') || true
    echo "${uri:-http://deb.debian.org/debian}"
}

step "1. docker.io and debootstrap"
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
fi

step "2. compose v2 plugin"
if ! docker compose version >/dev/null 2>&1; then
    work=$(mktemp -d)
    mirror=${DEBIAN_MIRROR:-$(debian_mirror)}
    chmod 0755 "$work"
    mkdir -p "$work/lists/partial" "$work/archives/partial"
    echo "deb $mirror trixie main" >"$work/sources.list"
    apt_trixie=(-o Dir::Etc::sourcelist="$work/sources.list" -o Dir::Etc::sourceparts=-
        -o Dir::State::Lists="$work/lists" -o Dir::Cache::Archives="$work/archives"
        -o APT::Get::List-Cleanup=0)
    apt-get "${apt_trixie[@]}" update -qq
    (cd "$work" && apt-get "${apt_trixie[@]}" download docker-compose >/dev/null)
    dpkg -x "$work"/docker-compose_*.deb "$work/root"
    plugin=$(find "$work/root" -path '*cli-plugins/docker-compose' -type f | head -n1)
    install -D -m 0755 "$plugin" "$PLUGIN_DIR/docker-compose"
    rm -rf "$work"
fi
docker compose version

step "3. dockerd"
if ! docker info >/dev/null 2>&1; then
    nohup /usr/sbin/dockerd >"$DOCKERD_LOG" 2>&1 &
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    docker info >/dev/null || { echo "dockerd did not start: $DOCKERD_LOG" >&2; exit 1; }
fi
docker info --format 'engine {{.ServerVersion}}, storage {{.Driver}}, cgroup v{{.CgroupVersion}}'

step "4. base image $BASE_IMAGE"
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    root=$(mktemp -d)
    mirror=${DEBIAN_MIRROR:-$(debian_mirror)}
    # As in python:3.11-slim: `python` on PATH (python-is-python3) and the C headers (libpython3-dev:
    # torch builds the worker's C++ kernels against them); passwd: groupadd/useradd.
    debootstrap --variant=minbase \
        --include=python3,python3-venv,python3-pip,python-is-python3,libpython3-dev,ca-certificates,passwd \
        bookworm "$root" "$mirror" >/dev/null
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$BASE_IMAGE" >/dev/null
    rm -rf "$root"
fi
docker image inspect "$BASE_IMAGE" --format "$BASE_IMAGE: {{.Size}} bytes"

step "5. docker/local: CA bundle and local wheels"
# The host's CA bundle and every torch wheel in pip's find-links folders (the CPU build lies
# there on these machines); `make test-compose` does the same in each clone.
. "$REPO_ROOT/scripts/docker_local.sh"
fill_docker_local "$LOCAL_DIR"
ls -l "$LOCAL_DIR" "$LOCAL_DIR/wheels"
step "done: LORASTREAM_PYTHON_IMAGE=$BASE_IMAGE docker compose --profile cpu up -d --build"

# docker/local (the image build's extras, docker/local/README.md) filled from this machine and
# checked: sourced by scripts/docker_host_prepare.sh (its step 5) and scripts/docker_test_compose.sh.
# git ignores docker/local, so each clone has its own: a second clone of a prepared machine must
# fill its own, or its build fails deep in pip with CERTIFICATE_VERIFY_FAILED behind a
# TLS-inspecting proxy, or looking for torch on an index it cannot reach.
#
# Environment: LORASTREAM_HOST_CA_BUNDLE (the machine's CA bundle, default
# /etc/ssl/certs/ca-certificates.crt); LORASTREAM_WHEEL_DIRS (folders holding torch wheels,
# space-separated; default pip's find-links folders, where the CPU build lies on these machines).

PREPARE_STEP="sudo scripts/docker_host_prepare.sh (step 5, docker/local)"

# The folders whose torch wheels docker/local takes.
wheel_dirs() {
    if [ -n "${LORASTREAM_WHEEL_DIRS+set}" ]; then
        echo "$LORASTREAM_WHEEL_DIRS"
    else
        pip config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p" | sort -u
    fi
}

# fill_docker_local DIR: the machine's CA bundle and torch wheels into DIR (hard links where the
# filesystem allows, so a second clone costs no copy of a 0.9 GB wheel). Idempotent.
fill_docker_local() {
    local dir=$1 ca=${LORASTREAM_HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt} src wheel
    mkdir -p "$dir/wheels"
    if [ -s "$ca" ] && ! cmp -s "$ca" "$dir/ca-certificates.crt"; then
        cp "$ca" "$dir/ca-certificates.crt"
    fi
    for src in $(wheel_dirs); do
        for wheel in "$src"/torch-*.whl; do
            [ -e "$wheel" ] || continue
            [ -e "$dir/wheels/${wheel##*/}" ] && continue
            ln "$wheel" "$dir/wheels/" 2>/dev/null || cp "$wheel" "$dir/wheels/"
        done
    done
}

# check_docker_local DIR NEED_TORCH_WHEEL: 0 when DIR holds what the build needs (a CA bundle;
# a torch wheel too when NEED_TORCH_WHEEL is 1, i.e. no torch index will be reachable), else 1
# with one line per missing file naming the step that provides it.
check_docker_local() {
    local dir=$1 need_torch=$2 ok=0
    if [ ! -s "$dir/ca-certificates.crt" ]; then
        echo "$dir/ca-certificates.crt is missing and this machine has no" \
             "${LORASTREAM_HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt} to copy: the image" \
             "build would fail in pip behind a TLS-inspecting proxy. Run $PREPARE_STEP, or copy" \
             "the CA bundle your proxy needs there." >&2
        ok=1
    fi
    if [ "$need_torch" = 1 ] && ! compgen -G "$dir/wheels/torch-*.whl" >/dev/null; then
        echo "$dir/wheels has no torch wheel and none was found in pip's find-links folders" \
             "(LORASTREAM_WHEEL_DIRS): without registry access the build cannot fetch torch." \
             "Run $PREPARE_STEP, put torch's CPU wheel there, or set" \
             "LORASTREAM_TORCH_INDEX_URL to an index the build can reach." >&2
        ok=1
    fi
    return $ok
}

#!/usr/bin/env bash
# The wheelhouse the GPU machine installs from (it reaches no package registry): the Python 3.12
# manylinux x86-64 wheels of scripts/gpu_requirements.txt, downloaded here into DEST (default
# .gpu-wheelhouse/, ignored by git), then resolved for Python 3.12 without installing anything
# (pip install --dry-run --no-index: every pin has its wheel). Fails when the wheelhouse passes
# 40 MiB, or the working tree (tracked and untracked-not-ignored files) plus the wheelhouse pass
# 60 MiB (the device tool carries 64 MiB in all).
#   scripts/gpu_wheelhouse.sh [DEST]        (make gpu-wheelhouse)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.gpu-wheelhouse}
python=${PYTHON:-python3}
requirements=scripts/gpu_requirements.txt
wheelhouse_limit=$((40 << 20))
carried_limit=$((60 << 20))

# pip matches each manylinux tag exactly: name every glibc level up to the image's (Ubuntu 24.04,
# glibc 2.39) that a pinned wheel is built for (llguidance's is 2.31).
target=(--python-version 3.12 --implementation cp --only-binary=:all:)
for tag in manylinux1 manylinux2014 manylinux_2_5 manylinux_2_12 manylinux_2_17 manylinux_2_24 \
           manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  target+=(--platform "${tag}_x86_64")
done

stamp="$dest/.complete-$(cksum < "$requirements" | cut -d' ' -f1)"
if [ ! -e "$stamp" ]; then
  rm -rf "$dest"
  mkdir -p "$dest"
  "$python" -m pip download --quiet --no-deps "${target[@]}" --dest "$dest" -r "$requirements"
  touch "$stamp"
fi

# Python 3.12 resolution from the wheelhouse alone, nothing installed (--no-deps: the image holds
# the rest; the CPU dry run checks the whole set with `pip check`).
resolve=$(mktemp -d)
trap 'rm -rf "$resolve"' EXIT
"$python" -m pip install --dry-run --quiet --no-index --no-deps --find-links "$dest" \
  "${target[@]}" --target "$resolve/site" --report "$resolve/report.json" -r "$requirements"
"$python" - "$resolve/report.json" "$requirements" <<'PY'
import json, re, sys
report = json.load(open(sys.argv[1]))
got = {re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]["version"]
       for i in report["install"]}
wanted = {}
for line in open(sys.argv[2]):
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        wanted[re.sub(r"[-_.]+", "-", name).lower()] = version
if got != wanted:
    sys.exit(f"gpu wheelhouse: Python 3.12 resolution differs from the pins: {got} != {wanted}")
print(f"gpu wheelhouse: {len(got)} pins resolve for Python 3.12 (cp312, manylinux x86-64)")
PY

wheelhouse_bytes=$(cat "$dest"/*.whl | wc -c)
# What the device tool carries besides: tracked files and untracked ones git does not ignore.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard \
             | xargs -0 cat 2>/dev/null | wc -c)
carried=$((wheelhouse_bytes + tree_bytes))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
echo "gpu wheelhouse: $dest, $(ls "$dest"/*.whl | wc -l) wheels, $(mib "$wheelhouse_bytes") MiB" \
     "(limit 40); repository + wheelhouse $(mib "$carried") MiB (limit 60)"
if [ "$wheelhouse_bytes" -gt "$wheelhouse_limit" ] || [ "$carried" -gt "$carried_limit" ]; then
  echo "gpu wheelhouse: over its size budget" >&2
  exit 1
fi

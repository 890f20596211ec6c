#!/usr/bin/env bash
# The GPU path in one call, on a CUDA machine that reaches no package registry (the device tool's
# H200: Python 3.12, torch 2.11 cu130, triton 3.6, transformers 5.17; README "GPU tests").
# Budget: 7 minutes in all (each step has its own limit and none starts past the total); carried:
# the repository (~15 MiB) and .gpu-wheelhouse/ (~31 MiB, `make gpu-wheelhouse`), under 60 MiB.
#
#   1. a venv over the image's python with its packages (torch, triton, transformers, ...), and
#      from the wheelhouse, --no-index --no-deps, only what the image lacks or has too old
#      (scripts/gpu_requirements.txt; pip skips a pin the image already satisfies);
#   2. the environment (versions, the GPU, `pip check`) and the import of every module tests/gpu
#      and the GPU benchmarks reach (scripts/gpu_imports.py);
#   3. tests/gpu with TRITON_INTERPRET=0 -> gpu-tests.xml, and its summary with every skip and
#      failure and its reason;
#   4. the GPU benchmarks, shortened: SGMV kernels (rank 16; 1, 32 and 256 rows of distinct
#      adapters; Llama-3-8B shapes), host -> device load path, and the serving figures on
#      random-weight models (bf16, built on the device) of Llama-3.1-8B's shapes, then of
#      Qwen3-30B-A3B's (MoE, 61 GB; 8 streams and 6 cold expert LoRAs of 1.29 GB made on the
#      host: ~18 GB of disk), then of the default model's -> JSON. The limits add up to more than
#      the budget: a step that finishes early leaves its time to the next, and the step least
#      needed (the default model's shapes) goes last, where the budget may run out.
#
# Everything lands in OUT (first argument, else $OUT, else gpu-check-out/): summary.txt (read it
# first), gpu-check.log, gpu-tests.xml, kernels-gpu.json, h2d-gpu.json, gpu-serving-8b.json,
# gpu-serving-moe.json, gpu-serving-smollm2.json. Exit status: 0 when every step passed, 1 when one failed or ran out
# of time, 2 when there is no CUDA device (with --dry-run: the CPU rehearsal of
# scripts/gpu_dry_run.sh, where every test must skip for want of CUDA and every benchmark must
# refuse to run).
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=0
if [ "${1:-}" = "--dry-run" ]; then dry_run=1; shift; fi
out=$(mkdir -p "${1:-${OUT:-gpu-check-out}}" && cd "${1:-${OUT:-gpu-check-out}}" && pwd)
wheelhouse=${LORASTREAM_GPU_WHEELHOUSE:-.gpu-wheelhouse}
image_python=${PYTHON:-python3}
venv=${LORASTREAM_GPU_VENV:-/tmp/lorastream-gpu-venv}
budget_s=${LORASTREAM_GPU_CHECK_BUDGET_S:-420}
began=$(date +%s)
summary=$out/summary.txt
: > "$summary"
exec > >(tee "$out/gpu-check.log") 2>&1
tee_pid=$!
failed=0

note() { echo "$*" | tee -a "$summary"; }
elapsed() { echo $(( $(date +%s) - began )); }

# step NAME LIMIT_S EXPECT COMMAND...: run COMMAND within LIMIT_S (less if the total budget has
# less left); EXPECT is the exit status that passes (0; 2 for a benchmark in the dry run).
step() {
  local name=$1 limit=$2 expect=$3 left status
  shift 3
  left=$(( budget_s - $(elapsed) ))
  if [ "$left" -lt 15 ]; then
    note "SKIPPED  $name: the ${budget_s}-s budget is spent ($(elapsed) s gone)"
    failed=1
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== [$(elapsed) s] $name (limit ${limit} s)"
  local start
  start=$(date +%s)
  # SIGINT first: pytest stops as on Ctrl-C and still writes its JUnit XML and summary
  timeout --signal=INT --kill-after=15 "$limit" "$@"
  status=$?
  local took=$(( $(date +%s) - start ))
  if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    note "TIMEOUT  $name: stopped after ${limit} s"
    failed=1
  elif [ "$status" -ne "$expect" ]; then
    note "FAILED   $name: exit status $status (expected $expect), ${took} s"
    failed=1
  else
    note "ok       $name (${took} s)"
  fi
}

has_cuda=$("$image_python" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
if [ "${has_cuda:-0}" != 1 ] && [ "$dry_run" = 0 ]; then
  note "no CUDA device here (torch.cuda.is_available() is False): nothing checked." \
       "On a CPU machine, scripts/gpu_dry_run.sh rehearses this script."
  exit 2
fi
bench_expect=0
[ "$dry_run" = 1 ] && bench_expect=2
mode=$([ "$dry_run" = 1 ] && echo ' (dry run: no CUDA)')
note "lorastream GPU check$mode, $(date -u +%FT%TZ)," \
     "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"

# 1. The venv. The image's python is itself a venv (/opt/torch/.venv): --system-site-packages
# would reach the base interpreter's packages, not the image's, so its site-packages are linked
# in by a .pth file, after the new venv's own (whose wheels therefore win). No pip of its own
# (ensurepip may be missing there): the image's pip, seen through the link, installs into it.
# The dry run leaves out --system-site-packages: there the image's stand-in is a venv over a
# developer's Python, whose own packages would hide a package missing from both lists.
system_site=--system-site-packages
[ "$dry_run" = 1 ] && system_site=
setup_venv() {
  set -e
  if ! ls "$wheelhouse"/*.whl > /dev/null 2>&1; then
    echo "no wheelhouse at $wheelhouse: run \`make gpu-wheelhouse\` and carry .gpu-wheelhouse"
    return 1
  fi
  rm -rf "$venv"
  "$image_python" -m venv --without-pip $system_site "$venv"
  local image_site venv_site
  image_site=$("$image_python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  venv_site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  [ "$image_site" != "$venv_site" ] && echo "$image_site" > "$venv_site/_gpu_image.pth"
  "$venv/bin/python" -m pip install --quiet --no-index --no-deps --no-cache-dir \
    --disable-pip-version-check --find-links "$wheelhouse" -r scripts/gpu_requirements.txt
}
export image_python venv wheelhouse system_site
export -f setup_venv
step "venv over the image + wheelhouse ($wheelhouse)" 90 0 bash -c setup_venv
py=$venv/bin/python
if [ "$failed" = 1 ]; then
  note "stopped: without its venv nothing else can run"
  exec 1>&- 2>&-
  wait "$tee_pid"
  exit 1
fi
export PYTHONPATH=$PWD PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

# 2. The environment, then every import.
environment() {
  "$py" - <<'PY'
from importlib.metadata import PackageNotFoundError, version
import torch
names = ("torch", "triton", "transformers", "huggingface_hub", "peft", "accelerate",
         "safetensors", "tokenizers", "grpcio", "protobuf", "pydantic", "numpy", "pytest")
def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "missing"
print("packages: " + ", ".join(f"{n} {v(n)}" for n in names))
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability "
          f"{p.major}.{p.minor}, CUDA {torch.version.cuda}")
else:
    print("gpu: none (torch.cuda.is_available() is False)")
PY
}
environment | tee -a "$summary"
# On the GPU machine a conflict may be the image's own: reported. In the dry run (our stand-in of
# the image) any conflict fails.
if PYTHONPATH= "$py" -m pip check > "$out/pip-check.txt" 2>&1; then  # the checkout is no package
  note "pip check: no broken requirements"
else
  note "pip check:"
  sed 's/^/  /' "$out/pip-check.txt" | tee -a "$summary"
  [ "$dry_run" = 1 ] && failed=1
fi
rm -f "$out/pip-check.txt"
step "imports (scripts/gpu_imports.py)" 45 0 "$py" scripts/gpu_imports.py

# 3. tests/gpu, a file per pytest-xdist worker (the SGMV file's Triton compiles beside the
# engine tests): a quarter of the cores, at most 4 (the H200's 16 cores: 4; 0 runs in-process).
workers=${LORASTREAM_GPU_TEST_WORKERS:-$(( $(nproc) / 4 > 4 ? 4 : $(nproc) / 4 ))}
step "tests/gpu (TRITON_INTERPRET=0, $workers xdist workers)" 170 0 "$py" -m pytest -q -rs \
  -p no:cacheprovider -n "$workers" --dist loadfile --timeout=120 tests/gpu \
  --junitxml="$out/gpu-tests.xml"
if [ -f "$out/gpu-tests.xml" ]; then
  expect=()
  [ "$dry_run" = 1 ] && expect=(--expect-all-skipped "no CUDA device")
  "$py" scripts/gpu_summary.py "$out/gpu-tests.xml" "${expect[@]}" > "$out/tests.txt"
  status=$?
  { echo "tests/gpu:"; sed 's/^/  /' "$out/tests.txt"; } >> "$summary"
  [ "$status" -ne 0 ] && failed=1
  rm -f "$out/tests.txt"
fi

# 4. The benchmarks, shortened to fit.
step "bench: SGMV kernels" 50 "$bench_expect" "$py" -m lorastream.kernels.bench \
  --batch-sizes 1,32,256 --ranks 16 --popularities distinct --warmup 5 --repeat 20 \
  --output "$out/kernels-gpu.json"
step "bench: host -> device load path" 30 "$bench_expect" "$py" -m lorastream.bench.h2d \
  --repeats 10 --output "$out/h2d-gpu.json"
step "bench: serving, Llama-3.1-8B shapes" 110 "$bench_expect" "$py" -m \
  lorastream.bench.gpu_serving --shape llama-3.1-8b --repeats 2 --output "$out/gpu-serving-8b.json"
step "bench: serving, Qwen3-30B-A3B shapes (MoE)" 180 "$bench_expect" "$py" -m \
  lorastream.bench.gpu_serving --shape qwen3-30b-a3b --streams 8 --cold-adapters 6 --repeats 2 \
  --output "$out/gpu-serving-moe.json"
step "bench: serving, default model's shapes" 40 "$bench_expect" "$py" -m \
  lorastream.bench.gpu_serving --shape smollm2-135m --repeats 2 \
  --output "$out/gpu-serving-smollm2.json"

note "done in $(elapsed) s: $([ "$failed" = 0 ] && echo 'every step passed' || echo 'see above')"
rm -rf "$venv"
exec 1>&- 2>&-
wait "$tee_pid"
exit "$failed"

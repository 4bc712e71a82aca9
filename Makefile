# vx: the two commands a user needs are `make test` and `make serve`.
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup test serve lint stress bench clean check-c

setup: $(BIN)/.vx-setup

# Idempotent: the stamp is rebuilt only when the project metadata changes.
$(BIN)/.vx-setup: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, from TORCH_SPEC, so that no dependency can pull a CUDA build
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

test: setup
	$(BIN)/python -m ruff check vx tests bench
	$(BIN)/python -m pytest -q -rs -m "not stress and not gpu"; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

serve: setup
	$(BIN)/vx serve $(ARGS)

stress: setup
	$(BIN)/python -m pytest -q -m stress

# The CPU kernel library built with AddressSanitizer (VX_CPU_SANITIZE=address, its own cache
# folder) under the kernel tests; python itself is not instrumented, so the runtime is preloaded,
# and leak checks are off (the interpreter's own allocations would drown the kernels').
# Run `make setup` first; CHECK_C_TESTS picks other test files.
CC ?= cc
CHECK_C_TESTS ?= tests/gpu/cpu/test_kernel_library.py tests/gpu/attention/test_fast_attention.py \
	tests/gpu/cpu/test_vnni_gemm.py tests/gpu/cpu/test_ops.py
check-c:
	VX_CPU_SANITIZE=address VX_CACHE=$(CURDIR)/build/asan ASAN_OPTIONS=detect_leaks=0 \
	  LD_PRELOAD=$$($(CC) -print-file-name=libasan.so) \
	  $(BIN)/python -m pytest -q -p no:cacheprovider $(CHECK_C_TESTS)

lint: setup
	$(BIN)/python -m ruff check vx tests bench

clean:
	rm -rf $(VENV) build *.egg-info

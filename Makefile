# Two commands for a fresh machine: `make book` (the website) and `make test` (every test).
# While working: `make unit` (the package's quick tests, under a minute) and `make lint`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# DEVICE: where the chapters and the reference-equality tests run (`make check-device
# DEVICE=cuda`; CI runs `make test DEVICE=cpu`). Empty: each chapter takes the best device it
# finds. Read by transformer_tutorial.get_device and the tests' `device` fixture.
DEVICE ?=
export TRANSFORMER_TUTORIAL_DEVICE := $(DEVICE)
# TORCH: another torch for `make check-torch TORCH=2.6.0`, installed into its own venv.
TORCH  ?=
LINTED := src tests scripts bench
# Two test processes, one torch thread each: the tests assert values, not speed, and their
# models are tiny. `make unit` deals tests out one by one; `make pytest` keeps each file in one
# process (measured: 165 s against 253 s for one by one with the browser check grouped).
# TEST_THREADS: torch threads per test process (`make portable` tries 2).
TEST_THREADS ?= 1
PYTEST := OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -n 2

# $(call timed,COMMAND): run COMMAND, then say how long the target took and whether it passed.
define timed
@start=$$(date +%s); $(1); status=$$?; \
	echo "===== $@: $$([ $$status = 0 ] && echo passed || echo FAILED)" \
	"in $$(( $$(date +%s) - start )) s"; exit $$status
endef

.PHONY: book test unit lint pytest chapters install execute clean bench check-device check-torch \
	portable portable-unit

book: $(VENV)/.installed
	rm -rf _build
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo "The website is at _build/html/index.html"

# Everything CI checks, in the order a reader's trust needs it: the website builds with warnings
# as errors, lint, every pytest test (unit, slow, website in a browser), the unit tests again in
# other CPUs' float orders, then every chapter run alone from the installed wheel. -k: every
# part runs even when an earlier one fails.
test: $(VENV)/.installed
	$(MAKE) -k book lint pytest portable-unit chapters

# The package's unit tests without the training runs and the browser: under a minute.
# (Order-only prerequisite: an existing .venv is used as it is, never reinstalled here.)
unit: | $(VENV)/.installed
	$(call timed,$(PYTEST) --dist load -m "not slow and not website" tests)

# ruff, and the chapters' stored outputs: no measured digits nbval would compare on another CPU,
# no printed line wider than the website's column (scripts/check_outputs.py says why).
lint: | $(VENV)/.installed
	$(call timed,$(BIN)/ruff check $(LINTED) && $(BIN)/ruff format --check $(LINTED) \
		&& $(BIN)/python scripts/check_outputs.py)

# Every pytest test: unit, slow (training runs), website (needs the book built: `make book`).
pytest: $(VENV)/.installed
	$(call timed,$(PYTEST) --dist loadfile tests)

# Each chapter copied alone into an empty folder and run under nbval against the wheel.
chapters: $(VENV)/.installed
	$(call timed,$(BIN)/python scripts/run_tests.py)

# Portability: another CPU adds in another order (MKL and oneDNN pick their kernels by CPU; a
# thread count splits every sum differently), and nbval compares stored outputs. Each setting
# below runs here what another machine would run (settings' variables joined by +):
#   MKL_CBWR=COMPATIBLE+CHAPTER_THREADS=2   MKL's plainest path, the one most unlike this
#                                            CPU's; chapters 0-9 and 12-25 on two threads
#   MKL_CBWR=AVX2+ONEDNN_MAX_CPU_ISA=AVX2   a machine without AVX-512
#   OMP_NUM_THREADS=1+TEST_THREADS=2         chapters 10-11 on one thread, the tests on two
# `make portable` (the unit tests and every chapter under each, ~20 min on 2 cores) before every
# commit that changes a stored output; `make portable-unit` (the unit tests only, 45 s each) is
# part of `make test`.
PORTABLE_SETTINGS := MKL_CBWR=COMPATIBLE+CHAPTER_THREADS=2 MKL_CBWR=AVX2+ONEDNN_MAX_CPU_ISA=AVX2 \
	OMP_NUM_THREADS=1+TEST_THREADS=2
# $(call each_setting,TARGETS): make TARGETS under every setting; fails if any failed.
define each_setting
(status=0; for setting in $(PORTABLE_SETTINGS); do echo "===== under $$setting"; \
	env $$(echo $$setting | tr + ' ') $(MAKE) --no-print-directory -k $(1) || status=1; \
	done; exit $$status)
endef

portable: | $(VENV)/.installed
	$(call timed,$(call each_setting,unit chapters))

portable-unit: | $(VENV)/.installed
	$(call timed,$(call each_setting,unit))

# Speed against nn.Transformer, decoding, attention: one process, 2 CPU threads, <= 10 min on a
# CPU; writes bench/results/<device>-<torch>.json and .png.
# On a GPU: make bench BENCH_ARGS="--device cuda".
bench: | $(VENV)/.installed
	$(call timed,$(BIN)/python -m bench $(BENCH_ARGS))

# The unit tests and every chapter on one device: `make check-device DEVICE=cuda` on a machine
# with a GPU (TF32 off for the equality tests). Off the CPU, chapters are checked for errors and
# failing asserts only (nbval --nbval-lax): their stored outputs were computed on a CPU.
check-device: | $(VENV)/.installed
	@test -n "$(DEVICE)" || { echo "check-device needs DEVICE=cpu, cuda, cuda:1 or mps"; exit 2; }
	$(MAKE) -k unit chapters

# The unit tests and every chapter on another torch, in a venv of its own under /tmp:
# `make check-torch TORCH=2.6.0` (on Linux pip downloads that torch with its CUDA libraries,
# about 5 GB). The chapters' stored outputs are compared as usual.
check-torch:
	@test -n "$(TORCH)" || { echo "check-torch needs TORCH=<version>, e.g. TORCH=2.6.0"; exit 2; }
	$(MAKE) -k unit chapters VENV=/tmp/venv-torch-$(TORCH)

# Re-run chapters so their stored outputs match the package (after changing code they import).
execute: $(VENV)/.installed
	$(BIN)/python scripts/execute_notebooks.py $(NOTEBOOKS)

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# TORCH=X installs that torch first; on Linux without torch, take the 2.13.0 wheel first:
	@# the ranges below then install no other.
	if [ -n "$(TORCH)" ]; then $(BIN)/python -m pip install --quiet torch==$(TORCH); \
	elif [ "$$(uname -s)" = Linux ] && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		$(BIN)/python -m pip install --quiet torch==2.13.0; fi
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet -e .
	@# The requirements may replace TORCH (transformers 5 needs torch >= 2.6): say so, and stop.
	@if [ -n "$(TORCH)" ]; then $(BIN)/python scripts/check_torch_version.py $(TORCH); fi
	touch $@

clean:
	rm -rf _build $(VENV)

# Two commands for a fresh machine: `make book` (the website) and `make test` (every test).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: book test install execute clean

book: $(VENV)/.installed
	rm -rf _build
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo "The website is at _build/html/index.html"

test: $(VENV)/.installed
	$(BIN)/python scripts/run_tests.py

# Re-run chapters so their stored outputs match the package (after changing code they import).
execute: $(VENV)/.installed
	$(BIN)/python scripts/execute_notebooks.py $(NOTEBOOKS)

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# On Linux without torch, take the 2.13.0 wheel first: the ranges below then install no other.
	if [ "$$(uname -s)" = Linux ] && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		$(BIN)/python -m pip install --quiet torch==2.13.0; fi
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet -e .
	touch $@

clean:
	rm -rf _build $(VENV)

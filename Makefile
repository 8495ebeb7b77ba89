# Two commands on a fresh machine, each creating the virtual environment when it is missing:
#   make demo   the main job: sentence embeddings through provider="ipu" on the host emulator
#   make test   the test suite (what .ci/run runs, in a fresh environment)
#   make release-check   the test suite with every test matrix in full (tests/full_matrix.py)
# VENV picks the environment's directory; EDITABLE= (empty) installs the package as a wheel, as CI does.

PYTHON ?= python3
VENV ?= .venv
EDITABLE ?= -e
BIN := $(VENV)/bin
# Recorded once the environment is complete; a changed pyproject.toml installs again.
READY := $(VENV)/.optimum-ipu-ready

.PHONY: demo test release-check venv

demo: $(READY)
	OPTIMUM_IPU_DEVICE=emulator $(BIN)/python examples/sentence_embeddings.py

test: $(READY)
	$(BIN)/python -m pytest -n 2

release-check: $(READY)
	OPTIMUM_IPU_FULL_MATRIX=1 $(BIN)/python -m pytest -n 2

venv: $(READY)

# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build.
$(READY): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install $(EDITABLE) ".[test]"
	$(BIN)/pip check
	touch $@

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(BIN)/python:
	$(shell command -v $(PYTHON) || echo python3) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	@echo "== install 1/2: torch 2.13.0, the CPU build pinned by constraints.txt (about 200 MB)"
	$(BIN)/pip install --progress-bar off -c constraints.txt torch==2.13.0
	@echo "== install 2/2: phalanx (editable) and its test dependencies"
	$(BIN)/pip install --progress-bar off -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

DEMO_DIR ?= runs/demo
demo: $(STAMP)
	$(BIN)/phalanx run -n 2 examples/digits.py --checkpoint-dir $(DEMO_DIR) $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=20

clean:
	rm -rf $(VENV) build src/*.egg-info

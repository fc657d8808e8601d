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
	$(BIN)/python -m phalanx run -n 2 examples/digits.py --checkpoint-dir $(DEMO_DIR) $(DEMO_ARGS)

# Two pytest workers (pytest-xdist) even on two cores: many tests wait on timeouts and heartbeats
# (--dist loadgroup keeps the Ray tests together, on the session's one Ray cluster). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=20 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

clean:
	rm -rf $(VENV) build src/*.egg-info

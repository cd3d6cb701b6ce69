# Two entry points: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test proto bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,worker]'
	touch $@

demo: $(BIN)/.installed
	rm -rf elastic-state/demo
	$(BIN)/elasticd local --config workers/tiny/job.toml --hosts 4 --devices-per-host 1 --state-dir elastic-state/demo

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q

proto: $(BIN)/.installed
	$(BIN)/python -m elastic.protogen

clean:
	rm -rf $(VENV) elastic-state .pytest_cache

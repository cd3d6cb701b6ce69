# Two entry points: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo demo-gcs demo-isolated test test-serial proto bench clean

# Byte-compile the project's own modules before running them: an editable
# install leaves them as source, and with PYTHONDONTWRITEBYTECODE=1 (as on the
# CI machines) every process compiled them again, ~0.27 s of CPU for an agent
# or a controller; five process-heavy test files took 7 % less time with them
# compiled (187 and 187 s against 202 and 201 s, alternating, 2026-11-28).
COMPILE := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m compileall -q elastic workers > /dev/null

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# (byte-compiled here, at install: with PYTHONDONTWRITEBYTECODE=1, as on the
	# CI machines, a module not compiled now is compiled again by every process)
	$(BIN)/python -m pip install -q -e '.[dev,worker,gcs]'
	touch $@

# The main job: workers/lm on 4 simulated hosts x 2 CPU devices; host-1 is
# killed at step 120 and training goes on with 3 hosts from the last checkpoint.
demo: $(BIN)/.installed
	$(COMPILE)
	rm -rf elastic-state/demo
	$(BIN)/elasticd local --config workers/lm/job.toml --hosts 4 --devices-per-host 2 \
		--fault kill-host:host-1@step=120 --state-dir elastic-state/demo

# The same, with the checkpoints in a bucket of a local GCS emulator
# (fake-gcs-server) instead of a local directory.
demo-gcs: $(BIN)/.installed
	$(COMPILE)
	rm -rf elastic-state/demo-gcs
	$(BIN)/elasticd local --config workers/lm/job.toml --hosts 4 --devices-per-host 2 \
		--fault kill-host:host-1@step=120 --state-dir elastic-state/demo-gcs --gcs-emulator

# The same on hosts that share nothing (needs root): each in namespaces of its
# own, checkpoints in the emulator's bucket; host-2 is also cut off from every
# other node at step 200, for 12 s.
demo-isolated: $(BIN)/.installed
	$(COMPILE)
	rm -rf elastic-state/demo-isolated
	$(BIN)/elasticd local --config workers/lm/job.toml --hosts 4 --devices-per-host 2 \
		--fault kill-host:host-1@step=120 --fault partition:host-2@step=200 \
		--state-dir elastic-state/demo-isolated --isolate

# Two pytest workers, each taking whole files (module fixtures run once), the
# files that start processes first (tests/conftest.py), sharing one executable
# cache and one undisturbed run of the reference model: 6m13s, 6m01s and 6m04s
# against 8m58s and 9m23s in one process, alternating, on 2 cores at night;
# ~11 against ~15 minutes on a slow evening (docs/performance-history.md).
test: $(BIN)/.installed
	$(COMPILE)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The same in one process: for a failure to read in order, or --pdb.
test-serial: $(BIN)/.installed
	$(COMPILE)
	$(BIN)/python -m pytest -q

proto: $(BIN)/.installed
	$(BIN)/python -m elastic.protogen

clean:
	rm -rf $(VENV) elastic-state .pytest_cache

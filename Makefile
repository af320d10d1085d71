# The two commands of the README: `make demo` runs the whole pipeline on the tiny demo target (CPU),
# `make test` runs the test suite. Both set up .venv themselves.
.PHONY: demo test venv
VENV := .venv/bin
# A loaded 2-core machine can need longer than Prefect's default to start its ephemeral API.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180
# The machines may have no route to the internet: no telemetry attempts (they log an ERROR line each time).
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

venv:
	@scripts/setup-venv.sh

demo: venv
	@scripts/setup-system.sh demo
	$(VENV)/python -m flows.pipeline configs/demo.yaml

# Two xdist workers: most tests wait on one busy core (tests/conftest.py says how modules are kept together).
TEST_WORKERS ?= 2
test: venv
	@scripts/setup-system.sh
	$(VENV)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

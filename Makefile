# The two commands of the README: `make demo` runs the whole pipeline on the tiny demo target (CPU),
# `make test` runs the test suite. Both set up .venv themselves.
.PHONY: demo test venv
VENV := .venv/bin

venv:
	@scripts/setup-venv.sh

demo: venv
	$(VENV)/python -m flows.pipeline configs/demo.yaml

test: venv
	$(VENV)/python -m pytest $(PYTEST_ARGS)

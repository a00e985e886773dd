# make run   — create .venv (once), install, and generate with the embedded demo model
# make test  — create .venv (once), install, and run the test suite
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test clean

$(STAMP): pyproject.toml requirements/cpu-constraints.txt
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -c requirements/cpu-constraints.txt torch==2.13.0
	$(PYTHON) -m pip install -q -c requirements/cpu-constraints.txt -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/autodeploy run --prompt "def fibonacci(n):" --prompt "import os"

test: $(STAMP)
	$(PYTHON) -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info

